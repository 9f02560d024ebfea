"""A sequence's pages: the per-sequence half of the KV cache's books, over the pool's page table
and prefix index (page_manager.py), as vLLM v1's KV cache manager keeps them apart from its
scheduler. The scheduler decides who runs and how much; this module says what that costs in
pages, and it alone writes a sequence's `SequencePages`:

- `cached_prefix(seq)`: the pages of the longest cached prefix of its prompt (changes nothing);
- `admit(seq, prefix)`: pins those pages and reserves every other page the sequence can ever
  need, or changes nothing (admission is all or nothing: a running sequence never waits for a
  page);
- `grow(seq, n)`: takes reserved pages until its block table covers n positions;
- `publish(seq)`: indexes its pages that became full, once every shard has written them (for
  proposals, once they were accepted: a rejected one's position is written again);
- `release(seq)`: returns its pages and what is left of its reservation. Idempotent.
"""

from __future__ import annotations

from shardline.router.core.page_manager import PageManager
from shardline.router.core.sequence import Sequence, SequencePages


class KVManager:
    def __init__(self, pool: PageManager):
        self.pool = pool

    @property
    def page_size(self) -> int:
        return self.pool.page_size

    def can_ever_fit(self, num_tokens: int) -> bool:
        """Whether the whole pool holds a sequence of `num_tokens` positions."""
        return self.pool.pages_for(num_tokens) <= self.pool.num_pages

    def cached_prefix(self, seq: Sequence) -> list[int]:
        """The pages of the longest prefix of the prompt whose KV the pool holds. A prompt to be
        scored needs its logits at every position: nothing of it is reused."""
        pages = seq.pages
        if pages.prompt_hashes is None:  # hashed once, however often admission is tried
            pages.prompt_hashes = self.pool.prompt_hashes(seq.prompt_ids, seq.cache_namespace)
        return [] if seq.prompt_logprobs is not None else self.pool.lookup(pages.prompt_hashes)

    def admit(self, seq: Sequence, prefix: list[int]) -> bool:
        """Pins the `prefix` pages (`cached_prefix`, unchanged since) and reserves the rest of
        what the sequence can ever need; False, changing nothing, where the pool cannot."""
        total = self.pool.pages_for(seq.max_tokens)
        if not self.pool.admit(prefix, total, len(seq.prompt_ids)):
            return False
        pages = seq.pages
        pages.block_table, pages.reserved = list(prefix), total - len(prefix)
        pages.published = pages.prompt_hashes[: len(prefix)]
        seq.num_computed = seq.cached_prompt_tokens = len(prefix) * self.page_size
        return True

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Gives the sequence the reserved pages that cover `num_tokens` positions."""
        pages = seq.pages
        while len(pages.block_table) * self.page_size < num_tokens:
            pages.block_table.append(self.pool.allocate())
            pages.reserved -= 1

    def publish(self, seq: Sequence, accepted: list[int] = ()) -> None:
        """Indexes every page of the sequence that its computed positions fill, each under the
        hash chained over the tokens before it (a prompt page's is known from admission).
        `accepted`: proposals the shards accepted, computed but not yet among its outputs."""
        pages, size = seq.pages, self.page_size
        full = seq.num_computed // size
        if len(pages.published) >= full:
            return
        tokens = [*seq.prompt_ids, *seq.output_ids, *accepted]
        while len(pages.published) < full:
            i = len(pages.published)
            if i < len(pages.prompt_hashes):
                h = pages.prompt_hashes[i]
            else:
                parent = pages.published[-1] if i else self.pool.root_hash(seq.cache_namespace)
                h = self.pool.chain(parent, tokens[i * size : (i + 1) * size])
            page_tokens = tokens[i * size : (i + 1) * size]
            self.pool.publish(pages.block_table[i], h, pages.block_table[i - 1] if i else None, page_tokens)
            pages.published.append(h)

    def release(self, seq: Sequence) -> None:
        """Returns the sequence's pages (the prefix index keeps what was published) and the rest
        of its reservation."""
        self.pool.release(seq.pages.block_table)
        self.pool.unreserve(seq.pages.reserved)
        seq.pages = SequencePages(prompt_hashes=seq.pages.prompt_hashes)
