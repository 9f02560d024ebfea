"""KV cache events in vLLM's wire format (router/api/kv_events.py), read by a subscriber written from
vLLM's own example (examples/features/kv_events/kv_events_subscriber.py): its types are declared
here as vLLM declares them, so a field or an encoding that differs from vLLM's fails to decode.

The page manager's change logs and the publisher's batches are tested in process; one server
(a tiny model with a pool small enough to reclaim) is then driven through prefix reuse, reclaim
and a restart of its shard group while the subscriber mirrors its index, which must end as the
router's own prefix index (its Fleet snapshot); a gap is filled through the replay socket."""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from types import SimpleNamespace
from typing import Any

import grpc
import httpx
import msgspec
import pytest
import zmq
from msgspec.msgpack import Decoder

from shardline.processes import free_ports
from shardline.protos import fleet_pb2 as fpb
from shardline.protos import fleet_pb2_grpc
from shardline.protos import generation_pb2 as pb
from shardline.router.api.kv_events import KvEventPublisher, events_of, external_hash
from shardline.router.core.page_manager import Change, PageManager
from tests.support import Server, health_status, wait_for

ExternalBlockHash = bytes | int  # vllm.v1.core.kv_cache_utils


# -- vLLM's types (vllm/distributed/kv_events.py, main after vllm-project/vllm#42892) --------------
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base class for all KV cache-related events"""


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
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
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODER = Decoder(type=KVEventBatch)
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def replay(endpoint: str, start: int, timeout_ms: int = 5000, delimited: bool = True) -> list[tuple[int, bytes]]:
    """Every batch the replay socket keeps from `start` on. The request is vLLM's (8 bytes
    big-endian after an empty delimiter, as a REQ socket frames it); a DEALER reads the many
    replies, where a REQ socket (as in vLLM's example) takes the first and drops the rest.
    `delimited` False: a bare DEALER's request, without the delimiter."""
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart([b"", start.to_bytes(8, "big")] if delimited else [start.to_bytes(8, "big")])
        got = []
        while dealer.poll(timeout_ms):
            *delimiter, seq_bytes, payload = dealer.recv_multipart()
            assert delimiter == ([b""] if delimited else [])
            if not payload:  # the end marker
                assert seq_bytes == END_SEQ
                return got
            got.append((int.from_bytes(seq_bytes, "big"), payload))
        raise AssertionError("the replay never ended")
    finally:
        dealer.close()


class Mirror:
    """A subscriber's copy of one replica's cached pages, from its events alone (what llm-d's and
    Dynamo's indexers keep): every batch decoded, none missed (a gap is filled by replay)."""

    def __init__(self, endpoint: str, replay_endpoint: str, topic: bytes = b"kv@"):
        self.replay_endpoint = replay_endpoint
        self.pages: set[int] = set()
        self.payloads: dict[int, bytes] = {}
        self.last_seq, self.replayed, self.counts = -1, 0, {"stored": 0, "removed": 0, "cleared": 0}
        self.topics: set[bytes] = set()
        self.sub = zmq.Context.instance().socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        self.sub.connect(endpoint)
        self.stop, self.error = threading.Event(), None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        try:
            while not self.stop.is_set():
                if self.sub.poll(50):
                    topic, seq_bytes, payload = self.sub.recv_multipart()
                    self.topics.add(topic)
                    seq = int.from_bytes(seq_bytes, "big")
                    if seq > self.last_seq + 1:  # missed some (a late joiner misses the first ones)
                        for missed, missed_payload in replay(self.replay_endpoint, self.last_seq + 1):
                            if self.last_seq < missed < seq:
                                self.replayed += 1
                                self._apply(missed, missed_payload)
                    assert seq == self.last_seq + 1, f"batch {seq} after {self.last_seq}: a gap replay did not fill"
                    self._apply(seq, payload)
        except BaseException as e:  # noqa: BLE001 (reported by the test)
            self.error = e

    def _apply(self, seq: int, payload: bytes) -> None:
        batch = DECODER.decode(payload)
        assert batch.data_parallel_rank == 0
        for event in batch.events:
            if isinstance(event, BlockStored):
                assert event.parent_block_hash is None or event.parent_block_hash in self.pages, "an orphan"
                assert len(event.token_ids) == event.block_size * len(event.block_hashes)
                assert event.medium == "GPU" and event.lora_name is None
                self.pages.update(event.block_hashes)
                self.counts["stored"] += len(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                assert set(event.block_hashes) <= self.pages, "removed what was never stored"
                self.pages.difference_update(event.block_hashes)
                self.counts["removed"] += len(event.block_hashes)
            else:
                self.pages.clear()
                self.counts["cleared"] += 1
        self.payloads[seq] = payload
        self.last_seq = seq

    def close(self):
        self.stop.set()
        self.thread.join(5)
        self.sub.close()


# -- in process ------------------------------------------------------------------------------------
def _publish_chain(m: PageManager, prompt: list[int]) -> list[int]:
    hashes = m.prompt_hashes(prompt + [0])
    assert m.admit([], len(hashes), len(prompt))
    pages = [m.allocate() for _ in hashes]
    for i, (page, h) in enumerate(zip(pages, hashes)):
        m.publish(page, h, pages[i - 1] if i else None, prompt[i * m.page_size : (i + 1) * m.page_size])
    return pages


def test_every_change_of_the_index_reaches_every_log_with_its_parent_and_tokens():
    m = PageManager(4, 2, model_key="m")
    assert not m.logs  # nobody listens: nothing is recorded
    m.release(_publish_chain(m, [1, 2]))
    first, second = m.watch(), m.watch()
    pages = _publish_chain(m, [5, 6, 7, 8])
    h = m.prompt_hashes([5, 6, 7, 8, 0])
    want = [Change(True, h[0], None, [5, 6]), Change(True, h[1], h[0], [7, 8])]
    assert first == second == want and first[0] is second[0]  # one record, shared by the logs
    m.release(pages)
    first.clear()
    m.unwatch(second)
    assert m.admit([], 3, 6)
    taken = [m.allocate() for _ in range(3)]  # the free page, then the oldest evictable ones
    gone = [m.prompt_hashes([1, 2, 0])[0], h[1]]  # [1, 2]'s page, then [5, 6, 7, 8]'s tail
    assert first == [Change(False, x) for x in gone] and second == want
    first.clear()
    m.release(taken)
    assert m.reset() and first == [Change(False, h[0])]
    m.check()


def test_a_chain_is_one_block_stored_and_removals_one_block_removed():
    h = [bytes([i]) * 16 for i in range(4)]
    changes = [
        Change(True, h[0], None, [1, 2]),
        Change(True, h[1], h[0], [3, 4]),
        Change(True, h[3], h[2], [7, 8]),  # another chain
        Change(False, h[3]),
        Change(False, h[1]),
    ]
    stored, other, removed = events_of(changes, 2)
    assert stored.block_hashes == [external_hash(h[0]), external_hash(h[1])] and stored.parent_block_hash is None
    assert stored.token_ids == [1, 2, 3, 4] and stored.block_size == 2
    assert other.parent_block_hash == external_hash(h[2]) and removed.block_hashes == [
        external_hash(x) for x in h[3:0:-2]
    ]
    assert external_hash(b"\x00" * 8 + b"\x01" * 8) == int.from_bytes(b"\x01" * 8, "big")  # the low 64 bits


def test_the_publisher_sends_vllms_batches_and_replays_them():
    pub_port, replay_port = free_ports(2)
    pool = PageManager(4, 2, model_key="m")
    replica = SimpleNamespace(pool=None)
    kv = KvEventPublisher(replica, f"tcp://*:{pub_port}", f"tcp://*:{replay_port}", "kv@10.0.0.7:8000@tiny")
    try:
        kv.tick()  # the first start: cleared
        replica.pool = pool
        kv.tick()  # a new pool after a clear already sent: nothing
        pages = _publish_chain(pool, [5, 6, 7, 8])
        kv.tick()
        pool.release(pages)
        replica.pool = PageManager(4, 2, model_key="m")  # a reconnect
        kv.tick()
        kv.tick()  # nothing changed: nothing sent
        assert (kv.seq, kv.sent, kv.dropped) == (3, 3, 0)
        batches: list = []

        def ask(start, delimited):
            batches.append(replay(f"tcp://127.0.0.1:{replay_port}", start, delimited=delimited))

        for start, delimited in ((1, True), (2, False)):
            asker = threading.Thread(target=ask, args=(start, delimited))
            asker.start()
            wait_for(lambda t=asker: kv.tick() or not t.is_alive(), 10, "the replay")  # answered between ticks
        batches, bare = batches
        assert [seq for seq, _ in batches] == [1, 2] and bare == batches[1:]
        stored, cleared = (DECODER.decode(p).events for _, p in batches)
        (event,) = stored
        assert event.block_hashes == [external_hash(h) for h in pool.prompt_hashes([5, 6, 7, 8, 0])]
        assert event.token_ids == [5, 6, 7, 8] and isinstance(cleared[0], AllBlocksCleared)
        assert pool.logs == []  # the old pool is no longer watched
    finally:
        kv.close()
    with pytest.raises(SystemExit, match="--kv-events-endpoint 'tcp://\\*:nope'"):
        KvEventPublisher(replica, "tcp://*:nope")
    taken = KvEventPublisher(replica, f"tcp://*:{pub_port}")
    try:
        with pytest.raises(SystemExit, match=f"--kv-events-replay-endpoint 'tcp://\\*:{pub_port}'"):
            KvEventPublisher(replica, f"tcp://*:{replay_port}", f"tcp://*:{pub_port}")
    finally:
        taken.close()


# -- one server -------------------------------------------------------------------------------------
PAGE, PAGES = 8, 32


@pytest.fixture(scope="module")
def server(tiny_models):
    pub_port, replay_port = free_ports(2)
    server = Server(
        "--model",
        str(tiny_models["llama"]),
        "--page-size",
        str(PAGE),
        "--num-pages",
        str(PAGES),
        "--kv-events-endpoint",
        f"tcp://*:{pub_port}",
        "--kv-events-replay-endpoint",
        f"tcp://*:{replay_port}",
        "--served-model-name",
        "tiny-llama",
    )
    server.kv_endpoints = f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{replay_port}"
    yield server
    assert server.stop() == 0


@pytest.mark.processes
def test_a_subscriber_mirrors_the_prefix_index_through_reuse_reclaim_and_a_restart(server):
    mirror = Mirror(*server.kv_endpoints)
    rng = random.Random(7)
    system = [rng.randrange(10, 250) for _ in range(3 * PAGE)]

    def generate(prompt):
        server.generate(prompt_token_ids=pb.PromptTokens(ids=prompt), max_new_tokens=PAGE + 1, ignore_eos=True)

    def workload(n):
        for i in range(n):  # followers of one prefix, and one-use prompts that push it out
            shared = i % 2 == 0
            generate((system if shared else []) + [rng.randrange(10, 250) for _ in range(4 * PAGE + 3)])

    def index_mirrored() -> set[int]:
        """The router's prefix index (its Fleet snapshot), once the subscriber holds exactly it."""
        server.wait_idle()
        with grpc.insecure_channel(server.target) as channel:
            snapshot = next(iter(fleet_pb2_grpc.FleetStub(channel).WatchCache(fpb.WatchCacheRequest(), timeout=10)))
        indexed = {external_hash(h) for h in snapshot.published}
        wait_for(lambda: mirror.error or mirror.pages == indexed, 10, "the subscriber to hold the router's index")
        assert mirror.error is None, mirror.error
        assert mirror.pages == indexed and len(indexed) > 0
        return indexed

    try:
        workload(12)
        index_mirrored()
        removed = mirror.counts["removed"]
        assert removed > 0  # the pool is smaller than the workload: pages were reclaimed
        (shard,) = server.shard_pids()
        os.kill(shard, signal.SIGKILL)  # `serve` restarts the group; the router starts a new pool
        wait_for(lambda: server.stats().replica_recoveries == 1, 90, "the shard group to be back")
        wait_for(lambda: health_status(server.channel) == 1, 30, "the replica to serve again")
        workload(12)
        index_mirrored()
        assert mirror.counts["removed"] > removed, mirror.counts  # reclaimed in the new pool too
        assert mirror.counts["cleared"] == 2, mirror.counts  # the first start, the group's failure
        assert mirror.replayed > 0  # the first batches went out before the subscriber joined
        assert mirror.topics == {f"kv@127.0.0.1:{server.http_port}@tiny-llama".encode()}
        # The replay socket keeps every batch sent: the same bytes the subscriber was sent.
        again = dict(replay(server.kv_endpoints[1], 0))
        assert again == mirror.payloads and min(again) == 0
        assert isinstance(DECODER.decode(again[0]).events[0], AllBlocksCleared)  # the first start
    finally:
        mirror.close()


@pytest.mark.processes
def test_the_metrics_an_endpoint_picker_reads_from_vllm(server):
    text = httpx.get(server.http_url.removesuffix("/v1") + "/metrics", timeout=10).text
    for name in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"):
        assert f"\n{name} " in text, name
    assert f'vllm:cache_config_info{{block_size="{PAGE}",num_gpu_blocks="{PAGES}"}} 1.0' in text
    assert 'vllm:lora_requests_info{max_lora="0",running_lora_adapters="",waiting_lora_adapters=""}' in text
    time.sleep(0)  # (the values are read at scrape time: nothing to wait for)


def test_the_topic_and_the_endpoints_of_several_replicas(monkeypatch):
    from shardline.replica_set import offset_endpoint
    from shardline.router.api.kv_events import topic_of

    monkeypatch.delenv("POD_IP", raising=False)
    assert topic_of("kv@{pod_ip}:{port}@{model}", "0.0.0.0", 8000, "m") == "kv@127.0.0.1:8000@m"
    assert topic_of("kv@{pod_ip}:{port}@{model}", "10.1.2.3", 8000, "m") == "kv@10.1.2.3:8000@m"
    monkeypatch.setenv("POD_IP", "10.9.9.9")
    assert topic_of("kv@{pod_ip}@{model}", "0.0.0.0", 8000, "m") == "kv@10.9.9.9@m"
    with pytest.raises(SystemExit, match="--kv-events-topic 'kv@{pod}'"):
        topic_of("kv@{pod}", "0.0.0.0", 8000, "m")
    assert [offset_endpoint("tcp://*:5557", n) for n in range(3)] == ["tcp://*:5557", "tcp://*:5558", "tcp://*:5559"]
    assert offset_endpoint("ipc:///tmp/kv", 2) == "ipc:///tmp/kv_dp2" and offset_endpoint("", 3) == ""
