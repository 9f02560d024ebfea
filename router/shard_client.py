"""The router's side of the shard contract: one long-lived Steps stream per shard."""
from __future__ import annotations

import asyncio

import grpc

from protos import shard_pb2, shard_pb2_grpc


class ShardError(RuntimeError):
    """A shard failed or went away; the replica cannot serve until it is back."""


class ShardClient:
    def __init__(self, address: str):
        self.address = address
        self.channel = grpc.aio.insecure_channel(address, options=[
            ("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)])
        self.stub = shard_pb2_grpc.ShardStub(self.channel)
        self._stream = None

    async def info(self, timeout: float) -> shard_pb2.ShardInfo:
        # wait_for_ready: a shard that is still loading its weights is not an error.
        return await self.stub.Info(shard_pb2.InfoRequest(), wait_for_ready=True, timeout=timeout)

    async def warmup(self, num_pages: int, max_batch: int) -> None:
        await self.stub.Warmup(shard_pb2.WarmupRequest(num_pages=num_pages, max_batch=max_batch),
                               timeout=600)
        self._stream = self.stub.Steps()

    async def step(self, plan: shard_pb2.StepPlan) -> shard_pb2.StepResult:
        try:
            await self._stream.write(plan)
            result = await self._stream.read()
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as e:
            raise ShardError(f"shard {self.address}: {e}") from e
        if result is grpc.aio.EOF:
            code = await self._stream.code()
            details = await self._stream.details()
            raise ShardError(f"shard {self.address} closed its step stream: {code} {details}")
        if result.step_id != plan.step_id:
            raise ShardError(f"shard {self.address} answered step {result.step_id}, expected {plan.step_id}")
        return result

    async def close(self) -> None:
        if self._stream is not None:
            self._stream.cancel()
        await self.channel.close()


class ShardGroup:
    """Every shard of a replica receives the same plan; a step is done when all have answered.
    Only the last stage's TP rank 0 returns sampled tokens."""

    def __init__(self, addresses: list[str]):
        self.shards = [ShardClient(a) for a in addresses]
        self.sampler = len(self.shards) - 1

    async def info(self, timeout: float) -> list[shard_pb2.ShardInfo]:
        infos = list(await asyncio.gather(*(s.info(timeout) for s in self.shards)))
        tp, pp = infos[0].tp_size, infos[0].pp_size
        layout = sorted((i.pp_stage, i.tp_rank) for i in infos)
        if layout != [(s, r) for s in range(pp) for r in range(tp)] or \
                any((i.tp_size, i.pp_size) != (tp, pp) for i in infos):
            raise ShardError(f"the shards do not form one TP{tp} x PP{pp} replica: {layout}")
        self.sampler = next(n for n, i in enumerate(infos) if i.pp_stage == pp - 1 and i.tp_rank == 0)
        return infos

    async def warmup(self, num_pages: int, max_batch: int) -> None:
        await asyncio.gather(*(s.warmup(num_pages, max_batch) for s in self.shards))

    async def step(self, plan: shard_pb2.StepPlan) -> shard_pb2.StepResult:
        # gather raises the first failure; a shard that died fails the whole step.
        results = await asyncio.gather(*(s.step(plan) for s in self.shards))
        return results[self.sampler]

    async def close(self) -> None:
        await asyncio.gather(*(s.close() for s in self.shards), return_exceptions=True)
