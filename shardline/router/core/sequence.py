"""A request as the router tracks it: tokens, pages, progress and where its output goes."""

from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass, field

from opentelemetry.trace import Span

from shardline.router.core.constrained import Constrained
from shardline.router.core.proposers import Proposers


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    """Why a request ended, when it did not fail (a `Failure` says why it did)."""

    STOP = "stop"  # a stop string matched, or the constraint is complete
    EOS = "eos"  # the model's end-of-sequence token
    LENGTH = "length"  # max_new_tokens, or the model's context
    CANCELLED = "cancelled"  # by its client


@dataclass(frozen=True)
class Failure:
    """Why a request ended without finishing: a gRPC status code name and a message for the client."""

    code: str  # INTERNAL | UNAVAILABLE | INVALID_ARGUMENT ...
    message: str


Ending = FinishReason | Failure


def ending_label(end: Ending) -> str:
    """A finish reason's value, or a failure's status code in lower case ("internal")."""
    return end.code.lower() if isinstance(end, Failure) else end.value


@dataclass(frozen=True)
class Sampling:
    """How the shards draw a sequence's tokens, as they take it on its first step."""

    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0  # 1: off
    top_k: int = 0  # 0: off
    seed: int = 0
    logprobs: int | None = None  # alternatives to report per sampled token (None: no log-probabilities)


@dataclass(frozen=True)
class TokenLogprob:
    """log p(token_id) under the model's raw distribution, and the best alternatives, best first."""

    token_id: int
    logprob: float
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


@dataclass(frozen=True)
class Output:
    """What a step produced for one request; `finish_reason` or `failure` set on the last one."""

    token_ids: list[int]
    text: str = ""
    finish_reason: FinishReason | None = None
    failure: Failure | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token, when asked for
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # on the first output, when asked for
    stop: str | None = None  # on the last: the stop string the output ended at (not part of the text)


@dataclass(eq=False)
class SequencePages:
    """A sequence's share of the KV cache. Only the KV manager (kv_manager.py) writes it."""

    block_table: list[int] = field(default_factory=list)
    reserved: int = 0  # pages promised at admission and not yet taken
    prompt_hashes: list[bytes] | None = None  # chain hashes of the prompt's full pages
    published: list[bytes] = field(default_factory=list)  # hashes of block_table's published prefix
    # With a window pool (kv_manager.py): the windowed layers' pages of the same positions, those
    # the window no longer reaches being the pool size (the shards' padding page), and what is
    # left of that pool's reservation.
    window_table: list[int] = field(default_factory=list)
    window_reserved: int = 0


@dataclass(eq=False)
class Sequence:
    seq_id: int
    request_id: str
    prompt_ids: list[int]
    max_new_tokens: int
    sampling: Sampling  # its seed set (the server picks one where the request sets none)
    stop_token_ids: frozenset[int] = frozenset()
    arrival: float = field(default_factory=time.monotonic)
    admitted_at: float | None = None  # time.monotonic() of admission, first token, last two tokens
    first_token_at: float | None = None
    previous_token_at: float | None = None
    last_token_at: float | None = None
    status: Status = Status.WAITING
    output_ids: list[int] = field(default_factory=list)
    pages: SequencePages = field(default_factory=SequencePages)
    num_computed: int = 0  # tokens whose K/V is written on every shard
    cancelled: bool = False
    cached_prompt_tokens: int = 0
    cache_namespace: str = ""  # cached pages are shared only within one (common/auth.py)
    long_rope: bool = False  # its positions turn by the model's long rotary factors (shard.proto)
    tenant: str = ""
    priority: int = 0
    prompt_logprobs: int | None = None  # alternatives per prompt token; the prompt is then computed whole
    prompt_scores: list[TokenLogprob] = field(default_factory=list)  # of prompt tokens 1..
    outputs: asyncio.Queue = field(default_factory=asyncio.Queue)
    span: Span | None = None  # its trace span (observers/tracing.py), when tracing is on
    # Admitted only once this sequence's prompt is computed (its full pages cached) or it ended:
    # the n choices of one request share the first one's prompt pages through the prefix cache.
    after: Sequence | None = None
    constrained: Constrained | None = None  # its matcher, when it has a constraint
    speculative: bool = True  # its tokens may be proposed and verified (speculation.py)
    drafting: Proposers | None = None  # its proposers, once it decodes with speculation on

    @property
    def logprobs(self) -> int | None:
        """Alternatives to report per sampled token (None: no log-probabilities)."""
        return self.sampling.logprobs

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def max_tokens(self) -> int:
        return len(self.prompt_ids) + self.max_new_tokens
