"""The replica's `Stats`: counters kept by an observer of the engine (like metrics and traces),
and the live page pool and queue counts read from the scheduler when asked.

The counters are the router's own: they survive a replica reconnect, which starts a fresh pool
(the pool's prefix hit counters start again with it)."""
from __future__ import annotations

import statistics
from collections import deque

from shardline.protos import generation_pb2 as pb
from shardline.router.events import RequestEvents
from shardline.router.sequence import Ending, Failure, Sequence

STEP_WINDOW = 512  # recent decode steps the step-time medians cover


class StatsCounters(RequestEvents):
    def __init__(self):
        self.steps = 0
        self.tokens_generated = 0
        self.prompt_tokens_computed = 0
        self.requests_failed = 0
        self.decode_graph_launches = self.eager_decode_steps = 0   # summed over the shards
        self.mixed_steps = 0
        self.layer_group_steps = 0
        # Recent decode steps as (router wall ms, shard compute ms).
        self.decode_step_times: deque[tuple[float, float]] = deque(maxlen=STEP_WINDOW)

    def token(self, seq: Sequence, first: bool) -> None:
        self.tokens_generated += 1

    def finished(self, seq: Sequence, end: Ending) -> None:
        if isinstance(end, Failure):
            self.requests_failed += 1

    def step_started(self, step_id: int, step, plan) -> None:
        self.steps = step_id

    def step_done(self, step_id: int, step, result, wall_s: float) -> None:
        self.decode_graph_launches += result.graph_launches
        self.eager_decode_steps += result.eager_decode_steps
        if step.is_prefill:
            if not step.layer_end:  # a chunk's tokens count once, when its last layer ran
                self.prompt_tokens_computed += sum(len(inputs) for _, inputs in step.chunks)
            self.mixed_steps += step.num_decode > 0
            self.layer_group_steps += bool(step.layer_start or step.layer_end)
        else:
            self.decode_step_times.append((wall_s * 1e3, result.compute_ms))


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def stats_response(replica, counters: StatsCounters) -> pb.StatsResponse:
    st = pb.StatsResponse(serving=replica.serving, replica_failures=replica.failures,
                          replica_recoveries=replica.recoveries)
    if replica.engine is None:
        return st
    sched, pages, c = replica.engine.scheduler, replica.engine.scheduler.pages, counters
    st.MergeFrom(pb.StatsResponse(
        pages_total=pages.num_pages, pages_free=pages.free, pages_referenced=pages.referenced,
        pages_evictable=pages.evictable, pages_cached=pages.cached, pages_reserved=pages.reserved,
        pages_probation=len(pages.probation), pages_protected=len(pages.protected),
        prefix_hit_tokens=pages.hit_tokens, prefix_query_tokens=pages.query_tokens,
        requests_waiting=len(sched.waiting),
        requests_running=len(sched.prefilling) + len(sched.decoding),
        requests_prefilling=len(sched.prefilling), requests_decoding=len(sched.decoding),
        steps=c.steps, tokens_generated=c.tokens_generated, prompt_tokens_computed=c.prompt_tokens_computed,
        requests_failed=c.requests_failed, decode_graph_launches=c.decode_graph_launches,
        eager_decode_steps=c.eager_decode_steps, mixed_steps=c.mixed_steps,
        layer_group_steps=c.layer_group_steps,
        decode_step_ms_p50=_median([w for w, _ in c.decode_step_times]),
        shard_decode_step_ms_p50=_median([s for _, s in c.decode_step_times])))
    return st
