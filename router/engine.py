"""The step loop: asks the scheduler for a step, sends its plan to the shards, applies the
sampled tokens, and streams outputs to the waiting request handlers.

Everything that changes pages happens here between steps, so a page a shard may still write is
never released while its step is in flight (cancellations wait for the step boundary).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque

from protos import shard_pb2
from router.scheduler import Scheduler, Step
from router.sequence import Output, Sequence, Status
from router.shard_client import ShardError, ShardGroup
from router.tokenizer import Detokenizer, StopMatcher

log = logging.getLogger(__name__)


class Engine:
    def __init__(self, scheduler: Scheduler, shards: ShardGroup, tokenizer, max_position: int):
        self.scheduler, self.shards, self.tokenizer = scheduler, shards, tokenizer
        self.max_position = max_position
        self._wake = asyncio.Event()
        self._detok: dict[int, tuple[Detokenizer, StopMatcher]] = {}
        self._cancelled: set[Sequence] = set()
        self.step_id = 0
        self.tokens_generated = 0
        self.prompt_tokens_computed = 0
        self.error: str | None = None      # set when a shard failed; the replica stops serving
        # Recent decode steps as (router wall ms, shard compute ms).
        self.decode_step_times: deque[tuple[float, float]] = deque(maxlen=512)

    def submit(self, seq: Sequence, stops: list[str]) -> None:
        self._detok[seq.seq_id] = (Detokenizer(self.tokenizer), StopMatcher(stops))
        self.scheduler.add(seq)
        self._wake.set()

    def cancel(self, seq: Sequence) -> None:
        """Marks the request; the loop drops it at the next step boundary."""
        if seq.status is not Status.FINISHED:
            seq.cancelled = True
            self._cancelled.add(seq)
            self._wake.set()

    async def run(self) -> None:
        try:
            await self._loop()
        except Exception as e:  # a bug in a step must not leave every stream hanging
            log.exception("the step loop failed")
            self.error = f"internal error: {e!r}"
            self._fail_all()

    async def _loop(self) -> None:
        while self.error is None:
            self._drop_cancelled()
            step = self.scheduler.schedule()
            if step is None:
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                tokens = await self._execute(step)
            except ShardError as e:
                log.error("shard failure, failing every request: %s", e)
                self.error = str(e)
                self._fail_all()
                return
            self.scheduler.complete(step)
            self._apply(step, tokens)

    async def _execute(self, step: Step) -> list[int]:
        self.step_id += 1
        plan = shard_pb2.StepPlan(step_id=self.step_id)
        for seq, inputs, emit in zip(step.seqs, step.inputs, step.emits):
            s = seq.sampling
            plan.seqs.append(shard_pb2.SequenceStep(
                seq_id=seq.seq_id, token_ids=inputs, start_pos=seq.num_computed,
                block_table=seq.block_table, emit=emit,
                sampling=shard_pb2.Sampling(temperature=s.temperature, top_p=s.top_p,
                                            top_k=s.top_k, seed=s.seed)))
        t0 = time.perf_counter()
        result = await self.shards.step(plan)
        wall_ms = (time.perf_counter() - t0) * 1e3
        if not step.is_prefill:
            self.decode_step_times.append((wall_ms, result.compute_ms))
        if len(result.tokens) != sum(step.emits):
            raise ShardError(f"step {self.step_id}: {len(result.tokens)} tokens for {sum(step.emits)} "
                             "emitting sequences")
        return list(result.tokens)

    def _apply(self, step: Step, tokens: list[int]) -> None:
        sampled = iter(tokens)
        for seq, inputs, emit in zip(step.seqs, step.inputs, step.emits):
            if step.is_prefill:
                self.prompt_tokens_computed += len(inputs)
            if not emit:
                continue  # an intermediate chunk: KV written, nothing sampled
            token = next(sampled)
            if seq.cancelled:
                continue  # dropped at the top of the next loop
            seq.output_ids.append(token)
            self.tokens_generated += 1
            detok, stops = self._detok[seq.seq_id]
            is_eos = token in seq.stop_token_ids
            text, stopped = stops.feed("" if is_eos else detok.push(token))
            reason = ("stop" if stopped else "eos" if is_eos else
                      "length" if len(seq.output_ids) >= seq.max_new_tokens
                      or seq.num_tokens >= self.max_position else "")
            if reason and not stopped:
                text += stops.flush()
            seq.outputs.put_nowait(Output([token], text, reason))
            if reason:
                self._finish(seq)

    def _finish(self, seq: Sequence) -> None:
        self.scheduler.finish(seq)
        self._detok.pop(seq.seq_id, None)

    def _drop_cancelled(self) -> None:
        for seq in self._cancelled:
            if seq.status is not Status.FINISHED:
                self._finish(seq)
                seq.outputs.put_nowait(Output([], "", "cancelled"))
        self._cancelled.clear()

    def _fail_all(self) -> None:
        for seq in [*self.scheduler.waiting, *self.scheduler.running]:
            try:
                self._finish(seq)
            finally:  # whatever state the failure left, the client hears of it
                seq.outputs.put_nowait(Output([], "", "error"))
