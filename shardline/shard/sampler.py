"""Turns last-position logits into tokens: greedy, or temperature / top-k / top-p with a seed.

A seeded draw depends only on (seed, position), not on which other sequences share the batch,
so the same request with the same seed gets the same tokens under any load.

Numerics, for every value the router accepts (temperature finite and >= 0, top_p in (0, 1]):
- temperature T > 0 samples from softmax(logits / T), computed as softmax((logits - max) / T),
  which cannot overflow. As T shrinks the distribution tends to a uniform choice among the tied
  best tokens; once T is below (best - second best) / 104 every other token's probability
  underflows to exactly 0, so a tiny temperature (1e-39, say) is greedy, ties broken by the seed.
  A huge T makes the choice uniform over what top-k / top-p keep.
- top_p keeps the smallest set of best tokens whose mass reaches top_p, and always the best
  one, so a tiny top_p is greedy too.
- A row whose logits are not all finite (a numerically broken model) is not sampled at all:
  its sequence fails alone, with a message, and the others in the batch are unaffected.
- A constrained row (an `allowed` mask, router/core/constrained.py) samples among the allowed tokens
  only: every other logit is -inf before temperature, top-k, top-p and the greedy choice. A mask
  that allows nothing fails the row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardline.kernels.token_mask import mask_logits


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    logprobs: int | None = None  # report the sampled token's log-probability and this many alternatives


def _mix(seed: int, position: int) -> int:
    return (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9) % (2**63 - 1)


def sample_row(logits: torch.Tensor, p: SamplingParams, position: int) -> int:
    logits = (logits - logits.max()) / p.temperature
    if 0 < p.top_k < logits.numel():
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token is always kept).
        drop = sorted_probs.cumsum(0) - sorted_probs >= p.top_p
        drop[0] = False
        sorted_probs[drop] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    # Inverse CDF with one uniform draw: torch.multinomial draws a random number per vocabulary
    # entry, a visible part of a many-stream decode step at a large vocabulary. A token of
    # probability 0 is never picked: its CDF entry equals the one before it (right=True).
    gen = torch.Generator(device=logits.device).manual_seed(_mix(p.seed, position))
    cdf = probs.cumsum(0, dtype=torch.float64)
    u = torch.rand((), dtype=torch.float64, generator=gen, device=logits.device)
    return int(torch.searchsorted(cdf, u * cdf[-1], right=True).clamp_(max=probs.numel() - 1))


def verify(logits: torch.Tensor, proposals: list[int], p: SamplingParams, position: int) -> list[int]:
    """The tokens a verification emits: logits [k + 1, vocab] of the rows that take the last
    input and the k proposals, the token of row i at `position` + i. Each row draws its token
    as a step without proposals would (greedy: the best; sampled: `sample_row`, its uniform a
    function of the seed and the position), and the proposals equal to those draws are
    accepted, up to the first that is not, whose draw is emitted instead (or after the last).

    For a proposal that came with certainty (q(x) = 1, as the router's n-grams do), this is
    rejection sampling (Leviathan et al. 2023; Chen et al. 2023) coupled to the draw without
    speculation: x is accepted with probability p(x) = min(1, p(x) / q(x)), and a rejection
    emits a draw from p given that it is not x, which is max(0, p - q) renormalized. So every
    token is distributed as the target draws it, and a seed gives the same tokens with
    speculation on or off, whatever was proposed."""
    best = logits.argmax(dim=-1).tolist() if p.temperature <= 0 else None
    out = []
    for i in range(len(proposals) + 1):
        out.append(best[i] if best is not None else sample_row(logits[i], p, position + i))
        if i == len(proposals) or out[-1] != proposals[i]:
            break
    return out


@dataclass(frozen=True)
class Draw:
    """One row's outcome: its token, or why the row could not be sampled."""

    token: int | None = None
    failure: str | None = None


def finite_rows(logits: torch.Tensor) -> list[bool]:
    """Per row, whether every logit is finite. A non-finite value makes its row's sum non-finite
    (NaN, or an infinity that nothing cancels but a NaN), so only a row whose sum is not finite
    (that, or finite values overflowing) is checked value by value: `isfinite(...).all()` over
    every row took 2 ms of a 32-row step (AVX2), the sums 0.04 ms."""
    finite = torch.isfinite(logits.sum(dim=-1)).tolist()
    return [ok or bool(torch.isfinite(logits[i]).all()) for i, ok in enumerate(finite)]


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    positions: list[int],
    masked: list[int] = (),
    packed: torch.Tensor | None = None,
) -> list[Draw]:
    """logits [B, vocab] fp32 -> one Draw per row. `masked` rows may take only the tokens their
    packed masks (uint8 [len(masked), bytes], kernels/token_mask.py) allow; `logits` itself is
    left as it is."""
    finite = finite_rows(logits)
    empty = [False] * len(params)
    if masked:
        for i, some in zip(masked, packed.any(dim=-1).tolist()):
            empty[i] = not some
        if len(masked) == len(params):
            logits = mask_logits(logits.contiguous(), packed)
        else:
            logits = logits.clone()
            logits[masked] = mask_logits(logits[masked].contiguous(), packed)
    greedy = logits.argmax(dim=-1).tolist()
    out = []
    for i, p in enumerate(params):
        if not finite[i]:
            out.append(Draw(failure="the model produced non-finite logits for this sequence"))
        elif empty[i]:
            out.append(Draw(failure="the constraint allows no token here"))
        elif p.temperature > 0:
            try:
                out.append(Draw(sample_row(logits[i], p, positions[i])))
            except RuntimeError as e:  # a bug here must cost this request only
                out.append(Draw(failure=f"sampling failed: {e}"))
        else:
            out.append(Draw(greedy[i]))
    return out
