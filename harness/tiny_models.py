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


def make_tiny_model(arch: str, path: Path, seed: int = 0) -> Path:
    """A random Hugging Face checkpoint (config, safetensors, SmolLM2's tokenizer) in `path`."""
    import transformers

    cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[arch]
    tok = smollm2_tokenizer()
    config = cls[0](
        vocab_size=len(tok),
        max_position_embeddings=2048,
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
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path
