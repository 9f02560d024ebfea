"""The window pool (router/core/kv_manager.py, kv_pools.py): a sequence of a model with
sliding-window layers holds in it only the pages its window and its step reach, gives the others
back as it goes (the shard forgets them by the same rule), and a cached prefix is reused as far
as the window pool still holds the pages its window needs; nothing leaks."""

from collections import Counter

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardline.router.core.kv_manager import KVManager
from shardline.router.core.kv_pools import PoolSizes, pool_sizes, window_span
from shardline.router.core.page_manager import PageManager
from shardline.router.core.scheduler import Scheduler
from shardline.router.core.sequence import Sampling, Sequence
from shardline.router.core.shards import ShardInfo
from shardline.shard.sampler import SamplingParams
from shardline.shard.sequences import SequenceTable

PAGE, WINDOW, CHUNK = 4, 8, 8
SPAN = window_span(WINDOW, CHUNK, PAGE)  # 15 positions on pages that need not start with them: 5


def _seq(i, prompt_len, max_new, first_token=0):
    prompt = list(range(first_token, first_token + prompt_len))
    return Sequence(seq_id=i, request_id=str(i), prompt_ids=prompt, max_new_tokens=max_new, sampling=Sampling())


def _kv(pages=64, window_pages=4 * SPAN) -> KVManager:
    return KVManager(PageManager(pages, PAGE), PageManager(window_pages, PAGE), WINDOW, SPAN)


def _check(kv: KVManager, running: list[Sequence]) -> None:
    """Both pools' books agree with what the running sequences hold."""
    for pool, table, reserved in (
        (kv.pool, lambda s: s.pages.block_table, lambda s: s.pages.reserved),
        (
            kv.window_pool,
            lambda s: [p for p in s.pages.window_table if p != kv.forgotten],
            lambda s: s.pages.window_reserved,
        ),
    ):
        holders = Counter(p for s in running for p in table(s))
        assert all(pool.ref[p] == n for p, n in holders.items()), "a page's ref count is not its holders"
        assert len(holders) == pool.referenced
        assert pool.reserved == sum(reserved(s) for s in running)
        pool.check()
    for s in running:
        table = s.pages.window_table
        assert len(table) == len(s.pages.block_table)  # the two tables cover the same positions
        held = [i for i, p in enumerate(table) if p != kv.forgotten]
        assert len(held) + s.pages.window_reserved <= SPAN
        # forgotten: a prefix of the table, and only pages the window of the next position left
        assert held == list(range(len(table) - len(held), len(table)))
        assert len(table) - len(held) <= max(0, s.num_computed - WINDOW + 1) // PAGE


def _run(sched: Scheduler) -> None:
    """Steps until every sequence finished, as the engine runs them: every shard acks, emitting
    sequences get a token, a sequence at its length ends."""
    while sched.has_work():
        step = sched.schedule()
        _check(sched.kv, sched.running)
        sched.complete(step)
        for s in step.scheduled:
            if s.emit:
                s.seq.output_ids.append(1000 + len(s.seq.output_ids))
                if len(s.seq.output_ids) == s.seq.max_new_tokens:
                    sched.finish(s.seq)
        _check(sched.kv, sched.running)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 60), st.integers(1, 20)), min_size=1, max_size=6), st.booleans())
def test_a_sequence_holds_only_its_windows_pages_and_nothing_leaks(requests, same_prompts):
    kv = _kv()
    sched = Scheduler(kv, max_batch=3, max_batch_tokens=20, chunk_size=CHUNK)
    for i, (prompt_len, max_new) in enumerate(requests):
        sched.add(_seq(i, prompt_len, max_new, first_token=0 if same_prompts else 100 * i))
    _run(sched)
    for pool in (kv.pool, kv.window_pool):
        assert pool.referenced == pool.reserved == 0
        pool.check()


def test_a_cached_prefix_is_reused_as_far_as_the_window_pool_holds_its_window():
    kv = _kv()
    sched = Scheduler(kv, max_batch=1, max_batch_tokens=20, chunk_size=CHUNK)
    first = _seq(1, 40, 4)
    sched.add(first)
    _run(sched)
    assert kv.window_pool.evictable >= 10  # every window page was published before it was given back

    again = _seq(2, 40, 4)
    prefix = kv.cached_prefix(again)
    assert len(prefix) == 9  # (40 - 1) // 4 full pages: the whole reusable prompt
    assert kv.admit(again, prefix)
    table = again.pages.window_table
    first_seen = (9 * PAGE - WINDOW + 1) // PAGE  # the window of position 36 starts on page 7
    assert table[:first_seen] == [kv.forgotten] * first_seen and kv.forgotten not in table[first_seen:]
    kv.release(again)

    # Other sequences take the window pool's evictable pages: page 8's window page goes, so the
    # prefix is reused only up to a shorter one whose window is still held (or not at all).
    lost = kv.window_pool.index.pop(again.pages.prompt_hashes[8])
    kv.window_pool.hash[lost] = None
    kv.window_pool.probation.remove(lost)
    kv.window_pool._free.append(lost)  # as a reclaim leaves it
    kv.window_pool.check()
    shorter = kv.cached_prefix(_seq(3, 40, 4))
    assert len(shorter) == 8  # page 8's window is gone; a query at 32 sees pages 6 and 7, still held


def test_the_shard_forgets_the_pages_the_router_gives_back():
    """By the same rule: the router at the next position to compute, the shard at a step's start."""
    kv = _kv()
    seq = _seq(1, 60, 1)
    assert kv.admit(seq, kv.cached_prefix(seq))
    table = SequenceTable(
        rows=1, max_pages=32, padding_page=64, device=torch.device("cpu"), window_padding_page=kv.forgotten
    )
    state = table.admit(1, 0, SamplingParams())
    for start in range(0, 60, CHUNK):
        seq.num_computed = start
        sent = len(seq.pages.window_table)
        kv.grow(seq, start + CHUNK)
        table.append_pages(state, seq.pages.block_table[sent:], seq.pages.window_table[sent:])
        table.forget_outside(state, WINDOW, start, PAGE)
        forgotten = [i for i, p in enumerate(seq.pages.window_table) if p == kv.forgotten]
        held = table.window_tables[0, : len(state.pages)].tolist()
        assert [i for i, p in enumerate(held) if p == kv.forgotten] == forgotten
        assert table.window_tables[0, forgotten].eq(kv.forgotten).all()
    kv.release(seq)


def _info(budget, full_bytes, window_bytes, max_pages=0) -> ShardInfo:
    values = dict.fromkeys(ShardInfo.__dataclass_fields__, 0)
    per_page = full_bytes + window_bytes
    values |= dict(kv_bytes_per_page=per_page, window_kv_bytes_per_page=window_bytes, kv_budget_bytes=budget)
    return ShardInfo(**values | dict(max_pages=max_pages or budget // per_page - 1))


def test_pool_sizes_give_the_window_pool_the_batchs_windows_and_the_page_pool_the_rest():
    one = _info(budget=1000 * 6, full_bytes=1, window_bytes=5)  # Gemma 3's layers: 1 global to 5 local
    assert pool_sizes([one], max_batch=4, span=10, num_pages=0, context_pages=100) == PoolSizes(6000 - 41 * 5 - 1, 40)
    assert pool_sizes([one], max_batch=4, span=10, num_pages=50, context_pages=100) == PoolSizes(50, 40)
    # half the budget at most; a window as long as the context needs no pool of its own
    assert pool_sizes([one], max_batch=1000, span=10, num_pages=0, context_pages=100).window_pages == 6000 // 2 // 5 - 1
    assert pool_sizes([one], max_batch=4, span=100, num_pages=0, context_pages=100) == PoolSizes(999)
    # every layer windowed (Mistral's): page pool pages cost nothing, the window pool takes all
    every = _info(budget=1000, full_bytes=0, window_bytes=10)
    assert pool_sizes([every], max_batch=4, span=10, num_pages=0, context_pages=100) == PoolSizes(400, 99)
    # the smallest shard's room, over the stages of a pipeline
    stages = [_info(6000, 1, 5), _info(3000, 2, 0)]
    assert pool_sizes(stages, max_batch=4, span=10, num_pages=0, context_pages=100) == PoolSizes(1499, 40)
