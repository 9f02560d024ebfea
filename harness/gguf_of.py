"""A Hugging Face checkpoint written as a GGUF the way llama.cpp's converter writes one (its
tensor names, Q/K rows permuted for llama's RoPE, a mixture's experts stacked into one 3-D tensor
per kind, a shared expert's gate as a vector), every tensor F32 so that it holds the checkpoint's
weights exactly, with SmolLM2's tokenizer (the tiny models' own). What the tests serve to check
that a GGUF and its checkpoint give the same tokens; `llama-quantize` makes quantized files of it.
"""

from __future__ import annotations

import functools
import json
import math
import re
from pathlib import Path

import numpy as np

# Hugging Face model_type -> GGUF general.architecture (Mixtral is llama with experts in GGUF)
ARCHITECTURES = {
    "llama": "llama",
    "mixtral": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen2_moe": "qwen2moe",
    "qwen3_moe": "qwen3moe",
    "smollm3": "smollm3",
    "granite": "granite",
    "olmo2": "olmo2",
    "phi3": "phi3",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",
    "gpt_oss": "gpt-oss",
}
# Architectures whose Q/K rows the converter permutes: its LlamaModel and those built on it
_PERMUTED = ("llama", "smollm3", "granite")
_LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.qkv_proj": "attn_qkv",  # Phi-3's fused projections, fused in its GGUF too
    "mlp.gate_up_proj": "ffn_up",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
    "block_sparse_moe.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}
# OLMo 2's norms follow its sublayers: its `post_attention_layernorm` is no MLP input norm
_OLMO2_LAYER = {"post_attention_layernorm": "post_attention_norm", "post_feedforward_layernorm": "post_ffw_norm"}
_GEMMA3_LAYER = _OLMO2_LAYER | {"pre_feedforward_layernorm": "ffn_norm"}  # and norms before them too
# gpt-oss's MLP input norm under OLMo 2's name, its router as any mixture's
_GPT_OSS_LAYER = {"post_attention_layernorm": "post_attention_norm", "mlp.router": "ffn_gate_inp"}
_EXPERT = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight")
_FUSED_EXPERTS = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(_bias)?")
_EXPERT_KINDS = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down"}


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's Q/K row order (shard/weights.py's `unpermute_rope` undoes it)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(folder: Path) -> dict[str, np.ndarray]:
    """The checkpoint's tensors under GGUF's names, fp32, as llama.cpp lays them out."""
    from safetensors.numpy import load_file

    raw = json.loads((folder / "config.json").read_text())
    arch = ARCHITECTURES[raw["model_type"]]
    family = {"olmo2": _OLMO2_LAYER, "gemma2": _GEMMA3_LAYER, "gemma3": _GEMMA3_LAYER, "gpt-oss": _GPT_OSS_LAYER}
    names = _LAYER | family.get(arch, {})
    heads, kv_heads = raw["num_attention_heads"], raw.get("num_key_value_heads", raw["num_attention_heads"])
    sd = {}
    for f in sorted(folder.glob("*.safetensors")):
        sd.update(load_file(f))
    out, experts = {}, {}
    for name, w in sd.items():
        w = w.astype(np.float32)
        if arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):  # 1 + w, as the converter adds it
            w = w + 1
        if m := _EXPERT.fullmatch(name):
            layer, expert, kind = int(m[1]), int(m[2]), _EXPERT_KINDS[m[3]]
            experts.setdefault((layer, kind), {})[expert] = w
            continue
        if m := _FUSED_EXPERTS.fullmatch(name):  # gpt-oss's, x @ W, gate and up interleaved
            layer, kind, bias = m[1], m[2], m[3]
            at = f"blk.{layer}.ffn_{{}}_exps.{'bias' if bias else 'weight'}"
            if kind == "down_proj":
                out[at.format("down")] = w if bias else w.swapaxes(1, 2)
            else:
                gate, up = (
                    (w[..., ::2], w[..., 1::2]) if bias else (w[..., ::2].swapaxes(1, 2), w[..., 1::2].swapaxes(1, 2))
                )
                out[at.format("gate")], out[at.format("up")] = gate, up
            continue
        if name.endswith("self_attn.sinks"):
            out[name.replace("model.layers.", "blk.").replace("self_attn.sinks", "attn_sinks.weight")] = w
            continue
        if name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"):
            out[{"model.embed_tokens.weight": "token_embd", "lm_head.weight": "output"}.get(name, "output_norm")] = w
            continue
        layer, part, kind = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)", name).groups()
        gguf = names[part]
        if arch in _PERMUTED and gguf in ("attn_q", "attn_k"):
            w = _permute(w, heads if gguf == "attn_q" else kv_heads)
        if gguf == "ffn_gate_inp_shexp":
            w = w.reshape(-1)  # llama.cpp's is a vector of n_embd
        out[f"blk.{layer}.{gguf}.{kind}"] = w
    for (layer, kind), by_expert in experts.items():
        out[f"blk.{layer}.ffn_{kind}_exps.weight"] = np.stack([by_expert[e] for e in sorted(by_expert)])
    return {(k if k.count(".") else k + ".weight"): v for k, v in out.items()}


def add_smollm2_tokenizer(writer) -> int:
    """Writes SmolLM2's tokenizer (the default model's GGUF fields) into `writer`; returns its
    vocabulary's size."""
    from gguf import GGUFValueType

    fields, vocab = _smollm2_tokenizer_fields()
    for key, kind, contents in fields:
        if kind is GGUFValueType.ARRAY:
            writer.add_array(key, contents)
        else:
            writer.add_key_value(key, contents, kind)
    return vocab


@functools.cache
def _smollm2_tokenizer_fields() -> tuple[list, int]:
    """(key, type, contents) of each tokenizer field, read once a process: the gguf package reads
    a 49k-token vocabulary in seconds."""
    from gguf import GGUFReader

    from shardline.common.model_source import resolve_model

    smollm2 = GGUFReader(str(resolve_model(None).path))
    fields = [(k, f.types[0], f.contents()) for k, f in smollm2.fields.items() if k.startswith("tokenizer.")]
    return fields, len(smollm2.fields["tokenizer.ggml.tokens"].data)


def _add_phi3_rotary(writer, raw: dict, head_dim: int) -> None:
    """Phi-3's keys and tensors as the converter's Phi3MiniModel writes them: the turning
    dimensions, the window (0: none), and LongRoPE's factors as two F32 tensors with the
    attention factor it derives from the context's growth."""
    rope = raw.get("rope_parameters") or {}
    turned = int(head_dim * rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)))
    original = rope.get("original_max_position_embeddings") or raw["original_max_position_embeddings"]
    writer.add_rope_scaling_orig_ctx_len(original)
    writer.add_rope_dimension_count(turned)
    writer.add_sliding_window(raw.get("sliding_window") or 0)
    if not rope.get("long_factor"):
        return
    scale = raw["max_position_embeddings"] / original
    writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
    writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
    writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))


def _add_gemma3_keys(writer, raw: dict) -> None:
    """Gemma 3's keys as the converter's Gemma3Model writes them: the local layers' rotary base,
    the global layers' linear scaling (their base is the file's), the window and the logit cap
    (the 5:1 pattern is llama.cpp's default, the attention scale it derives from the size)."""
    rope = raw["rope_parameters"].get("full_attention", raw["rope_parameters"])
    writer.add_rope_freq_base_swa(raw["rope_parameters"]["sliding_attention"]["rope_theta"])
    if rope.get("rope_type") == "linear":
        from gguf import RopeScalingType

        writer.add_rope_scaling_type(RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    if raw.get("final_logit_softcapping"):
        writer.add_final_logit_softcapping(raw["final_logit_softcapping"])
    writer.add_sliding_window(raw["sliding_window"])


def write_gguf_of(folder: Path, path: Path, expert_type: str = "F32") -> Path:
    """`folder`'s checkpoint as an F32 GGUF at `path`; its experts' weights MXFP4 where asked, as
    llama.cpp's converter writes gpt-oss's (see `with_mxfp4_experts`)."""
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize

    raw = json.loads((folder / "config.json").read_text())
    arch = ARCHITECTURES[raw["model_type"]]
    heads = raw["num_attention_heads"]
    head_dim = (raw.get("head_dim") if arch != "granite" else None) or raw["hidden_size"] // heads
    rope = raw.get("rope_parameters") or {}
    rope = rope.get("full_attention", rope)  # Gemma 3's: per layer type, the file's base the global layers'
    writer = GGUFWriter(str(path), arch)
    writer.add_name(folder.name)
    writer.add_context_length(raw["max_position_embeddings"])
    writer.add_embedding_length(raw["hidden_size"])
    writer.add_feed_forward_length(raw["intermediate_size"])
    writer.add_block_count(raw["num_hidden_layers"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(raw.get("num_key_value_heads", heads))
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(float(raw.get("rope_theta") or rope.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(raw["rms_norm_eps"])
    experts = raw.get("num_experts") or raw.get("num_local_experts") or 0
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(raw["num_experts_per_tok"])
        if "moe_intermediate_size" in raw or arch == "gpt-oss":
            writer.add_expert_feed_forward_length(raw.get("moe_intermediate_size") or raw["intermediate_size"])
        if raw.get("shared_expert_intermediate_size"):
            writer.add_expert_shared_feed_forward_length(raw["shared_expert_intermediate_size"])
    for key, add in [
        ("attention_multiplier", writer.add_attention_scale),
        ("embedding_multiplier", writer.add_embedding_scale),
        ("residual_multiplier", writer.add_residual_scale),
        ("logits_scaling", writer.add_logit_scale),
    ]:  # Granite's, as the converter writes them
        if raw.get(key):
            add(raw[key])
    if arch == "phi3":
        _add_phi3_rotary(writer, raw, head_dim)
    if arch == "gemma3":
        _add_gemma3_keys(writer, raw)
    if arch == "gpt-oss":
        writer.add_sliding_window(raw["sliding_window"])
    if arch == "gemma2":  # the converter's Gemma2Model
        writer.add_attn_logit_softcapping(raw["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(raw["final_logit_softcapping"])
        writer.add_sliding_window(raw["sliding_window"])
    if rope.get("rope_type") == "yarn":  # the converter's TextModel
        from gguf import RopeScalingType

        writer.add_rope_scaling_type(RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        writer.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        writer.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    if rope.get("rope_type") == "llama3":  # the converter's LlamaModel: the divisors as a tensor
        from shardline.shard.config import ModelConfig

        writer.add_tensor("rope_freqs.weight", np.array(ModelConfig.from_hf(folder).rope_factors, dtype=np.float32))
    add_smollm2_tokenizer(writer)
    for name, w in gguf_tensors(folder).items():
        if expert_type == "MXFP4" and re.fullmatch(r"blk\.\d+\.ffn_\w+_exps\.weight", name):
            writer.add_tensor(name, quantize(w, GGMLQuantizationType.MXFP4), raw_dtype=GGMLQuantizationType.MXFP4)
        else:
            writer.add_tensor(name, np.ascontiguousarray(w))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def with_mxfp4_experts(folder: Path, out: Path) -> Path:
    """A copy of gpt-oss's checkpoint `folder` at `out` whose experts' weights are rounded to MXFP4
    along the rows a GGUF blocks them by (each expert's gate, up and down as the file holds them):
    the weights an MXFP4 GGUF of it holds exactly, for transformers to be the reference of."""
    import shutil

    from gguf import GGMLQuantizationType as T
    from gguf.quants import dequantize, quantize
    from safetensors.numpy import load_file, save_file

    def rounded(w: np.ndarray) -> np.ndarray:  # blocks of 32 along the last axis
        return dequantize(quantize(np.ascontiguousarray(w, dtype=np.float32), T.MXFP4), T.MXFP4).reshape(w.shape)

    shutil.copytree(folder, out)
    sd = load_file(out / "model.safetensors")
    for name in [n for n in sd if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        sd[name] = rounded(sd[name].swapaxes(1, 2)).swapaxes(1, 2).copy()  # x @ W: the file's rows are W's columns
    save_file(sd, out / "model.safetensors", metadata={"format": "pt"})
    return out
