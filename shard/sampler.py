"""Turns last-position logits into tokens: greedy, or temperature / top-k / top-p with a seed.

A seeded draw depends only on (seed, position), not on which other sequences share the batch,
so the same request with the same seed gets the same tokens under any load.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0


def _mix(seed: int, position: int) -> int:
    return (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9) % (2**63 - 1)


def sample_row(logits: torch.Tensor, p: SamplingParams, position: int) -> int:
    logits = logits / p.temperature
    if p.top_k > 0 and p.top_k < logits.numel():
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token is always kept).
        drop = sorted_probs.cumsum(0) - sorted_probs >= p.top_p
        sorted_probs[drop] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    gen = torch.Generator(device=logits.device).manual_seed(_mix(p.seed, position))
    return int(torch.multinomial(probs, 1, generator=gen))


def sample(logits: torch.Tensor, params: list[SamplingParams], positions: list[int]) -> list[int]:
    """logits [B, vocab] fp32 -> one token per row."""
    tokens = logits.argmax(dim=-1).tolist()
    for i, p in enumerate(params):
        if p.temperature > 0:
            tokens[i] = sample_row(logits[i], p, positions[i])
    return tokens
