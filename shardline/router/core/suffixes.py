"""Suffix decoding's proposals (SuffixDecoding, Oliaro et al. 2024, as ArcticInference serves it):
the longest suffix of a sequence that occurred before, in its own prompt and output or in the
outputs of the requests before it, continued by the tokens that most often followed it, as far
as the match's length and the continuation's frequency say it will hold.

ArcticInference keeps suffix trees; the same answers come here from indexes of positions by the
MIN_MATCH tokens before each (a tree node's subtree is what followed its string's occurrences):
- the occurrences of the sequence's last MIN_MATCH tokens (the OCCURRENCES latest of each
  index), each measured back to how far it agrees with the sequence: its match length;
- for a match length m, the occurrences that agree over at least m tokens propose, a position
  at a time, the token most of them go on with; its probability is the share of them that do,
  times the probability before it. The proposal ends where that falls below MIN_PROBABILITY, or
  at FACTOR x m tokens: a longer match earns a longer proposal;
- of the match lengths measured, the proposal with the best score (its probabilities' sum) wins.

Where this pays beyond prompt lookup (ngrams.py): a request that writes what an earlier one
wrote (an agent's loop re-emitting a file, a template filled again), and continuations that
more occurrences agree on than the latest one. A request's output joins the cache once it ends
(OutputCache, one per replica); cached outputs are kept per cache namespace, as cached pages are
(common/auth.py), so one tenant's outputs never shape another's proposals, nor their timing.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from shardline.router.core.ngrams import Drafting

MIN_MATCH = 3  # tokens an occurrence shares with the sequence's end at least (ngrams.MIN_N's reason)
MAX_MATCH = 64  # how far back a match is measured
OCCURRENCES = 16  # the latest occurrences of an index key looked at
MATCH_LENGTHS = 4  # of the occurrences' distinct match lengths, the longest this many are weighed
FACTOR = 1.0  # tokens proposed per token matched, at most (ArcticInference's max_spec_factor)
MIN_PROBABILITY = 0.1  # ArcticInference's min_token_prob
CACHED_TOKENS = 1 << 17  # earlier outputs' tokens kept, all namespaces together; the oldest go first

Occurrence = tuple[list[int], int]  # a text, and the position after a match in it


def _keep_latest(occurrences: list) -> None:
    if len(occurrences) > 2 * OCCURRENCES:
        del occurrences[:-OCCURRENCES]


class OutputCache:
    """Earlier requests' outputs, indexed by namespace and the MIN_MATCH tokens before each
    position. Invariant: every index entry names a kept text, and every key has an entry."""

    def __init__(self, budget: int = CACHED_TOKENS):
        self.budget, self.tokens = budget, 0
        self._texts: OrderedDict[int, tuple[str, list[int]]] = OrderedDict()  # oldest first
        self._index: dict[tuple, list[tuple[int, int]]] = {}  # (namespace, *tokens) -> (text, position)
        self._next_id = 0

    def add(self, namespace: str, tokens: list[int]) -> None:
        tokens = list(tokens[-self.budget :])
        if len(tokens) <= MIN_MATCH:
            return
        text, self._next_id = self._next_id, self._next_id + 1
        self._texts[text] = (namespace, tokens)
        self.tokens += len(tokens)
        for p in range(MIN_MATCH, len(tokens)):  # positions a token follows the key at
            entries = self._index.setdefault((namespace, *tokens[p - MIN_MATCH : p]), [])
            entries.append((text, p))
            _keep_latest(entries)
        while self.tokens > self.budget:
            self._evict_oldest()

    def _evict_oldest(self) -> None:
        text, (namespace, tokens) = self._texts.popitem(last=False)
        self.tokens -= len(tokens)
        for p in range(MIN_MATCH, len(tokens)):
            key = (namespace, *tokens[p - MIN_MATCH : p])
            entries = self._index.get(key)
            if entries is not None:
                entries[:] = [e for e in entries if e[0] != text]
                if not entries:
                    del self._index[key]

    def occurrences(self, namespace: str, key: tuple[int, ...]) -> list[Occurrence]:
        """The latest occurrences of `key` in `namespace`'s outputs, latest first."""
        entries = self._index.get((namespace, *key), ())
        return [(self._texts[text][1], p) for text, p in reversed(entries[-OCCURRENCES:])]

    def __len__(self) -> int:
        return len(self._texts)


def continuation(context: list[int], occurrences: list[Occurrence], most: int) -> list[int]:
    """The best-scoring proposal of at most `most` tokens to follow `context`, from `occurrences`
    of its last MIN_MATCH tokens (earlier ones first on a tie)."""
    n, matched = len(context), []
    for text, p in occurrences:
        m = MIN_MATCH
        while m < MAX_MATCH and m < p and m < n and text[p - 1 - m] == context[n - 1 - m]:
            m += 1
        matched.append((m, text, p))
    best, best_score = [], 0.0
    for m in sorted({m for m, _, _ in matched})[-MATCH_LENGTHS:]:
        tokens, score = _walk([(text, p) for length, text, p in matched if length >= m], min(most, int(m * FACTOR)))
        if score >= best_score:  # a longer match wins a tie, as ArcticInference's does
            best, best_score = tokens, score
    return best


def _walk(live: list[Occurrence], most: int) -> tuple[list[int], float]:
    """Follows the occurrences' most common next token while its probability holds."""
    tokens, probability, score = [], 1.0, 0.0
    while len(tokens) < most:
        if len(live) == 1:  # one text: it is copied as far as allowed, each token as likely
            text, p = live[0]
            rest = text[p : p + most - len(tokens)]
            return tokens + rest, score + probability * len(rest)
        counts: dict[int, int] = {}
        for text, p in live:
            if p < len(text):
                counts[text[p]] = counts.get(text[p], 0) + 1
        if not counts:
            break
        token = max(counts, key=counts.__getitem__)  # the first seen of the most common
        probability *= counts[token] / len(live)
        if probability < MIN_PROBABILITY:
            break
        tokens.append(token)
        score += probability
        live = [(text, p + 1) for text, p in live if p < len(text) and text[p] == token]
    return tokens, score


@dataclass(eq=False)
class SuffixDrafting(Drafting):
    """A sequence's suffix-decoding proposer: its own index and its replica's OutputCache, with
    the running record of its proposals (ngrams.Drafting's). Its proposals' length is set by
    the match, not by `k`."""

    cache: OutputCache | None = None
    namespace: str = ""
    _own: dict[tuple[int, ...], list[int]] = field(default_factory=dict)  # key -> positions after it
    _proposal: tuple[int, int, list[int]] | None = None  # (tokens, most, proposal) of the last call

    def propose(self, prompt: list[int], output: list[int], most: int) -> list[int]:
        tokens = self._tokens
        if not tokens:
            tokens.extend(prompt)
        tokens.extend(output[len(tokens) - len(prompt) :])
        n, most = len(tokens), min(self.most_tokens, most)
        if self._proposal is not None and self._proposal[:2] == (n, most):  # asked again this step
            return self._proposal[2]
        for p in range(max(self._indexed, MIN_MATCH), n):  # a position once a token stands there
            positions = self._own.setdefault(tuple(tokens[p - MIN_MATCH : p]), [])
            positions.append(p)
            _keep_latest(positions)
        self._indexed = max(self._indexed, n)
        proposal = []
        if most >= 1 and n >= MIN_MATCH:
            key = tuple(tokens[n - MIN_MATCH :])
            own = [(tokens, p) for p in reversed(self._own.get(key, ())[-OCCURRENCES:])]
            cached = self.cache.occurrences(self.namespace, key) if self.cache is not None else []
            proposal = continuation(tokens, own + cached, most)
        self._proposal = (n, most, proposal)
        return proposal
