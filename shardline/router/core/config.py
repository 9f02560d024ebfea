"""What the replica takes from the router's flags (shardline/flags.py says what each means),
built once when the router starts."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReplicaConfig:
    page_size: int
    dtype: str
    num_pages: int = 0  # 0: what the shards' memory budget holds
    max_batch: int = 32
    max_batch_tokens: int = 4096
    chunk_size: int = 0
    mixed_steps: bool = False
    layer_groups: int = 8
    priority_aging_s: float = 1.0
    prefix_cache: bool = True
    eviction: str = "lru"
    slru_protected_ratio: float = 0.5
    shard_timeout_s: float = 300.0  # for the shards to come up
    step_timeout_s: float = 20.0
    drain_timeout_s: float = 30.0
    speculative: str = "suffix"  # off | ngram | suffix (router/core/speculation.py)
    spec_tokens: int = 8  # the most tokens proposed for one sequence in one step

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
