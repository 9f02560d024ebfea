"""What keeps a reconnect from wedging a multi-rank group (unit tests of one class each, with
stand-ins): a shard that is leaving its broken group takes no new work, and a group warmup that
fails on one shard closes the step streams the others opened.

The race they close: an abandoned shard lives on for half a second before it exits; a router
that reconnected at once got its Info, warmed its peer up (which then waited in a collective for
a minute), and every later attempt found a step stream still open."""
import asyncio

import grpc
import pytest

from protos import shard_pb2
from router.shard_client import ShardError, ShardGroup
import shard.server as shard_server


class Aborted(Exception):
    def __init__(self, code, details):
        super().__init__(details)
        self.code = code


class Context:
    def abort(self, code, details):
        raise Aborted(code, details)


def test_a_shard_leaving_its_group_takes_no_new_work(monkeypatch):
    monkeypatch.setattr(shard_server, "exit_soon", lambda seconds: None)  # not this test process
    service = shard_server.ShardService(runner=None, info=shard_pb2.ShardInfo(model="tiny"), grouped=True,
                                        decode_graphs=False, work=None)
    assert service.Info(shard_pb2.InfoRequest(), Context()).model == "tiny"
    service._leave_group_soon("the router abandoned the step stream")
    for call in (lambda: service.Info(shard_pb2.InfoRequest(), Context()),
                 lambda: service.Warmup(shard_pb2.WarmupRequest(num_pages=1, max_batch=1), Context()),
                 lambda: next(iter(service.Steps(iter([]), Context())))):
        with pytest.raises(Aborted) as refused:
            call()
        assert refused.value.code == grpc.StatusCode.UNAVAILABLE and "leaving its group" in str(refused.value)


class Warming:
    """Stands in for a ShardClient: its warmup opens a stream, or fails."""

    def __init__(self, fails: bool):
        self.fails, self.open = fails, False

    async def warmup(self, num_pages, max_batch):
        await asyncio.sleep(0.05 if self.fails else 0.01)  # one warms up before the other fails
        if self.fails:
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                       details="connect failed")
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
