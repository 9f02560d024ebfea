"""Tiny random Hugging Face checkpoints with SmolLM2's tokenizer: what most tests serve, and
what the benchmarks run where a model's speed does not matter (the gateway's routing, say)."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from shardline.common.model_source import resolve_model
from shardline.common.tokenizer_files import tokenizer_folder

TINY_CONFIGS = {
    # Large enough init that random logits are not near-uniform (greedy ties would be noise).
    "llama": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    ),
    "qwen2": dict(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
    "qwen3": dict(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        tie_word_embeddings=False,
    ),
    # Mistral: Llama's block with a head_dim of its own; its window off (v0.3 onwards)
    "mistral": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        sliding_window=None,
        tie_word_embeddings=False,
    ),
    # SmolLM3: layer 3 of 4 without rotary embedding, tied embeddings
    "smollm3": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        pad_token_id=None,  # its default, 128004, is past the tiny vocabulary
    ),
    # Granite 3: every multiplier away from what Llama's block does
    "granite": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        embedding_multiplier=4.0,
        residual_multiplier=0.5,
        attention_multiplier=0.2,
        logits_scaling=2.0,
        tie_word_embeddings=True,
    ),
    # OLMo 2: norms after each sublayer, q/k norms across all heads
    "olmo2": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    ),
    # Phi-3 / Phi-4-mini: fused projections, 12 of a head's 16 dimensions turning, LongRoPE's
    # factors short below position 128 and long from there on, a tied head
    "phi3": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        partial_rotary_factor=0.75,
        original_max_position_embeddings=128,
        rope_scaling=dict(
            rope_type="longrope",
            short_factor=[1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
            long_factor=[1.5, 3.0, 6.0, 12.0, 24.0, 48.0],
        ),
        sliding_window=None,
        tie_word_embeddings=True,
        pad_token_id=None,  # its default, 32000, is past the tiny vocabulary
    ),
    # Gemma 3: five local layers of a 16-token window (their own rotary base) to one global layer
    # (linear rope scaling, as the 4B's), q/k norms, pre and post norms of 1 + w, GELU, embedding
    # and attention scales, and Gemma 2's final logit cap
    "gemma3_text": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=16,
        query_pre_attn_scalar=16,  # the head size, as in all but the 27B (whose a GGUF does not say)
        rope_parameters=dict(
            full_attention=dict(rope_type="linear", factor=8.0, rope_theta=1e6),
            sliding_attention=dict(rope_type="default", rope_theta=1e4),
        ),
        final_logit_softcapping=30.0,
        tie_word_embeddings=True,
        pad_token_id=None,
    ),
    # Gemma 2: every other layer local (a 16-token window), scores capped at 5 (so that the cap
    # bends them), pre and post norms of 1 + w, GELU, scales and the final logit cap
    "gemma2": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=16,
        query_pre_attn_scalar=16,
        attn_logit_softcapping=5.0,
        final_logit_softcapping=30.0,
        tie_word_embeddings=True,
        pad_token_id=None,
    ),
    # gpt-oss: sliding layers of a 16-token window between full ones, sinks, biases everywhere,
    # 8 experts of 32 units (clamped SwiGLU), 2 per token, and YaRN's frequencies (its correction
    # range unrounded, as gpt-oss's own)
    "gpt_oss": dict(
        hidden_size=64,
        intermediate_size=32,
        num_local_experts=8,
        num_experts_per_tok=2,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=16,
        rope_parameters=dict(
            rope_type="yarn",
            factor=8.0,
            beta_fast=32.0,
            beta_slow=1.0,
            truncate=False,
            original_max_position_embeddings=256,  # of the tiny models' 2048 positions
            rope_theta=10000.0,
        ),
        tie_word_embeddings=False,
    ),
    # Mixtures of experts: 8 experts of 32 units (16 per TP rank), 2 per token; Qwen3-MoE with a
    # dense layer among its sparse ones, Qwen2-MoE with a shared expert and unnormalized weights.
    "qwen3_moe": dict(
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        mlp_only_layers=[1],
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        tie_word_embeddings=False,
    ),
    "mixtral": dict(
        hidden_size=64,
        intermediate_size=32,
        num_local_experts=8,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    ),
    "qwen2_moe": dict(
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=False,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    ),
}


@functools.cache
def smollm2_tokenizer():
    """transformers' tokenizer of the default model: the reference for the router's own."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_folder(resolve_model(None)))


@functools.cache
def smollm2_codec():
    """The router's own tokenizer of the default model."""
    from shardline.common.tokenizer import TextCodec

    return TextCodec(tokenizer_folder(resolve_model(None)))


def make_tiny_model(arch: str, path: Path, seed: int = 0, context: int = 2048) -> Path:
    """A random Hugging Face checkpoint (config, safetensors, SmolLM2's tokenizer) in `path`, of
    `context` positions."""
    import transformers

    cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
        "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "smollm3": (transformers.SmolLM3Config, transformers.SmolLM3ForCausalLM),
        "granite": (transformers.GraniteConfig, transformers.GraniteForCausalLM),
        "olmo2": (transformers.Olmo2Config, transformers.Olmo2ForCausalLM),
        "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
        "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
        "gemma3_text": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
        "gpt_oss": (transformers.GptOssConfig, transformers.GptOssForCausalLM),
    }[arch]
    tok = smollm2_tokenizer()
    config = cls[0](
        vocab_size=len(tok),
        max_position_embeddings=context,
        rms_norm_eps=1e-6,
        initializer_range=0.3,
        eos_token_id=tok.eos_token_id,
        bos_token_id=1,
        rope_theta=10000.0,
        **TINY_CONFIGS[arch],
    )
    torch.manual_seed(seed)
    model = cls[1](config).eval()
    with torch.no_grad():  # biases start at 0 and norms at 1; make them matter
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(torch.randn_like(param) * 0.3)
            if arch == "gpt_oss" and name.endswith("experts.gate_up_proj"):  # past its SwiGLU's clamp of 7
                param.mul_(4)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path
