"""One sequence's proposals for speculative decoding: the tokens that followed the most recent
earlier occurrence of its longest suffix of MIN_N to MAX_N tokens (prompt lookup, as vLLM's and
llama.cpp's n-gram proposers do), and how well its proposals have done.

What copies from its context (a quoted paragraph, code with one name changed, JSON whose keys
repeat) finds its next tokens there; text that copies nothing rarely matches a suffix of
MIN_N tokens, so it is rarely proposed for. The index grows with the sequence: each position
adds its n-grams once, so a proposal costs a few dictionary lookups, not a scan of the context.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Suffix lengths looked up, longest first. A 2-token suffix (", the") recurs by chance in any
# text, and its proposals cost rows that are rejected; 3 measured faster on every workload.
MIN_N, MAX_N = 3, 4
PRIOR = 0.6  # the acceptance expected of a sequence's proposals before any was verified
LEARNING = 0.3  # weight of one verification in the running acceptance
RECOVERY = 0.05  # how far a proposal not sent moves the acceptance back toward PRIOR


@dataclass(eq=False)
class Drafting:
    """A sequence's n-gram index and the running record of its proposals."""

    most_tokens: int  # the most tokens proposed at once (the router's --spec-tokens)
    k: int = 0  # how many to propose next: grows while all are accepted, shrinks where some are not
    acceptance: float = PRIOR  # per proposed token, the chance it is accepted (a running estimate)
    proposed: int = 0  # totals over the sequence's verifications
    accepted: int = 0
    verifications: int = 0
    _tokens: list[int] = field(default_factory=list)  # the sequence as far as proposed from
    _latest: dict[tuple[int, ...], int] = field(default_factory=dict)  # n-gram -> position after it
    _indexed: int = 0  # positions whose preceding n-grams are in _latest

    def __post_init__(self):
        self.k = self.k or self.most_tokens

    def propose(self, prompt: list[int], output: list[int], most: int) -> list[int]:
        """At most min(k, `most`) tokens to follow the sequence so far (its `prompt`, then its
        `output`, which only grows), or none. The sequence is kept here, extended by the new
        outputs only: no copy of the whole context per step."""
        tokens = self._tokens
        if not tokens:
            tokens.extend(prompt)
        tokens.extend(output[len(tokens) - len(prompt) :])
        n_tokens = len(tokens)
        self._index(tokens, n_tokens)
        most = min(self.k, most)
        if most < 1:
            return []
        for n in range(min(MAX_N, n_tokens), MIN_N - 1, -1):
            at = self._latest.get(tuple(tokens[n_tokens - n :]))
            if at is not None:
                return tokens[at : at + most]
        return []

    def _index(self, tokens: list[int], end: int) -> None:
        """Adds the n-grams that end before each position up to `end` (exclusive): a later
        lookup of the same n-gram finds the tokens from that position on. The sequence's own
        suffix is indexed once a token follows it, so a lookup never finds itself."""
        latest = self._latest
        for at in range(max(self._indexed, MIN_N), end):
            for n in range(MIN_N, min(MAX_N, at) + 1):
                latest[tuple(tokens[at - n : at])] = at
        self._indexed = max(self._indexed, end)

    def verified(self, proposed: int, accepted: int) -> None:
        """Learns from a verification: `accepted` of `proposed` tokens (a prefix of them) were."""
        self.proposed += proposed
        self.accepted += accepted
        self.verifications += 1
        # The rate that makes this outcome likeliest: accepted of the accepted + 1 tokens tested
        # (a rejection ends the test), or all of them.
        rate = accepted / (accepted + (accepted < proposed))
        self.acceptance += LEARNING * (rate - self.acceptance)
        self.k = min(self.most_tokens, max(self.k, 2 * proposed)) if accepted == proposed else max(1, accepted + 1)

    def not_sent(self) -> None:
        """A proposal the step left out (too little expected of it): the estimate drifts back
        toward the prior, so a sequence whose text starts to copy is tried again."""
        self.acceptance += RECOVERY * (PRIOR - self.acceptance)

    def expected(self, proposed: int) -> float:
        """Tokens expected to be accepted of `proposed`, each accepted with `acceptance` after
        the ones before it were."""
        a = self.acceptance
        return proposed if a >= 1 else a * (1 - a**proposed) / (1 - a)
