"""Chooses each step: admit waiting requests (their whole prefill) or decode every running one.

Steps alternate between the two while both have work, so new requests join a running batch
without starving it (continuous batching). Admission is all or nothing on pages: a request is
admitted only when the pages of its cached prefix are pinned and every other page it can ever
need is reserved; otherwise it keeps its place at the head of the queue and nothing changes.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from router.page_manager import PageManager
from router.sequence import Sequence, Status


@dataclass
class Step:
    seqs: list[Sequence]
    inputs: list[list[int]]       # per sequence, the tokens this step computes
    is_prefill: bool


class Scheduler:
    def __init__(self, pages: PageManager, max_batch: int, max_batch_tokens: int):
        self.pages = pages
        self.max_batch, self.max_batch_tokens = max_batch, max_batch_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._last_was_prefill = False

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def can_ever_fit(self, num_tokens: int) -> bool:
        return self.pages.pages_for(num_tokens) <= self.pages.num_pages

    def schedule(self) -> Step | None:
        prefer_prefill = not self._last_was_prefill or not self.running
        step = (self._admit() or self._decode()) if prefer_prefill else (self._decode() or self._admit())
        if step is not None:
            self._last_was_prefill = step.is_prefill
        return step

    def _admit(self) -> Step | None:
        pages, admitted, tokens = self.pages, [], 0
        while self.waiting and len(self.running) + len(admitted) < self.max_batch:
            seq = self.waiting[0]
            if seq.prompt_hashes is None:
                seq.prompt_hashes = pages.prompt_hashes(seq.prompt_ids, seq.cache_salt)
            hits = pages.lookup(seq.prompt_hashes)
            need = len(seq.prompt_ids) - len(hits) * pages.page_size
            if admitted and tokens + need > self.max_batch_tokens:
                break
            total = pages.pages_for(seq.max_tokens)
            if not pages.admit(hits, total, len(seq.prompt_ids)):
                break
            self.waiting.popleft()
            seq.block_table, seq.page_hashes = hits, seq.prompt_hashes[:len(hits)]
            seq.num_computed = seq.cached_prompt_tokens = len(hits) * pages.page_size
            seq.reserved_pages, seq.status = total - len(hits), Status.RUNNING
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
        while len(seq.block_table) * self.pages.page_size < num_tokens:
            seq.block_table.append(self.pages.allocate())
            seq.reserved_pages -= 1

    def publish(self, seq: Sequence) -> None:
        """Indexes the pages that became full in a step every shard has acked."""
        pages, ps = self.pages, self.pages.page_size
        full = seq.num_computed // ps
        if len(seq.page_hashes) >= full:
            return
        tokens = seq.prompt_ids + seq.output_ids
        while len(seq.page_hashes) < full:
            i = len(seq.page_hashes)
            if i < len(seq.prompt_hashes):
                h = seq.prompt_hashes[i]
            else:
                parent = seq.page_hashes[-1] if i else pages.root_hash(seq.cache_salt)
                h = pages.chain(parent, tokens[i * ps:(i + 1) * ps])
            pages.publish(seq.block_table[i], h, seq.block_table[i - 1] if i else None)
            seq.page_hashes.append(h)

    def finish(self, seq: Sequence) -> None:
        """Takes the sequence out of the queues and returns its pages and reservation.
        Called only at a step boundary, so no shard still writes these pages. Idempotent."""
        if seq.status is Status.FINISHED:
            return
        if seq.status is Status.WAITING:
            self.waiting.remove(seq)
        else:
            self.running.remove(seq)
        self.pages.release(seq.block_table)
        self.pages.unreserve(seq.reserved_pages)
        seq.block_table, seq.reserved_pages, seq.status = [], 0, Status.FINISHED
