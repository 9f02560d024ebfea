"""The step loop: asks the scheduler for a step, sends its plan to the shards, applies the
sampled tokens, and streams outputs to the waiting request handlers.

Everything that changes pages happens here between steps (cancellations wait for the step
boundary). A page is released only when no step sent before the one that may give it to another
sequence still writes it: a step may be sent ahead of the one running (`run`), but a shard runs
its plans in order.

The engine hands the shard group (core/shards.py) a `Step` and reads back one result per
scheduled sequence; what the shards already hold, and so what a plan must tell them, is the
group's to know (router/shards/codec.py). The engine tells it only which sequences ended.

Blast radius: a failure that belongs to one request (the shard could not serve its plan entry or
sample its token; its detokenizer or stop strings raised) ends that request alone with a status,
and releases its pages. A failure of the shard group (`ShardError`) or of the loop itself leaves
`run` with the exception; the replica (replica.py) then fails every request and reconnects
with a new engine.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from shardline.common.tokenizer import Detokenizer, TextCodec
from shardline.router.core.constrained import next_masks
from shardline.router.core.events import RequestEvents
from shardline.router.core.page_manager import PageManager
from shardline.router.core.scheduler import Scheduler
from shardline.router.core.sequence import Ending, Failure, FinishReason, Output, Sequence, Status
from shardline.router.core.shards import SequenceResult, Shards, StepOutcome
from shardline.router.core.step import Phase, Step
from shardline.router.core.stop_strings import StopMatcher

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Load:
    """The engine's queues at one moment (the Stats RPC, metrics and the Fleet stream read it)."""

    waiting: int
    prefilling: int
    decoding: int
    prompt_tokens_queued: int  # prompt tokens of waiting and prefilling requests not yet computed

    @property
    def running(self) -> int:
        return self.prefilling + self.decoding


@dataclass
class InFlight:
    """A step whose plan the shards were sent, and when."""

    step: Step
    step_id: int
    sent_at: float


class Engine:
    def __init__(
        self,
        scheduler: Scheduler,
        shards: Shards,
        codec: TextCodec,
        max_position: int,
        observers: list[RequestEvents] = (),
    ):
        self.scheduler, self.shards, self.codec = scheduler, shards, codec
        self.max_position = max_position
        self.observers = list(observers)  # Stats, metrics and traces: told every request's and step's events
        self._wake = asyncio.Event()
        self._text: dict[int, tuple[Detokenizer, StopMatcher]] = {}
        self._cancelled: set[Sequence] = set()
        self._received_at = 0.0  # perf_counter() of the last step's result
        self._in_flight = 0  # steps sent and not answered
        self.step_id = 0

    # -- what the request path and the observers ask ------------------------------------------------
    @property
    def pool(self) -> PageManager:
        """The page pool and prefix index of this connection's shard group."""
        return self.scheduler.kv.pool

    def can_ever_fit(self, num_tokens: int) -> bool:
        return self.scheduler.kv.can_ever_fit(num_tokens)

    def waiting(self, tenant: str | None = None) -> int:
        """Requests waiting for admission (of one tenant, or of all)."""
        return sum(1 for s in self.scheduler.waiting if tenant is None or s.tenant == tenant)

    def load(self) -> Load:
        sched = self.scheduler
        queued = sum(len(s.prompt_ids) - s.num_computed for s in sched.prefilling) + sum(
            len(s.prompt_ids) for s in sched.waiting
        )
        return Load(len(sched.waiting), len(sched.prefilling), len(sched.decoding), queued)

    # -- requests ---------------------------------------------------------------------------------
    def submit(self, seq: Sequence, stops: list[str]) -> None:
        self._text[seq.seq_id] = (self.codec.stream(), StopMatcher(stops))
        self.scheduler.add(seq)
        for o in self.observers:
            o.queued(seq)
        self._wake.set()

    def has_work(self) -> bool:
        """Requests to serve, or a step still in flight (one sent ahead for a sequence that has
        since finished, say)."""
        return self.scheduler.has_work() or self._in_flight > 0

    def cancel(self, seq: Sequence) -> None:
        """Marks the request; the loop drops it at the next step boundary."""
        if seq.status is not Status.FINISHED:
            seq.cancelled = True
            self._cancelled.add(seq)
            self._wake.set()

    async def run(self) -> None:
        """Runs steps until the shard group or the loop fails (the exception propagates).

        While a decode step runs on a lone shard, the decode step after it is sent too when it
        is sure to follow (`_ahead`); the shard then finds its next plan waiting when a step
        ends, and neither the round trip to the router nor the router's work on the tokens
        holds it up. At most one step is sent ahead, so a new request or a cancellation waits
        for one step more."""
        ahead: InFlight | None = None
        while True:
            if ahead is None:
                self._drop_cancelled()
                step = self.scheduler.schedule()
                if step is None:
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                current = await self._send(step)
            else:
                current, ahead = ahead, None
            step = current.step
            try:
                if (next_step := self._ahead(step)) is not None:
                    ahead = await self._send(next_step)
                result = await self._receive(current)
            except BaseException as e:  # every step in flight fails with it
                for sent in (current, ahead):
                    for o in self.observers if sent is not None else ():
                        o.step_failed(sent.step_id, sent.step, e)
                raise
            failed = {seq_id: row.failure for seq_id, row in result.rows.items() if row.failure is not None}
            self.scheduler.complete(step, failed)
            self._apply(step, result)
            if ahead is not None:  # the inputs the shard takes: the tokens just applied
                for s in ahead.step.scheduled:
                    s.tokens = s.seq.output_ids[-1:]

    def _ahead(self, step: Step) -> Step | None:
        """The decode step to send while `step` runs, or None. Only a lone shard holds the tokens
        it samples; a constrained sequence needs the mask of the token `step` samples. (A mixed
        step's phase is that of its chunks; a cancelled sequence is in `_cancelled` until it
        is dropped, and FINISHED after.)"""
        if (
            not self.shards.samples_alone
            or step.phase is not Phase.DECODE
            or self._cancelled
            or step.proposed  # where its sequences stand after it is known from its answer alone
            or any(seq.constrained is not None for seq in step.seqs)
        ):
            return None
        going = [
            seq
            for seq in step.seqs
            if seq.status is Status.RUNNING
            and len(seq.output_ids) + 1 < seq.max_new_tokens
            and seq.num_tokens + 1 < self.max_position
        ]
        return self.scheduler.decode_ahead(going)

    async def _send(self, step: Step) -> InFlight:
        self.step_id += 1
        if step.phase is Phase.ADMIT:
            now = time.monotonic()
            for chunk in step.chunks:
                chunk.seq.admitted_at = now
                for o in self.observers:
                    o.admitted(chunk.seq)
        for o in self.observers:
            o.step_started(self.step_id, step)
        try:
            await self.shards.send(self.step_id, step)
        except BaseException as e:
            for o in self.observers:
                o.step_failed(self.step_id, step, e)
            raise
        self._in_flight += 1
        return InFlight(step, self.step_id, time.perf_counter())

    async def _receive(self, sent: InFlight) -> StepOutcome:
        step, step_id = sent.step, sent.step_id
        result = await self.shards.receive(step_id, step)
        self._in_flight -= 1
        # A step sent ahead starts when the one before it ends.
        received_at = time.perf_counter()
        wall_s, self._received_at = received_at - max(sent.sent_at, self._received_at), received_at
        for s in step.scheduled:
            s.accepted = max(0, len(result.rows[s.seq.seq_id].tokens) - 1)
        self.scheduler.timed(step, wall_s)
        for o in self.observers:
            o.step_done(step_id, step, result, wall_s)
        return result

    def _apply(self, step: Step, result: StepOutcome) -> None:
        for s in step.scheduled:
            seq, row = s.seq, result.rows[s.seq.seq_id]
            if row.failure is not None:
                self.fail(seq, Failure("INTERNAL", f"the shard could not serve this request: {row.failure}"))
                continue
            seq.prompt_scores.extend(row.prompt_scores)
            if not s.emit:
                continue  # an intermediate chunk: KV written, nothing sampled
            if seq.cancelled or seq.status is Status.FINISHED:
                continue  # dropped at the top of the next loop, or it ended while a step sent ahead ran
            if why := self._missing_logprobs(seq, row):
                self.fail(seq, Failure("INTERNAL", why))
                continue
            for i, token in enumerate(row.tokens):
                if seq.status is Status.FINISHED:  # until one ends it (EOS, a stop string, a limit)
                    break
                try:
                    self._emit(seq, token, list(row.sampled_scores[i : i + 1]))
                except Exception as e:  # a detokenizer or stop-string edge case: this request only
                    log.exception("request %s failed on token %d", seq.request_id, token)
                    self.fail(seq, Failure("INTERNAL", f"turning token {token} into text failed: {e!r}"))
        self._next_masks(step)

    def _next_masks(self, step: Step) -> None:
        """The next token masks of the step's constrained sequences that go on; one that reached
        a dead end (its constraint asks for what the model's tokens cannot spell) fails alone."""
        going = [
            seq
            for seq in step.seqs
            if seq.constrained is not None and seq.status is not Status.FINISHED and seq.output_ids
        ]
        try:
            next_masks([seq.constrained for seq in going if not seq.constrained.error])
        except Exception as e:  # noqa: BLE001 - llguidance misused or broken: these requests only
            log.exception("computing token masks failed")
            for seq in going:
                self.fail(seq, Failure("INTERNAL", f"computing the token mask failed: {e!r}"))
            return
        for seq in going:
            if seq.constrained.error:
                self.fail(seq, Failure("INVALID_ARGUMENT", seq.constrained.error))

    @staticmethod
    def _missing_logprobs(seq: Sequence, row: SequenceResult) -> str | None:
        if seq.logprobs is not None and len(row.sampled_scores) != len(row.tokens):
            return "the shard returned no log-probability for a sampled token"
        if seq.prompt_logprobs is not None and not seq.output_ids and len(seq.prompt_scores) != len(seq.prompt_ids) - 1:
            return f"the shards scored {len(seq.prompt_scores)} prompt positions, expected {len(seq.prompt_ids) - 1}"
        return None

    def _emit(self, seq: Sequence, token: int, logprobs: list) -> None:
        first = not seq.output_ids
        seq.output_ids.append(token)
        seq.previous_token_at, seq.last_token_at = seq.last_token_at, time.monotonic()
        if first:
            seq.first_token_at = seq.last_token_at
        for o in self.observers:
            o.token(seq, first)
        detok, stops = self._text[seq.seq_id]
        is_eos = token in seq.stop_token_ids
        constrained = seq.constrained
        if constrained is not None:
            constrained.consume(token)
        text, stopped = stops.feed("" if is_eos else detok.push(token))
        reason = (
            FinishReason.STOP
            if stopped
            else FinishReason.EOS
            if is_eos
            else FinishReason.STOP
            if constrained is not None and constrained.complete
            else FinishReason.LENGTH
            if len(seq.output_ids) >= seq.max_new_tokens or seq.num_tokens >= self.max_position
            else None
        )
        if reason and not stopped:
            rest, stopped = stops.flush()
            text, reason = text + rest, FinishReason.STOP if stopped else reason
        seq.outputs.put_nowait(
            Output(
                [token],
                text,
                reason,
                logprobs=logprobs,
                prompt_logprobs=seq.prompt_scores if first else [],
                stop=stops.matched if reason else None,
            )
        )
        if reason:
            self._finish(seq, reason)

    def _finish(self, seq: Sequence, end: Ending) -> None:
        if seq.status is not Status.FINISHED:
            for o in self.observers:
                o.finished(seq, end)
        self.scheduler.finish(seq)
        self._text.pop(seq.seq_id, None)
        self.shards.release(seq.seq_id)

    def fail(self, seq: Sequence, failure: Failure) -> None:
        """Ends one request with a status; its pages go back at once (call between steps only)."""
        if seq.status is Status.FINISHED:
            return
        try:
            self._finish(seq, failure)
        finally:  # whatever state the failure left, the client hears of it
            seq.outputs.put_nowait(Output([], "", failure=failure))

    def fail_all(self, failure: Failure) -> None:
        """Ends every request: the shard group failed or the server stops. The engine is done
        (a reconnected group starts from nothing, with a new one)."""
        for seq in [*self.scheduler.waiting, *self.scheduler.running]:
            self.fail(seq, failure)
        self._cancelled.clear()

    def _drop_cancelled(self) -> None:
        for seq in self._cancelled:
            if seq.status is not Status.FINISHED:
                self._finish(seq, FinishReason.CANCELLED)
                seq.outputs.put_nowait(Output([], "", FinishReason.CANCELLED))
        self._cancelled.clear()
