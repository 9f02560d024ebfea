"""The gateway's parts one at a time: the choice, its view of a replica's cache stream, the
router's side of that stream, and failover before the first token."""

import asyncio
import random
from types import SimpleNamespace

import grpc
import pytest

from shardline.common.prefix_hash import prompt_hashes
from shardline.gateway.choice import LEAST_LOAD, PREFIX, ROUND_ROBIN, Candidate, Weights, rank
from shardline.gateway.replicas import Replica, Resync
from shardline.gateway.service import GatewayService
from shardline.protos import fleet_pb2 as fpb
from shardline.protos import generation_pb2 as pb
from shardline.router.api.fleet import CacheWatchers
from shardline.router.core.engine import Load
from shardline.router.core.page_manager import PageManager


def test_prefix_routing_prefers_the_cache_until_the_guard_spreads_a_hot_prefix():
    w, rng = Weights(load_weight=0.5, balance_abs=4, balance_rel=1.5), random.Random(0)
    cached = Candidate("a", cached_tokens=900, requests=3, queued_tokens=0)
    cold = Candidate("b", cached_tokens=0, requests=0, queued_tokens=0)
    assert [c.key for c in rank([cold, cached], 1000, w, rng)] == ["a", "b"]
    # Queued prefill work counts at the load weight: 0.5 x (2000 + 3 x 64) > the 900 tokens saved.
    busy = Candidate("a", cached_tokens=900, requests=3, queued_tokens=2000)
    assert [c.key for c in rank([cold, busy], 1000, w, rng)] == ["b", "a"]
    less_busy = Candidate("a", cached_tokens=900, requests=3, queued_tokens=600)
    assert [c.key for c in rank([cold, less_busy], 1000, w, rng)] == ["a", "b"]
    # 5 requests above the idle one and more than 1.5x its load: spread, whatever it caches.
    hot = Candidate("a", cached_tokens=1000, requests=5, queued_tokens=0)
    assert [c.key for c in rank([cold, hot], 1000, w, rng)] == ["b", "a"]
    assert [c.key for c in rank([Candidate("b", 0, 2, 0), hot], 1000, w, rng)] == ["a", "b"]  # within the guard


def test_a_new_prefix_goes_where_it_evicts_no_other():
    w, rng = Weights(load_weight=0.25), random.Random(0)
    full = Candidate("a", cached_tokens=0, requests=1, queued_tokens=0, unused_tokens=0)
    room = Candidate("b", cached_tokens=0, requests=2, queued_tokens=0, unused_tokens=4096)
    assert [c.key for c in rank([full, room], 512, w, rng)] == ["b", "a"]  # 512 + 512 evicted + 16 > 512 + 32
    assert [c.key for c in rank([full, room], 512, w, rng, LEAST_LOAD)] == ["a", "b"]


def test_ties_break_at_random_and_the_other_policies_ignore_the_cache():
    w, rng = Weights(), random.Random(0)
    same = [Candidate(k, 0, 0, 0) for k in "abcd"]
    firsts = {rank(same, 100, w, rng)[0].key for _ in range(200)}
    assert firsts == set("abcd")
    cands = [Candidate("a", 1000, 2, 0), Candidate("b", 0, 1, 0)]
    assert rank(cands, 1000, w, rng, LEAST_LOAD)[0].key == "b"
    assert [rank(cands, 1000, w, rng, ROUND_ROBIN, turn)[0].key for turn in range(4)] == ["a", "b", "a", "b"]
    assert rank(cands, 1000, w, rng, PREFIX)[0].key == "a"


def _replica() -> Replica:
    return Replica("r:1", channel=None, stub=None)


def test_a_replicas_view_follows_its_stream_and_a_gap_asks_for_a_resync():
    r = _replica()
    hashing = fpb.PageHashing(page_size=4, model_key="m", tenants_share_cache=False)
    prompt = list(range(13))
    hashes = prompt_hashes(prompt, 4, "m", "7:charlie:")
    r.apply(fpb.CacheEvent(epoch="e1", seq=5, snapshot=True, hashing=hashing, published=hashes[:1]))
    tenant = lambda shared: "" if shared else "7:charlie:"  # noqa: E731
    assert r.cached_tokens(r.hashes(prompt, tenant)) == 4
    r.apply(fpb.CacheEvent(epoch="e1", seq=6, published=hashes[1:]))
    assert r.cached_tokens(r.hashes(prompt, tenant)) == 12
    assert r.cached_tokens(r.hashes(prompt, lambda shared: "")) == 0  # another namespace: nothing
    r.apply(fpb.CacheEvent(epoch="e1", seq=7, evicted=hashes[1:2]))
    assert r.cached_tokens(r.hashes(prompt, tenant)) == 4  # a prefix stops at its first missing page
    with pytest.raises(Resync):
        r.apply(fpb.CacheEvent(epoch="e1", seq=9, published=hashes[1:2]))
    with pytest.raises(Resync):
        r.apply(fpb.CacheEvent(epoch="e2", seq=1))
    r.apply(fpb.CacheEvent(epoch="e2", seq=0, snapshot=True, hashing=hashing))  # a restarted router
    assert r.cached_tokens(r.hashes(prompt, tenant)) == 0 and not r.index
    # A prompt the gateway sent here counts as coming while its request is open, not as indexed.
    r.open(hashes, uncached=13)
    r.open(hashes[:1], uncached=5)
    assert r.cached_tokens(hashes, pending=True) == 12 and r.cached_tokens(hashes) == 0
    r.close(hashes, 13, had_first_token=False)
    assert r.cached_tokens(hashes, pending=True) == 4  # the other open request still computes page 0
    r.close(hashes[:1], 5, had_first_token=True)
    assert not r.pending and r.in_flight == 0


def test_the_router_streams_its_index_changes_and_a_new_pool_starts_a_new_epoch():
    pages = PageManager(4, 2, model_key="m")
    replica = SimpleNamespace(
        pool=pages,
        load=lambda: Load(waiting=0, prefilling=0, decoding=0, prompt_tokens_queued=0),
        serving=True,
        accepting=True,
    )
    watchers = CacheWatchers(replica, tenants_share_cache=False)
    queue: asyncio.Queue = asyncio.Queue()
    watchers._queues.add(queue)
    watchers.tick()
    first = queue.get_nowait()
    assert first.snapshot and first.seq == 0 and first.hashing.page_size == 2 and not first.published
    assert pages.admit([], 4, 8)
    block = [pages.allocate() for _ in range(4)]
    h = pages.prompt_hashes(list(range(9)))
    for i, page in enumerate(block):
        pages.publish(page, h[i], block[i - 1] if i else None)
    pages.release(block)
    watchers.tick()
    event = queue.get_nowait()
    assert (event.epoch, event.seq, set(event.published), list(event.evicted)) == (first.epoch, 1, set(h), [])
    watchers.tick()
    assert queue.empty()  # nothing changed, no heartbeat due yet
    assert pages.admit([], 1, 2)
    pages.allocate()  # reclaims the oldest evictable page: its hash is gone
    watchers.tick()
    event = queue.get_nowait()
    assert event.seq == 2 and len(event.evicted) == 1 and not event.published
    assert event.load.requests_running == 0 and event.load.pages_total == 4
    assert event.load.pages_unused == 0 and event.load.pages_free == 3  # 3 evictable pages still hold the prefix
    snap = watchers.snapshot()
    assert set(snap.published) == set(h) - set(event.evicted)
    replica.pool = PageManager(4, 2, model_key="m")  # the replica reconnected
    watchers.tick()
    fresh = queue.get_nowait()
    assert fresh.snapshot and fresh.epoch != first.epoch and not fresh.published


class _Call:
    """A replica's Generate call: yields `replies` (serialized, as the gateway's call does), then
    raises `error`."""

    def __init__(self, replies, error=None):
        self.replies, self.error, self.cancelled = replies, error, False

    def __aiter__(self):
        return self._run()

    async def _run(self):
        for r in self.replies:
            yield r.SerializeToString()
        if self.error is not None:
            raise self.error

    def cancel(self):
        self.cancelled = True


def _unavailable():
    return grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "gone")


class _Aborted(Exception):
    pass


class _Context:
    def invocation_metadata(self):
        return ()

    def time_remaining(self):
        return 30.0

    async def abort(self, code, details):
        raise _Aborted(code, details)


def _service(calls: dict[str, _Call]) -> GatewayService:
    replicas = []
    for address, call in calls.items():
        r = Replica(address, channel=None, stub=None, generate=lambda *a, call=call, **k: call)
        r.connected, r.heard_at = True, float("inf")
        r.load, r.hashing = fpb.Load(serving=True), fpb.PageHashing(page_size=4, model_key="m")
        replicas.append(r)
    fleet = SimpleNamespace(routable=lambda: replicas)
    return GatewayService(fleet, codec=None, keys=None, weights=Weights(), policy=ROUND_ROBIN)


async def _collect(service, request):
    return [m async for m in service.Generate(request, _Context())]


def test_unavailable_before_the_first_token_is_retried_once_on_another_replica():
    ok = pb.GenerateResponse(token_ids=[1], finish_reason="length")
    calls = {"a": _Call([], _unavailable()), "b": _Call([ok])}
    service = _service(calls)
    request = pb.GenerateRequest(prompt_token_ids=pb.PromptTokens(ids=[1, 2, 3]), max_new_tokens=1)
    assert asyncio.run(_collect(service, request)) == [ok.SerializeToString()]
    a, b = service.replicas.routable()
    assert (a.counters.failovers, b.counters.failovers) == (1, 0)
    assert a.in_flight == b.in_flight == 0 and a.pending_tokens == b.pending_tokens == 0
    assert request.request_id  # the gateway named it, so a Cancel finds it


def test_a_failure_after_the_first_token_reaches_the_client():
    calls = {"a": _Call([pb.GenerateResponse(token_ids=[1])], _unavailable()), "b": _Call([pb.GenerateResponse()])}
    service = _service(calls)
    got = []

    async def run():
        async for m in service.Generate(
            pb.GenerateRequest(prompt_token_ids=pb.PromptTokens(ids=[1]), max_new_tokens=2), _Context()
        ):
            got.append(m)

    with pytest.raises(_Aborted) as err:
        asyncio.run(run())
    assert err.value.args[0] == grpc.StatusCode.UNAVAILABLE and len(got) == 1
    assert all(r.counters.failovers == 0 for r in service.replicas.routable())
    assert calls["a"].cancelled


def test_the_gateway_refuses_bytes_that_do_not_parse_and_an_id_already_running():
    from shardline.common.generation_service import parser

    service = _service({"a": _Call([pb.GenerateResponse(token_ids=[1], finish_reason="length")])})

    async def run(request):
        return [m async for m in service.Generate(request, _Context())]

    with pytest.raises(_Aborted) as err:
        asyncio.run(run(parser(pb.GenerateRequest)(b"\xff\xff\xff")))
    assert err.value.args[0] == grpc.StatusCode.INVALID_ARGUMENT and "does not parse" in err.value.args[1]
    service._running[("", "taken")] = service.replicas.routable()[0]
    with pytest.raises(_Aborted) as err:
        asyncio.run(run(pb.GenerateRequest(request_id="taken", prompt_token_ids=pb.PromptTokens(ids=[1]))))
    assert err.value.args[0] == grpc.StatusCode.ALREADY_EXISTS
    del service._running[("", "taken")]
    assert len(asyncio.run(run(pb.GenerateRequest(request_id="taken", prompt_token_ids=pb.PromptTokens(ids=[1]))))) == 1
    assert not service._running  # released when its stream ended


def test_a_watcher_that_falls_behind_gets_a_snapshot_instead_of_its_backlog(monkeypatch):
    from shardline.router.api import fleet

    pages = PageManager(4, 2, model_key="m")
    replica = SimpleNamespace(
        pool=pages,
        load=lambda: Load(waiting=0, prefilling=0, decoding=0, prompt_tokens_queued=0),
        serving=True,
        accepting=True,
    )
    watchers = CacheWatchers(replica, tenants_share_cache=True)
    watchers.tick()
    queue: asyncio.Queue = asyncio.Queue()
    watchers._queues.add(queue)
    monkeypatch.setattr(fleet, "WATCHER_BACKLOG", 3)
    for serving in (False, True, False, True):  # four changes of the load, never read
        replica.serving = serving
        watchers.tick()
    got = [queue.get_nowait() for _ in range(queue.qsize())]
    (snapshot,) = got  # three deltas, then the fourth found a full backlog: one snapshot for all
    assert snapshot.snapshot and snapshot.seq == watchers.seq == 4 and snapshot.hashing.tenants_share_cache


def test_the_replica_set_follows_what_its_entries_resolve_to():
    from shardline.gateway.replicas import Replicas, _resolve

    assert _resolve("localhost:50051") == ["127.0.0.1:50051"]
    assert _resolve("no-such-host.invalid:1") == []

    async def run():
        changes = []
        fleet = Replicas(["localhost:1"], 5.0, lambda: changes.append(1))
        fleet._update({"127.0.0.1:1": "localhost", "127.0.0.2:1": "localhost"})
        assert (
            sorted(fleet.by_address) == ["127.0.0.1:1", "127.0.0.2:1"] and fleet.host_of("127.0.0.2:1") == "localhost"
        )
        first = fleet.by_address["127.0.0.1:1"]
        fleet._update({"127.0.0.2:1": "localhost"})  # a pod gone from the headless Service
        assert list(fleet.by_address) == ["127.0.0.2:1"] and changes
        await asyncio.sleep(0)
        assert first.task.cancelled() or first.task.done()
        assert not fleet.routable()  # nothing answers there
        await fleet.close()

    asyncio.run(run())
