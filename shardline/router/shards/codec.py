"""The router's steps and the shards' answers, as shard.proto writes them and as the core reads
them: the one place that knows both.

- A plan tells the shards only what changed (shard.proto, `SequenceStep`): a sequence's first
  step carries its sampling and its whole block table, a later one the pages appended since; a
  sequence that ended is released once, by the next plan. `Told` is what the shards were told.
- A result's tokens are one flat list, in plan order, counted per emitting sequence. They are
  read back into one `SequenceResult` per scheduled sequence and checked against the step: counts
  that do not add up, or more tokens than a sequence's proposals and one, mean the shard group is
  broken (ShardError), not one request.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from shardline.protos import shard_pb2
from shardline.router.core.sequence import Sampling, TokenLogprob
from shardline.router.core.shards import SequenceResult, ShardError, ShardInfo, StepOutcome, Warmup
from shardline.router.core.step import Scheduled, Step


@dataclass
class Told:
    """What the shards hold, as the router told them: a new one with each warmup, whose fresh
    pool holds no sequence."""

    pages: dict[int, int] = field(default_factory=dict)  # seq_id -> pages of its block table they hold
    released: list[int] = field(default_factory=list)  # sequences that ended, for the next plan

    def release(self, seq_id: int) -> None:
        if self.pages.pop(seq_id, None) is not None:
            self.released.append(seq_id)


def plan_of(step_id: int, step: Step, told: Told) -> shard_pb2.StepPlan:
    """The step as the shards take it; `told` then includes it."""
    plan = shard_pb2.StepPlan(
        step_id=step_id,
        seqs=[_entry(s, step, told) for s in step.scheduled],
        released=told.released,
        trace_context=step.trace_context,
        layer_start=step.layer_start,
        layer_end=step.layer_end or 0,  # 0: through the last layer
    )
    told.released = []
    return plan


def _entry(s: Scheduled, step: Step, told: Told) -> shard_pb2.SequenceStep:
    seq, block_table = s.seq, s.seq.pages.block_table
    held = told.pages.get(seq.seq_id)
    told.pages[seq.seq_id] = len(block_table)
    entry = shard_pb2.SequenceStep(
        seq_id=seq.seq_id,
        token_ids=s.tokens,
        # A step sent ahead computes the position after the one the step before it computes.
        start_pos=seq.num_computed + step.sampled_inputs,
        sampled_input=step.sampled_inputs,
        emit=s.emit,
        first=held is None,
        new_pages=block_table[held or 0 :],
        new_window_pages=seq.pages.window_table[held or 0 :],
        proposals=s.proposals,
        sampling=_sampling(seq.sampling) if held is None else None,
        long_rope=seq.long_rope and held is None,
    )
    if seq.prompt_logprobs is not None and seq.num_computed < len(seq.prompt_ids):
        entry.prompt_logprobs = seq.prompt_logprobs
        end = seq.num_computed + len(s.tokens)
        if end < len(seq.prompt_ids):
            entry.next_token = seq.prompt_ids[end]
    if s.emit and seq.constrained is not None:
        entry.allowed_tokens = seq.constrained.mask
        entry.proposal_masks.extend(seq.constrained.masks_after(s.proposals))
    return entry


def _sampling(s: Sampling) -> shard_pb2.Sampling:
    return shard_pb2.Sampling(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, seed=s.seed, logprobs=s.logprobs)


def outcome_of(step: Step, result: shard_pb2.StepResult) -> StepOutcome:
    """The shards' answer to `step`, one result per scheduled sequence."""
    failed = {f.seq_id: f.message for f in result.failures}
    emitting = [s for s in step.scheduled if s.emit and s.seq.seq_id not in failed]
    counts = result.token_counts or [1] * len(emitting)
    if len(counts) != len(emitting) or sum(counts) != len(result.tokens):
        raise ShardError(f"step {result.step_id}: {len(result.tokens)} tokens for {len(emitting)} emitting sequences")
    tokens, start = {}, 0
    for s, count in zip(emitting, counts):
        if not 1 <= count <= 1 + len(s.proposals):
            raise ShardError(f"step {result.step_id}: {count} tokens for a sequence of {len(s.proposals)} proposals")
        tokens[s.seq.seq_id], start = tuple(result.tokens[start : start + count]), start + count
    scores = {entry.seq_id: entry for entry in result.logprobs}
    rows = {}
    for s in step.scheduled:
        seq_id = s.seq.seq_id
        entry = scores.get(seq_id)
        rows[seq_id] = SequenceResult(
            tokens=tokens.get(seq_id, ()),
            prompt_scores=tuple(map(_logprob, entry.prompt)) if entry is not None else (),
            sampled_scores=tuple(map(_logprob, entry.sampled)) if entry is not None else (),
            failure=failed.get(seq_id),
        )
    return StepOutcome(rows, result.compute_ms, result.graph_launches, result.eager_decode_steps)


def _logprob(entry: shard_pb2.TokenLogprob) -> TokenLogprob:
    return TokenLogprob(entry.token_id, entry.logprob, tuple(entry.top_ids), tuple(entry.top_logprobs))


def info_of(message: shard_pb2.ShardInfo) -> ShardInfo:
    return _plain(ShardInfo, message)


def warmup_of(message: shard_pb2.WarmupResponse) -> Warmup:
    return _plain(Warmup, message)


def _plain(cls, message):
    """A dataclass of a message's fields, by name: repeated fields as tuples, maps as dicts."""
    values = {}
    for f in dataclasses.fields(cls):
        value = getattr(message, f.name)
        descriptor = message.DESCRIPTOR.fields_by_name[f.name]
        if descriptor.message_type is not None and descriptor.message_type.GetOptions().map_entry:
            value = dict(value)
        elif descriptor.is_repeated:
            value = tuple(value)
        values[f.name] = value
    return cls(**values)
