"""The step loop with stand-in shards (a unit test of one class): deferred release on cancel,
failures that belong to one request, and failures of the shard group."""
import asyncio

import pytest

from protos import shard_pb2
from router.engine import Engine
from router.page_manager import PageManager
from router.scheduler import Scheduler
from router.sequence import Failure, FinishReason, Sampling, Sequence
from router.shard_client import ShardError
from router.stats import StatsCounters
from tests.support import smollm2_codec



class GatedShards:
    """Answers each step only when the test opens the gate; `fail_seqs` are reported failed,
    `extra_tokens` makes the answer carry the wrong number of tokens."""

    def __init__(self):
        self.gate = asyncio.Event()
        self.started = asyncio.Event()
        self.fail = False
        self.fail_seqs: set[int] = set()
        self.extra_tokens = 0
        self.plans = []
        self.open = False  # answer every step at once

    async def step(self, plan):
        self.plans.append(plan)
        self.started.set()
        if not self.open:
            await self.gate.wait()
            self.gate.clear()
        if self.fail:
            raise ShardError("shard 0 died")
        ok = [s for s in plan.seqs if s.seq_id not in self.fail_seqs]
        return shard_pb2.StepResult(
            step_id=plan.step_id, tokens=[42] * (sum(s.emit for s in ok) + self.extra_tokens),
            failures=[shard_pb2.SequenceFailure(seq_id=i, message="page id 999 outside the pool")
                      for i in sorted(self.fail_seqs & {s.seq_id for s in plan.seqs})])


def _setup(num_seqs=1):
    pool = PageManager(16, 4)
    shards = GatedShards()
    engine = Engine(Scheduler(pool, 8, 1000), shards, smollm2_codec(), max_position=1000, observers=[StatsCounters()])
    seqs = [Sequence(i, f"r{i}", list(range(10 * i, 10 * i + 10)), 20, Sampling()) for i in range(1, num_seqs + 1)]
    return pool, shards, engine, seqs


def stats_of(engine) -> StatsCounters:
    return next(o for o in engine.observers if isinstance(o, StatsCounters))


async def _drain(seq):
    out = [await asyncio.wait_for(seq.outputs.get(), 5)]
    while not (out[-1].finish_reason or out[-1].failure):
        out.append(await asyncio.wait_for(seq.outputs.get(), 5))
    return out


def test_cancel_during_a_step_releases_pages_only_after_the_step():
    async def scenario():
        pool, shards, engine, (seq,) = _setup()
        engine.submit(seq, [])
        loop = asyncio.create_task(engine.run())
        await shards.started.wait()
        assert pool.referenced == 3
        engine.cancel(seq)
        await asyncio.sleep(0.05)
        assert pool.referenced == 3, "pages released while the shard may still write them"
        shards.gate.set()
        assert (await _drain(seq))[-1].finish_reason is FinishReason.CANCELLED
        assert pool.available == 16 and pool.referenced == 0 and pool.reserved == 0
        pool.check()
        assert not engine.scheduler.has_work()
        loop.cancel()

    asyncio.run(scenario())


def test_a_sequence_the_shard_could_not_serve_fails_alone_and_publishes_nothing():
    async def scenario():
        pool, shards, engine, (a, b) = _setup(2)
        engine.submit(a, [])
        engine.submit(b, [])
        shards.fail_seqs = {a.seq_id}
        loop = asyncio.create_task(engine.run())
        shards.gate.set()                    # the admit step: a fails, b gets its first token
        out_a = await _drain(a)
        assert out_a[-1].failure == Failure("INTERNAL", "the shard could not serve this request: "
                                                        "page id 999 outside the pool")
        # Only b's two full prompt pages were published; a's KV was never written.
        assert sorted(pool.index.values()) == sorted(b.block_table[:2]), "a failed sequence's pages were published"
        for _ in range(19):                  # b runs to its end, alone
            await shards.started.wait()
            shards.started.clear()
            shards.gate.set()
        out_b = await _drain(b)
        assert [o.token_ids for o in out_b] == [[42]] * 20 and out_b[-1].finish_reason is FinishReason.LENGTH
        assert all([s.seq_id for s in p.seqs] == [b.seq_id] for p in shards.plans[1:])
        assert pool.referenced == 0 and pool.reserved == 0 and stats_of(engine).requests_failed == 1
        pool.check()
        loop.cancel()

    asyncio.run(scenario())


def test_an_exception_turning_one_requests_tokens_into_text_fails_that_request_alone():
    class Broken:
        def push(self, token):
            raise ValueError("detokenizer edge case")

    async def scenario():
        pool, shards, engine, (a, b) = _setup(2)
        engine.submit(a, [])
        engine.submit(b, [])
        engine._text[a.seq_id] = (Broken(), engine._text[a.seq_id][1])
        loop = asyncio.create_task(engine.run())
        shards.gate.set()
        failure = (await _drain(a))[-1].failure
        assert failure.code == "INTERNAL" and "detokenizer edge case" in failure.message
        for _ in range(19):
            await shards.started.wait()
            shards.started.clear()
            shards.gate.set()
        assert (await _drain(b))[-1].finish_reason is FinishReason.LENGTH
        assert pool.referenced == 0 and pool.reserved == 0
        loop.cancel()

    asyncio.run(scenario())


@pytest.mark.parametrize("fault", ["shard died", "a token too many", "a token missing"])
def test_a_shard_group_failure_leaves_run_and_fail_all_returns_every_page(fault):
    async def scenario():
        pool, shards, engine, (seq,) = _setup()
        engine.submit(seq, [])
        loop = asyncio.create_task(engine.run())
        await shards.started.wait()
        if fault == "shard died":
            shards.fail = True
        else:  # the engine checks that a step returns one token per emitting sequence
            shards.extra_tokens = 1 if fault == "a token too many" else -1
        shards.gate.set()
        want = {"shard died": "died", "a token too many": "2 tokens for 1", "a token missing": "0 tokens for 1"}
        with pytest.raises(ShardError, match=want[fault]):
            await asyncio.wait_for(loop, 5)
        assert pool.referenced == 3  # nothing released yet: the replica decides
        engine.fail_all(Failure("UNAVAILABLE", "the replica failed"))
        assert (await _drain(seq))[-1].failure.code == "UNAVAILABLE"
        assert pool.available == 16 and pool.referenced == 0
        pool.check()

    asyncio.run(scenario())


def test_plans_name_only_what_changed_and_release_what_they_announced():
    """Prompt of 10 tokens, pages of 4, 7 new tokens: the first step sends the sequence whole;
    a decode step sends one token, plus a page id only when its position starts a page; the
    next plan after the sequence finished releases it."""
    async def scenario():
        pool, shards, engine, (a, b) = _setup(2)
        a.max_new_tokens = 7
        shards.open = True
        engine.submit(a, [])
        loop = asyncio.create_task(engine.run())
        await _drain(a)
        engine.submit(b, [])
        await _drain(b)
        loop.cancel()
        entries = [(plan.released, s) for plan in shards.plans for s in plan.seqs]
        first, *decodes = [s for _, s in entries if s.seq_id == a.seq_id]
        assert first.first and first.HasField("sampling") and len(first.new_pages) == 3
        assert [(s.start_pos, len(s.new_pages)) for s in decodes] == [(10, 0), (11, 0), (12, 1), (13, 0), (14, 0),
                                                                      (15, 0)]
        assert not any(s.first or s.HasField("sampling") for s in decodes)
        released_with_b = [r for r, s in entries if s.seq_id == b.seq_id and s.first]
        assert list(released_with_b[0]) == [a.seq_id]
        assert sum(len(plan.released) for plan in shards.plans) == 1

    asyncio.run(scenario())
