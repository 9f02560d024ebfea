"""Which replica serves a request: plain data in, an order of preference out.

Prefix-aware routing ranks the replicas by the cost of serving the request there,

    cost = prompt tokens not cached there + cached tokens their pages would evict there
           + load_weight x load there,
    load = prompt tokens queued there + REQUEST_TOKENS x requests running or waiting there,

in tokens of prefill work, lowest first, ties broken at random. A load_weight below 1 keeps a
prompt's followers with the replica that caches it while that replica is merely busier: computing
the prefix again elsewhere would make this request's first token sooner, but every later one's
later, as both replicas then hold (and evict for) the same pages. The eviction term sends a new
prefix where pages are unused rather than where it would push other prefixes out (which their
followers would then compute again). The imbalance guard (as SGLang's
cache-aware router has it) keeps a hot prefix from piling onto one replica: a replica with more
than `balance_abs` requests above the least loaded one, and more than `balance_rel` times its
requests, is ranked after every other one, by load, whatever it caches. The rest of the order
is where a request goes when its first choice fails before its first token.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

PREFIX, LEAST_LOAD, ROUND_ROBIN = "prefix", "least-load", "round-robin"
REQUEST_TOKENS = 64  # the load one request in flight counts as, in prompt tokens
POLICIES = (PREFIX, LEAST_LOAD, ROUND_ROBIN)


@dataclass(frozen=True)
class Candidate:
    key: str  # the replica's address
    cached_tokens: int  # of this prompt, in the replica's prefix index
    requests: int  # running and waiting there
    queued_tokens: int  # prompt tokens still to compute there
    unused_tokens: int = 1 << 62  # tokens of pages that hold no cached prefix there


@dataclass(frozen=True)
class Weights:
    load_weight: float = 0.25
    balance_abs: int = 8
    balance_rel: float = 1.5


def overloaded(c: Candidate, least: int, w: Weights) -> bool:
    return c.requests - least > w.balance_abs and c.requests > w.balance_rel * least


def rank(
    candidates: list[Candidate], prompt_tokens: int, w: Weights, rng: random.Random, policy: str = PREFIX, turn: int = 0
) -> list[Candidate]:
    """The candidates, best first. `turn`: the request's number, for round-robin."""
    if not candidates:
        return []
    if policy == ROUND_ROBIN:
        ordered = sorted(candidates, key=lambda c: c.key)
        i = turn % len(ordered)
        return ordered[i:] + ordered[:i]
    noise = {c.key: rng.random() for c in candidates}
    if policy == LEAST_LOAD:
        return sorted(candidates, key=lambda c: (c.requests, c.queued_tokens, noise[c.key]))
    least = min(c.requests for c in candidates)
    fit = [c for c in candidates if not overloaded(c, least, w)]
    hot = [c for c in candidates if overloaded(c, least, w)]

    def cost(c: Candidate) -> float:
        uncached = prompt_tokens - c.cached_tokens
        evicted = max(0, uncached - c.unused_tokens)
        return uncached + evicted + w.load_weight * (c.queued_tokens + REQUEST_TOKENS * c.requests)

    return sorted(fit, key=lambda c: (cost(c), noise[c.key])) + sorted(hot, key=lambda c: (c.requests, noise[c.key]))
