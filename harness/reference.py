"""`transformers`' own model over exactly the weights Shardline serves (a GGUF dequantized as the
shard does it): the reference of the parity tests and the peer of the benchmarks."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from shardline.common.model_source import ModelSource
from shardline.shard.config import ModelConfig
from shardline.shard.weights import load_state_dict

_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def write_hf_config(cfg: ModelConfig, path: Path) -> None:
    """A config.json that `transformers` reads."""
    path.write_text(
        json.dumps(
            {
                "architectures": [_ARCHITECTURES[cfg.architecture]],
                "model_type": cfg.architecture,
                "vocab_size": cfg.vocab_size,
                "hidden_size": cfg.hidden_size,
                "intermediate_size": cfg.intermediate_size,
                "num_hidden_layers": cfg.num_layers,
                "num_attention_heads": cfg.num_heads,
                "num_key_value_heads": cfg.num_kv_heads,
                "head_dim": cfg.head_dim,
                "rope_theta": cfg.rope_theta,
                "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
                "rms_norm_eps": cfg.rms_norm_eps,
                "max_position_embeddings": cfg.max_position,
                "tie_word_embeddings": cfg.tie_word_embeddings,
                "eos_token_id": cfg.eos_token_ids,
                "hidden_act": "silu",
                "torch_dtype": "float32",
            }
        )
    )


def transformers_model(source: ModelSource, folder: Path):
    """`folder` receives the config.json the model is built from."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg, sd = load_state_dict(source)
    write_hf_config(cfg, folder / "config.json")
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=torch.float32)
    model.load_state_dict(sd, strict=False)
    model.tie_weights()
    return model.eval()
