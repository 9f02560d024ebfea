"""Scheduler over the page manager: admission is all or nothing, phases alternate, prefixes are
reused, nothing leaks."""

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from shardline.router.core.kv_manager import KVManager
from shardline.router.core.page_manager import PageManager
from shardline.router.core.scheduler import Scheduler
from shardline.router.core.sequence import Sampling, Sequence, Status
from shardline.router.core.speculation import NGRAM, Speculator


def _seq(i, prompt_len, max_new, period=0):
    """A sequence whose prompt counts up, or repeats `period` tokens (its n-grams then propose)."""
    prompt = [t % period for t in range(prompt_len)] if period else list(range(prompt_len))
    return Sequence(seq_id=i, request_id=str(i), prompt_ids=prompt, max_new_tokens=max_new, sampling=Sampling())


def _check(pool: PageManager, sched: Scheduler):
    for seq in sched.running:  # each published page under the hash of the tokens it holds
        tokens, size = seq.prompt_ids + seq.output_ids, pool.page_size
        assert len(seq.pages.published) * size <= seq.num_computed
        want = pool.prompt_hashes(tokens[: len(seq.pages.published) * size + 1])  # +1: full pages
        assert seq.pages.published == want
    holders = Counter(p for s in sched.running for p in s.pages.block_table)
    assert all(pool.ref[p] == n for p, n in holders.items()), "a page's ref count is not its holders"
    assert len(holders) == pool.referenced
    assert pool.reserved == sum(s.pages.reserved for s in sched.running)
    pool.check()


def _run_step(sched: Scheduler):
    """What the engine does with a step: every shard acks, emitting sequences get a token."""
    step = sched.schedule()
    sched.complete(step)
    for s in step.scheduled:
        if s.emit:
            s.seq.output_ids.append(7)
        assert len(s.seq.pages.block_table) * sched.kv.page_size >= s.seq.num_computed
    return step


def test_admission_waits_at_the_head_without_changing_anything():
    pool = PageManager(num_pages=4, page_size=4)
    sched = Scheduler(KVManager(pool), max_batch=8, max_batch_tokens=100)
    big, small = _seq(1, 8, 8), _seq(2, 2, 2)  # big needs all 4 pages, small 1
    sched.add(small)
    sched.add(big)
    step = _run_step(sched)
    assert step.is_prefill and step.seqs == [small]  # big does not fit beside small: it waits
    assert list(sched.waiting) == [big] and big.pages.block_table == [] and big.pages.reserved == 0
    _check(pool, sched)
    sched.finish(small)
    sched.finish(small)  # idempotent
    _check(pool, sched)
    step = _run_step(sched)
    assert step.seqs == [big] and pool.reserved == 4 - len(big.pages.block_table)
    _check(pool, sched)


def test_prefill_and_decode_alternate_while_both_have_work():
    pool = PageManager(num_pages=128, page_size=4)
    sched = Scheduler(KVManager(pool), max_batch=8, max_batch_tokens=100)
    sched.add(_seq(1, 5, 50))
    kinds = []
    for i in range(2, 6):
        sched.add(_seq(i, 5, 50))
        kinds.append(_run_step(sched).is_prefill)
        kinds.append(_run_step(sched).is_prefill)
    assert kinds == [True, False] * 4


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["add", "step", "finish_one", "cancel_waiting"]), st.integers(1, 30), st.integers(1, 30)
        ),
        max_size=60,
    )
)
def test_random_workloads_never_leak_or_overcommit(ops):
    """With speculation: prompts that repeat propose, and each verification accepts a random
    prefix of its proposals (the rest rolled back); pages are published only as accepted tokens
    fill them."""
    pool = PageManager(num_pages=12, page_size=4)
    sched = Scheduler(KVManager(pool), max_batch=4, max_batch_tokens=40, speculator=Speculator(NGRAM, 4, 64))
    n = 0
    for op, a, b in ops:
        if op == "add" and sched.kv.can_ever_fit(a + b):
            n += 1
            sched.add(_seq(n, a, b, period=1 + b % 3))
        elif op == "step" and sched.has_work():
            step = sched.schedule()
            if step is None:
                continue
            for s in step.scheduled:
                s.accepted = (a + b) % (len(s.proposals) + 1)
            sched.complete(step)
            for s in step.scheduled:
                if s.emit:
                    s.seq.output_ids.extend([*s.proposals[: s.accepted], 1])
                assert s.seq.num_tokens <= s.seq.max_tokens
                if len(s.seq.output_ids) >= s.seq.max_new_tokens:
                    sched.finish(s.seq)
        elif op == "finish_one" and sched.running:
            sched.finish(sched.running[a % len(sched.running)])
        elif op == "cancel_waiting" and sched.waiting:
            seq = sched.waiting[a % len(sched.waiting)]
            sched.finish(seq)
            assert seq.status is Status.FINISHED
        _check(pool, sched)
    for seq in [*sched.waiting, *sched.running]:
        sched.finish(seq)
    assert pool.available == pool.num_pages and pool.referenced == 0 and pool.reserved == 0


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 14), st.integers(1, 20), st.integers(1, 3)), min_size=1, max_size=4),
    st.lists(st.integers(0, 8), min_size=1, max_size=60),
)
def test_rejected_proposals_roll_back_and_only_accepted_tokens_fill_published_pages(seqs, accepts):
    """Sequences whose prompts repeat propose; each verification accepts a prefix of its
    proposals chosen at random. Every accepted token and the target's are within the request's
    limits, the pages published hold exactly the tokens output, and nothing leaks."""
    pool = PageManager(num_pages=24, page_size=4)
    sched = Scheduler(KVManager(pool), max_batch=4, max_batch_tokens=40, speculator=Speculator(NGRAM, 4, 64))
    for i, (prompt, max_new, period) in enumerate(seqs):
        sched.add(_seq(i, prompt, max_new, period))
    proposed = 0
    for choice in accepts:
        step = sched.schedule()
        if step is None:
            break
        for s in step.scheduled:
            s.accepted = choice % (len(s.proposals) + 1)
            proposed += len(s.proposals)
        sched.complete(step)
        for s in step.scheduled:
            if s.emit:
                s.seq.output_ids.extend([*s.proposals[: s.accepted], 1])
            assert s.seq.num_tokens <= s.seq.max_tokens and s.seq.num_computed == s.seq.num_tokens - s.emit
            if len(s.seq.output_ids) >= s.seq.max_new_tokens:
                sched.finish(s.seq)
        _check(pool, sched)
    for seq in [*sched.waiting, *sched.running]:
        sched.finish(seq)
    assert pool.available == pool.num_pages and pool.referenced == 0 and pool.reserved == 0


def test_a_cached_prefix_is_reused_and_only_the_rest_is_computed():
    pool = PageManager(num_pages=32, page_size=4)
    sched = Scheduler(KVManager(pool), max_batch=8, max_batch_tokens=100)
    first = _seq(1, 10, 3)
    sched.add(first)
    _run_step(sched)
    sched.finish(first)
    second = _seq(2, 11, 3)  # same first 10 tokens: two full pages cached
    sched.add(second)
    step = _run_step(sched)
    assert second.cached_prompt_tokens == 8 and [s.tokens for s in step.scheduled] == [[8, 9, 10]]
    assert [s.emit for s in step.scheduled] == [True]
    assert second.pages.block_table[:2] == first_pages(pool, 2)
    _check(pool, sched)


def first_pages(pool: PageManager, n: int) -> list[int]:
    hashes = pool.prompt_hashes(list(range(n * pool.page_size + 1)))
    return [pool.index[h] for h in hashes[:n]]


def test_a_sequence_after_another_waits_for_its_prompt_and_then_shares_its_pages():
    """The choices of one request: the others are admitted once the first's prompt is computed,
    and find its full pages cached; a leader that ends (cancelled, say) frees them too."""
    pool = PageManager(num_pages=32, page_size=4)
    sched = Scheduler(KVManager(pool), max_batch=8, max_batch_tokens=100, chunk_size=4)
    lead = _seq(1, 10, 4)  # 10 tokens: two full pages and 2 over, in chunks of 4
    follow = [_seq(i, 10, 4) for i in (2, 3)]
    for s in follow:
        s.after = lead
    for s in (lead, *follow):
        sched.add(s)
    admitted = []
    while lead.num_computed < len(lead.prompt_ids):
        admitted += [s for s in _run_step(sched).seqs if s in follow]
        assert not admitted, "a choice started before the first one's prompt was computed"
    steps = [_run_step(sched) for _ in range(3)]
    assert all(s.status is Status.RUNNING for s in follow)
    assert [s.cached_prompt_tokens for s in follow] == [8, 8]  # the two full pages, computed once
    assert any(set(follow) <= set(step.seqs) for step in steps)
    _check(pool, sched)
    orphan = _seq(4, 6, 2)
    orphan.after = _seq(5, 6, 2)
    orphan.after.status = Status.FINISHED  # its leader was cancelled before it computed anything
    sched.add(orphan)
    for _ in range(10):
        if orphan.status is Status.WAITING:
            _run_step(sched)
    assert orphan.status is not Status.WAITING
    _check(pool, sched)
