"""Chooses each step. A step runs one phase:

- Decode: one token for every sequence whose prompt is fully computed;
- Continue: the next chunk of every admitted prefill still in progress, round-robin;
- Admit: the first chunk of new requests, picked by priority with aging.

Prefill steps rotate in rounds of Continue and Admit, each where it has work, and a Decode step
follows every prefill step while sequences decode. Where the request next to be admitted is
shorter than what remains of the prefill in progress, the round runs Admit before Continue, so a
short prompt that arrives during a long one's chunks waits for one chunk, not two (shortest
first, for time to first token). So Decode runs at least once in every two steps, and Continue
and Admit in every six (three prefill steps): a decoding sequence waits for one prefill step at
most, not a Continue and an Admit back to back (in `bench.mixed` that pair, a short prompt's
admission and a long one's chunk, was the decoding stream's slowest gap), and new requests join
a running batch without waiting for it to drain (continuous batching). With `mixed_steps` (as
Sarathi-Serve and vLLM v1 run), every step carries the Decode rows instead of a Decode step
following each prefill step: a decoding sequence then waits for no step but the one that
computes its token.

With `chunk_size` 0 a prompt runs whole in its Admit step; otherwise prompts are cut into chunks
of at most `chunk_size` tokens, and only the final chunk of a prompt samples a token. A chunk's
tokens attend to every token before them, so late in a long prompt a chunk of `chunk_size`
tokens costs far more than the first (on a 2-core CPU, SmolLM2's eighth chunk of 256 took 1.6-2x
its first): given `pair_cost` (one attention pair's multiply-adds over one token's through the
weights, from the shards' Info), a chunk holds as many tokens as cost what `chunk_size` tokens
cost at the start of a prompt, so that the steps a decoding sequence waits for grow little with
the prompt.

With `layer_groups` G > 1, the chunks of a prompt longer than one chunk run in layer groups (where
they apply: with chunking, without mixed steps, whose decode rows run every layer, and on a single
stage, as pipeline stages run whole chunks; else G is 1): a
step runs about 1/G of the model's layers on the chunk, and the shard keeps the chunk's hidden
states until the next group (`StepPlan.layer_start`). Each group is a prefill step of its own in
the rotation, so a decoding sequence waits for one group, not one chunk, and a short prompt that
arrives during a long one's chunk is admitted after the group that runs (shortest first, above),
not after the chunk. A prompt that fits in one chunk runs whole, its first token being near. One
chunk at a time runs in groups, alone in its step; a chunk with nothing to give way to (no other
sequence running or waiting) runs its remaining layers at once.

Admission is all or nothing on pages: a request is admitted only when the pages of its cached
prefix are pinned and every other page it can ever need is reserved; otherwise the request
keeps its place at the head of the queue and nothing changes. The pages themselves are the KV
manager's (kv_manager.py): the scheduler asks it what a choice costs and tells it what ran.

A sequence that waits for another (`Sequence.after`: the other choices of a request with
several) is admitted once that one's prompt is computed, so that it finds the prompt's full
pages in the prefix cache.

Priority orders only admission. A waiting request's effective priority grows by one level per
`aging_s` seconds waited, so a request waits behind higher priorities for at most
(priority gap) x `aging_s` seconds plus the time its pages take to become free.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Collection

from shardline.router.core.kv_manager import KVManager
from shardline.router.core.sequence import Sequence, Status
from shardline.router.core.speculation import Speculator
from shardline.router.core.step import Phase, Scheduled, Step


class Scheduler:
    def __init__(
        self,
        kv: KVManager,
        max_batch: int,
        max_batch_tokens: int,
        chunk_size: int = 0,
        aging_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        mixed_steps: bool = False,
        pair_cost: float = 0.0,
        layer_groups: int = 1,
        num_layers: int = 0,
        speculator: Speculator | None = None,
        stages: int = 1,
    ):
        if (
            max_batch < 1
            or max_batch_tokens < 1
            or chunk_size < 0
            or not aging_s > 0
            or not pair_cost >= 0
            or layer_groups < 1
        ):
            raise ValueError(
                f"scheduler limits out of range: max_batch {max_batch}, max_batch_tokens "
                f"{max_batch_tokens}, chunk_size {chunk_size}, aging_s {aging_s}, pair_cost {pair_cost}, "
                f"layer_groups {layer_groups}"
            )
        if not chunk_size or mixed_steps or stages > 1:
            layer_groups = 1
        layer_groups = min(layer_groups, max(1, num_layers))
        self.kv = kv
        self.speculator = speculator  # which decode rows carry proposals, if any
        # Layer group boundaries: group i runs layers [bounds[i], bounds[i + 1]).
        self.layer_bounds = [round(i * num_layers / layer_groups) for i in range(layer_groups + 1)]
        self._group: Step | None = None  # the chunk running in layer groups, as its last group ran
        self.max_batch, self.max_batch_tokens = max_batch, max_batch_tokens
        self.chunk_size, self.aging_s, self.clock = chunk_size, aging_s, clock
        self.mixed_steps, self.pair_cost = mixed_steps, pair_cost
        # A round's prefill phases, each a step where it has work: Continue first, or Admit where
        # a shorter request waits (`_rotate`).
        self._rotation = [Phase.CONTINUE, Phase.ADMIT]
        self._decode_due = False  # without mixed steps: the step before was a prefill step
        self.waiting: list[Sequence] = []
        self.prefilling: deque[Sequence] = deque()  # admitted, prompt not fully computed
        self.decoding: list[Sequence] = []
        self._next_phase = 0

    @property
    def running(self) -> list[Sequence]:
        return [*self.prefilling, *self.decoding]

    def add(self, seq: Sequence) -> None:
        seq.arrival = self.clock()
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.decoding)

    def schedule(self) -> Step | None:
        if not self.mixed_steps:
            return self._rotate(self.max_batch_tokens)
        decode = self._decode()
        # The decode rows take their share of the step's token budget before the chunk does.
        chunks = self._rotate(self.max_batch_tokens - decode.num_tokens if decode else self.max_batch_tokens)
        if decode is None or chunks is None:
            return decode or chunks
        return Step(chunks.phase, decode.scheduled + chunks.scheduled)

    def _rotate(self, budget: int) -> Step | None:
        """The next step: without mixed steps, Decode after every prefill step; then the next
        prefill phase of the round that has work, or else Decode."""
        if self._decode_due:
            self._decode_due = False
            step = self._decode()
            if step is not None:
                return step
        rotation = self._rotation
        if self._next_phase == 0:  # a round's prefill pair is next: Continue, Admit
            rotation[:] = [Phase.ADMIT, Phase.CONTINUE] if self._shorter_waits() else [Phase.CONTINUE, Phase.ADMIT]
        for i in range(len(rotation)):
            phase = (self._next_phase + i) % len(rotation)
            step = self._continue(budget) if rotation[phase] is Phase.CONTINUE else self._admit(budget)
            if step is not None:
                self._next_phase = (phase + 1) % len(rotation)
                self._decode_due = not self.mixed_steps
                return step
        return None if self.mixed_steps else self._decode()

    # -- phases -----------------------------------------------------------------------------------
    def _decode(self) -> Step | None:
        if not self.decoding:
            return None
        proposals = self.speculator.propose(self.decoding) if self.speculator else {}
        step = Step(Phase.DECODE)
        for seq in self.decoding:
            proposal = proposals.get(seq, [])
            self.kv.grow(seq, seq.num_tokens + len(proposal))
            step.scheduled.append(Scheduled(seq, seq.output_ids[-1:], True, True, proposal))
        return step

    def timed(self, step: Step, wall_s: float) -> None:
        """A step took `wall_s` seconds: what decode steps cost is what speculation weighs."""
        if self.speculator is not None and step.phase is Phase.DECODE:
            self.speculator.measured(step.num_tokens, wall_s, step.sampled_inputs)

    def decode_ahead(self, seqs: list[Sequence]) -> Step | None:
        """The decode step of `seqs`, to be sent while their decode step runs, when it is the step
        that follows: no prefill is in progress and no waiting request may be admitted. `seqs`
        are the sequences of that step that are sure to go on after it (not at their length
        limit, unconstrained); each computes the position after the one it computes now, from
        the token it samples there. Decode steps are then never rotated with the others: they
        are the only phase with work."""
        if not seqs or self.prefilling or (len(self.decoding) < self.max_batch and self._most_urgent()):
            return None
        # A sequence that copies from its context proposes its next tokens: the step after this
        # one is scheduled once its token is known (a step sent ahead carries no proposals).
        if self.speculator is not None and self.speculator.propose(seqs, trial=True):
            return None
        for seq in seqs:
            self.kv.grow(seq, seq.num_computed + 2)
        return Step(Phase.DECODE, [Scheduled(seq, [], True, True) for seq in seqs], sampled_inputs=True)

    def _continue(self, budget: int) -> Step | None:
        if self._group is not None:
            return self._next_group()
        step = Step(Phase.CONTINUE)
        for _ in range(len(self.prefilling)):
            seq = self.prefilling[0]
            n = self._chunk(seq, budget, first=not step.scheduled)
            grouped = self._in_groups(seq, n, seq.cached_prompt_tokens)
            if n == 0 or grouped and step.scheduled:
                break
            self.prefilling.rotate(-1)  # round robin: the next Continue step starts after it
            self._add_chunk(step, seq, n, grouped)
            budget -= n
            if step.partial:
                break
        return step if step.scheduled else None

    def _admit(self, budget: int) -> Step | None:
        step = Step(Phase.ADMIT)
        while len(self.prefilling) + len(self.decoding) < self.max_batch:
            seq = self._most_urgent()
            if seq is None:
                break
            prefix = self.kv.cached_prefix(seq)
            cached = len(prefix) * self.kv.page_size
            n = self._chunk(seq, budget, first=not step.scheduled, computed=cached)
            # A chunk in layer groups runs alone, and one at a time: a long prompt waits for both.
            grouped = self._in_groups(seq, n, cached)
            if n == 0 or grouped and (step.scheduled or self._group is not None):
                break
            if not self.kv.admit(seq, prefix):
                break
            self.waiting.remove(seq)
            seq.status = Status.RUNNING
            self.prefilling.append(seq)
            self._add_chunk(step, seq, n, grouped)
            budget -= n
            if step.partial:
                break
        return step if step.scheduled else None

    # -- layer groups -----------------------------------------------------------------------------
    @property
    def layer_groups(self) -> int:
        return len(self.layer_bounds) - 1

    def _in_groups(self, seq: Sequence, n: int, cached: int) -> bool:
        """Whether a chunk of `n` tokens of `seq` runs in layer groups: its prompt past its `cached`
        prefix does not fit in one chunk. (Callers start one only while no other is in groups.)"""
        return self.layer_groups > 1 and n < len(seq.prompt_ids) - cached

    def _group_end(self, done: int) -> int | None:
        """Where the group after `done` layers ends: the next bound, or None (through the last
        layer) when nothing else runs or waits, or the bound is the last."""
        if not (self.decoding or self.waiting or len(self.prefilling) > 1):
            return None
        end = next(b for b in self.layer_bounds if b > done)
        return None if end == self.layer_bounds[-1] else end

    def _next_group(self) -> Step:
        """The next layer group of the chunk in groups: its tokens again, from where the last ended."""
        (chunk,) = self._group.chunks
        seq, done = chunk.seq, self._group.layer_end
        end = self._group_end(done)
        emit = end is None and seq.num_computed + len(chunk.tokens) == len(seq.prompt_ids)
        return Step(Phase.CONTINUE, [Scheduled(seq, chunk.tokens, emit, False)], layer_start=done, layer_end=end)

    # -- helpers ----------------------------------------------------------------------------------
    def _shorter_waits(self) -> bool:
        """Whether the request next to be admitted has a shorter prompt than what remains of the
        prefill the next Continue step starts with (cached prefixes not counted)."""
        if not self.prefilling:
            return False
        seq, head = self._most_urgent(), self.prefilling[0]
        return seq is not None and len(seq.prompt_ids) < len(head.prompt_ids) - head.num_computed

    def _most_urgent(self) -> Sequence | None:
        """The waiting sequence that may start with the highest effective priority (one pass)."""
        now = self.clock()
        return max(
            (s for s in self.waiting if _may_start(s)),
            default=None,
            key=lambda s: (s.priority + (now - s.arrival) / self.aging_s, -s.arrival),
        )

    def _chunk(self, seq: Sequence, budget: int, first: bool, computed: int | None = None) -> int:
        """Prompt tokens `seq` computes in this step: the rest of its prompt, cut to the chunk
        size at its position and the step's token budget. With chunking off a prompt runs whole,
        alone if it is larger than the budget."""
        start = seq.num_computed if computed is None else computed
        remaining = len(seq.prompt_ids) - start
        if self.chunk_size:
            return max(0, min(remaining, self.chunk_at(start), budget))
        return remaining if first or remaining <= budget else 0

    def chunk_at(self, start: int) -> int:
        """The most tokens a chunk after `start` computed ones holds: at least one, at most
        `chunk_size`, as many as cost no more than `chunk_size` tokens at position 0. n tokens
        after `start` cost n (the weights) + pair_cost * n * (start + (n - 1) / 2) (attention
        pairs): the positive root of that quadratic in n, rounded down."""
        size, p = self.chunk_size, self.pair_cost
        if not p:
            return size
        limit = size * (1 + p * (size - 1) / 2)
        b = 1 + p * (start - 0.5)
        n = (math.sqrt(b * b + 2 * p * limit) - b) / p
        return max(1, min(size, int(n + 1e-6)))

    def _add_chunk(self, step: Step, seq: Sequence, n: int, grouped: bool) -> None:
        """Adds a chunk to the step; a chunk that runs in layer groups (alone) adds its first."""
        start = seq.num_computed
        self.kv.grow(seq, start + n)
        if grouped:
            step.layer_end = self._group_end(0)
        emit = start + n == len(seq.prompt_ids) and not step.partial
        step.scheduled.append(Scheduled(seq, seq.prompt_ids[start : start + n], emit, False))

    # -- after a step -----------------------------------------------------------------------------
    def complete(self, step: Step, failed: Collection[int] = ()) -> None:
        """Every shard acked `step`: its tokens' KV is written, except for the sequences in
        `failed` (ids), which the shards left out and which are to be finished, and for those
        that finished while the step ran (sent ahead, it computed a token they do not need).
        Advances each other sequence, publishes the pages that became full, and moves finished
        prefills to the decode phase."""
        if step.partial:  # nothing computed yet
            seq = step.scheduled[0].seq
            gone = seq.seq_id in failed or seq.status is Status.FINISHED
            self._group = None if gone else step
            return
        if step.layer_start:
            self._group = None
        for s in step.scheduled:
            seq = s.seq
            if seq.seq_id in failed or seq.status is Status.FINISHED:
                continue
            seq.num_computed += len(s.tokens) + s.accepted  # a rejected proposal's position is written again
            if s.proposals:
                seq.drafting.verified(len(s.proposals), s.accepted)
            self.kv.publish(seq, s.proposals[: s.accepted])
            if not s.decode and seq.num_computed == len(seq.prompt_ids) and seq.status is Status.RUNNING:
                self.prefilling.remove(seq)
                self.decoding.append(seq)

    def finish(self, seq: Sequence) -> None:
        """Takes the sequence out of its phase and returns its pages and reservation.
        Called only at a step boundary: a shard may still write these pages in a step sent
        ahead, but a step that gives them to another sequence is sent after it, and a shard
        runs its plans in order. Idempotent."""
        if seq.status is Status.FINISHED:
            return
        if self._group is not None and self._group.scheduled[0].seq is seq:
            self._group = None
        for queue in (self.waiting, self.prefilling, self.decoding):
            if seq in queue:
                queue.remove(seq)
                break
        self.kv.release(seq)
        if self.speculator is not None:
            self.speculator.finished(seq)
        seq.status = Status.FINISHED


def _may_start(seq: Sequence) -> bool:
    """Whether `seq` may be admitted: it waits for no other sequence, or that one has computed
    its prompt (whose full pages are then cached) or ended."""
    lead = seq.after
    return (
        lead is None
        or lead.status is Status.FINISHED
        or (lead.status is Status.RUNNING and lead.num_computed >= len(lead.prompt_ids))
    )
