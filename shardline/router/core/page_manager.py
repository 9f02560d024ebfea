"""The router's page table of the paged KV cache: page pool, prefix index and reclaim policy.

A page is in exactly one state:
- FREE: ref 0, not indexed, in the free stack;
- REFERENCED: ref >= 1 (held by running requests, private or shared);
- EVICTABLE: ref 0, still indexed by its prefix hash, in exactly one reclaim queue.

Invariants, kept after every public call (`check` verifies them; the tests call it after every
operation):
1. free + evictable + referenced = pool size; no ref below 0; the index and the pages agree both
   ways; reserved <= free + evictable (a promise made at admission can always be kept).
2. Every operation is O(1) per page: a free stack, intrusive linked queues, a dict index.
3. Release is tail-first and an indexed page's parent page is always indexed: a chain's tail is
   reclaimed before its head, and a suffix never survives its prefix.
4. Only full pages whose KV every shard has written are published (the caller publishes after
   the step's acks); partial pages never are.
5. Admission is all or nothing: a refused `admit` changes nothing at all.
6. SLRU: a page is flagged protected only by an admission that hit it and succeeded; the
   protected queue never exceeds `protected_ratio * pool`, overflow demotes its oldest page to
   the newest end of probation, and probation is reclaimed first.

Prefix hashes chain over full pages (common/prefix_hash.py, which a gateway shares). The page
manager is the one source of the index's changes: every page published, reclaimed or dropped by a
reset is appended as a `Change` to each log a consumer opened with `watch` (router/api/fleet.py
streams them to gateways, router/api/kv_events.py to vLLM's subscribers). One record is made per
change and shared by the logs; with no log open nothing is made.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import NamedTuple

from shardline.common import prefix_hash
from shardline.router.core.page_queue import PageLinks, PageQueue

LRU, SLRU = "lru", "slru"


class Change(NamedTuple):
    """One change of the prefix index: a page published (`stored`: the hash of the page before it
    in its chain, None for a chain's first page, and the page's token ids), or gone (reclaimed or
    reset). A log's order is the index's: a parent is published before its children."""

    stored: bool
    hash: bytes
    parent: bytes | None = None
    tokens: Sequence[int] = ()


class PageManager:
    def __init__(
        self,
        num_pages: int,
        page_size: int,
        policy: str = LRU,
        prefix_cache: bool = True,
        protected_ratio: float = 0.5,
        model_key: str = "",
    ):
        if policy not in (LRU, SLRU):
            raise ValueError(f"unknown eviction policy {policy!r}")
        if not 0.0 <= protected_ratio <= 1.0:
            raise ValueError("the protected ratio must lie in [0, 1]")
        self.num_pages, self.page_size = num_pages, page_size
        self.policy, self.prefix_cache = policy, prefix_cache
        self.protected_bound = int(protected_ratio * num_pages)
        self.model_key = model_key
        self.ref = array("i", [0]) * num_pages
        self.hash: list[bytes | None] = [None] * num_pages
        self.parent: list[bytes | None] = [None] * num_pages
        self.protected_flag = bytearray(num_pages)
        self.index: dict[bytes, int] = {}
        self._free = list(range(num_pages - 1, -1, -1))  # a stack: low page ids first
        links = PageLinks(num_pages, 2)
        # LRU uses one queue; SLRU reclaims probation before protected.
        self.probation, self.protected = PageQueue(links, 0), PageQueue(links, 1)
        self._reclaim_order = (self.probation,) if policy == LRU else (self.probation, self.protected)
        self.reserved = 0
        self.hit_tokens = 0
        self.query_tokens = 0
        self.logs: list[list[Change]] = []  # one per consumer (`watch`)

    # -- counts -----------------------------------------------------------------------------------
    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def evictable(self) -> int:
        return len(self.probation) + len(self.protected)

    @property
    def referenced(self) -> int:
        return self.num_pages - self.free - self.evictable

    @property
    def cached(self) -> int:
        return len(self.index)

    @property
    def available(self) -> int:
        """Pages a new admission may still count on."""
        return self.free + self.evictable - self.reserved

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    # -- prefix hashing and lookup ---------------------------------------------------------------
    def root_hash(self, namespace: str = "") -> bytes:
        return prefix_hash.root_hash(self.model_key, namespace)

    chain = staticmethod(prefix_hash.chain)

    def prompt_hashes(self, prompt: list[int], namespace: str = "") -> list[bytes]:
        return prefix_hash.prompt_hashes(prompt, self.page_size, self.model_key, namespace)

    def lookup(self, hashes: list[bytes]) -> list[int]:
        """Pages of the longest indexed prefix; walks from the first page, stops at the first miss.
        Changes nothing (a lookup whose admission is then refused leaves no trace)."""
        if not self.prefix_cache:
            return []
        pages = []
        for h in hashes:
            page = self.index.get(h)
            if page is None:
                break
            pages.append(page)
        return pages

    # -- the change logs ------------------------------------------------------------------------------
    def watch(self) -> list[Change]:
        """Opens a log that every later change of the index is appended to; its consumer empties it
        as it reads (`log.clear()`) and closes it with `unwatch`."""
        log: list[Change] = []
        self.logs.append(log)
        return log

    def unwatch(self, log: list[Change]) -> None:
        self.logs = [other for other in self.logs if other is not log]

    def _gone(self, page_hash: bytes) -> None:
        if self.logs:
            change = Change(False, page_hash)
            for log in self.logs:
                log.append(change)

    # -- admission and allocation ----------------------------------------------------------------
    def fits(self, hits: list[int], total_pages: int) -> bool:
        """Whether `admit` would pin `hits` and reserve the rest of `total_pages`."""
        hit_evictable = sum(1 for p in hits if self.ref[p] == 0)
        return total_pages - len(hits) <= self.available - hit_evictable

    def admit(self, hits: list[int], total_pages: int, prompt_tokens: int) -> bool:
        """Pins the hit pages and reserves the rest of `total_pages`, or does nothing at all."""
        if not self.fits(hits, total_pages):
            return False
        need = total_pages - len(hits)
        for page in hits:
            if self.ref[page] == 0:
                (self.probation if page in self.probation else self.protected).remove(page)
            self.ref[page] += 1
            if self.policy == SLRU:
                self.protected_flag[page] = 1
        self.reserved += need
        self.hit_tokens += len(hits) * self.page_size
        self.query_tokens += prompt_tokens
        return True

    def allocate(self) -> int:
        """Hands out one page reserved at admission: a free one, else the oldest evictable one."""
        assert self.reserved > 0, "a page was allocated without a reservation"
        self.reserved -= 1
        page = self._free.pop() if self._free else self._reclaim()
        self.ref[page] = 1
        return page

    def _reclaim(self) -> int:
        for queue in self._reclaim_order:
            if len(queue):
                page = queue.pop_oldest()
                del self.index[self.hash[page]]
                self._gone(self.hash[page])
                self.hash[page] = self.parent[page] = None
                self.protected_flag[page] = 0
                return page
        raise AssertionError("reservation accounting broke: nothing to reclaim")

    def reserve(self, n: int) -> None:
        """Promises `n` more pages to a sequence that holds them already reserved or referenced
        and has just released as many (a window that moved on): the promise is kept by them."""
        assert n >= 0 and self.reserved + n <= self.free + self.evictable
        self.reserved += n

    def unreserve(self, n: int) -> None:
        assert 0 <= n <= self.reserved
        self.reserved -= n

    # -- publication and release -----------------------------------------------------------------
    def publish(self, page: int, page_hash: bytes, parent_page: int | None, tokens: Sequence[int] = ()) -> bool:
        """Indexes a full page whose KV every shard has written; `parent_page` is the page before
        it in the same block table (None for the first page), `tokens` the page's token ids (for
        the change logs). Refused (False) when the prefix is
        already indexed through another page, or when the parent page is not indexed itself:
        then this page and the rest of its chain stay private, so no indexed page ever hangs
        off a prefix that could be reclaimed before it."""
        if not self.prefix_cache or page_hash in self.index:
            return False
        parent = None if parent_page is None else self.hash[parent_page]
        if parent_page is not None and parent is None:
            return False
        assert self.ref[page] > 0 and self.hash[page] is None
        self.index[page_hash] = page
        self.hash[page], self.parent[page] = page_hash, parent
        if self.logs:
            change = Change(True, page_hash, parent, tokens)
            for log in self.logs:
                log.append(change)
        return True

    def release(self, pages: list[int]) -> None:
        """Drops one request's reference to each page, last page first, so that the tail of a
        chain enters the reclaim queue before its head and is reclaimed first."""
        for page in reversed(pages):
            assert self.ref[page] > 0, f"page {page} released more often than referenced"
            self.ref[page] -= 1
            if self.ref[page] == 0:
                if self.hash[page] is None:
                    self._free.append(page)
                elif self.protected_flag[page]:
                    self.protected.append(page)
                    while len(self.protected) > self.protected_bound:
                        demoted = self.protected.pop_oldest()
                        self.protected_flag[demoted] = 0
                        self.probation.append(demoted)
                else:
                    self.probation.append(page)

    def reset(self) -> bool:
        """Empties the prefix index. Refused (False) while any page is referenced or reserved."""
        if self.referenced or self.reserved:
            return False
        for queue in (self.probation, self.protected):
            while len(queue):
                page = queue.pop_oldest()
                self._gone(self.hash[page])
                self.hash[page] = self.parent[page] = None
                self.protected_flag[page] = 0
                self._free.append(page)
        self.index.clear()
        return True

    # -- verification -----------------------------------------------------------------------------
    def check(self) -> None:
        """Asserts every invariant in the module docstring. O(pool): for tests only."""
        free = set(self._free)
        assert len(free) == len(self._free), "a page is on the free stack twice"
        queued = set(self.probation) | set(self.protected)
        assert len(queued) == self.evictable, "a page is in two queues"
        assert not free & queued
        assert self.free + self.evictable + self.referenced == self.num_pages
        for page in range(self.num_pages):
            ref, h = self.ref[page], self.hash[page]
            assert ref >= 0
            if page in free:
                assert ref == 0 and h is None
            elif page in queued:
                assert ref == 0 and h is not None, f"evictable page {page} must be indexed"
            else:
                assert ref > 0, f"page {page} is lost: not free, not queued, not referenced"
            if h is not None:
                assert self.index.get(h) == page
                assert self.parent[page] is None or self.parent[page] in self.index, (
                    f"page {page} survives without its prefix"
                )
        assert all(self.hash[p] == h for h, p in self.index.items())
        assert self.reserved <= self.free + self.evictable
        assert len(self.protected) <= self.protected_bound
        if self.policy == LRU:
            assert len(self.protected) == 0
        for page in self.protected:
            assert self.protected_flag[page]
