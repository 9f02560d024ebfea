"""What keeps a reconnect from wedging a multi-rank group (unit tests of one class each, with
stand-ins): a shard that is leaving its broken group takes no new work, and a group warmup that
fails on one shard closes the step streams the others opened.

The race they close: an abandoned shard lives on for half a second before it exits; a router
that reconnected at once got its Info, warmed its peer up (which then waited in a collective for
a minute), and every later attempt found a step stream still open."""

import asyncio

import grpc
import pytest

import shardline.shard.server as shard_server
from shardline.protos import shard_pb2
from shardline.router.core.shards import ShardError
from shardline.router.shards.group import ShardGroup


class Aborted(Exception):
    def __init__(self, code, details):
        super().__init__(details)
        self.code = code


class Context:
    def abort(self, code, details):
        raise Aborted(code, details)


def test_a_shard_leaving_its_group_takes_no_new_work(monkeypatch):
    monkeypatch.setattr(shard_server, "exit_soon", lambda seconds: None)  # not this test process
    service = shard_server.ShardService(
        runner=None, info=shard_pb2.ShardInfo(model="tiny"), grouped=True, decode_graphs=False, work=None
    )
    assert service.Info(shard_pb2.InfoRequest(), Context()).model == "tiny"
    service._leave_group_soon("the router abandoned the step stream")
    for call in (
        lambda: service.Info(shard_pb2.InfoRequest(), Context()),
        lambda: service.Warmup(shard_pb2.WarmupRequest(num_pages=1, max_batch=1), Context()),
        lambda: next(iter(service.Steps(iter([]), Context()))),
    ):
        with pytest.raises(Aborted) as refused:
            call()
        assert refused.value.code == grpc.StatusCode.UNAVAILABLE and "leaving its group" in str(refused.value)


class Warming:
    """Stands in for a ShardClient: its warmup opens a stream, or fails."""

    def __init__(self, fails: bool):
        self.fails, self.open = fails, False

    async def warmup(self, num_pages, max_batch, window_pages=0):
        await asyncio.sleep(0.05 if self.fails else 0.01)  # one warms up before the other fails
        if self.fails:
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), details="connect failed"
            )
        self.open = True
        return shard_pb2.WarmupResponse()

    async def close_stream(self, abandon: bool):
        assert not abandon  # a shard that warmed up keeps its state
        self.open = False


def test_a_failed_group_warmup_closes_the_streams_it_opened():
    group = ShardGroup([])
    group.shards = [Warming(fails=True), Warming(fails=False)]
    with pytest.raises(ShardError, match="failed its warmup: UNAVAILABLE connect failed"):
        asyncio.run(group.warmup(8, 1))
    assert not group.shards[1].open


class Answering:
    """Stands in for a ShardClient: answers Info as rank `rank` of the group start `group_id`."""

    def __init__(self, rank: int, group_id: str):
        self.reply = shard_pb2.ShardInfo(
            model="tiny", page_size=16, dtype="float32", tp_size=2, pp_size=1, tp_rank=rank, group_id=group_id
        )

    async def info(self, timeout):
        return self.reply

    async def close_stream(self, abandon: bool):
        pass


def test_ranks_of_two_starts_of_a_group_are_not_taken_as_one():
    """The rank that survived a kill -9 of its peer answers Info before it learns it must exit; its
    restarted peer answers too. Warming both up hung the new rank in a collective (seen in CI)."""
    group = ShardGroup([])
    group.shards = [Answering(0, "old"), Answering(1, "new")]
    with pytest.raises(ShardError, match="not one start of their process group"):
        asyncio.run(group.info(1))
    group.shards = [Answering(0, "new"), Answering(1, "new")]
    assert [i.tp_rank for i in asyncio.run(group.info(1))] == [0, 1]


def test_a_router_does_not_reconnect_to_the_group_it_abandoned():
    """Both ranks of the failed group may still answer before either exits: the router waits for
    the group's next start."""
    from shardline.router.core.replica import Replica
    from shardline.router.shards.link import ShardLink
    from tests.support import replica_config

    group = ShardGroup([])
    group.shards = [Answering(0, "failed"), Answering(1, "failed")]
    asyncio.run(group.info(1))  # it served, then failed: its streams are abandoned
    asyncio.run(group.close_streams(abandon=True))
    replica = Replica(replica_config(shard_timeout_s=1), "tiny", ShardLink(group), codec=None, on_serving=None)
    with pytest.raises(ShardError, match="has not restarted yet"):
        asyncio.run(replica._connect())
