"""The Fleet service (protos/fleet.proto): the router's prefix index and load, streamed to the
gateways in front of many replicas.

One publisher task looks every PERIOD_S: it takes what its change log of the page pool holds
(core/page_manager.py appends every page published or reclaimed to it) and the load, and when either changed, or
HEARTBEAT_S passed without a message, sends one message to every watcher: a watcher that hears
nothing for a few heartbeats knows the router is gone, even where no connection reset tells it.
Everything runs on the router's event loop, between steps, so a snapshot and the changes after
it are consistent. A replica that reconnects its shard group starts with a new page pool: the
publisher sees the new pool, starts a new epoch, and sends every watcher a snapshot of it
(empty), which replaces what the watcher knew.

A watcher that falls WATCHER_BACKLOG messages behind is sent a snapshot in place of its backlog.
The stream carries page hashes and counts, never tokens; it is meant for the fleet's own network
(mutual TLS in a deployment).
"""

from __future__ import annotations

import asyncio
import time
import uuid

import grpc

from shardline.protos import fleet_pb2 as fpb
from shardline.protos import fleet_pb2_grpc
from shardline.router.core.page_manager import Change, PageManager
from shardline.router.core.replica import Replica

FLEET_SERVICE = fpb.DESCRIPTOR.services_by_name["Fleet"].full_name
PERIOD_S = 0.02
HEARTBEAT_S = 1.0
WATCHER_BACKLOG = 256


class CacheWatchers:
    """`tenants_share_cache`: as --prefix-cache-sharing; `http_port`: the router's OpenAI API's
    (0: none)."""

    def __init__(self, replica: Replica, tenants_share_cache: bool, http_port: int = 0):
        self.replica, self.tenants_share_cache, self.http_port = replica, tenants_share_cache, http_port
        self.epoch, self.seq = "", 0
        self._pool: PageManager | None = None
        self._log: list[Change] = []  # the pool's changes not sent yet
        self._load: fpb.Load | None = None
        self._sent_at = 0.0
        self._queues: set[asyncio.Queue] = set()

    # -- what is sent ---------------------------------------------------------------------------
    def load(self) -> fpb.Load:
        replica = self.replica
        load, pages = replica.load(), replica.pool
        if load is None:
            return fpb.Load(serving=False)
        return fpb.Load(
            serving=replica.serving and replica.accepting,
            requests_running=load.running,
            requests_waiting=load.waiting,
            prompt_tokens_queued=load.prompt_tokens_queued,
            pages_free=max(0, pages.available),
            pages_total=pages.num_pages,
            pages_unused=max(0, pages.free - pages.reserved),
        )

    def snapshot(self) -> fpb.CacheEvent:
        pool = self._pool
        event = fpb.CacheEvent(
            epoch=self.epoch, seq=self.seq, snapshot=True, load=self.load(), http_port=self.http_port
        )
        if pool is not None:
            event.hashing.CopyFrom(
                fpb.PageHashing(
                    page_size=pool.page_size, model_key=pool.model_key, tenants_share_cache=self.tenants_share_cache
                )
            )
            event.published.extend(pool.index)
        return event

    # -- the publisher ----------------------------------------------------------------------------
    async def run(self) -> None:
        while True:
            self.tick()
            await asyncio.sleep(PERIOD_S)

    def tick(self) -> None:
        pool = self.replica.pool
        if pool is not self._pool or not self.epoch:
            if self._pool is not None:
                self._pool.unwatch(self._log)
            self._pool, self.epoch, self.seq = pool, uuid.uuid4().hex, 0
            self._log = pool.watch() if pool is not None else []
            self._load = self.load()
            self._send_all(self.snapshot)
            return
        load = self.load()
        if not self._log and load == self._load and time.monotonic() - self._sent_at < HEARTBEAT_S:
            return
        final = {c.hash: c.stored for c in self._log}  # a hash's last change is what holds now
        self._log.clear()
        self.seq += 1
        self._load = load
        event = fpb.CacheEvent(
            epoch=self.epoch,
            seq=self.seq,
            load=load,
            published=[h for h, indexed in final.items() if indexed],
            evicted=[h for h, indexed in final.items() if not indexed],
        )
        self._send_all(lambda: event)

    def _send_all(self, message) -> None:
        self._sent_at = time.monotonic()
        for queue in self._queues:
            if queue.qsize() >= WATCHER_BACKLOG:  # fallen behind: a snapshot instead of the backlog
                while not queue.empty():
                    queue.get_nowait()
                queue.put_nowait(self.snapshot())
            else:
                queue.put_nowait(message())

    # -- the RPC ----------------------------------------------------------------------------------
    async def WatchCache(self, request, context):
        if not self.epoch:
            self.tick()
        queue: asyncio.Queue = asyncio.Queue()
        queue.put_nowait(self.snapshot())
        self._queues.add(queue)
        try:
            while True:
                yield await queue.get()
        finally:
            self._queues.discard(queue)


def add_fleet_service(server: grpc.aio.Server, watchers: CacheWatchers) -> None:
    fleet_pb2_grpc.add_FleetServicer_to_server(watchers, server)
