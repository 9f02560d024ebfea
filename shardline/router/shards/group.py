"""The router's side of the shard contract on the wire: one long-lived Steps stream per shard.

A shard is judged failed when its stream breaks (it died, or its connection did), when it ends a
step with an error, or when a step has run for `step_timeout_s` and the shard then does not
answer a health check within `probe_timeout_s` (a hung or SIGSTOPped process). A step that runs
long on shards that still answer may be a long prefill, and is left to finish, up to
HUNG_AFTER_TIMEOUTS step timeouts, or longer for a step of many tokens where the steps measured
so far say it needs more (SLOW_STEP_MARGIN times its tokens at the slowest rate yet, the
warmup's prefill included, so that a first request's long prompt has a rate to go by: a
Llama-3.1-8B shape's prefill of 16 prompts runs past a minute on two cores, SmolLM2's 4,096-token
prompt with prompt logprobs past one on a busy machine): past that its compute hangs (a
deadlock that leaves the gRPC threads alive), and the shard fails all the same.
"""

from __future__ import annotations

import asyncio
import math
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shardline.common.process import hang_detection_s, reconnect_options
from shardline.protos import shard_pb2, shard_pb2_grpc
from shardline.router.core.shards import ShardError

HUNG_AFTER_TIMEOUTS = 3
SLOW_STEP_MARGIN = 4


class ShardClient:
    def __init__(self, address: str, credentials: grpc.ChannelCredentials | None = None):
        """`credentials`: mutual TLS to a shard on TCP (a unix socket stays plaintext)."""
        self.address = address
        options = [
            ("grpc.max_send_message_length", 64 << 20),
            ("grpc.max_receive_message_length", 64 << 20),
            *reconnect_options(address),
        ]
        self.channel = (
            grpc.aio.secure_channel(address, credentials, options=options)
            if credentials is not None and not address.startswith("unix:")
            else grpc.aio.insecure_channel(address, options=options)
        )
        self.stub = shard_pb2_grpc.ShardStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self._stream = None

    async def info(self, timeout: float) -> shard_pb2.ShardInfo:
        # wait_for_ready: a shard that is still loading its weights is not an error.
        return await self.stub.Info(shard_pb2.InfoRequest(), wait_for_ready=True, timeout=timeout)

    async def warmup(self, num_pages: int, max_batch: int, window_pages: int = 0) -> shard_pb2.WarmupResponse:
        # Capturing decode graphs compiles them on a first start: minutes on a small CPU.
        request = shard_pb2.WarmupRequest(num_pages=num_pages, max_batch=max_batch, window_pages=window_pages)
        response = await self.stub.Warmup(request, timeout=1800)
        self._stream = self.stub.Steps()
        return response

    async def answers(self, timeout: float) -> bool:
        try:
            await self.health.Check(health_pb2.HealthCheckRequest(), timeout=timeout)
            return True
        except grpc.aio.AioRpcError:
            return False

    async def ended(self) -> str:
        """Waits until the step stream ends, and says how."""
        code = await self._stream.code()
        return f"shard {self.address} ended its step stream: {code.name} {await self._stream.details()}"

    async def send(self, plan: shard_pb2.StepPlan) -> None:
        try:
            await self._stream.write(plan)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as e:
            raise ShardError(f"shard {self.address}: {e}") from e

    async def receive(self, plan: shard_pb2.StepPlan) -> shard_pb2.StepResult:
        """The answer to `plan`, the oldest plan sent and not yet answered."""
        try:
            result = await self._stream.read()
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as e:
            raise ShardError(f"shard {self.address}: {e}") from e
        if result is grpc.aio.EOF:
            code, details = await self._stream.code(), await self._stream.details()
            raise ShardError(f"shard {self.address} closed its step stream: {code.name} {details}")
        if result.step_id != plan.step_id:
            raise ShardError(f"shard {self.address} answered step {result.step_id}, expected {plan.step_id}")
        return result

    async def close_stream(self, abandon: bool) -> None:
        """Ends the step stream: cleanly, after a closing plan (the shard keeps its state and may
        be driven again), or by cancelling it (a shard of a multi-rank group then exits, to be
        restarted with it)."""
        stream, self._stream = self._stream, None
        if stream is None:
            return
        if abandon:
            stream.cancel()
            return
        try:
            await asyncio.wait_for(stream.write(shard_pb2.StepPlan(close=True)), 5)
            await asyncio.wait_for(stream.done_writing(), 5)
            await asyncio.wait_for(stream.code(), 5)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError, asyncio.TimeoutError):
            stream.cancel()

    async def close(self) -> None:
        await self.close_stream(abandon=False)
        await self.channel.close()


def _mismatch(infos: list[shard_pb2.ShardInfo], field: str) -> str | None:
    values = {getattr(i, field) for i in infos}
    return f"the shards disagree on {field}: {sorted(map(str, values))}" if len(values) > 1 else None


class ShardGroup:
    """Every shard of a replica receives the same plan; a step is done when all have answered.
    Only the last stage's TP rank 0 returns sampled tokens."""

    def __init__(
        self, addresses: list[str], step_timeout_s: float = 20.0, credentials: grpc.ChannelCredentials | None = None
    ):
        self.shards = [ShardClient(a, credentials) for a in addresses]
        self.sampler = len(self.shards) - 1
        self.step_timeout_s = step_timeout_s
        self.probe_timeout_s, _ = hang_detection_s(step_timeout_s)
        self.ms_per_token = 0.0  # the slowest a step's tokens have run, from the steps measured so far
        self.group_id = ""  # the start of the shards' process group last answering Info
        self.abandoned_group: str | None = None  # a multi-rank start whose streams were abandoned: it exits

    async def info(self, timeout: float) -> list[shard_pb2.ShardInfo]:
        """Every shard's Info, checked to form one replica of one model, and of one start of its
        process group (`ShardInfo.group_id`) other than one being abandoned: a rank may still
        answer Info before it learns that it must exit, and a warmup with it would hang the new
        ranks' collectives."""
        try:
            infos = list(await asyncio.gather(*(s.info(timeout) for s in self.shards)))
        except grpc.aio.AioRpcError as e:
            raise ShardError(f"a shard did not answer Info: {e.code().name} {e.details()}") from e
        for field in ("model", "page_size", "dtype", "kv_dtype", "vocab_size", "context_length", "tp_size", "pp_size"):
            if why := _mismatch(infos, field):
                raise ShardError(why)
        starts = {i.group_id for i in infos}
        if len(starts) > 1:  # some ranks of a failed group are still exiting
            raise ShardError("the shards are not one start of their process group yet")
        if starts == {self.abandoned_group}:  # all of them still exiting
            raise ShardError("the shard group that failed has not restarted yet")
        self.group_id = starts.pop()
        tp, pp = infos[0].tp_size, infos[0].pp_size
        layout = sorted((i.pp_stage, i.tp_rank) for i in infos)
        if layout != [(s, r) for s in range(pp) for r in range(tp)]:
            raise ShardError(f"the shards do not form one TP{tp} x PP{pp} replica: (stage, rank) {layout}")
        self.sampler = next(n for n, i in enumerate(infos) if i.pp_stage == pp - 1 and i.tp_rank == 0)
        return infos

    async def warmup(self, num_pages: int, max_batch: int, window_pages: int = 0) -> list[shard_pb2.WarmupResponse]:
        """Every shard's warmup, waited for to the end: a shard that warmed up while another did
        not has opened its step stream, which is closed again (cleanly: it keeps its state), or
        the next attempt would find it open."""
        answers = await asyncio.gather(
            *(s.warmup(num_pages, max_batch, window_pages) for s in self.shards), return_exceptions=True
        )
        failed = [a for a in answers if isinstance(a, BaseException)]
        if not failed:
            self.ms_per_token = max(self.ms_per_token, *(a.prefill_ms_per_token for a in answers))
            return list(answers)
        await self.close_streams(abandon=False)
        e = failed[0]
        if isinstance(e, grpc.aio.AioRpcError):
            raise ShardError(f"a shard failed its warmup: {e.code().name} {e.details()}") from e
        raise e

    async def ended(self) -> str:
        """Waits until any shard's step stream ends (between steps too), and says how."""
        tasks = [asyncio.ensure_future(s.ended()) for s in self.shards]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            return done.pop().result()
        finally:
            for t in tasks:
                t.cancel()

    @property
    def samples_alone(self) -> bool:
        """One shard: it holds every token it samples, and can be sent a plan that uses them."""
        return len(self.shards) == 1

    async def send(self, plan: shard_pb2.StepPlan) -> None:
        """Sends a plan to every shard; each runs the plans it is sent in order, one at a time."""
        await asyncio.gather(*(s.send(plan) for s in self.shards))

    async def receive(self, plan: shard_pb2.StepPlan) -> shard_pb2.StepResult:
        """Every shard's answer to `plan`, the oldest plan sent and not yet answered."""
        tasks = [asyncio.ensure_future(s.receive(plan)) for s in self.shards]
        t0, tokens = time.monotonic(), max(1, sum(len(seq.token_ids) + len(seq.proposals) for seq in plan.seqs))
        hung_after = max(HUNG_AFTER_TIMEOUTS, SLOW_STEP_MARGIN * self.ms_per_token * tokens / 1e3 / self.step_timeout_s)
        try:
            for _ in range(math.ceil(hung_after)):
                done, pending = await asyncio.wait(
                    tasks, timeout=self.step_timeout_s, return_when=asyncio.FIRST_EXCEPTION
                )
                for task in done:
                    if task.exception() is not None:
                        raise task.exception()
                if not pending:
                    result = tasks[self.sampler].result()
                    result.graph_launches = sum(t.result().graph_launches for t in tasks)
                    result.eager_decode_steps = sum(t.result().eager_decode_steps for t in tasks)
                    result.compute_ms = max(t.result().compute_ms for t in tasks)  # the slowest rank
                    self.ms_per_token = max(self.ms_per_token, result.compute_ms / tokens)
                    return result
                # A long step: it may be a long prefill, or a shard that hangs. Ask them all.
                answers = await asyncio.gather(*(s.answers(self.probe_timeout_s) for s in self.shards))
                silent = [s.address for s, ok in zip(self.shards, answers) if not ok]
                if silent:
                    raise ShardError(
                        f"step {plan.step_id} has run {time.monotonic() - t0:.0f} s and shard(s) "
                        f"{', '.join(silent)} did not answer a health check within "
                        f"{self.probe_timeout_s:.0f} s"
                    )
            late = [s.address for s, t in zip(self.shards, tasks) if not t.done()]
            raise ShardError(
                f"step {plan.step_id} has not returned after {time.monotonic() - t0:.0f} s "
                f"({math.ceil(hung_after)} step timeouts) on shard(s) {', '.join(late)}, which "
                "still answer health checks: their compute hangs"
            )
        finally:
            for task in tasks:
                task.cancel()

    async def close_streams(self, abandon: bool) -> None:
        if abandon and len(self.shards) > 1 and self.group_id:  # it exits as a whole (shard/server.py)
            self.abandoned_group = self.group_id
        await asyncio.gather(*(s.close_stream(abandon) for s in self.shards), return_exceptions=True)

    async def close(self) -> None:
        await asyncio.gather(*(s.close() for s in self.shards), return_exceptions=True)
