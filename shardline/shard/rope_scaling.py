"""A model's rotary scaling, read into ModelConfig's rotary fields (shard/model.py's Rotary turns
by them): per-frequency divisors (`rope_factors`: Llama 3.1's, YaRN's, LongRoPE's short ones),
LongRoPE's long ones from a position on, a linear scale, and a factor on cos and sin."""

from __future__ import annotations

import math

from shardline.common.gguf_header import GgufHeader

SCALINGS = ("default", "linear", "llama3", "yarn", "longrope", "su")


def rotary_from_hf(raw: dict, rope: dict, head_dim: int) -> dict:
    """The rotary fields from a config.json: plain, or LongRoPE's (Phi-3's "longrope", once "su").
    LongRoPE's factors are short below `original_max_position_embeddings` and long from there on,
    position by position: transformers' generation, which switches to the long factors once the
    sequence outgrows that length, gives these tables to every prompt within it and to every
    token generated past it (a longer prompt it turns with the long factors throughout)."""
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in SCALINGS:
        raise ValueError(f"rope scaling {rope} is not supported")
    partial = rope.get("partial_rotary_factor") or raw.get("partial_rotary_factor") or 1.0
    fields = dict(rotary_dim=int(head_dim * partial) if partial != 1 else 0)
    theta = float(raw.get("rope_theta") or rope.get("rope_theta", 10000.0))
    if kind == "default":
        return fields
    if kind == "linear":
        return fields | dict(rope_scale=float(rope["factor"]))
    if kind == "llama3":
        return fields | dict(rope_factors=_llama3_factors(rope, head_dim, theta))
    if kind == "yarn":
        original = rope.get("original_max_position_embeddings") or raw["original_max_position_embeddings"]
        factor = rope.get("factor") or raw["max_position_embeddings"] / original
        betas = rope.get("beta_fast") or 32, rope.get("beta_slow") or 1
        yarn = Yarn(factor, original, *betas, truncate=rope.get("truncate", True))
        attention = rope.get("attention_factor")
        if attention is None and rope.get("mscale") and rope.get("mscale_all_dim"):
            attention = _mscale(factor, rope["mscale"]) / _mscale(factor, rope["mscale_all_dim"])
        return fields | yarn.fields(fields["rotary_dim"] or head_dim, theta, attention)
    original = rope.get("original_max_position_embeddings") or raw["original_max_position_embeddings"]
    factor = rope.get("factor") or raw["max_position_embeddings"] / original
    attention = rope.get("attention_factor")
    if attention is None:  # the paper's, as transformers computes it
        attention = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
    return fields | dict(
        rope_factors=list(rope["short_factor"]),
        rope_long_factors=list(rope["long_factor"]),
        rope_long_from=original,
        rope_attention_factor=attention,
    )


def _llama3_factors(rope: dict, head_dim: int, theta: float) -> list[float]:
    """Llama 3.1's rope scaling as per-frequency divisors (what llama.cpp's converter writes as
    `rope_freqs`): wavelengths shorter than the original context / high_freq_factor keep their
    frequency, those longer than it / low_freq_factor divide it by `factor`, those between
    blend the two as transformers' "llama3" rope does."""
    factor, low, high = rope.get("factor", 8.0), rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old = rope.get("original_max_position_embeddings", 8192)
    factors = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(float(factor))
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return factors


def _mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature (its paper's eq. 21): 0.1 * mscale * ln(factor) + 1."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


class Yarn:
    """YaRN's scaling (gpt-oss's, Qwen's long contexts): a frequency that turns more than
    `beta_fast` times over the original context keeps its value, one that turns fewer than
    `beta_slow` times is divided by `factor`, those between blend linearly by their index (the
    correction range's bounds rounded out where `truncate`, as llama.cpp always does); cos and
    sin are scaled by the attention temperature."""

    def __init__(self, factor: float, original: int, beta_fast: float, beta_slow: float, truncate: bool):
        self.factor, self.original = float(factor), int(original)
        self.beta_fast, self.beta_slow, self.truncate = float(beta_fast), float(beta_slow), truncate

    def fields(self, dim: int, theta: float, attention: float | None = None) -> dict:
        def correction_dim(rotations: float) -> float:
            return dim * math.log(self.original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # as transformers avoids the division by zero
        factors = []
        for i in range(dim // 2):
            extrapolated = 1 - min(1.0, max(0.0, (i - low) / (high - low)))
            factors.append(1 / ((1 - extrapolated) / self.factor + extrapolated))
        attention = _mscale(self.factor) if attention is None else attention
        return dict(rope_factors=factors, rope_attention_factor=attention)


def rotary_from_gguf(header: GgufHeader, arch: str) -> dict:
    """The rotary fields as llama.cpp's converter writes them: a dimension count where not all
    of a head turns, LongRoPE's factors as two F32 tensors and its attention factor as a key,
    YaRN's parameters as keys."""
    head_dim = header.get(f"{arch}.attention.key_length") or (
        header.get(f"{arch}.embedding_length") // header.get(f"{arch}.attention.head_count")
    )
    rotary_dim = header.get(f"{arch}.rope.dimension_count", head_dim)
    fields = dict(rotary_dim=rotary_dim if rotary_dim != head_dim else 0)
    scaling = header.get(f"{arch}.rope.scaling.type", "none")
    key = f"{arch}.rope.scaling."
    if scaling == "linear":
        fields["rope_scale"] = float(header.get(key + "factor", 1.0))
    elif scaling == "yarn":
        # gpt-oss's correction range is not rounded out (its config says so; a GGUF cannot)
        yarn = Yarn(
            header.get(key + "factor"),
            header.get(key + "original_context_length"),
            header.get(key + "yarn_beta_fast", 32.0),
            header.get(key + "yarn_beta_slow", 1.0),
            truncate=arch != "gpt-oss",
        )
        attention = header.get(key + "yarn_attn_factor") or header.get(key + "attn_factor")
        fields |= yarn.fields(rotary_dim, float(header.get(f"{arch}.rope.freq_base", 10000.0)), attention)
    elif scaling != "none":
        raise ValueError(f"rope scaling {scaling!r} is not supported")
    if divisors := header.floats("rope_freqs.weight"):  # Llama 3.1's scaling, per frequency
        fields["rope_factors"] = divisors
    short, long = header.floats("rope_factors_short.weight"), header.floats("rope_factors_long.weight")
    if long is None:
        return fields
    return fields | dict(
        rope_factors=short or [1.0] * len(long),
        rope_long_factors=long,
        rope_long_from=header.get(f"{arch}.rope.scaling.original_context_length"),
        rope_attention_factor=float(header.get(f"{arch}.rope.scaling.attn_factor", 1.0)),
    )
