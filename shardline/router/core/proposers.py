"""A sequence's proposers for speculative decoding (ngrams.Drafting, and suffixes.SuffixDrafting
beside it with suffix decoding), each keeping its own record of how its proposals did, so that a
sequence that copies its prompt and one that repeats an earlier answer each take the proposer
that serves it (speculation.py weighs the proposal, as it would one proposer's)."""

from __future__ import annotations

from dataclasses import dataclass

from shardline.router.core.ngrams import Drafting


@dataclass(eq=False)
class Proposers:
    """A sequence's proposers, each with its own record, and the one whose proposal awaits
    verification (at most one: a step with proposals is scheduled once the one before ended)."""

    each: tuple[Drafting, ...]
    sent: Drafting | None = None

    def propose(self, prompt: list[int], output: list[int], most: int) -> tuple[Drafting | None, list[int]]:
        """The proposal expected to yield the most tokens by its proposer's record (the first
        proposer's on a tie), and that proposer."""
        best, best_tokens, best_expected = None, [], 0.0
        for drafting in self.each:
            tokens = drafting.propose(prompt, output, most)
            if tokens and drafting.expected(len(tokens)) > best_expected:
                best, best_tokens, best_expected = drafting, tokens, drafting.expected(len(tokens))
        return best, best_tokens

    def verified(self, proposed: int, accepted: int) -> None:
        assert self.sent is not None, "a verification of proposals never sent"
        self.sent.verified(proposed, accepted)
        self.sent = None

    @property
    def proposed(self) -> int:
        return sum(d.proposed for d in self.each)

    @property
    def accepted(self) -> int:
        return sum(d.accepted for d in self.each)
