"""KV cache events in vLLM's wire format, for the fleet schedulers that route by prefix from them
(llm-d's KV-cache indexer, NVIDIA Dynamo's KV router); DESIGN.md "KV events" says why they match.

What goes out is what vLLM's ZmqEventPublisher sends (vllm/distributed/kv_events.py):
- a ZMQ PUB socket at --kv-events-endpoint sends multipart [topic, seq, payload]: seq counts the
  batches from 0 as 8 bytes big-endian, payload is a msgpack `KVEventBatch` (ts, events,
  data_parallel_rank): the batch a positional array, each event a map tagged with its type under
  "type" (vLLM's encoding since vllm-project/vllm#42892), or with `--kv-events-encoding array` a
  positional array, its type first (vLLM's before it, which llm-d-kv-cache before its v0.9 and
  Dynamo's older relays read);
- a ZMQ ROUTER socket at --kv-events-replay-endpoint answers a REQ client's start seq (8 bytes
  big-endian) with a [seq, payload] message per batch still kept (the last REPLAY_BATCHES) from
  there on, then the end marker [-1 as 8 bytes, b""].

Its one source is the page pool's change log (core/page_manager.py), as the Fleet stream's: a page
published is a BlockStored (consecutive pages of one chain share an event, as vLLM stores a
request's blocks), a page reclaimed or reset a BlockRemoved, and a pool that is not the one before
(the first, a reconnect of the shard group, none while the group is down) an AllBlocksCleared.
A page's hash goes out as vLLM sends its own by default: the low 64 bits as an unsigned int.

It runs on the router's event loop every PERIOD_S, between steps, and never waits: PUB drops what
a slow subscriber's high-water mark cannot take (that subscriber sees a gap in seq and asks the
replay socket), and a send that fails is counted in `dropped`, never retried.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from collections import deque
from typing import Any

import msgspec
import zmq

from shardline.router.core.page_manager import Change, PageManager

log = logging.getLogger("shardline.router.kv_events")

PERIOD_S = 0.02
REPLAY_BATCHES = 10_000  # vLLM's buffer_steps
HWM = 100_000  # vLLM's high-water mark for its PUB socket
END_SEQ = (-1).to_bytes(8, "big", signed=True)
MEDIUM = "GPU"  # vLLM's name for an engine's own KV cache (llm-d reads it as the "gpu" tier)
_FIRST = object()  # what the publisher saw before its first tick: not a pool, nor None


# -- the wire types, field for field as vLLM declares them ------------------------------------------
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """An event is a map tagged by its class name under "type"."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


ENCODINGS = ("map", "array")


def as_array(event: KVCacheEvent) -> list:
    """An event as vLLM encoded it before vllm-project/vllm#42892 (`array_like` structs): its type,
    then its fields in order, the defaults at the end left out."""
    values = [getattr(event, name) for name in event.__struct_fields__]
    required = len(event.__struct_fields__) - len(event.__struct_defaults__)
    while len(values) > required and values[-1] is None:
        values.pop()
    return [type(event).__name__, *values]


def encode_batch(encoder: msgspec.msgpack.Encoder, events: list[KVCacheEvent], encoding: str, ts: float) -> bytes:
    if encoding == "array":
        events = [as_array(e) for e in events]
    return encoder.encode(KVEventBatch(ts=ts, events=events, data_parallel_rank=0))


def external_hash(page_hash: bytes) -> int:
    """A page hash as vLLM sends a block hash by default (`maybe_convert_block_hash`)."""
    return int.from_bytes(page_hash[-8:], "big")


def events_of(changes: list[Change], page_size: int) -> list[BlockStored | BlockRemoved]:
    """The events of a change log, in its order: a run of published pages each the child of the
    one before is one BlockStored, a run of removals one BlockRemoved."""
    events: list[BlockStored | BlockRemoved] = []
    last: bytes | None = None
    for change in changes:
        event = events[-1] if events else None
        if change.stored:
            if isinstance(event, BlockStored) and change.parent == last:
                event.block_hashes.append(external_hash(change.hash))
                event.token_ids.extend(change.tokens)
            else:
                parent = None if change.parent is None else external_hash(change.parent)
                events.append(
                    BlockStored(
                        [external_hash(change.hash)], parent, list(change.tokens), page_size, None, MEDIUM, None
                    )
                )
        elif isinstance(event, BlockRemoved):
            event.block_hashes.append(external_hash(change.hash))
        else:
            events.append(BlockRemoved([external_hash(change.hash)], MEDIUM))
        last = change.hash
    return events


def topic_of(template: str, host: str, http_port: int, model: str) -> str:
    """--kv-events-topic with its fields filled: {pod_ip} ($POD_IP, else --host where it names one
    address), {port} (the HTTP API's, which an endpoint picker routes to) and {model}."""
    wildcard = host in ("", "0.0.0.0", "::", "[::]")
    pod_ip = os.environ.get("POD_IP") or ("127.0.0.1" if wildcard else host)
    try:
        return template.format(pod_ip=pod_ip, port=http_port, model=model)
    except (KeyError, IndexError, ValueError) as e:
        raise SystemExit(
            f"--kv-events-topic {template!r}: {e!r}; the fields are {{pod_ip}}, {{port}} and {{model}}"
        ) from None


class KvEventPublisher:
    """`replica`: whose page pool (`replica.pool`) is described. Binds (or, for an address of
    one host, connects, as vLLM does) at once: an endpoint ZMQ refuses stops the router."""

    def __init__(self, replica, endpoint: str, replay_endpoint: str = "", topic: str = "", encoding: str = "map"):
        if encoding not in ENCODINGS:
            raise ValueError(f"unknown KV event encoding {encoding!r}")
        self.replica, self.topic, self.encoding = replica, topic.encode(), encoding
        self.seq, self.sent, self.dropped = 0, 0, 0
        self._ctx = zmq.Context()
        self._pub = self._socket(zmq.PUB, endpoint, "--kv-events-endpoint", HWM)
        self._replay = (
            self._socket(zmq.ROUTER, replay_endpoint, "--kv-events-replay-endpoint", REPLAY_BATCHES + 1)
            if replay_endpoint
            else None
        )
        self._kept: deque[tuple[int, bytes]] = deque(maxlen=REPLAY_BATCHES)
        self._encoder = msgspec.msgpack.Encoder()
        self._pool: PageManager | None | object = _FIRST  # not a pool: the first tick clears
        self._log: list[Change] = []
        self._cleared = False  # the last batch sent ended with AllBlocksCleared

    def _socket(self, kind: int, endpoint: str, flag: str, hwm: int) -> zmq.Socket:
        sock = self._ctx.socket(kind)
        sock.set_hwm(hwm)
        sock.setsockopt(zmq.LINGER, 0)
        local = "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))
        try:
            sock.bind(endpoint) if local or kind == zmq.ROUTER else sock.connect(endpoint)
        except zmq.ZMQError as e:
            self._ctx.destroy(linger=0)  # and every socket opened before this one
            raise SystemExit(f"{flag} {endpoint!r}: {e}") from None
        return sock

    # -- the publisher ------------------------------------------------------------------------------
    async def run(self) -> None:
        while True:
            self.tick()
            await asyncio.sleep(PERIOD_S)

    def tick(self) -> None:
        """Answers the replay requests waiting, then sends one batch of what changed since."""
        self._serve_replays()
        pool = self.replica.pool
        events: list[KVCacheEvent] = []
        if pool is not self._pool:  # its pages are gone with it, and what was not sent of them
            if isinstance(self._pool, PageManager):
                self._pool.unwatch(self._log)
            self._pool, self._log = pool, pool.watch() if pool is not None else []
            if not self._cleared:
                events.append(AllBlocksCleared())
        if self._log:
            events += events_of(self._log, pool.page_size)
            self._log.clear()
        if events:
            self._send(events)

    def _send(self, events: list[KVCacheEvent]) -> None:
        seq, self.seq = self.seq, self.seq + 1
        payload = encode_batch(self._encoder, events, self.encoding, time.time())
        self._kept.append((seq, payload))  # a batch PUB could not send can still be replayed
        self._cleared = isinstance(events[-1], AllBlocksCleared)
        try:
            self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload), zmq.NOBLOCK)
            self.sent += 1
        except zmq.ZMQError as e:
            self.dropped += 1
            if self.dropped & (self.dropped - 1) == 0:  # the 1st, 2nd, 4th, ... drop
                log.warning("KV event batch %d not sent (%s); %d dropped so far", seq, e, self.dropped)

    def _serve_replays(self) -> None:
        if self._replay is None:
            return
        while True:
            try:
                frames = self._replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            # [identity, b"", start seq] from a REQ (or a DEALER that frames it so), [identity,
            # start seq] from a bare DEALER; the answer goes back with the same envelope.
            *envelope, request = frames
            if len(request) != 8 or not 1 <= len(envelope) <= 2 or envelope[1:] not in ([], [b""]):
                continue
            start, first = int.from_bytes(request, "big"), self._kept[0][0] if self._kept else 0
            try:
                for seq, payload in itertools.islice(self._kept, max(0, start - first), None):
                    self._replay.send_multipart((*envelope, seq.to_bytes(8, "big"), payload), zmq.NOBLOCK)
                self._replay.send_multipart((*envelope, END_SEQ, b""), zmq.NOBLOCK)
            except zmq.ZMQError as e:  # the client is gone
                log.warning("a KV event replay was cut short: %s", e)

    def close(self) -> None:
        self._pub.close()
        if self._replay is not None:
            self._replay.close()
        self._ctx.term()
