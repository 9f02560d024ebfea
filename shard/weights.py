"""Loads weights into a `Transformer`: GGUF (dequantized with the `gguf` package) or safetensors.

A GGUF file is converted once to safetensors in the cache folder, so later starts only mmap it.
"""
from __future__ import annotations

import json
import logging
import os

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from shard.config import ModelConfig
from shard.model import Rotary, Transformer
from common.model_source import ModelSource

log = logging.getLogger(__name__)

_GGUF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_BLOCK_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def hf_name(gguf_name: str) -> str:
    if gguf_name in _GGUF_NAMES:
        return _GGUF_NAMES[gguf_name]
    _, layer, part, kind = gguf_name.split(".")
    return f"model.layers.{layer}.{_GGUF_BLOCK_NAMES[part]}.{kind}"


def unpermute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter interleaves the rows of Q and K for its RoPE layout; undo it."""
    return (w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:])
             .swapaxes(1, 2).reshape(w.shape))


def read_gguf(source: ModelSource) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(source.path))
    cfg = ModelConfig.from_gguf(reader, source.name)
    sd = {}
    for t in tqdm(reader.tensors, desc=f"dequantizing {source.path.name}", unit="tensor"):
        w = dequantize(t.data, t.tensor_type).astype(np.float32)
        name = hf_name(t.name)
        if cfg.architecture == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            w = unpermute_rope(w, cfg.num_heads)
        elif cfg.architecture == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            w = unpermute_rope(w, cfg.num_kv_heads)
        sd[name] = torch.from_numpy(np.ascontiguousarray(w))
    return cfg, sd


def load_state_dict(source: ModelSource) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Hugging Face-named fp32/bf16 tensors for the source, converting a GGUF only once."""
    if source.kind == "hf":
        sd = {}
        files = sorted(source.path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {source.path}")
        for f in tqdm(files, desc="loading safetensors", unit="file"):
            sd.update(load_file(f))
        return ModelConfig.from_hf(source.path), sd
    cache = source.cache_dir
    weights, config = cache / "model.safetensors", cache / "shardline_config.json"
    if weights.is_file() and config.is_file():
        return ModelConfig.from_json(config.read_text()), load_file(weights)
    cfg, sd = read_gguf(source)
    cache.mkdir(parents=True, exist_ok=True)
    # Shards of one replica may convert at the same time: each writes its own temporary file and
    # renames it into place, config first, so a reader that finds the weights finds both whole.
    config.write_text(cfg.to_json())
    tmp = weights.with_suffix(f".{os.getpid()}.tmp")
    save_file(sd, tmp)
    tmp.replace(weights)
    return cfg, sd


def build_model(source: ModelSource, dtype: torch.dtype, device: torch.device) -> Transformer:
    cfg, sd = load_state_dict(source)
    with torch.device("meta"):
        model = Transformer(cfg)
    model.load_hf_state_dict({k: v.to(device=device, dtype=dtype) for k, v in sd.items()})
    with torch.device(device):
        model.rotary = Rotary(cfg.head_dim, cfg.rope_theta, cfg.max_position)
    return model.eval().requires_grad_(False)


# GGUF types whose blocks are groups of 32 weights on a 4-bit grid: int4 reproduces them exactly.
_FOUR_BIT = {"Q4_0", "Q4_1", "Q4_K"}
_FLOAT = {"F32", "F16", "BF16", "F64"}


def gguf_types(source: ModelSource) -> dict[str, str]:
    """Hugging Face tensor name -> GGUF type name (Q4_1, Q8_0, F32, ...). Parsing the file's header
    takes seconds, so the answer is kept beside the converted weights."""
    from gguf import GGUFReader

    cached = source.cache_dir / "gguf_types.json"
    if cached.is_file():
        return json.loads(cached.read_text())
    types = {hf_name(t.name): t.tensor_type.name for t in GGUFReader(str(source.path)).tensors}
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_suffix(f".{os.getpid()}.tmp")  # shards of one replica may race here
    tmp.write_text(json.dumps(types))
    tmp.replace(cached)
    return types


def mark_quantized(model: Transformer, source: ModelSource, weights: str, quantize: str) -> None:
    """Tags each linear layer that is to be served quantized with `quant_bits` (4 or 8), for
    `kernels.quantized.quantize` to swap after any slicing.

    `weights="native"` keeps a GGUF's quantized layers quantized: 4-bit block types as int4, the
    others as int8. `quantize` ("int4" | "int8" | "") quantizes dense layers at load: with int4 the
    block layers take int4 and the LM head int8, whose logits suffer most from 4 bits."""
    def parts(i: int) -> dict[str, list[str]]:
        p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        return {f"layers.{i}.attn.wqkv": [a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"],
                f"layers.{i}.attn.wo": [a + "o_proj.weight"],
                f"layers.{i}.mlp.w13": [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"],
                f"layers.{i}.mlp.w2": [p + "mlp.down_proj.weight"]}

    layers = {}
    for i in range(model.cfg.num_layers):
        layers.update(parts(i))
    types = gguf_types(source) if source.kind == "gguf" and weights == "native" else {}
    head = "lm_head.weight" if "lm_head.weight" in types else "model.embed_tokens.weight"
    for name, tensors in [*layers.items(), ("lm_head", [head])]:
        kinds = {types.get(t, "F32") for t in tensors}
        if quantize == "int8" or (quantize == "int4" and name == "lm_head"):
            bits = 8
        elif quantize == "int4" or kinds <= _FOUR_BIT:
            bits = 4
        elif not kinds <= _FLOAT:
            bits = 8
        else:
            continue
        model.get_submodule(name).quant_bits = bits


def write_hf_config(cfg: ModelConfig, path) -> None:
    """A config.json that `transformers` reads, for reference runs over the same weights."""
    arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
    path.write_text(json.dumps({
        "architectures": [arch[cfg.architecture]], "model_type": cfg.architecture,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim, "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta}, "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position, "tie_word_embeddings": cfg.tie_word_embeddings,
        "eos_token_id": cfg.eos_token_ids, "hidden_act": "silu", "torch_dtype": "float32",
    }))


def transformers_model(source: ModelSource, folder):
    """`transformers`' own model class over exactly the weights Shardline serves (a GGUF
    dequantized as the shard does it): the reference for parity tests and the peer in benchmarks.
    `folder` receives the config.json it is built from."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg, sd = load_state_dict(source)
    write_hf_config(cfg, folder / "config.json")
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=torch.float32)
    model.load_state_dict(sd, strict=False)
    model.tie_weights()
    return model.eval()
