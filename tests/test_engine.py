"""The step loop with stand-in shards (a unit test of one class): deferred release on cancel, and
a shard failure or an internal error that fails every request and returns every page."""
import asyncio

from protos import shard_pb2
from router.engine import Engine
from router.page_manager import PageManager
from router.scheduler import Scheduler
from router.sequence import Sampling, Sequence
from router.shard_client import ShardError
from tests.support import smollm2_tokenizer

TOK = smollm2_tokenizer()


class GatedShards:
    """Answers each step only when the test opens the gate."""

    def __init__(self):
        self.gate = asyncio.Event()
        self.started = asyncio.Event()
        self.fail = False

    async def step(self, plan):
        self.started.set()
        await self.gate.wait()
        self.gate.clear()
        if self.fail:
            raise ShardError("shard 0 died")
        return shard_pb2.StepResult(step_id=plan.step_id, tokens=[42] * len(plan.seqs))


def _setup():
    pool = PageManager(16, 4)
    shards = GatedShards()
    engine = Engine(Scheduler(pool, 8, 1000), shards, TOK, max_position=1000)
    seq = Sequence(1, "r1", list(range(10)), 20, Sampling())
    return pool, shards, engine, seq


def test_cancel_during_a_step_releases_pages_only_after_the_step():
    async def scenario():
        pool, shards, engine, seq = _setup()
        engine.submit(seq, [])
        loop = asyncio.create_task(engine.run())
        await shards.started.wait()
        assert pool.referenced == 3
        engine.cancel(seq)
        await asyncio.sleep(0.05)
        assert pool.referenced == 3, "pages released while the shard may still write them"
        shards.gate.set()
        out = [await seq.outputs.get()]
        while not out[-1].finish_reason:
            out.append(await seq.outputs.get())
        assert out[-1].finish_reason == "cancelled"
        assert pool.available == 16 and pool.referenced == 0 and pool.reserved == 0
        pool.check()
        assert not engine.scheduler.has_work()
        loop.cancel()

    asyncio.run(scenario())


def test_shard_failure_fails_requests_and_returns_pages():
    async def scenario():
        pool, shards, engine, seq = _setup()
        engine.submit(seq, [])
        loop = asyncio.create_task(engine.run())
        await shards.started.wait()
        shards.fail = True
        shards.gate.set()
        await loop
        assert (await seq.outputs.get()).finish_reason == "error"
        assert engine.error and pool.available == 16 and pool.referenced == 0
        pool.check()

    asyncio.run(scenario())


def test_an_internal_error_fails_requests_instead_of_leaving_them_hanging():
    class BrokenTokenizer:
        def decode(self, *args, **kwargs):
            raise RuntimeError("detokenizer bug")

    async def scenario():
        pool, shards, _, seq = _setup()
        engine = Engine(Scheduler(pool, 8, 1000), shards, BrokenTokenizer(), max_position=1000)
        engine.submit(seq, [])
        loop = asyncio.create_task(engine.run())
        shards.gate.set()
        await asyncio.wait_for(loop, 5)
        assert (await asyncio.wait_for(seq.outputs.get(), 5)).finish_reason == "error"
        assert "detokenizer bug" in engine.error
        assert pool.referenced == 0 and pool.reserved == 0

    asyncio.run(scenario())
