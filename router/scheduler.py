"""Chooses each step: admit waiting requests (their whole prefill) or decode every running one.

Steps alternate between the two while both have work, so new requests join a running batch
without starving it (continuous batching). Admission is all or nothing on pages: a request is
admitted only when every page it can ever need is reserved; otherwise it keeps its place at
the head of the queue and nothing changes.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from router.pages import PagePool
from router.sequence import Sequence, Status


@dataclass
class Step:
    seqs: list[Sequence]
    inputs: list[list[int]]       # per sequence, the tokens this step computes
    is_prefill: bool


class Scheduler:
    def __init__(self, pool: PagePool, max_batch: int, max_batch_tokens: int):
        self.pool = pool
        self.max_batch, self.max_batch_tokens = max_batch, max_batch_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._last_was_prefill = False

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def can_ever_fit(self, num_tokens: int) -> bool:
        return self.pool.pages_for(num_tokens) <= self.pool.num_pages

    def schedule(self) -> Step | None:
        prefer_prefill = not self._last_was_prefill or not self.running
        step = (self._admit() or self._decode()) if prefer_prefill else (self._decode() or self._admit())
        if step is not None:
            self._last_was_prefill = step.is_prefill
        return step

    def _admit(self) -> Step | None:
        admitted, tokens = [], 0
        while self.waiting and len(self.running) + len(admitted) < self.max_batch:
            seq = self.waiting[0]
            need = len(seq.prompt_ids)
            if admitted and tokens + need > self.max_batch_tokens:
                break
            pages = self.pool.pages_for(seq.max_tokens)
            if not self.pool.reserve(pages):
                break
            self.waiting.popleft()
            seq.reserved_pages, seq.status = pages, Status.RUNNING
            self._grow(seq, len(seq.prompt_ids))
            admitted.append(seq)
            tokens += need
        if not admitted:
            return None
        self.running.extend(admitted)
        return Step(admitted, [s.next_input() for s in admitted], is_prefill=True)

    def _decode(self) -> Step | None:
        if not self.running:
            return None
        for seq in self.running:
            self._grow(seq, seq.num_tokens)
        return Step(list(self.running), [s.next_input() for s in self.running], is_prefill=False)

    def _grow(self, seq: Sequence, num_tokens: int) -> None:
        """Gives the sequence the reserved pages that cover `num_tokens` positions."""
        while len(seq.block_table) * self.pool.page_size < num_tokens:
            seq.block_table.append(self.pool.take_reserved())
            seq.reserved_pages -= 1

    def finish(self, seq: Sequence) -> None:
        """Takes the sequence out of the queues and returns its pages and reservation.
        Called only at a step boundary, so no shard still writes these pages. Idempotent."""
        if seq.status is Status.FINISHED:
            return
        if seq.status is Status.WAITING:
            self.waiting.remove(seq)
        else:
            self.running.remove(seq)
        self.pool.release(seq.block_table)
        self.pool.unreserve(seq.reserved_pages)
        seq.block_table, seq.reserved_pages, seq.status = [], 0, Status.FINISHED
