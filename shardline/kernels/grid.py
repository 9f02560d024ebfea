"""Weights as groups of 32 along the input dimension on a grid, w = lo + scale * code: recovered
exactly from dequantized GGUF blocks, or rounded to one where no exact grid exists.

- 16 levels (int4): GGUF's Q4_0, Q4_1 and Q4_K blocks are such groups.
- 255 levels (int8): GGUF's Q8_0 blocks are such groups; finer-grained types (Q6_K) are rounded
  to 8 bits per group.
"""

from __future__ import annotations

import torch

GROUP = 32
# What loading does to a layer's weights (recovering a grid, packing operands, a dense copy) it
# does a slice of rows at a time, a few copies of the slice at once: this many weights a slice
# (8 MB in fp32), so that the temporaries stay small beside a large model's widest layers.
WEIGHTS_AT_ONCE = 1 << 21


def rows_at_once(k: int) -> int:
    """Rows of K weights in a slice: a whole number of 64 rows, at least 64. Ours pack blocks of 8
    rows; torch's int4 packing for the CPU interleaves blocks of 64, so that slices of any other
    size, packed apart and stacked, multiply wrong weights."""
    return max(64, WEIGHTS_AT_ONCE // k // 64 * 64)


def grid_groups(
    w: torch.Tensor, levels: int, search: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """w [N, K] -> (codes int32 [N, K] in 0..levels-1, scale [N, K/32], lo [N, K/32], share exact),
    with w = lo + scale * code.

    A group of 32 whose weights already lie on such a grid (what a GGUF block dequantizes to:
    Q4_0, Q4_1 and Q4_K with 16 levels, Q8_0 with 255) keeps that grid exactly; any other group is
    rounded to the nearest of `levels` evenly spaced values between its min and max. The last
    value is the share of groups kept exactly. `search`: look for a grid whose step is not the
    span over the levels (one whose codes do not reach both ends); pointless, and most of the
    time taken, for weights that lie on no grid of this width (a Q6_K's, at 8 bits)."""
    n, k = w.shape
    if k % GROUP:
        raise ValueError(f"quantized layers need an input dimension divisible by {GROUP}, got {k}")
    if n > (step := rows_at_once(k)):  # the temporaries below are several copies of w: bound them
        parts = [grid_groups(w[i : i + step], levels, search) for i in range(0, n, step)]
        exact = sum(p[3] * len(p[0]) for p in parts) / n
        return (*(torch.cat([p[j] for p in parts]) for j in range(3)), exact)
    g = w.float().reshape(-1, GROUP)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    span = hi - lo
    scale = torch.where(span > 0, span / (levels - 1), torch.ones_like(span))
    codes = ((g - lo) / scale).round().clamp(0, levels - 1)
    exact = (span == 0) | ((lo + codes * scale - g).abs() <= span * 1e-4).all(-1, keepdim=True)
    # Groups whose codes do not reach both ends: hi and lo are still grid points, so the step is
    # span / (a whole number of steps), and the smallest gap between values is a whole number of
    # steps too (more than one when no two of the codes present are adjacent).
    todo = (~exact).squeeze(-1).nonzero().squeeze(-1) if search else torch.zeros(0, dtype=torch.int64)
    t_g, t_lo, t_span = g[todo], lo[todo], span[todo]  # t_: the groups still without a grid
    gaps = t_g.sort(-1).values.diff(dim=-1)
    t_tol = t_span * 1e-4
    t_gap = torch.where(gaps > t_tol, gaps, torch.full_like(gaps, float("inf"))).amin(-1, keepdim=True)
    for per_gap in range(1, 9):
        if not len(todo):
            break
        steps = (per_gap * t_span / t_gap).round()
        trial = t_span / steps
        trial_codes = ((t_g - t_lo) / trial).round()
        fits = (steps <= levels - 1) & ((t_lo + trial_codes * trial - t_g).abs() <= t_tol).all(-1, keepdim=True)
        fits = fits.squeeze(-1)
        rows = todo[fits]
        scale[rows], codes[rows], exact[rows] = trial[fits], trial_codes[fits], True
        rest = ~fits
        todo, t_g, t_lo, t_span, t_tol, t_gap = (
            todo[rest],
            t_g[rest],
            t_lo[rest],
            t_span[rest],
            t_tol[rest],
            t_gap[rest],
        )
    return (
        codes.reshape(n, k).to(torch.int32),
        scale.reshape(n, k // GROUP),
        lo.reshape(n, k // GROUP),
        exact.float().mean().item(),
    )


def grid_weights(codes: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """The weights in fp32, [N, K], from their groups."""
    return lo.repeat_interleave(GROUP, 1) + scale.repeat_interleave(GROUP, 1) * codes
