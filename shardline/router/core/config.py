"""What the replica takes from the router's flags, built once when the router starts.
shardline/flags.py says what each means and is the one home of its default."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReplicaConfig:
    page_size: int
    dtype: str
    num_pages: int  # 0: what the shards' memory budget holds
    max_batch: int
    max_batch_tokens: int
    chunk_size: int
    mixed_steps: bool
    layer_groups: int  # asked for; the scheduler runs 1 where they do not apply
    priority_aging_s: float
    prefix_cache: bool
    eviction: str
    slru_protected_ratio: float
    shard_timeout_s: float  # for the shards to come up
    step_timeout_s: float
    drain_timeout_s: float
    speculative: str  # off | ngram | suffix (router/core/speculation.py)
    spec_tokens: int  # the most tokens proposed for one sequence in one step

    @classmethod
    def from_flags(cls, args) -> ReplicaConfig:
        return cls(
            page_size=args.page_size,
            dtype=args.dtype,
            num_pages=args.num_pages,
            max_batch=args.max_batch,
            max_batch_tokens=args.max_batch_tokens,
            chunk_size=args.chunk_size,
            mixed_steps=args.mixed_steps == "on",
            layer_groups=args.layer_groups,
            priority_aging_s=args.priority_aging_s,
            prefix_cache=args.prefix_cache == "on",
            eviction=args.eviction,
            slru_protected_ratio=args.slru_protected_ratio,
            shard_timeout_s=args.shard_timeout,
            step_timeout_s=args.step_timeout_s,
            drain_timeout_s=args.drain_timeout_s,
            speculative=args.speculative,
            spec_tokens=args.spec_tokens,
        )
