"""The shard group as the engine and the replica see it, in the router's own plain types.

The wire contract is shard.proto; `router/shards/` speaks it (the gRPC streams, and the codec
that turns a `Step` into a step plan and a step result into one `SequenceResult` per scheduled
sequence). Nothing here knows protobuf: the engine hands a group its steps and reads back, per
sequence, what the step did for it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from shardline.router.core.sequence import TokenLogprob
from shardline.router.core.step import Step


class ShardError(RuntimeError):
    """A shard failed or went away; the replica cannot serve until its group is back."""


@dataclass(frozen=True)
class ShardInfo:
    """One shard's Info answer (shard.proto's ShardInfo says what each field is)."""

    model: str
    vocab_size: int
    context_length: int
    page_size: int
    max_pages: int
    tp_rank: int
    tp_size: int
    pp_stage: int
    pp_size: int
    dtype: str
    device: str
    eos_token_ids: tuple[int, ...]
    weight_bytes: int
    kv_bytes_per_page: int
    weight_formats: dict[str, str]
    kv_dtype: str
    group_id: str
    attention_pair_cost: float
    num_layers: int
    rope_long_from: int  # prompts longer turn by the long rotary factors (0: none)
    window: int  # the longest sliding window of the model's layers (0: none)
    window_kv_bytes_per_page: int  # of its windowed layers, a part of kv_bytes_per_page
    kv_budget_bytes: int


@dataclass(frozen=True)
class Warmup:
    """One shard's Warmup answer (shard.proto's WarmupResponse)."""

    decode_graph_buckets: tuple[int, ...]
    capture_s: float
    kv_pool_bytes: int
    prefill_ms_per_token: float


@dataclass(frozen=True)
class SequenceResult:
    """What one step did for one scheduled sequence."""

    # The tokens it sampled: one, or its accepted proposals and one more; none for a chunk that
    # does not emit, or a sequence the shard could not serve.
    tokens: tuple[int, ...] = ()
    prompt_scores: tuple[TokenLogprob, ...] = ()  # of the step's prompt positions, when asked for
    sampled_scores: tuple[TokenLogprob, ...] = ()  # one per sampled token, when asked for
    failure: str | None = None  # why the shard could not serve it (the shard forgot it)


@dataclass(frozen=True)
class StepOutcome:
    """A step's answer: one result per scheduled sequence, and what the shards measured."""

    rows: dict[int, SequenceResult] = field(default_factory=dict)  # seq_id -> its result
    compute_ms: float = 0.0  # the slowest shard's time on the step
    graph_launches: int = 0  # decode graphs replayed, over the shards
    eager_decode_steps: int = 0  # decode steps run eagerly instead, over the shards

    @property
    def failures(self) -> int:
        return sum(row.failure is not None for row in self.rows.values())


class Shards(Protocol):
    """What a replica's shard group does for the replica (connect) and the engine (steps)."""

    sampler: int  # the index, in `info`'s answer, of the shard that samples
    samples_alone: bool  # one shard: a plan may use the tokens it sampled (Engine._ahead)

    async def info(self, timeout: float) -> list[ShardInfo]: ...

    async def warmup(self, num_pages: int, max_batch: int, window_pages: int = 0) -> list[Warmup]:
        """A fresh pool (and window pool, of `window_pages`) on every shard: they hold no
        sequence from here on."""

    async def send(self, step_id: int, step: Step) -> None:
        """Sends the step; the shards run steps in the order they were sent."""

    async def receive(self, step_id: int, step: Step) -> StepOutcome:
        """The answer to the oldest step sent and not yet answered."""

    def release(self, seq_id: int) -> None:
        """The sequence ended: the next step tells the shards to forget it, if they hold it."""

    async def ended(self) -> str: ...

    async def close_streams(self, abandon: bool) -> None: ...
