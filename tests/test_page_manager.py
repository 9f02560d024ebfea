"""The page manager against every invariant of DESIGN.md "Page lifecycle", after every operation."""

from hypothesis import given, settings
from hypothesis import strategies as st

from shardline.router.core.page_manager import LRU, SLRU, PageManager

PS = 2  # tokens per page


def snapshot(m: PageManager):
    return (
        list(m.ref),
        list(m._free),
        list(m.probation),
        list(m.protected),
        dict(m.index),
        m.reserved,
        bytes(m.protected_flag),
        m.hit_tokens,
        m.query_tokens,
        list(m.hash),
    )


class Request:
    """What the scheduler keeps per request: pages, chain hashes, computed tokens, reservation."""

    def __init__(self, m: PageManager, tokens: list[int], max_new: int, salt: str = ""):
        self.m, self.tokens, self.max_new, self.salt = m, tokens, max_new, salt
        self.limit = len(tokens) + max_new  # positions this request may ever fill
        self.pages: list[int] = []
        self.hashes: list[bytes] = []
        self.computed = 0
        self.reserved = 0
        self.released = False
        self.in_flight = False
        self.cancel_pending = False

    def admit(self) -> bool:
        hashes = self.m.prompt_hashes(self.tokens, self.salt)
        hits = self.m.lookup(hashes)
        total = self.m.pages_for(self.limit)
        if not self.m.admit(hits, total, len(self.tokens)):
            return False
        self.pages, self.hashes = list(hits), hashes[: len(hits)]
        self.computed, self.reserved = len(hits) * PS, total - len(hits)
        return True

    def start_step(self, n: int) -> None:
        """Computes up to n more tokens (growing past the prompt like decode would)."""
        self.target = min(self.limit, self.computed + n)
        while len(self.pages) * PS < self.target:
            self.pages.append(self.m.allocate())
            self.reserved -= 1
        self.in_flight = True

    def complete_step(self) -> None:
        """Every shard acked: the tokens are written; publish the pages that became full."""
        self.in_flight = False
        self.computed = self.target
        while len(self.tokens) < self.computed:
            self.tokens.append(len(self.tokens) % 3)  # generated tokens extend the chain too
        if self.cancel_pending:
            self.release()
            return
        while len(self.hashes) < self.computed // PS:
            i = len(self.hashes)
            parent = self.hashes[-1] if self.hashes else self.m.root_hash(self.salt)
            h = self.m.chain(parent, self.tokens[i * PS : (i + 1) * PS])
            self.m.publish(self.pages[i], h, self.pages[i - 1] if i else None)
            self.hashes.append(h)

    def release(self) -> None:
        """Finish or cancel; idempotent; deferred while a step that writes these pages runs."""
        if self.in_flight:
            self.cancel_pending = True
            return
        if self.released:
            return
        self.released = True
        self.m.release(self.pages)
        self.m.unreserve(self.reserved)
        self.pages, self.reserved = [], 0


def prefilled(m: PageManager, tokens: list[int], salt: str = "") -> Request:
    """A request admitted with its whole prompt computed and published, still holding its pages."""
    r = Request(m, list(tokens), max_new=1, salt=salt)
    assert r.admit()
    r.start_step(len(tokens))
    r.complete_step()
    return r


PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 9, 9], [1, 2, 8], [5, 5, 5, 5, 5, 5, 5, 5, 5], [1, 2, 3, 4, 5]]


# Weighted so that random runs reach the interesting states: shared prefixes, pressure, reclaim.
OPS = ["new"] * 3 + ["admit"] * 3 + ["step"] * 4 + ["complete"] * 4 + ["release"] * 3 + ["release_again", "reset"]


@settings(max_examples=300, deadline=None)
@given(
    policy=st.sampled_from([LRU, SLRU]),
    pool=st.integers(3, 9),
    ratio=st.sampled_from([0.0, 0.25, 0.5, 1.0]),
    ops=st.lists(st.tuples(st.sampled_from(OPS), st.integers(0, 99), st.integers(1, 6)), min_size=40, max_size=150),
)
def test_random_operations_keep_every_invariant(policy, pool, ratio, ops):
    m = PageManager(pool, PS, policy=policy, protected_ratio=ratio, model_key="tiny")
    waiting, running, done = [], [], []
    for op, a, b in ops:
        if op == "new":
            # Shared-prefix families, plus one-use prompts that fill the pool and force reclaim.
            prompt = list(PROMPTS[a % len(PROMPTS)]) if a % 3 else [a] * (2 + 2 * b)
            r = Request(m, prompt, max_new=b, salt="tenant" if a % 7 == 0 else "")
            if m.pages_for(len(prompt) + b) <= pool:
                waiting.append(r)
        elif op == "admit":
            if waiting:  # admission at the head of the queue
                before = snapshot(m)
                if waiting[0].admit():
                    running.append(waiting.pop(0))
                else:
                    assert snapshot(m) == before, "a refused admission changed the manager"
        elif op == "step" and running:
            r = running[a % len(running)]
            if not r.in_flight and not r.cancel_pending and r.computed < r.limit:
                r.start_step(b)
        elif op == "complete" and running:
            r = running[a % len(running)]
            if r.in_flight:
                r.complete_step()
        elif op in ("release", "release_again") and (running or done):
            pick = (
                (running + done)[a % len(running + done)]
                if op == "release_again"
                else running[a % len(running)]
                if running
                else done[0]
            )
            pages_before = list(pick.pages)
            pick.release()
            if pick.cancel_pending and pick.in_flight:
                assert pick.pages == pages_before  # deferred: a shard may still write them
            if pick in running and pick.released:
                running.remove(pick)
                done.append(pick)
        elif op == "reset":
            before = snapshot(m)
            ok = m.reset()
            assert ok == (m.referenced == 0 and m.reserved == 0)
            if not ok:
                assert snapshot(m) == before
        for r in running:  # shared ownership: every page a request holds is referenced
            assert all(m.ref[p] >= 1 for p in r.pages)
        m.check()
    for r in running:
        if r.in_flight:
            r.complete_step()
        r.release()
    m.check()
    assert m.referenced == 0 and m.reserved == 0 and m.available == pool


def test_reclaim_order_after_tail_first_release():
    m = PageManager(6, PS)
    r = prefilled(m, [1, 2, 3, 4, 5, 6, 7])
    chain = list(r.pages)  # 4 pages; the first three are full and published
    r.release()
    assert list(m.probation) == [chain[2], chain[1], chain[0]]  # tail first
    m.check()


def test_reclaim_takes_free_pages_first_then_the_chain_tail_first():
    m = PageManager(5, PS)
    r = prefilled(m, [1, 2, 3, 4, 5, 6, 7])
    chain = list(r.pages)  # pages 0..3: 0,1,2 full and indexed, 3 partial
    r.release()
    assert m.free == 2 and m.evictable == 3  # partial page 3 went straight back to free
    big = Request(m, [8] * 9, max_new=1)  # 5 pages: 2 free + 3 reclaimed
    assert big.admit()
    big.start_step(10)
    got = big.pages
    assert got[2:] == [chain[2], chain[1], chain[0]]
    assert m.cached == 0
    m.check()


def test_refused_admission_pins_nothing_and_moves_nothing():
    m = PageManager(4, PS, policy=SLRU)
    a = prefilled(m, [1, 2, 3, 4, 5])
    a.release()  # pages of [1,2] [3,4] evictable
    holder = Request(m, [7, 7, 7], max_new=1)
    assert holder.admit()  # holds 2 pages' reservation
    before = snapshot(m)
    greedy = Request(m, [1, 2, 3, 4, 5, 6, 7, 8, 9], max_new=3)  # hits 2 pages, needs 4 more
    assert not greedy.admit()
    assert snapshot(m) == before
    m.check()


def test_reset_is_refused_while_pages_are_referenced():
    m = PageManager(4, PS)
    r = prefilled(m, [1, 2, 3])
    assert m.reset() is False and m.cached == 1
    r.release()
    assert m.reset() is True and m.cached == 0 and m.free == 4
    m.check()


def test_salted_requests_never_share_pages():
    m = PageManager(8, PS)
    first = prefilled(m, [1, 2, 3, 4, 5], salt="alice")
    same = Request(m, [1, 2, 3, 4, 5], max_new=1, salt="alice")
    other = Request(m, [1, 2, 3, 4, 5], max_new=1, salt="bob")
    assert same.admit() and other.admit()
    assert same.pages == first.pages[:2] and other.pages == []
    m.check()


def test_shared_pages_become_evictable_only_after_every_holder_releases():
    m = PageManager(8, PS)
    owner = prefilled(m, [1, 2, 3, 4, 5])
    sharers = [Request(m, [1, 2, 3, 4, 6], max_new=1) for _ in range(3)]
    for s in sharers:
        assert s.admit() and s.pages == owner.pages[:2]
    for r in [owner, *sharers[:2]]:
        r.release()
        r.release()  # twice: nothing more changes
        assert m.evictable == 0
        m.check()
    sharers[2].release()
    assert m.evictable == 2
    m.check()


def _hot_and_scan(policy: str) -> bool:
    """A hot prefix reused between one-use scans that alone would fill the pool."""
    m = PageManager(8, PS, policy=policy, protected_ratio=0.5)
    hot = [1, 2, 3, 4, 5]

    prefilled(m, hot).release()
    prefilled(m, hot).release()  # second use hits the hot prefix: SLRU promotes it
    for i in range(6):
        prefilled(m, [100 + i] * 7).release()  # one-use prompts, 3 full pages each
    m.check()
    probe = Request(m, hot, max_new=1)
    assert probe.admit()
    return len(probe.pages) == 2


def test_slru_keeps_a_hot_prefix_through_a_scan_that_lru_loses():
    assert _hot_and_scan(SLRU) is True
    assert _hot_and_scan(LRU) is False


def test_protected_segment_stays_within_its_bound():
    m = PageManager(10, PS, policy=SLRU, protected_ratio=0.2)  # bound: 2 pages
    for i in range(4):
        prompt = [i] * 5
        for _ in range(2):  # the second admission hits and promotes
            r = prefilled(m, prompt)
            r.release()
            m.check()
    assert len(m.protected) == 2 and m.probation
