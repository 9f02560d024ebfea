"""Reclaim queues of the page pool: intrusive doubly linked lists over page ids.

The links live in arrays shared by every queue of one pool (a page is in at most one queue at a
time), so append, remove and pop-oldest are O(1) and a page costs a few machine words, not an
object. Each queue has its own sentinel slot after the page slots.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator

NO_QUEUE = -1


class PageLinks:
    def __init__(self, num_pages: int, num_queues: int):
        slots = num_pages + num_queues
        self.num_pages = num_pages
        self.prev = array("i", range(slots))  # a lone sentinel points at itself
        self.next = array("i", range(slots))
        self.owner = array("b", [NO_QUEUE]) * slots


class PageQueue:
    """Pages oldest first. Invariant: `owner[p] == qid` iff p is linked into this queue."""

    def __init__(self, links: PageLinks, qid: int):
        self.links, self.qid = links, qid
        self.sentinel = links.num_pages + qid
        self.size = 0

    def __len__(self) -> int:
        return self.size

    def __contains__(self, page: int) -> bool:
        return self.links.owner[page] == self.qid

    def append(self, page: int) -> None:
        """Adds `page` as the most recent entry."""
        links, s = self.links, self.sentinel
        assert links.owner[page] == NO_QUEUE, f"page {page} is already queued"
        tail = links.prev[s]
        links.next[tail] = page
        links.prev[page] = tail
        links.next[page] = s
        links.prev[s] = page
        links.owner[page] = self.qid
        self.size += 1

    def remove(self, page: int) -> None:
        links = self.links
        assert links.owner[page] == self.qid, f"page {page} is not in queue {self.qid}"
        before, after = links.prev[page], links.next[page]
        links.next[before] = after
        links.prev[after] = before
        links.owner[page] = NO_QUEUE
        self.size -= 1

    def oldest(self) -> int | None:
        page = self.links.next[self.sentinel]
        return None if page == self.sentinel else page

    def pop_oldest(self) -> int:
        page = self.oldest()
        assert page is not None, "pop from an empty queue"
        self.remove(page)
        return page

    def __iter__(self) -> Iterator[int]:
        page = self.links.next[self.sentinel]
        while page != self.sentinel:
            yield page
            page = self.links.next[page]
