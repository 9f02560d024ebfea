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

With a window pool (kv_pools.py), the sliding-window layers keep their pages there, in a second
block table of the same positions (`SequencePages.window_table`): a page the window of the
sequence's next position no longer reaches (positions below num_computed - window + 1) goes back
to that pool as the sequence grows (the shards forget it by the same rule, shard.proto), still
indexed under its prefix hash where it was published. So a sequence holds at most `span` window
pages at once, and that is what admission reserves there. A cached prefix is reused as far as
the window pool still holds the pages its window reaches, besides the page pool holding all of
it. The window pool's index takes the page pool's hashes, unchained (a page whose prefix is gone
from it is still of use: the window never looks back that far).
"""

from __future__ import annotations

from shardline.router.core.page_manager import PageManager
from shardline.router.core.sequence import Sequence, SequencePages


class KVManager:
    def __init__(self, pool: PageManager, window_pool: PageManager | None = None, window: int = 0, span: int = 0):
        """`window_pool`: the sliding-window layers' pages, for a window of `window` tokens, of
        which a sequence holds at most `span` (kv_pools.window_span); None: those layers keep
        their pages in `pool`."""
        self.pool, self.window_pool = pool, window_pool
        self.window, self.span = window, span

    @property
    def page_size(self) -> int:
        return self.pool.page_size

    @property
    def forgotten(self) -> int:
        """The window table's entry of a page the window no longer reaches: the shards' padding
        page of the window pool."""
        return self.window_pool.num_pages

    def can_ever_fit(self, num_tokens: int) -> bool:
        """Whether the whole pool holds a sequence of `num_tokens` positions."""
        if self.window_pool is not None and self._window_pages(num_tokens) > self.window_pool.num_pages:
            return False
        return self.pool.pages_for(num_tokens) <= self.pool.num_pages

    def cached_prefix(self, seq: Sequence) -> list[int]:
        """The pages of the longest prefix of the prompt whose KV the pool holds (and the window
        pool the part its window reaches). A prompt to be scored needs its logits at every
        position: nothing of it is reused."""
        pages = seq.pages
        if pages.prompt_hashes is None:  # hashed once, however often admission is tried
            pages.prompt_hashes = self.pool.prompt_hashes(seq.prompt_ids, seq.cache_namespace)
        if seq.prompt_logprobs is not None:
            return []
        prefix = self.pool.lookup(pages.prompt_hashes)
        if self.window_pool is not None:
            prefix = prefix[: self._window_reuse(pages.prompt_hashes, len(prefix))]
        return prefix

    def admit(self, seq: Sequence, prefix: list[int]) -> bool:
        """Pins the `prefix` pages (`cached_prefix`, unchanged since) and reserves the rest of
        what the sequence can ever need; False, changing nothing, where the pool cannot."""
        total, pages = self.pool.pages_for(seq.max_tokens), seq.pages
        if self.window_pool is None:
            if not self.pool.admit(prefix, total, len(seq.prompt_ids)):
                return False
        else:
            first = self._first_seen(len(prefix) * self.page_size)
            hits = [self.window_pool.index[h] for h in pages.prompt_hashes[first : len(prefix)]]
            span = self._window_pages(seq.max_tokens)
            if not (self.pool.fits(prefix, total) and self.window_pool.fits(hits, span)):
                return False
            self.pool.admit(prefix, total, len(seq.prompt_ids))
            self.window_pool.admit(hits, span, 0)
            pages.window_table, pages.window_reserved = [self.forgotten] * first + hits, span - len(hits)
        pages.block_table, pages.reserved = list(prefix), total - len(prefix)
        pages.published = pages.prompt_hashes[: len(prefix)]
        seq.num_computed = seq.cached_prompt_tokens = len(prefix) * self.page_size
        return True

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Gives the sequence the reserved pages that cover `num_tokens` positions (first, with a
        window pool, returning the window pages its window left behind)."""
        pages = seq.pages
        if self.window_pool is not None:
            self._forget_behind(seq)
        while len(pages.block_table) * self.page_size < num_tokens:
            pages.block_table.append(self.pool.allocate())
            pages.reserved -= 1
            if self.window_pool is not None:
                pages.window_table.append(self.window_pool.allocate())
                pages.window_reserved -= 1

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
            if self.window_pool is not None and pages.window_table[i] != self.forgotten:
                self.window_pool.publish(pages.window_table[i], h, None)
            pages.published.append(h)

    def release(self, seq: Sequence) -> None:
        """Returns the sequence's pages (the prefix index keeps what was published) and the rest
        of its reservation."""
        pages = seq.pages
        self.pool.release(pages.block_table)
        self.pool.unreserve(pages.reserved)
        if self.window_pool is not None:
            self.window_pool.release([p for p in pages.window_table if p != self.forgotten])
            self.window_pool.unreserve(pages.window_reserved)
        seq.pages = SequencePages(prompt_hashes=pages.prompt_hashes)

    # -- the window pool ----------------------------------------------------------------------
    def _window_pages(self, num_tokens: int) -> int:
        """The window pages a sequence of `num_tokens` positions holds at most at once."""
        return min(self.pool.pages_for(num_tokens), self.span)

    def _first_seen(self, position: int) -> int:
        """The first page that the window of a query at `position` reaches."""
        return max(0, position - self.window + 1) // self.page_size

    def _window_reuse(self, hashes: list[bytes], cached: int) -> int:
        """Of the `cached` first pages of a prompt (hashes), how many may be reused: the most
        whose window (the pages a query right after them sees) the window pool holds."""
        run = best = 0  # run: indexed window pages up to page k - 1
        for k in range(1, cached + 1):
            run = run + 1 if hashes[k - 1] in self.window_pool.index else 0
            if run >= k - self._first_seen(k * self.page_size):
                best = k
        return best

    def _forget_behind(self, seq: Sequence) -> None:
        """Returns the window pages below the window of the sequence's next position to the pool,
        keeping their reservation (the sequence takes as many again as it grows)."""
        table = seq.pages.window_table
        i = min(self._first_seen(seq.num_computed), len(table)) - 1
        returned = []
        while i >= 0 and table[i] != self.forgotten:  # everything before a forgotten page is too
            returned.append(table[i])
            table[i] = self.forgotten
            i -= 1
        if returned:
            self.window_pool.release(returned[::-1])  # released last page first
            self.window_pool.reserve(len(returned))
            seq.pages.window_reserved += len(returned)
