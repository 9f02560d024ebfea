"""A constrained sequence's matcher (llguidance), which says before every step which tokens may
come next and is advanced by every sampled token; compiled from the request by the request path
(requests/constraints.py).

The mask of the next token rides in the step plan to the sampling shard as llguidance writes it
(shard.proto, `SequenceStep.allowed_tokens`). After each step the engine feeds every constrained
sequence its sampled token, then computes the next masks together (`next_masks`), so a dead end
is found between steps and fails that request alone, INVALID_ARGUMENT: a matcher error, a mask
that allows nothing while the constraint is unfinished, or a token the mask allowed that the
matcher then refuses. All three happen where the constraint asks for text the model's tokens
cannot spell (SmolLM2's vocabulary has no token for some control bytes, such as 0x14; llguidance
then allows a token it refuses on the next step).

EOS is allowed only where the constraint is complete; once it admits nothing more the request
finishes "stop".

Speculative decoding (speculation.py): proposals are cut to the prefix the constraint accepts
(`valid_prefix`), and the row that verifies each takes the mask after the ones before it
(`masks_after`: the matcher consumes them and is rolled back); the accepted tokens are then fed
one by one, as sampled ones are.
"""

from __future__ import annotations

import llguidance as llg


class Constrained:
    """One sequence's matcher and the mask of its next token."""

    def __init__(self, matcher: llg.LLMatcher):
        self.matcher = matcher
        self.error: str | None = None
        self._set_mask(matcher.compute_bitmask())

    @property
    def complete(self) -> bool:
        """The constraint admits no further token (its output is whole)."""
        return self.matcher.is_stopped() and not self.matcher.is_error()

    def consume(self, token: int) -> None:
        """Advances the matcher by a sampled token; `next_masks` then computes the next mask."""
        if not self.matcher.consume_token(token):
            self.error = (
                "the constraint cannot be continued with this model's tokens: "
                f"token {token} does not fit it ({self.matcher.get_error()})"
            )

    def valid_prefix(self, tokens: list[int]) -> list[int]:
        """The longest prefix of proposed `tokens` the constraint accepts from here."""
        return tokens[: self.matcher.validate_tokens(tokens)] if tokens else []

    def masks_after(self, tokens: list[int]) -> list[bytes]:
        """The mask after each of `tokens` (a `valid_prefix`), for the rows that verify them;
        the matcher is rolled back to where it was."""
        masks = []
        for token in tokens:
            self.matcher.consume_token(token)
            masks.append(self.matcher.compute_bitmask())
        if tokens:
            self.matcher.rollback(len(tokens))
        return masks

    def _set_mask(self, mask: bytes) -> None:
        self.mask = mask
        if self.matcher.is_error():
            self.error = f"the constraint failed: {self.matcher.get_error()}"
        elif self.mask.count(0) == len(self.mask):
            self.error = "the constraint reached a dead end: none of this model's tokens can continue it"


def next_masks(sequences: list[Constrained]) -> None:
    """The next mask of each (unfinished, not failed) sequence. One after the other on the
    event loop's thread: llguidance's parallel executor measured slower end to end on two cores
    (its pool threads spin after each batch, taking CPU from the shards and the event loop)."""
    for c in sequences:
        c._set_mask(c.matcher.compute_bitmask())
