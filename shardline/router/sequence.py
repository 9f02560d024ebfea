"""A request as the router tracks it: tokens, pages, progress and where its output goes."""
from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass, field


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    """Why a request ended, when it did not fail (a `Failure` says why it did)."""

    STOP = "stop"            # a stop string matched, or the constraint is complete
    EOS = "eos"              # the model's end-of-sequence token
    LENGTH = "length"        # max_new_tokens, or the model's context
    CANCELLED = "cancelled"  # by its client


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0


@dataclass(frozen=True)
class Failure:
    """Why a request ended without finishing: a gRPC status code name and a message for the client."""

    code: str        # INTERNAL | UNAVAILABLE | INVALID_ARGUMENT ...
    message: str


Ending = FinishReason | Failure


def ending_label(end: Ending) -> str:
    """A finish reason's value, or a failure's status code in lower case ("internal")."""
    return end.code.lower() if isinstance(end, Failure) else end.value


@dataclass(frozen=True)
class Output:
    """What a step produced for one request; `finish_reason` or `failure` set on the last one."""

    token_ids: list[int]
    text: str = ""
    finish_reason: FinishReason | None = None
    failure: Failure | None = None
    logprobs: list = field(default_factory=list)         # shard TokenLogprobs, one per token
    prompt_logprobs: list = field(default_factory=list)  # on the first output, when asked for


@dataclass(eq=False)
class Sequence:
    seq_id: int
    request_id: str
    prompt_ids: list[int]
    max_new_tokens: int
    sampling: Sampling
    stop_token_ids: frozenset[int] = frozenset()
    arrival: float = field(default_factory=time.monotonic)
    admitted_at: float | None = None      # time.monotonic() of admission, first token, last two tokens
    first_token_at: float | None = None
    previous_token_at: float | None = None
    last_token_at: float | None = None
    status: Status = Status.WAITING
    output_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    reserved_pages: int = 0       # pages promised at admission and not yet taken
    num_computed: int = 0         # tokens whose K/V is written on every shard
    cancelled: bool = False
    cached_prompt_tokens: int = 0
    cache_namespace: str = ""     # cached pages are shared only within one (common/auth.py)
    tenant: str = ""
    priority: int = 0
    logprobs: int | None = None          # alternatives to report per sampled token (None: no logprobs)
    prompt_logprobs: int | None = None   # likewise per prompt token; the prompt is then computed whole
    prompt_scores: list = field(default_factory=list)  # shard TokenLogprobs of prompt tokens 1..
    prompt_hashes: list[bytes] | None = None   # chain hashes of the prompt's full pages
    page_hashes: list[bytes] = field(default_factory=list)  # of block_table's published prefix
    outputs: asyncio.Queue = field(default_factory=asyncio.Queue)
    span: object | None = None   # its trace span (router/tracing.py), when tracing is on
    # Admitted only once this sequence's prompt is computed (its full pages cached) or it ended:
    # the n choices of one request share the first one's prompt pages through the prefix cache.
    after: "Sequence | None" = None
    constrained: object | None = None   # its router.constraints.Constrained, when it has a constraint

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def max_tokens(self) -> int:
        return len(self.prompt_ids) + self.max_new_tokens
