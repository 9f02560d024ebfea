"""Loads weights into a `Transformer`: GGUF (dequantized with the `gguf` package) or safetensors.

A GGUF file is converted once to safetensors in the cache folder, so later starts only mmap it.
"""

from __future__ import annotations

import logging
from collections.abc import Collection

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from shardline.common.files import publish
from shardline.common.gguf_header import read_header
from shardline.common.model_source import ModelSource
from shardline.shard.config import ModelConfig
from shardline.shard.footprint import QK_PERMUTED, Description, Unservable
from shardline.shard.model import Rotary, Transformer, uninitialized

log = logging.getLogger(__name__)

_GGUF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",  # Phi-3's, fused
    "attn_output": "self_attn.o_proj",
    "post_attention_norm": "post_attention_layernorm",  # OLMo 2's, after attention
    "post_ffw_norm": "post_feedforward_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# A mixture's experts: one 3-D tensor per kind in a GGUF, a tensor per expert in a checkpoint.
_GGUF_EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}


def hf_name(gguf_name: str, expert: int | None = None) -> str:
    """The Hugging Face name of a GGUF tensor (of `expert`'s slice of a 3-D experts tensor)."""
    if gguf_name in _GGUF_NAMES:
        return _GGUF_NAMES[gguf_name]
    _, layer, part, kind = gguf_name.split(".")
    if part == "attn_sinks":  # gpt-oss's, a parameter of its own in the checkpoint
        return f"model.layers.{layer}.self_attn.sinks"
    if part in _GGUF_EXPERTS:
        return f"model.layers.{layer}.mlp.experts.{expert}.{_GGUF_EXPERTS[part]}.{kind}"
    return f"model.layers.{layer}.{_GGUF_BLOCK_NAMES[part]}.{kind}"


def _per_expert(gguf_name: str, dims: int) -> bool:
    """Whether a GGUF tensor holds every expert's, one after the other: their weights (3-D) or
    their biases (2-D: gpt-oss's)."""
    return dims == 3 or (dims == 2 and gguf_name.endswith("_exps.bias"))


def unpermute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter interleaves the rows of Q and K for its RoPE layout; undo it."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_gguf(source: ModelSource) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(source.path))
    cfg = ModelConfig.from_gguf(read_header(source.path), source.name)
    sd = {}
    for t in tqdm(reader.tensors, desc=f"dequantizing {source.path.name}", unit="tensor"):
        if t.name.startswith(("rope_factors_", "rope_freqs")):  # hyper-parameters, in the config
            continue
        w = dequantize(t.data, t.tensor_type).astype(np.float32)
        if _per_expert(t.name, len(t.shape)):  # experts: one tensor each
            for e, rows in enumerate(w.reshape(tuple(int(d) for d in reversed(t.shape)))):
                sd[hf_name(t.name, e)] = torch.from_numpy(np.ascontiguousarray(rows))
            continue
        name = hf_name(t.name)
        if cfg.architecture == "phi3" and name.endswith("mlp.up_proj.weight"):  # gate and up, fused
            name = name.replace("up_proj", "gate_up_proj")
        if cfg.pre_norms and cfg.post_norms and t.name.endswith("ffn_norm.weight"):  # Gemma's MLP input norm
            name = name.replace("post_attention_layernorm", "pre_feedforward_layernorm")
        permuted = cfg.architecture in QK_PERMUTED
        if permuted and name.endswith(("q_proj.weight", "q_proj.bias")):
            w = unpermute_rope(w, cfg.num_heads)
        elif permuted and name.endswith(("k_proj.weight", "k_proj.bias")):
            w = unpermute_rope(w, cfg.num_kv_heads)
        if name.endswith("shared_expert_gate.weight"):  # a vector in the file, a one-row layer in the model
            w = w.reshape(1, -1)
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
        split_fused_experts(sd)
        return ModelConfig.from_hf(source.path), sd
    cache = source.cache_dir
    weights, config = cache / "model.safetensors", cache / "shardline_config.json"
    if weights.is_file() and config.is_file():
        return ModelConfig.from_json(config.read_text()), load_file(weights)
    cfg, sd = read_gguf(source)
    # Shards of one replica may convert at the same time; config first, so that a reader that
    # finds the weights finds both whole.
    publish(config, lambda tmp: tmp.write_text(cfg.to_json()))
    publish(weights, lambda tmp: save_file(sd, tmp))
    return cfg, sd


def parameter_sources(cfg: ModelConfig, available: Collection[str]) -> dict[str, list[str]]:
    """Each parameter of a `Transformer` -> the Hugging Face tensors it is made of, concatenated
    along the output dimension in this order: q/k/v into `wqkv`, gate/up into `w13`. A model
    without an `lm_head.weight` among `available` ties its LM head to the embedding."""
    embed = "model.embed_tokens.weight"
    own = {
        "embed.weight": [embed],
        "norm.weight": ["model.norm.weight"],
        "lm_head.weight": ["lm_head.weight" if "lm_head.weight" in available else embed],
    }
    for i in range(cfg.num_layers):
        p, a, o = f"model.layers.{i}.", f"model.layers.{i}.self_attn.", f"layers.{i}."
        own.update(_norm_sources(cfg, p, o))
        if a + "qkv_proj.weight" in available:  # Phi-3's, fused
            own[o + "attn.wqkv.weight"] = [a + "qkv_proj.weight"]
        else:
            own[o + "attn.wqkv.weight"] = [a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"]
        if cfg.qkv_bias:
            own[o + "attn.wqkv.bias"] = [a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"]
        if cfg.qk_norm:
            own[o + "attn.q_norm.weight"] = [a + "q_norm.weight"]
            own[o + "attn.k_norm.weight"] = [a + "k_norm.weight"]
        own[o + "attn.wo.weight"] = [a + "o_proj.weight"]
        if cfg.output_bias:
            own[o + "attn.wo.bias"] = [a + "o_proj.bias"]
        if cfg.attention_sinks:
            own[o + "attn.sinks"] = [a + "sinks"]
        if cfg.is_sparse(i):
            own.update(_moe_sources(cfg, p, o + "mlp.", available))
        elif p + "mlp.gate_up_proj.weight" in available:  # Phi-3's, fused
            own[o + "mlp.w13.weight"] = [p + "mlp.gate_up_proj.weight"]
            own[o + "mlp.w2.weight"] = [p + "mlp.down_proj.weight"]
        else:
            own[o + "mlp.w13.weight"] = [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]
            own[o + "mlp.w2.weight"] = [p + "mlp.down_proj.weight"]
    return own


def _norm_sources(cfg: ModelConfig, p: str, o: str) -> dict[str, list[str]]:
    """A block's norms (`Block`'s) from the checkpoint's names, which say where a norm sits only
    together: Llama's `post_attention_layernorm` is the MLP's input norm, OLMo 2's is attention's
    output norm."""
    own = {}
    if cfg.pre_norms:
        own[o + "attn_norm.weight"] = [p + "input_layernorm.weight"]
        mlp_input = "pre_feedforward_layernorm" if cfg.post_norms else "post_attention_layernorm"
        own[o + "mlp_norm.weight"] = [p + mlp_input + ".weight"]
    if cfg.post_norms:
        own[o + "attn_out_norm.weight"] = [p + "post_attention_layernorm.weight"]
        own[o + "mlp_out_norm.weight"] = [p + "post_feedforward_layernorm.weight"]
    return own


def _moe_sources(cfg: ModelConfig, p: str, o: str, available: Collection[str]) -> dict[str, list[str]]:
    """A sparse layer's parameters (`MoE`'s) from Qwen-MoE's names, or Mixtral's where the
    checkpoint has them."""
    own = {}
    if f"{p}block_sparse_moe.gate.weight" in available:  # Mixtral: w1 gate, w3 up, w2 down
        own[o + "gate.weight"] = [f"{p}block_sparse_moe.gate.weight"]
        for e in range(cfg.num_experts):
            x = f"{p}block_sparse_moe.experts.{e}."
            own[f"{o}experts.{e}.w13.weight"] = [x + "w1.weight", x + "w3.weight"]
            own[f"{o}experts.{e}.w2.weight"] = [x + "w2.weight"]
        return own
    own[o + "gate.weight"] = [p + "mlp.gate.weight"]
    kinds = ("weight", "bias") if cfg.expert_bias else ("weight",)
    if cfg.expert_bias:
        own[o + "gate.bias"] = [p + "mlp.gate.bias"]
    experts = [(f"{o}experts.{e}.", f"{p}mlp.experts.{e}.") for e in range(cfg.num_experts)]
    if cfg.shared_expert_intermediate_size:
        experts.append((o + "shared.", p + "mlp.shared_expert."))
        own[o + "shared_gate.weight"] = [p + "mlp.shared_expert_gate.weight"]
    for mine, theirs in experts:
        for kind in kinds:
            own[f"{mine}w13.{kind}"] = [f"{theirs}gate_proj.{kind}", f"{theirs}up_proj.{kind}"]
            own[f"{mine}w2.{kind}"] = [f"{theirs}down_proj.{kind}"]
    return own


def split_fused_experts(sd: dict[str, torch.Tensor]) -> None:
    """gpt-oss's checkpoint holds each layer's experts as 3-D tensors of x @ W form, gate and up
    interleaved unit by unit (`experts.gate_up_proj` [E, hidden, 2 * units]), and its router as
    `mlp.router`: renamed in place to one Qwen-named tensor per expert and kind, as llama.cpp's
    converter splits them."""
    for name in [n for n in sd if n.endswith("mlp.experts.gate_up_proj")]:
        p = name.removesuffix("experts.gate_up_proj")
        gate_up, gate_up_bias = sd.pop(name), sd.pop(name + "_bias")
        down, down_bias = sd.pop(p + "experts.down_proj"), sd.pop(p + "experts.down_proj_bias")
        for e in range(gate_up.shape[0]):
            x = f"{p}experts.{e}."
            sd[x + "gate_proj.weight"] = gate_up[e, :, ::2].T.contiguous()
            sd[x + "up_proj.weight"] = gate_up[e, :, 1::2].T.contiguous()
            sd[x + "gate_proj.bias"], sd[x + "up_proj.bias"] = gate_up_bias[e, ::2], gate_up_bias[e, 1::2]
            sd[x + "down_proj.weight"], sd[x + "down_proj.bias"] = down[e].T.contiguous(), down_bias[e]
        sd[p + "gate.weight"], sd[p + "gate.bias"] = sd.pop(p + "router.weight"), sd.pop(p + "router.bias")


def qkv_rows(cfg: ModelConfig) -> torch.Tensor | None:
    """The rows of a whole `wqkv` in the serving order: each q and k head's as Rotary.head_order
    lays them out, v's as they are. None: as the checkpoint holds them."""
    order = Rotary.head_order(cfg)
    if order is None:
        return None
    hd, heads = cfg.head_dim, cfg.num_heads + cfg.num_kv_heads
    turned = [h * hd + o for h in range(heads) for o in order]
    return torch.tensor(turned + list(range(heads * hd, (heads + cfg.num_kv_heads) * hd)))


def load_hf_state_dict(model: Transformer, sd: dict[str, torch.Tensor]) -> None:
    """Fills `model` from Hugging Face-named tensors (what safetensors checkpoints and our GGUF
    loader produce), fusing them as `parameter_sources` says."""
    own, sources = {}, parameter_sources(model.cfg, sd)
    missing = [t for parts in sources.values() for t in parts if t not in sd]
    if missing:  # a config that does not describe its checkpoint: refused, not a crash to restart
        raise Unservable(f"{model.cfg.name}: the checkpoint has no {', '.join(missing[:3])}, which its config names")
    for name, parts in sources.items():
        # Own every tensor: weights read from an mmap'd checkpoint would otherwise keep the whole
        # file mapped, and the pages already copied into fused matrices resident twice.
        own[name] = torch.cat([sd[t] for t in parts]) if len(parts) > 1 else sd[parts[0]].clone()
    if offset := model.cfg.norm_offset:  # Gemma's norms scale by 1 + w
        for name in own:
            if name.endswith("norm.weight"):
                own[name] = own[name] + offset
    rows = qkv_rows(model.cfg)
    if rows is not None:
        for name in own:
            if name.endswith(("attn.wqkv.weight", "attn.wqkv.bias")):
                own[name] = own[name].index_select(0, rows)
    model.load_state_dict(own, strict=True, assign=True)
    if model.cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed.weight


def build_model(source: ModelSource, dtype: torch.dtype, device: torch.device) -> Transformer:
    cfg, sd = load_state_dict(source)
    with uninitialized():
        model = Transformer(cfg)
    load_hf_state_dict(model, {k: v.to(device=device, dtype=dtype) for k, v in sd.items()})
    with torch.device(device):  # computed where it is used, as the reference computes it
        model.build_rotary()
    return model.eval().requires_grad_(False)


def gguf_types(model: Description) -> dict[str, str]:
    """Hugging Face tensor name -> GGUF type name (Q4_1, Q8_0, F32, ...), from the file's header."""
    types = {}
    for t in model.tensors:
        for e in range(t.dims[-1]) if _per_expert(t.name, len(t.dims)) else [None]:
            types[hf_name(t.name, e)] = t.kind
    return types
