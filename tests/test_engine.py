"""The step loop with stand-in shards (a unit test of one class, over the real codec and link
that write its plans and read their answers): deferred release on cancel, failures that belong
to one request, and failures of the shard group."""

import asyncio

import pytest

from shardline.protos import shard_pb2
from shardline.router.core.engine import Engine
from shardline.router.core.kv_manager import KVManager
from shardline.router.core.page_manager import PageManager
from shardline.router.core.scheduler import Scheduler
from shardline.router.core.sequence import Failure, FinishReason, Sampling, Sequence
from shardline.router.core.shards import ShardError
from shardline.router.observers.stats import StatsCounters
from shardline.router.shards.link import ShardLink
from tests.support import smollm2_codec


class GatedShards:
    """Answers a step each time the test opens the gate (`gate.release()`); `fail_seqs` are reported failed,
    `extra_tokens` makes the answer carry the wrong number of tokens. Like a lone shard, it runs
    the plans it is sent in order, and may be sent one while another runs."""

    def __init__(self, samples_alone: bool = True):
        self.samples_alone = samples_alone
        self.sampler = 0
        self.gate = asyncio.Semaphore(0)
        self.started = asyncio.Event()
        self.fail = False
        self.fail_seqs: set[int] = set()
        self.extra_tokens = 0
        self.token = 42  # every sampled token
        self.plans = []
        self.answered = 0  # plans answered so far
        self.most_in_flight = 0  # plans sent and not answered, at most
        self.open = False  # answer every step at once

    async def send(self, plan):
        self.plans.append(plan)
        self.most_in_flight = max(self.most_in_flight, len(self.plans) - self.answered)
        self.started.set()

    async def receive(self, plan):
        assert plan is self.plans[self.answered], "answers are asked for in the order plans were sent"
        if not self.open:
            await self.gate.acquire()
        self.answered += 1
        if self.fail:
            raise ShardError("shard 0 died")
        ok = [s for s in plan.seqs if s.seq_id not in self.fail_seqs]
        return shard_pb2.StepResult(
            step_id=plan.step_id,
            tokens=[self.token] * (sum(s.emit for s in ok) + self.extra_tokens),
            failures=[
                shard_pb2.SequenceFailure(seq_id=i, message="page id 999 outside the pool")
                for i in sorted(self.fail_seqs & {s.seq_id for s in plan.seqs})
            ],
        )


def _setup(num_seqs=1, samples_alone=True):
    pool = PageManager(16, 4)
    shards = GatedShards(samples_alone)
    engine = Engine(
        Scheduler(KVManager(pool), 8, 1000),
        ShardLink(shards),
        smollm2_codec(),
        max_position=1000,
        observers=[StatsCounters()],
    )
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
        shards.gate.release()
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
        shards.gate.release()  # the admit step: a fails, b gets its first token
        out_a = await _drain(a)
        assert out_a[-1].failure == Failure(
            "INTERNAL", "the shard could not serve this request: page id 999 outside the pool"
        )
        # Only b's two full prompt pages were published; a's KV was never written.
        assert sorted(pool.index.values()) == sorted(b.pages.block_table[:2]), (
            "a failed sequence's pages were published"
        )
        for _ in range(19):  # b runs to its end, alone
            shards.gate.release()
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
        shards.gate.release()
        failure = (await _drain(a))[-1].failure
        assert failure.code == "INTERNAL" and "detokenizer edge case" in failure.message
        for _ in range(19):
            shards.gate.release()
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
        shards.gate.release()
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
        assert [(s.start_pos, len(s.new_pages)) for s in decodes] == [
            (10, 0),
            (11, 0),
            (12, 1),
            (13, 0),
            (14, 0),
            (15, 0),
        ]
        assert not any(s.first or s.HasField("sampling") for s in decodes)
        released_with_b = [r for r, s in entries if s.seq_id == b.seq_id and s.first]
        assert list(released_with_b[0]) == [a.seq_id]
        assert sum(len(plan.released) for plan in shards.plans) == 1

    asyncio.run(scenario())


async def _until(condition):
    while not condition():
        await asyncio.sleep(0.001)


def test_a_lone_shard_is_sent_the_next_decode_step_while_one_runs_with_the_token_it_samples_as_input():
    async def scenario():
        pool, shards, engine, (seq,) = _setup()
        seq.max_new_tokens = 5
        engine.submit(seq, [])
        loop = asyncio.create_task(engine.run())
        shards.gate.release()  # the admit step: the first token
        await _until(lambda: len(shards.plans) == 3)
        assert shards.answered == 1, "the second decode step goes out before the first one's answer"
        (decode,), (ahead,) = shards.plans[1].seqs, shards.plans[2].seqs
        assert list(decode.token_ids) == [42] and not decode.sampled_input
        assert ahead.sampled_input and not ahead.token_ids and ahead.start_pos == decode.start_pos + 1
        for _ in range(4):
            shards.gate.release()
        out = await _drain(seq)
        assert [o.token_ids for o in out] == [[42]] * 5 and out[-1].finish_reason is FinishReason.LENGTH
        assert len(shards.plans) == 5, "no step is sent ahead past the length limit"
        assert [s.start_pos for p in shards.plans[1:] for s in p.seqs] == [10, 11, 12, 13]
        await _until(lambda: not engine.scheduler.has_work())
        assert pool.referenced == 0 and pool.reserved == 0
        pool.check()
        loop.cancel()

    asyncio.run(scenario())


def test_a_sequence_that_ends_while_its_step_sent_ahead_runs_drops_that_token_and_is_released_after_it():
    async def scenario():
        pool, shards, engine, (a, b) = _setup(2)
        a.stop_token_ids = frozenset({7})
        engine.submit(a, [])
        loop = asyncio.create_task(engine.run())
        shards.gate.release()  # the admit step: the first token, 42
        await _until(lambda: len(shards.plans) == 3)  # a decode step and one sent ahead
        shards.token = 7  # the decode step samples the end of sequence
        shards.gate.release()
        out = await _drain(a)
        assert [o.token_ids for o in out] == [[42], [7]] and out[-1].finish_reason is FinishReason.EOS
        assert engine.has_work() and not engine.scheduler.has_work(), "a drain waits for the step sent ahead"
        shards.token = 42
        shards.gate.release()  # the step sent ahead: its token is a's no more
        await _until(lambda: not engine.has_work())
        await asyncio.sleep(0.01)
        assert a.outputs.empty() and len(a.output_ids) == 2 and len(shards.plans) == 3
        engine.submit(b, [])
        shards.open = True
        await _drain(b)
        assert list(shards.plans[3].released) == [a.seq_id] and shards.plans[3].seqs[0].first
        assert pool.referenced == 0 and pool.reserved == 0 and stats_of(engine).requests_failed == 0
        pool.check()
        loop.cancel()

    asyncio.run(scenario())


def test_no_step_is_sent_ahead_to_a_group_of_shards_nor_past_a_request_waiting_to_be_admitted():
    async def scenario():
        pool, shards, engine, (a,) = _setup(1, samples_alone=False)
        shards.open = True
        engine.submit(a, [])
        loop = asyncio.create_task(engine.run())
        await _drain(a)
        assert shards.most_in_flight == 1 and not any(s.sampled_input for p in shards.plans for s in p.seqs)
        loop.cancel()

        pool, shards, engine, (a, b) = _setup(2)
        engine.submit(a, [])
        loop = asyncio.create_task(engine.run())
        shards.gate.release()
        await _until(lambda: len(shards.plans) == 3)
        engine.submit(b, [])  # waits while a decode step and one sent ahead run
        shards.gate.release()
        shards.gate.release()
        await _until(lambda: len(shards.plans) == 4)
        assert [s.seq_id for s in shards.plans[3].seqs] == [b.seq_id], "b is admitted next"
        loop.cancel()

    asyncio.run(scenario())
