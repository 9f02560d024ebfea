"""When a long step counts as hung (router/shards/group.py): after HUNG_AFTER_TIMEOUTS step
timeouts, or longer for a step whose tokens the steps measured so far say need more. Stand-in
shards (the unit under test is the group's deadline, not the wire)."""

import asyncio

import pytest

from shardline.protos import shard_pb2
from shardline.router.core.shards import ShardError
from shardline.router.shards.group import HUNG_AFTER_TIMEOUTS, ShardGroup


class _SlowShard:
    """Answers health checks, and each step after `seconds`, having computed for that long."""

    address = "stand-in"

    def __init__(self, seconds: float):
        self.seconds = seconds

    async def receive(self, plan):
        await asyncio.sleep(self.seconds)
        return shard_pb2.StepResult(step_id=plan.step_id, compute_ms=self.seconds * 1e3)

    async def answers(self, timeout: float) -> bool:
        return True

    async def warmup(self, num_pages: int, max_batch: int, window_pages: int = 0):
        return shard_pb2.WarmupResponse(prefill_ms_per_token=self.seconds * 1e3 / 20)  # a 20-token step's time


STEP_S = 0.05 * HUNG_AFTER_TIMEOUTS + 0.3  # past HUNG_AFTER_TIMEOUTS timeouts of 0.05 s


def _receive(tokens: int, ms_per_token: float) -> tuple[shard_pb2.StepResult, float]:
    """A step of `tokens` on a group that measured `ms_per_token` before: (its result, the rate after)."""

    async def run():
        group = ShardGroup(["unix:/unused"], step_timeout_s=0.05)
        group.shards, group.ms_per_token = [_SlowShard(STEP_S)], ms_per_token
        plan = shard_pb2.StepPlan(step_id=1, seqs=[shard_pb2.SequenceStep(token_ids=list(range(tokens)))])
        return await group.receive(plan), group.ms_per_token

    return asyncio.run(run())


def test_a_step_past_its_timeouts_with_no_rate_measured_counts_as_hung():
    with pytest.raises(ShardError, match="compute hangs"):
        _receive(64, ms_per_token=0.0)


def test_a_step_of_many_tokens_gets_the_time_the_measured_rate_says_it_needs():
    result, rate = _receive(64, ms_per_token=5.0)  # 64 tokens: 0.32 s, and the margin over it
    assert result.compute_ms > 0
    # what it measured raises the rate for later steps
    assert rate == pytest.approx(STEP_S * 1e3 / 64)


def test_the_warmups_prefill_rate_gives_a_first_long_step_its_time():
    """Before any step was measured, the warmup's prefill rate is the one to go by: a first request
    of a long prompt (SmolLM2's 4,096 tokens with prompt logprobs on a busy machine ran past the
    three timeouts) is not judged a hang."""

    async def run():
        group = ShardGroup(["unix:/unused"], step_timeout_s=0.05)
        group.shards = [_SlowShard(STEP_S)]
        await group.warmup(num_pages=4, max_batch=1)
        plan = shard_pb2.StepPlan(step_id=1, seqs=[shard_pb2.SequenceStep(token_ids=list(range(64)))])
        return await group.receive(plan)

    assert asyncio.run(run()).compute_ms > 0
