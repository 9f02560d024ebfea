"""Speculative decoding's policy: which decoding sequences carry proposals in a decode step.

A decode step on a CPU at a small batch is bound by reading the weights, so rows added to it
cost little beside it: a sequence that proposes k tokens (ngrams.py) is verified as k + 1 rows
in one step (shard.proto, `SequenceStep.proposals`), and emits its accepted proposals plus one
token of the target's. In a large batch the rows cost nearly their full price, and a proposal
pays only where it is likely accepted. So the step's proposals are chosen from what was
measured:

- `StepCosts`: the wall time of decode steps by their rows (decode rows and proposals), a
  running average per row count, read between the counts measured by a line through the two
  nearest; apart for steps sent ahead (a step without proposals may be, and then its router
  round trip overlaps the step before: the cost of not speculating);
- per sequence and proposer, the running acceptance of its proposals (ngrams.Drafting), which
  prices a proposal of k tokens at the tokens it is expected to yield. With suffix decoding
  (suffixes.py) beside prompt lookup, each step takes the proposal of the two that is expected
  to yield more (Proposers);
- the step takes proposals best first, each cut to the length that raises its expected tokens
  per second most, while one does by MARGIN at least; one left out counts as such
  (Drafting.not_sent). Where the costs of a step's rows are not known yet, and for a sequence's
  first proposal, it speculates and so measures them.

A sequence proposes nothing when its request opted out, or when at most one token is left to
its limit; a constrained one proposes only what its constraint accepts (constrained.py), and
each proposal's row is masked as a sampled token's would be.
Proposals never run past `max_new_tokens` or the context: the positions they take are within
the pages reserved at admission, and a rejected tail's pages stay in the block table as the
next positions the sequence writes, published only once accepted tokens fill them.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from shardline.router.core.ngrams import Drafting
from shardline.router.core.proposers import Proposers
from shardline.router.core.sequence import Sequence
from shardline.router.core.suffixes import OutputCache, SuffixDrafting

OFF, NGRAM, SUFFIX = "off", "ngram", "suffix"
MODES = (OFF, NGRAM, SUFFIX)
AVERAGING = 0.2  # weight of a new measurement in a row count's running step time
# How much faster the expected tokens per second of a step with proposals must be: the estimates
# err (acceptance from few verifications, costs read between row counts), and where the gain is
# that small a mistaken step costs as much as a right one wins.
MARGIN = 1.3


@dataclass
class StepCosts:
    """Decode steps' wall milliseconds by their rows, as measured."""

    ms: dict[int, float] = field(default_factory=dict)
    _rows: list[int] = field(default_factory=list)  # the keys of `ms`, sorted

    def add(self, rows: int, ms: float) -> None:
        old = self.ms.get(rows)
        if old is None:
            bisect.insort(self._rows, rows)
            self.ms[rows] = ms
        else:
            self.ms[rows] = old + AVERAGING * (ms - old)

    def estimate(self, rows: int) -> float | None:
        """The time of a step of `rows` rows: measured, or on the line through the two measured
        row counts nearest to it (None: fewer than two measured, and not this one)."""
        if rows in self.ms:
            return self.ms[rows]
        known = self._rows
        if len(known) < 2:
            return None
        at = min(max(bisect.bisect(known, rows), 1), len(known) - 1)
        r0, r1 = known[at - 1], known[at]
        m0, m1 = self.ms[r0], self.ms[r1]
        return max(m0 + (m1 - m0) * (rows - r0) / (r1 - r0), 1e-3)


class Speculator:
    def __init__(self, mode: str, most_tokens: int, max_position: int):
        if mode not in MODES or most_tokens < 1:
            raise ValueError(f"speculation {mode!r} with {most_tokens} tokens")
        self.mode, self.most_tokens, self.max_position = mode, most_tokens, max_position
        # Decode steps scheduled once the step before ended (as a step with proposals is), and
        # those sent ahead while it ran: a step without proposals can be, and then costs only
        # its compute (the router's work and the round trip overlap it).
        self.costs, self.ahead_costs = StepCosts(), StepCosts()
        self.outputs = OutputCache() if mode == SUFFIX else None  # earlier requests' outputs

    def _proposers(self, seq: Sequence) -> Proposers:
        ngram = Drafting(self.most_tokens)
        if self.mode == NGRAM:
            return Proposers((ngram,))
        return Proposers((SuffixDrafting(self.most_tokens, cache=self.outputs, namespace=seq.cache_namespace), ngram))

    def finished(self, seq: Sequence) -> None:
        """A sequence ended: with suffix decoding, its output is proposed from to the ones after it."""
        if self.outputs is not None and seq.speculative:
            self.outputs.add(seq.cache_namespace, seq.output_ids)

    def propose(self, seqs: list[Sequence], trial: bool = False) -> dict[Sequence, list[int]]:
        """The proposals of a decode step of `seqs`, per sequence that carries any. A `trial`
        (would the next step speculate?) changes no sequence's record."""
        if self.mode == OFF:
            return {}
        candidates = []
        for seq in seqs:
            if not seq.speculative:
                continue
            if seq.drafting is None:
                seq.drafting = self._proposers(seq)
            # Every accepted proposal and the target's token must fit the request's limits.
            room = min(seq.max_new_tokens - len(seq.output_ids), self.max_position - seq.num_tokens) - 1
            drafting, tokens = seq.drafting.propose(seq.prompt_ids, seq.output_ids, room)
            if tokens and seq.constrained is not None and not trial:
                tokens = seq.constrained.valid_prefix(tokens)
            if tokens:
                candidates.append((seq, drafting, tokens))
        return self._worth_it(len(seqs), candidates, trial)

    def _worth_it(
        self, rows: int, candidates: list[tuple[Sequence, Drafting, list[int]]], trial: bool
    ) -> dict[Sequence, list[int]]:
        """The candidates that raise the step's expected tokens per second, best first."""
        chosen: dict[Sequence, list[int]] = {}
        tokens, ms = rows, self.ahead_costs.estimate(rows) or self.costs.estimate(rows)
        candidates.sort(key=lambda c: c[1].acceptance, reverse=True)
        for seq, drafting, proposal in candidates:
            best = None  # (rate, proposed, tokens, ms) of the best prefix of the proposal
            for n in range(1, len(proposal) + 1):
                more_ms = self.costs.estimate(rows + n)
                # Not measured yet, or the proposer's first proposal (its acceptance is only the
                # prior's): try it whole.
                if ms is None or more_ms is None or not drafting.verifications:
                    best = (0.0, len(proposal), tokens + drafting.expected(len(proposal)), None)
                    break
                more_tokens = tokens + drafting.expected(n)
                if more_tokens / more_ms > (best[0] if best else MARGIN * tokens / ms):
                    best = (more_tokens / more_ms, n, more_tokens, more_ms)
            if best is None:
                if not trial:
                    drafting.not_sent()
                continue
            _, n, tokens, ms = best
            chosen[seq], rows = proposal[:n], rows + n
            if not trial:
                seq.drafting.sent = drafting
        return chosen

    def measured(self, rows: int, wall_s: float, ahead: bool) -> None:
        """A decode step of `rows` rows took `wall_s` seconds, as the router saw it; `ahead`: it
        was sent while the step before it ran."""
        (self.ahead_costs if ahead else self.costs).add(rows, wall_s * 1e3)
