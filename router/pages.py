"""The page pool of the paged KV cache: which page ids are free, which a sequence holds, and how
many pages admitted sequences may still claim.

Invariants kept after every call:
- free + referenced = pool size; a page is in the free list iff no sequence holds it.
- reserved <= free: a page promised to an admitted sequence is always there when it asks,
  so an admitted request never fails later for lack of pages.
Every operation is O(1) per page (a free stack and a set; no scans of the pool).
"""
from __future__ import annotations


class PagePool:
    def __init__(self, num_pages: int, page_size: int):
        self.num_pages, self.page_size = num_pages, page_size
        self._free = list(range(num_pages - 1, -1, -1))  # a stack: page 0 is handed out first
        self._held: set[int] = set()
        self.reserved = 0

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def referenced(self) -> int:
        return len(self._held)

    @property
    def available(self) -> int:
        """Pages a new admission may still count on."""
        return len(self._free) - self.reserved

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def reserve(self, n: int) -> bool:
        """Promises n pages to a sequence being admitted; all or nothing."""
        if n > self.available:
            return False
        self.reserved += n
        return True

    def take_reserved(self) -> int:
        """Hands out one page that was reserved earlier."""
        assert self.reserved > 0, "a page was taken without a reservation"
        self.reserved -= 1
        page = self._free.pop()
        self._held.add(page)
        return page

    def unreserve(self, n: int) -> None:
        assert 0 <= n <= self.reserved
        self.reserved -= n

    def release(self, pages: list[int]) -> None:
        """Returns a sequence's pages, last page first (the tail of a chain goes first)."""
        for page in reversed(pages):
            self._held.remove(page)
            self._free.append(page)
