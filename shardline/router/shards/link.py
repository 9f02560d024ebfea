"""The shard group as the core sees it (core/shards.py `Shards`): the gRPC group (group.py)
speaking through the codec (codec.py), with what the shards were told."""

from __future__ import annotations

from shardline.protos import shard_pb2
from shardline.router.core.shards import ShardInfo, StepOutcome, Warmup
from shardline.router.core.step import Step
from shardline.router.shards.codec import Told, info_of, outcome_of, plan_of, warmup_of
from shardline.router.shards.group import ShardGroup


class ShardLink:
    def __init__(self, group: ShardGroup):
        self.group = group
        self.told = Told()
        self._sent: dict[int, shard_pb2.StepPlan] = {}  # step_id -> its plan, until answered

    @property
    def sampler(self) -> int:
        return self.group.sampler

    @property
    def samples_alone(self) -> bool:
        return self.group.samples_alone

    async def info(self, timeout: float) -> list[ShardInfo]:
        return [info_of(i) for i in await self.group.info(timeout)]

    async def warmup(self, num_pages: int, max_batch: int, window_pages: int = 0) -> list[Warmup]:
        answers = await self.group.warmup(num_pages, max_batch, window_pages)
        self.told, self._sent = Told(), {}
        return [warmup_of(w) for w in answers]

    async def send(self, step_id: int, step: Step) -> None:
        plan = self._sent[step_id] = plan_of(step_id, step, self.told)
        await self.group.send(plan)

    async def receive(self, step_id: int, step: Step) -> StepOutcome:
        return outcome_of(step, await self.group.receive(self._sent.pop(step_id)))

    def release(self, seq_id: int) -> None:
        self.told.release(seq_id)

    async def ended(self) -> str:
        return await self.group.ended()

    async def close_streams(self, abandon: bool) -> None:
        await self.group.close_streams(abandon)

    async def close(self) -> None:
        await self.group.close()
