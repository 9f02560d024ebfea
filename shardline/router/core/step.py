"""What the scheduler (scheduler.py) answers for one step: its phase, one record per scheduled
sequence, and the layers it runs. The engine turns it into the step plan the shards run."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from shardline.router.core.sequence import Sequence


class Phase(enum.Enum):
    DECODE = "decode"
    CONTINUE = "continue"
    ADMIT = "admit"


@dataclass(eq=False)
class Scheduled:
    """One sequence's part of a step."""

    seq: Sequence
    tokens: list[int]  # the positions it computes: a decode row's last token, or a prompt chunk
    emit: bool  # it samples its next token (a decode row, or a prompt's final chunk)
    decode: bool  # a decode row, not a prompt chunk
    # Tokens proposed to follow `tokens` (speculation.py), computed as further positions; the
    # shards' answer says how many were accepted.
    proposals: list[int] = field(default_factory=list)
    accepted: int = 0


@dataclass
class Step:
    """What one step runs, one record per sequence: decode rows first, then prompt chunks, in
    `phase` (DECODE: a step of decode rows only; a mixed step's phase is its chunks')."""

    phase: Phase
    scheduled: list[Scheduled] = field(default_factory=list)
    # The layers it runs: every one, or those of a layer group (`Scheduler.layer_groups`) from
    # `layer_start` to `layer_end`, None being through the last layer: only a step that runs the
    # last layer computes its chunk's positions and may emit.
    layer_start: int = 0
    layer_end: int | None = None
    # Sent before the step ahead of it ended (`Scheduler.decode_ahead`): each decode row's input
    # is the token the shard samples for it in that step, so its `tokens` are [] until known.
    sampled_inputs: bool = False
    # W3C trace context (traceparent, tracestate) of the router's span of this step, set by the
    # tracing observer when the step starts: each shard's span of the step is its child.
    trace_context: dict[str, str] = field(default_factory=dict)

    @property
    def seqs(self) -> list[Sequence]:
        return [s.seq for s in self.scheduled]

    @property
    def is_prefill(self) -> bool:
        """Whether the step computes prompt chunks (a mixed step has decode rows too)."""
        return self.phase is not Phase.DECODE

    @property
    def partial(self) -> bool:
        """A layer group that stops short of the last layer: nothing is computed or sampled yet."""
        return self.layer_end is not None

    @property
    def num_decode(self) -> int:
        return sum(s.decode for s in self.scheduled)

    @property
    def num_tokens(self) -> int:
        """Positions the step computes (proposals included)."""
        if self.sampled_inputs:
            return len(self.scheduled)
        return sum(len(s.tokens) + len(s.proposals) for s in self.scheduled)

    @property
    def proposed(self) -> int:
        return sum(len(s.proposals) for s in self.scheduled)

    @property
    def accepted(self) -> int:
        """Proposals the shards accepted (known once the step is done)."""
        return sum(s.accepted for s in self.scheduled)

    @property
    def chunks(self) -> list[Scheduled]:
        """The step's prompt chunks."""
        return [s for s in self.scheduled if not s.decode]
