"""The gateway's `shardline.v1.Generation`: the router's public API, each request passed to the
replica that serves it best (gateway/choice.py) and its stream passed back as the replica
serialized it (parsing and serializing every token's message again would cost the gateway CPU
that the shards of a small host need).

A request that fails UNAVAILABLE before its first token (the replica went down, or is draining)
is retried once on the next replica in its order; after the first token the client sees the
failure, as it would from a router. The gateway gives every request an id when it has none, so
a Cancel finds the replica that runs it. Routers check API keys themselves; the gateway checks
them too, to know the tenant whose cache namespace the prompt's page hashes are in.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc

from shardline.common.auth import ApiKeys, cache_namespace, caller_tenant
from shardline.common.generation_service import Malformed
from shardline.common.prompts import prompt_ids
from shardline.common.tokenizer import TextCodec
from shardline.gateway.choice import PREFIX, Candidate, Weights, rank
from shardline.gateway.replicas import Replica, Replicas
from shardline.protos import generation_pb2 as pb

FORWARDED_OUT = ("grpc-", ":", "user-agent", "content-type", "te")  # not passed on to the router


def _forwarded(metadata) -> tuple:
    return tuple((k, v) for k, v in (metadata or ()) if not k.startswith(FORWARDED_OUT))


@dataclass(frozen=True)
class Placement:
    """A request placed on one replica: its prompt's page hashes there, and the prompt tokens the
    replica's index holds (the prediction its usage is later compared with)."""

    replica: Replica
    hashes: list[bytes]
    predicted: int
    prompt_tokens: int

    @property
    def uncached(self) -> int:
        return self.prompt_tokens - self.predicted


class GatewayService:
    def __init__(
        self,
        replicas: Replicas,
        codec: TextCodec,
        keys: ApiKeys | None,
        weights: Weights,
        policy: str = PREFIX,
        seed: int | None = None,
    ):
        self.replicas, self.codec, self.keys, self.weights, self.policy = replicas, codec, keys, weights, policy
        self.rng = random.Random(seed)
        self.accepting = True
        self.in_flight = 0
        self._turns = itertools.count()
        self._running: dict[tuple[str, str], Replica] = {}
        self._text_worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")

    async def _tenant(self, context) -> str:
        return await caller_tenant(self.keys, context)

    async def prompt(self, request) -> list[int] | None:
        """The prompt's token ids as the routers will compute them; None when they cannot be
        (the router then refuses the request with its reason)."""
        try:
            return await asyncio.get_running_loop().run_in_executor(self._text_worker, prompt_ids, self.codec, request)
        except Exception:  # a template or tool-list error: the router's to report
            return None

    def order(self, prompt: list[int] | None, tenant: str, salt: str) -> list[Placement]:
        """The routable replicas, best first. A prefix that a request the gateway has open on a
        replica is computing counts as cached there: its followers go where it will be."""

        def namespace_of(shared: bool) -> str:
            return cache_namespace(None if shared else tenant, salt)

        routes = {}
        for r in self.replicas.routable():
            hashes = r.hashes(prompt, namespace_of) if prompt else []
            routes[r.address] = Placement(r, hashes, r.cached_tokens(hashes), len(prompt or ()))
        candidates = [
            Candidate(
                a,
                route.replica.cached_tokens(route.hashes, pending=True),
                route.replica.requests,
                route.replica.queued_tokens,
                route.replica.unused_tokens,
            )
            for a, route in routes.items()
        ]
        ranked = rank(candidates, len(prompt or ()), self.weights, self.rng, self.policy, next(self._turns))
        return [routes[c.key] for c in ranked]

    async def _parsed(self, request, context):
        if isinstance(request, Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)

    async def Generate(self, request, context):
        tenant = await self._tenant(context)
        await self._parsed(request, context)
        if not self.accepting:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the gateway is shutting down")
        if not request.request_id:
            request.request_id = uuid.uuid4().hex
        key = (tenant, request.request_id)
        if key in self._running:  # it may run on another replica than this one would go to
            await context.abort(
                grpc.StatusCode.ALREADY_EXISTS, f"a request with request_id {request.request_id!r} is already running"
            )
        self._running[key] = None  # taken from here on, before any await
        self.in_flight += 1
        try:
            prompt = await self.prompt(request)
            order = self.order(prompt, tenant, request.cache_salt)
            if not order:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "no replica is serving")
            metadata = _forwarded(context.invocation_metadata())
            for attempt, route in enumerate(order[:2]):
                replica = route.replica
                replica.counters.requests_routed += 1
                replica.open(route.hashes, route.uncached)
                self._running[key] = replica
                call = replica.generate(request, metadata=metadata, timeout=context.time_remaining())
                first, last = True, b""
                try:
                    async for data in call:  # serialized GenerateResponses, passed on as they came
                        if first:
                            first = False
                            replica.first_token(route.uncached)
                        last = data
                        yield data
                    usage = pb.GenerateResponse.FromString(last).usage  # the last one carries it
                    replica.counters.predicted_cached_tokens += route.predicted
                    replica.counters.reported_cached_tokens += usage.cached_prompt_tokens
                    return
                except grpc.aio.AioRpcError as e:
                    if first and e.code() == grpc.StatusCode.UNAVAILABLE and attempt == 0 and len(order) > 1:
                        replica.counters.failovers += 1
                        continue
                    await context.abort(e.code(), e.details() or "")
                finally:
                    call.cancel()
                    replica.close(route.hashes, route.uncached, not first)
        finally:
            self.in_flight -= 1
            del self._running[key]

    async def Cancel(self, request, context):
        tenant = await self._tenant(context)
        await self._parsed(request, context)
        replica = self._running.get((tenant, request.request_id))
        if replica is None:  # unknown, or not sent anywhere yet
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no running request has request_id {request.request_id!r}")
        try:
            return await replica.stub.Cancel(request, metadata=_forwarded(context.invocation_metadata()), timeout=10)
        except grpc.aio.AioRpcError as e:
            await context.abort(e.code(), e.details() or "")

    async def Stats(self, request, context):
        await self._tenant(context)
        await self._parsed(request, context)
        st = pb.StatsResponse(serving=self.serving, requests_running=self.in_flight)
        for r in self.replicas:
            c = r.counters
            st.replicas.add(
                address=r.address,
                serving=r.serving,
                epoch=r.epoch,
                pages_cached=len(r.index),
                requests_running=r.load.requests_running,
                requests_waiting=r.load.requests_waiting,
                requests_routed=c.requests_routed,
                predicted_cached_tokens=c.predicted_cached_tokens,
                reported_cached_tokens=c.reported_cached_tokens,
                failovers=c.failovers,
            )
        return st

    async def Info(self, request, context):
        await self._tenant(context)
        await self._parsed(request, context)
        for replica in self.replicas.routable():
            try:
                return await replica.stub.Info(request, metadata=_forwarded(context.invocation_metadata()), timeout=10)
            except grpc.aio.AioRpcError:
                continue
        await context.abort(grpc.StatusCode.UNAVAILABLE, "no replica is serving")

    @property
    def serving(self) -> bool:
        return self.accepting and bool(self.replicas.routable())
