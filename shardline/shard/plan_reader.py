"""A step plan's entries as the runner computes them: each is checked against what this shard
holds for its sequence by small named rules, the first that fails saying why, and read into an
immutable `Entry`. Nothing here changes the plan or the shard's state.

A failed entry fails its sequence alone (runner.py). Every shard of a replica receives the same
plan and judges it by the same rules, so every rank leaves out the same sequences.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

from shardline.kernels.token_mask import mask_bytes
from shardline.protos import shard_pb2
from shardline.shard.logprobs import MAX_TOP
from shardline.shard.sampler import SamplingParams
from shardline.shard.sequences import SequenceState


@dataclass(frozen=True)
class Entry:
    """One sequence's part of a step, as read from its plan entry (shard.proto's SequenceStep)."""

    seq_id: int
    inputs: tuple[int, ...]  # the step's input tokens: the plan's, or the one sampled here last step
    proposals: tuple[int, ...]  # computed as the positions after the inputs, then verified
    start_pos: int
    emit: bool
    new_pages: tuple[int, ...]
    new_window_pages: tuple[int, ...]  # with a window pool: the window pages of new_pages' positions
    sampling: SamplingParams | None  # on the sequence's first step only
    prompt_logprobs: int | None  # alternatives per scored prompt position
    next_token: int | None  # the prompt token after the last input, scored against it
    allowed_tokens: bytes  # the first sampled row's mask (b"": any token)
    proposal_masks: tuple[bytes, ...]  # the mask of each proposal's row
    long_rope: bool  # on its first step: its positions turn by the long rotary factors

    @functools.cached_property
    def tokens(self) -> tuple[int, ...]:
        """The positions the step computes for it, in order (read several times a step)."""
        return self.inputs + self.proposals

    @property
    def first(self) -> bool:
        return self.sampling is not None


@dataclass(frozen=True)
class Context:
    """What the rules judge an entry by: the step's layers and this shard's limits."""

    layer_start: int  # the step runs layers from here
    finishing: bool  # and through the last one
    vocab_size: int
    max_position: int
    page_size: int
    max_pages: int  # of one block table
    num_pages: int  # in the pool
    held: int  # sequences this shard holds
    has_room: bool  # for one more
    long_rope: bool  # whether the model has long rotary factors
    window_pages: int = 0  # in the window pool (0: there is none)


Rule = Callable[[shard_pb2.SequenceStep, SequenceState | None, Context], str | None]


def _layers_held(s, state, at):
    held = state.partial_layers if state is not None else 0
    if held != at.layer_start:
        return (
            f"the plan runs the sequence's chunk from layer {at.layer_start}, but this shard holds it "
            f"after {held} layers"
        )


def _continues_its_chunk(s, state, at):
    if at.layer_start and (s.first or s.sampled_input or len(s.token_ids) != len(state.partial)):
        return (
            f"the plan continues a chunk of {len(state.partial)} tokens past layer {at.layer_start} with other inputs"
        )


def _samples_after_the_last_layer(s, state, at):
    if s.emit and not at.finishing:
        return "the plan samples from a step that stops before the last layer"


def _announced_once(s, state, at):
    if s.first and state is not None:
        return f"the plan announces sequence {s.seq_id} as new, but this shard already holds it"
    if not s.first and state is None:
        return f"the plan continues sequence {s.seq_id}, which this shard does not hold"


def _from_a_held_position(s, state, at):
    if state is not None and s.start_pos != state.next_pos and not state.holds_verified(s.start_pos):
        return (
            f"the plan computes from position {s.start_pos}, but this shard holds "
            f"{state.held_positions()} positions of the sequence"
        )


def _sampled_input_known(s, state, at):
    if s.sampled_input and s.token_ids:
        return "the plan gives input tokens and asks for the sampled one"
    if s.sampled_input and (state is None or state.sampled is None):
        return "the plan asks for the token sampled in the sequence's previous step, which sampled none here"


def _proposals_where_they_verify(s, state, at):
    if s.proposals and (not s.emit or s.sampled_input or s.HasField("prompt_logprobs")):
        return "the plan proposes tokens for an entry that does not sample from its last input"
    if s.proposals and at.layer_start:
        return "the plan proposes tokens in a layer group"


def _a_mask_per_proposal(s, state, at):
    if s.proposal_masks and (not s.allowed_tokens or len(s.proposal_masks) != len(s.proposals)):
        return f"{len(s.proposal_masks)} proposal masks for {len(s.proposals)} proposals"
    if s.allowed_tokens and s.proposals and len(s.proposal_masks) != len(s.proposals):
        return "a constrained entry proposes tokens without a mask for each"


def _masks_cover_the_vocabulary(s, state, at):
    need = mask_bytes(at.vocab_size)
    if any(len(m) < need for m in s.proposal_masks):
        return f"a proposal mask shorter than the {need} bytes of the vocabulary"
    if s.allowed_tokens and len(s.allowed_tokens) < need:
        return f"a token mask of {len(s.allowed_tokens)} bytes; the vocabulary of {at.vocab_size} takes {need}"


def _positions_in_its_pages(s, state, at):
    n = 1 if s.sampled_input else len(s.token_ids)
    end = s.start_pos + n + len(s.proposals)
    pages = (len(state.pages) if state else 0) + len(s.new_pages)
    if n == 0:
        return "no input tokens"
    if end > at.max_position:
        return f"positions up to {end} exceed the model's context of {at.max_position}"
    if pages * at.page_size < end:
        return f"block table of {pages} pages does not cover {end} positions"
    if pages > at.max_pages:
        return f"block table of {pages} pages is longer than the context needs"
    if s.new_pages and max(s.new_pages) >= at.num_pages:
        return f"page id {max(s.new_pages)} outside the pool of {at.num_pages} pages"


def _a_window_page_per_page(s, state, at):
    if s.new_window_pages and not at.window_pages:
        return "the plan names window pages, but this shard has no window pool"
    if at.window_pages and len(s.new_window_pages) != len(s.new_pages):
        return f"{len(s.new_window_pages)} window pages for {len(s.new_pages)} new pages"
    if s.new_window_pages and max(s.new_window_pages) > at.window_pages:  # == : its padding page
        return f"window page id {max(s.new_window_pages)} outside the window pool of {at.window_pages} pages"


def _tokens_in_the_vocabulary(s, state, at):
    wrong = max(max(s.token_ids, default=0), max(s.proposals, default=0), s.next_token)  # next_token: 0 unset
    if wrong >= at.vocab_size:
        return f"token id {wrong} outside the vocabulary of {at.vocab_size}"


def _alternatives_within_bounds(s, state, at):
    if max(s.prompt_logprobs, s.sampling.logprobs) > MAX_TOP:
        return f"at most {MAX_TOP} alternatives per position can be scored"


def _long_rope_where_the_model_has_it(s, state, at):
    if s.long_rope and not at.long_rope:
        return "the plan turns the sequence by long rotary factors, which the model has none of"
    if s.long_rope and not s.first:
        return "the plan turns a sequence by long rotary factors after its first step"


def _a_new_sequence_fits(s, state, at):
    sp = s.sampling
    if s.first and not (math.isfinite(sp.temperature) and sp.temperature >= 0 and 0 <= sp.top_p <= 1):
        return f"invalid sampling parameters {sp}"
    if s.first and not at.has_room:
        return f"this shard already holds {at.held} sequences, its maximum"


# In order: the first rules read what the shard holds, which the later ones then rely on.
RULES: tuple[Rule, ...] = (
    _layers_held,
    _continues_its_chunk,
    _samples_after_the_last_layer,
    _announced_once,
    _from_a_held_position,
    _sampled_input_known,
    _proposals_where_they_verify,
    _a_mask_per_proposal,
    _masks_cover_the_vocabulary,
    _positions_in_its_pages,
    _a_window_page_per_page,
    _tokens_in_the_vocabulary,
    _alternatives_within_bounds,
    _long_rope_where_the_model_has_it,
    _a_new_sequence_fits,
)


def plan_layers(plan: shard_pb2.StepPlan, num_layers: int, stages: int) -> tuple[slice, str | None]:
    """The layers the plan runs (`StepPlan.layer_start`, `layer_end`), and why every entry of it
    fails where a shard cannot run them."""
    layers = slice(plan.layer_start, plan.layer_end or num_layers)
    if layers == slice(0, num_layers):
        return layers, None
    if stages > 1:
        return layers, "the plan runs a layer group on a pipeline stage: layer groups need a single stage"
    if not layers.start < layers.stop <= num_layers:
        return layers, f"the plan runs layers {layers.start} to {layers.stop} of {num_layers}"
    return layers, None


def read(s: shard_pb2.SequenceStep, state: SequenceState | None, at: Context) -> Entry | str:
    """The entry, or why this shard cannot serve it."""
    for rule in RULES:
        if why := rule(s, state, at):
            return why
    sp = s.sampling
    return Entry(
        seq_id=s.seq_id,
        inputs=(state.sampled,) if s.sampled_input else tuple(s.token_ids),
        proposals=tuple(s.proposals),
        start_pos=s.start_pos,
        emit=s.emit,
        new_pages=tuple(s.new_pages),
        new_window_pages=tuple(s.new_window_pages),
        sampling=SamplingParams(
            sp.temperature, sp.top_p or 1.0, sp.top_k, sp.seed, sp.logprobs if sp.HasField("logprobs") else None
        )
        if s.first
        else None,
        prompt_logprobs=s.prompt_logprobs if s.HasField("prompt_logprobs") else None,
        next_token=s.next_token if s.HasField("next_token") else None,
        allowed_tokens=s.allowed_tokens,
        proposal_masks=tuple(s.proposal_masks),
        long_rope=s.long_rope,
    )
