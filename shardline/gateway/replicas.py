"""The gateway's view of its replicas: for each router, a channel, the exact set of prefix page
hashes its cache holds and its load, kept current by its Fleet stream (protos/fleet.proto).

A replica is routable while its stream is up, its last message says it serves, and a message
came within SILENT_S (the router sends a heartbeat every second). A stream that breaks, a gap in
the sequence numbers or a silence drops what was known and reconnects; the first message of the
new stream is a snapshot, so a restarted router (an empty cache) is resynced, stale entries gone.

The replica set comes from `--routers`: each entry HOST:PORT is resolved every
`resolve_interval_s`, and every address it resolves to is a replica (a Kubernetes headless
Service's name resolves to its ready pods), so replicas can come and go.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from dataclasses import dataclass, field

import grpc

from shardline.common.prefix_hash import prompt_hashes
from shardline.common.process import FAST_RECONNECT
from shardline.protos import fleet_pb2 as fpb
from shardline.protos import fleet_pb2_grpc, generation_pb2_grpc
from shardline.protos import generation_pb2 as pb

log = logging.getLogger("shardline.gateway")
SILENT_S = 3.0
RECONNECT_S = 0.5
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 256 << 20),
    ("grpc.max_send_message_length", 64 << 20),
    *FAST_RECONNECT,
]


class Resync(Exception):
    """The stream lost changes: reconnect for a snapshot."""


@dataclass
class ReplicaCounters:
    requests_routed: int = 0
    predicted_cached_tokens: int = 0
    reported_cached_tokens: int = 0
    failovers: int = 0  # requests that failed here before their first token and went elsewhere


GENERATE = "/shardline.v1.Generation/Generate"


def serialized_generate(channel: grpc.aio.Channel):
    """Generate on `channel`, its responses left serialized: the gateway passes them on as they
    came and reads only the last one."""
    return channel.unary_stream(
        GENERATE, request_serializer=pb.GenerateRequest.SerializeToString, response_deserializer=None
    )


@dataclass
class Replica:
    address: str
    channel: grpc.aio.Channel
    stub: generation_pb2_grpc.GenerationStub
    generate: object = None  # serialized_generate(channel)
    connected: bool = False
    epoch: str = ""
    seq: int = 0
    hashing: fpb.PageHashing | None = None
    http_port: int = 0  # of its OpenAI API, as its last snapshot said
    index: set[bytes] = field(default_factory=set)
    load: fpb.Load = field(default_factory=fpb.Load)
    heard_at: float = 0.0
    in_flight: int = 0  # requests this gateway has open here
    pending_tokens: int = 0  # uncached prompt tokens of those without a first token yet
    # Page hashes of the prompts of those requests: pages being computed here (or computed and
    # indexed by now), which the index does not show until their step is done. Counted, so that
    # two open requests with one prefix keep it until both end.
    pending: dict[bytes, int] = field(default_factory=dict)
    counters: ReplicaCounters = field(default_factory=ReplicaCounters)
    task: asyncio.Task | None = None

    @property
    def serving(self) -> bool:
        return (
            self.connected
            and self.load.serving
            and self.hashing is not None
            and time.monotonic() - self.heard_at < SILENT_S
        )

    @property
    def requests(self) -> int:
        return max(self.load.requests_running + self.load.requests_waiting, self.in_flight)

    @property
    def queued_tokens(self) -> int:
        return max(self.load.prompt_tokens_queued, self.pending_tokens)

    @property
    def unused_tokens(self) -> int:
        """Tokens of pages there that hold no cached prefix, less what requests the gateway sent
        and the router has not reported yet will take."""
        page = self.hashing.page_size if self.hashing is not None else 0
        return max(0, self.load.pages_unused * page - self.pending_tokens)

    def hashes(self, prompt: list[int], namespace_of) -> list[bytes]:
        """The prompt's page hashes as this replica computes them. `namespace_of(tenants_share_cache)`:
        the request's cache namespace."""
        h = self.hashing
        if h is None or not h.page_size:
            return []
        return prompt_hashes(prompt, h.page_size, h.model_key, namespace_of(h.tenants_share_cache))

    def cached_tokens(self, hashes: list[bytes], pending: bool = False) -> int:
        """Prompt tokens of the longest prefix of `hashes` this replica's index holds (`pending`:
        or that a request the gateway has open here is computing)."""
        hits = 0
        for page_hash in hashes:
            if page_hash not in self.index and not (pending and page_hash in self.pending):
                break
            hits += 1
        return hits * self.hashing.page_size if hits else 0

    def open(self, hashes: list[bytes], uncached: int) -> None:
        """A request with these prompt page hashes was sent here."""
        self.in_flight += 1
        self.pending_tokens += uncached
        for h in hashes:
            self.pending[h] = self.pending.get(h, 0) + 1

    def first_token(self, uncached: int) -> None:
        self.pending_tokens -= uncached

    def close(self, hashes: list[bytes], uncached: int, had_first_token: bool) -> None:
        """That request's stream ended here."""
        self.in_flight -= 1
        if not had_first_token:
            self.pending_tokens -= uncached
        for h in hashes:
            n = self.pending.get(h, 0) - 1
            if n > 0:
                self.pending[h] = n
            else:
                self.pending.pop(h, None)

    def apply(self, event: fpb.CacheEvent) -> None:
        if event.snapshot:
            self.epoch, self.seq = event.epoch, event.seq
            self.index = set(event.published)
            self.hashing = event.hashing if event.HasField("hashing") else None
            self.http_port = event.http_port
        elif event.epoch != self.epoch or event.seq != self.seq + 1:
            raise Resync(f"event {event.epoch[:8]}/{event.seq} after {self.epoch[:8]}/{self.seq}")
        else:
            self.seq = event.seq
            self.index.update(event.published)
            self.index.difference_update(event.evicted)
        self.load, self.heard_at = event.load, time.monotonic()

    def forget(self) -> None:
        self.connected, self.epoch, self.seq, self.hashing = False, "", 0, None
        self.index = set()
        self.load = fpb.Load()

    async def watch(self, on_change) -> None:
        """Follows the replica's Fleet stream for as long as the gateway knows the replica."""
        fleet = fleet_pb2_grpc.FleetStub(self.channel)
        while True:
            call = fleet.WatchCache(fpb.WatchCacheRequest())
            try:
                reader = call.__aiter__()
                while True:
                    event = await asyncio.wait_for(reader.__anext__(), SILENT_S)
                    was = self.serving
                    self.apply(event)
                    self.connected = True
                    if self.serving != was:
                        on_change()
            except StopAsyncIteration:
                why = "the stream ended"
            except grpc.aio.AioRpcError as e:
                why = f"{e.code().name} {e.details()}"
            except asyncio.TimeoutError:
                why = f"silent for {SILENT_S:.0f} s"
            except Resync as e:
                why = f"lost changes ({e})"
            finally:
                call.cancel()
            if self.connected:
                log.warning("replica %s: %s; reconnecting", self.address, why)
            self.forget()
            on_change()
            await asyncio.sleep(RECONNECT_S)


def _resolve(entry: str) -> list[str]:
    """The addresses `entry` (HOST:PORT) resolves to now; IPv4 ones where there are any."""
    host, _, port = entry.rpartition(":")
    host = host.strip("[]")
    try:
        infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except (socket.gaierror, ValueError, UnicodeError):
        return []
    v4 = sorted({f"{i[4][0]}:{port}" for i in infos if i[0] == socket.AF_INET})
    v6 = sorted({f"[{i[4][0]}]:{port}" for i in infos if i[0] == socket.AF_INET6})
    return v4 or v6


class Replicas:
    """The replica set, re-resolved from `entries` every `resolve_interval_s`. `credentials`:
    TLS to the routers (the entry's host name is checked against their certificate)."""

    def __init__(
        self,
        entries: list[str],
        resolve_interval_s: float,
        on_change,
        credentials: grpc.ChannelCredentials | None = None,
    ):
        self.entries, self.resolve_interval_s, self.on_change = entries, resolve_interval_s, on_change
        self.credentials = credentials
        self.by_address: dict[str, Replica] = {}
        self._hosts: dict[str, str] = {}  # address -> the host name of the entry it resolved from

    def __iter__(self):
        return iter(list(self.by_address.values()))

    def host_of(self, address: str) -> str:
        return self._hosts.get(address, "")

    def routable(self) -> list[Replica]:
        return [r for r in self.by_address.values() if r.serving]

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            found: dict[str, str] = {}
            for entry in self.entries:
                for address in await loop.run_in_executor(None, _resolve, entry):
                    found.setdefault(address, entry.rpartition(":")[0].strip("[]"))
            self._update(found)
            await asyncio.sleep(self.resolve_interval_s)

    def _update(self, found: dict[str, str]) -> None:
        for address in list(self.by_address):
            if address not in found:
                replica = self.by_address.pop(address)
                log.info("replica %s is gone from the resolved set", address)
                replica.task.cancel()
                asyncio.ensure_future(replica.channel.close())
        for address, host in found.items():
            if address in self.by_address:
                continue
            self._hosts[address] = host
            if self.credentials is not None:
                options = [*CHANNEL_OPTIONS, ("grpc.ssl_target_name_override", host)]
                channel = grpc.aio.secure_channel(address, self.credentials, options=options)
            else:
                channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
            replica = Replica(
                address, channel, generation_pb2_grpc.GenerationStub(channel), serialized_generate(channel)
            )
            replica.task = asyncio.ensure_future(replica.watch(self.on_change))
            self.by_address[address] = replica
            log.info("replica %s added", address)
        self.on_change()

    async def close(self) -> None:
        for replica in self.by_address.values():
            replica.task.cancel()
            await replica.channel.close()
