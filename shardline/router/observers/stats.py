"""The counters of the replica's `Stats`, kept by an observer of the engine (like metrics and
traces); the gRPC front end (api/generation.py) adds the live page pool and queue counts.

The counters are the router's own: they survive a replica reconnect, which starts a fresh pool
(the pool's prefix hit counters start again with it)."""

from __future__ import annotations

from collections import deque

from shardline.router.core.events import RequestEvents
from shardline.router.core.sequence import Ending, Failure, Sequence

STEP_WINDOW = 512  # recent decode steps the step-time medians cover


class StatsCounters(RequestEvents):
    def __init__(self):
        self.steps = 0
        self.tokens_generated = 0
        self.prompt_tokens_computed = 0
        self.requests_failed = 0
        self.decode_graph_launches = self.eager_decode_steps = 0  # summed over the shards
        self.mixed_steps = 0
        self.layer_group_steps = 0
        self.spec_proposed_tokens = self.spec_accepted_tokens = self.spec_verifications = 0
        # Recent decode steps as (router wall ms, shard compute ms).
        self.decode_step_times: deque[tuple[float, float]] = deque(maxlen=STEP_WINDOW)

    def token(self, seq: Sequence, first: bool) -> None:
        self.tokens_generated += 1

    def finished(self, seq: Sequence, end: Ending) -> None:
        if isinstance(end, Failure):
            self.requests_failed += 1

    def step_started(self, step_id: int, step) -> None:
        self.steps = step_id

    def step_done(self, step_id: int, step, result, wall_s: float) -> None:
        self.decode_graph_launches += result.graph_launches
        self.eager_decode_steps += result.eager_decode_steps
        self.spec_verifications += sum(1 for s in step.scheduled if s.proposals)
        self.spec_proposed_tokens += step.proposed
        self.spec_accepted_tokens += step.accepted
        if step.is_prefill:
            if not step.partial:  # a chunk's tokens count once, when its last layer ran
                self.prompt_tokens_computed += sum(len(chunk.tokens) for chunk in step.chunks)
            self.mixed_steps += step.num_decode > 0
            self.layer_group_steps += bool(step.layer_start or step.partial)
        else:
            self.decode_step_times.append((wall_s * 1e3, result.compute_ms))
