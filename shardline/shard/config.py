"""The model hyper-parameters a shard needs, read from a Hugging Face config.json or GGUF metadata."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from shardline.common.gguf_header import GgufHeader
from shardline.shard.rope_scaling import rotary_from_gguf, rotary_from_hf


@dataclass
class ModelConfig:
    """Llama-family decoder: Llama 2/3, SmolLM2, Qwen2/2.5 (qkv bias), Qwen3 (q/k norm), and their
    mixtures of experts: Mixtral (`llama` with experts), Qwen2-MoE (shared expert) and Qwen3-MoE;
    Mistral (Llama's block; served where its sliding window is off or spans the context), SmolLM3
    (no rotary embedding in `nope_layers`), Granite 3 (the four scales) and OLMo 2 (norms after
    each sublayer rather than before, q/k norms across all heads), Phi-3/Phi-4-mini (fused
    projections in its files; a partial rotary embedding with LongRoPE's per-frequency factors)
    and Gemma 3 (local sliding-window layers, GELU, norms before and after each sublayer; Gemma 2's
    without q/k norms, its attention scores capped); gpt-oss
    (sliding layers in turn with full ones, attention sinks, biases, clamped SwiGLU experts, YaRN).

    A mixture's layers are sparse (`num_experts` MLPs of `expert_intermediate_size`, a token's
    `experts_per_token` picked by a router) but for `dense_layers` (an MLP of `intermediate_size`)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_position: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    eos_token_ids: list[int] = field(default_factory=list)
    name: str = ""
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's expert every token takes, gated by a sigmoid
    norm_topk_prob: bool = True  # the picked experts' weights renormalized to sum to 1
    dense_layers: list[int] = field(default_factory=list)
    nope_layers: list[int] = field(default_factory=list)  # layers whose q and k do not rotate (SmolLM3's every 4th)
    qk_norm_across_heads: bool = False  # OLMo 2: q and k each normalized as one vector of all heads
    pre_norms: bool = True  # an RMSNorm on each sublayer's input (attention's, the MLP's)
    post_norms: bool = False  # an RMSNorm on each sublayer's output, before the residual add (OLMo 2)
    # Granite's multipliers: the embedding's output, each sublayer's output before the residual
    # add, the softmax's scale (0: head_dim ** -0.5) and the logits' divisor.
    embedding_scale: float = 1.0
    residual_scale: float = 1.0
    attention_scale: float = 0.0
    logit_scale: float = 1.0
    # The rotary embedding (shard/model.py's Rotary): it turns the first `rotary_dim` of a head's
    # dimensions (0: all), its frequencies divided by `rope_factors` (none: by 1) and, from
    # position `rope_long_from` on (0: never), by `rope_long_factors` (LongRoPE's), its cos and
    # sin scaled by `rope_attention_factor`.
    rotary_dim: int = 0
    rope_factors: list[float] = field(default_factory=list)
    rope_long_factors: list[float] = field(default_factory=list)
    rope_long_from: int = 0
    rope_attention_factor: float = 1.0
    rope_scale: float = 1.0  # linear scaling (Gemma 3's global layers): frequencies divided by it
    # Sliding-window attention (Gemma 3's local layers, Mistral's and Phi-3's where configured):
    # in `sliding_layers` a token sees the last `sliding_window` positions only (0: every layer
    # sees the whole context), turned by the rotary tables of base `local_rope_theta` where that
    # is set (Gemma 3's local layers; else the global tables).
    sliding_window: int = 0
    sliding_layers: list[int] = field(default_factory=list)
    local_rope_theta: float = 0.0
    # Gemma's: GELU (tanh approximation) in the MLP, norms that scale by 1 + w (`norm_offset`,
    # added to a checkpoint's norm weights at load; llama.cpp's converter adds it to a GGUF's),
    # and a soft cap on the logits (cap * tanh(logits / cap); 0: none).
    mlp_activation: str = "silu"  # silu | gelu_tanh | clamped_swiglu
    norm_offset: float = 0.0
    final_logit_softcap: float = 0.0
    attention_softcap: float = 0.0  # Gemma 2's cap on attention scores (cap * tanh(score / cap); 0: none)
    # gpt-oss's: a bias on attention's output projection (Llama's too where `attention_bias`), a
    # learned logit per head in each softmax's denominator (an attention sink), biases on the
    # router and every expert's projections, and its experts' clamped SwiGLU (gate at most
    # `activation_limit`, up within it: (up + 1) * gate * sigmoid(activation_alpha * gate)).
    output_bias: bool = False
    attention_sinks: bool = False
    expert_bias: bool = False
    activation_limit: float = 0.0
    activation_alpha: float = 1.0

    def is_sparse(self, layer: int) -> bool:
        return self.num_experts > 0 and layer not in self.dense_layers

    @property
    def active_intermediate_size(self) -> int:
        """The MLP units a token runs through in a sparse layer (or the dense MLP's)."""
        if not self.num_experts:
            return self.intermediate_size
        return self.experts_per_token * self.expert_intermediate_size + self.shared_expert_intermediate_size

    @property
    def attention_pair_cost(self) -> float:
        """One attention pair's multiply-adds (q·k and p·v over every head for a new token and one
        token it sees) over one token's through the weights of a layer."""
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        weights = self.hidden_size * (2 * q + 2 * kv + 3 * self.active_intermediate_size)
        return 2 * q / weights

    @classmethod
    def from_hf(cls, path: Path) -> ModelConfig:
        raw = json.loads((path / "config.json").read_text())
        arch = raw.get("model_type", "llama")
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        local_rope = {}
        if "full_attention" in rope:  # per layer type (Gemma 3's)
            rope, local_rope = rope["full_attention"], rope.get("sliding_attention", {})
        heads = raw["num_attention_heads"]
        head_dim = raw.get("head_dim") or raw["hidden_size"] // heads
        eos = raw.get("eos_token_id")
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        experts = raw.get("num_experts") or raw.get("num_local_experts") or 0
        layers = raw["num_hidden_layers"]
        step = raw.get("decoder_sparse_step") or 1
        dense = [i for i in range(layers) if i in (raw.get("mlp_only_layers") or []) or (i + 1) % step]
        rotates = raw.get("no_rope_layers") or [1] * layers  # SmolLM3's: 1 where the layer rotates
        fields = dict(
            architecture=arch,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads", heads),
            head_dim=head_dim,
            rope_theta=float(raw.get("rope_theta") or rope.get("rope_theta", 10000.0)),
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            max_position=raw.get("max_position_embeddings", 4096),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            qkv_bias=arch in ("qwen2", "qwen2_moe") or raw.get("attention_bias", False),
            output_bias=raw.get("attention_bias", False),
            qk_norm=arch in ("qwen3", "qwen3_moe", "olmo2", "gemma3_text"),
            eos_token_ids=eos,
            name=raw.get("_name_or_path") or path.name,
            num_experts=experts,
            experts_per_token=raw.get("num_experts_per_tok", 0) if experts else 0,
            expert_intermediate_size=(raw.get("moe_intermediate_size") or raw["intermediate_size"]) if experts else 0,
            shared_expert_intermediate_size=raw.get("shared_expert_intermediate_size", 0) if experts else 0,
            norm_topk_prob=raw.get("norm_topk_prob", arch in ("mixtral", "gpt_oss")),
            dense_layers=dense if experts else [],
            nope_layers=[i for i in range(layers) if not rotates[i]],
            qk_norm_across_heads=arch == "olmo2",
            pre_norms=arch != "olmo2",
            post_norms=arch in ("olmo2", "gemma2", "gemma3_text"),
            embedding_scale=raw.get("embedding_multiplier", 1.0),
            residual_scale=raw.get("residual_multiplier", 1.0),
            attention_scale=raw.get("attention_multiplier", 0.0),
            logit_scale=raw.get("logits_scaling", 1.0),
        )
        fields |= rotary_from_hf(raw, rope, head_dim) | _windows_from_hf(raw, arch, layers, local_rope)
        gemma = arch in ("gemma2", "gemma3_text")
        family = _gemma_from_hf(raw) if gemma else _gpt_oss_from_hf(raw) if arch == "gpt_oss" else {}
        return cls(**fields | family)

    @classmethod
    def from_gguf(cls, header: GgufHeader, name: str) -> ModelConfig:
        field_value = header.get
        arch = field_value("general.architecture")
        window = field_value(f"{arch}.attention.sliding_window")
        if (
            window
            and window < field_value(f"{arch}.context_length", 4096)
            and arch not in ("gemma2", "gemma3", "gpt-oss")
        ):
            raise ValueError(f"sliding-window attention ({window} tokens) is not served yet")
        tensors = {t.name for t in header.tensors}
        hidden = field_value(f"{arch}.embedding_length")
        heads = field_value(f"{arch}.attention.head_count")
        eos = field_value("tokenizer.ggml.eos_token_id")
        layers = field_value(f"{arch}.block_count")
        experts = field_value(f"{arch}.expert_count", 0)
        fields = dict(
            architecture=arch,
            vocab_size=len(header.metadata["tokenizer.ggml.tokens"]),
            hidden_size=hidden,
            intermediate_size=field_value(f"{arch}.feed_forward_length"),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=field_value(f"{arch}.attention.head_count_kv", heads),
            head_dim=field_value(f"{arch}.attention.key_length", hidden // heads),
            rope_theta=float(field_value(f"{arch}.rope.freq_base", 10000.0)),
            rms_norm_eps=float(field_value(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
            max_position=field_value(f"{arch}.context_length", 4096),
            tie_word_embeddings="output.weight" not in tensors,
            qkv_bias="blk.0.attn_q.bias" in tensors,
            output_bias="blk.0.attn_output.bias" in tensors,
            attention_sinks="blk.0.attn_sinks.weight" in tensors,
            expert_bias="blk.0.ffn_gate_inp.bias" in tensors,
            qk_norm="blk.0.attn_q_norm.weight" in tensors,
            eos_token_ids=[] if eos is None else [int(eos)],
            name=name,
            num_experts=experts,
            experts_per_token=field_value(f"{arch}.expert_used_count", 0) if experts else 0,
            # Mixtral's experts are as wide as its feed_forward_length says; Qwen's say their own
            expert_intermediate_size=(
                field_value(f"{arch}.expert_feed_forward_length") or field_value(f"{arch}.feed_forward_length")
            )
            if experts
            else 0,
            shared_expert_intermediate_size=field_value(f"{arch}.expert_shared_feed_forward_length", 0),
            # as llama.cpp reads each: Qwen2-MoE's weights are the softmax's, the others' renormalized
            norm_topk_prob=bool(field_value(f"{arch}.expert_weights_norm", arch != "qwen2moe")),
            dense_layers=[i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensors] if experts else [],
            # llama.cpp's SmolLM3 leaves every 4th layer unrotated; its GGUF says nothing of it
            nope_layers=[i for i in range(layers) if (i + 1) % 4 == 0] if arch == "smollm3" else [],
            qk_norm_across_heads=arch == "olmo2",
            pre_norms="blk.0.attn_norm.weight" in tensors,
            post_norms="blk.0.post_ffw_norm.weight" in tensors,  # gpt-oss's post_attention_norm is the MLP's input's
            embedding_scale=float(field_value(f"{arch}.embedding_scale", 1.0)),
            residual_scale=float(field_value(f"{arch}.residual_scale", 1.0)),
            attention_scale=float(field_value(f"{arch}.attention.scale", 0.0)),
            logit_scale=float(field_value(f"{arch}.logit_scale", 1.0)),
        ) | rotary_from_gguf(header, arch)
        family = (
            _gemma_from_gguf(header, arch)
            if arch in ("gemma2", "gemma3")
            else _gpt_oss_from_gguf(header)
            if arch == "gpt-oss"
            else {}
        )
        return cls(**fields | family)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> ModelConfig:
        return cls(**json.loads(text))


def _windows_from_hf(raw: dict, arch: str, layers: int, local_rope: dict) -> dict:
    """The sliding-window fields: Gemma 3's local layers (`layer_types`, or every layer but each
    `sliding_window_pattern`th), Gemma 2's and gpt-oss's (every other one), or every layer of a
    Mistral or Phi-3 whose config sets a window (unless it turns it off). A window as long as the
    context leaves no key out: none."""
    context = raw.get("max_position_embeddings", 4096)
    if arch in ("gemma2", "gemma3_text", "gpt_oss"):
        pattern = (
            raw.get("sliding_window_pattern")
            or raw.get("_sliding_window_pattern")
            or (6 if arch == "gemma3_text" else 2)
        )
        types = raw.get("layer_types") or [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)
        ]
        window, sliding = raw["sliding_window"], [i for i, t in enumerate(types) if t == "sliding_attention"]
        if arch != "gemma3_text":  # their local layers turn by the global tables
            return dict(sliding_window=window, sliding_layers=sliding)
        local_theta = local_rope.get("rope_theta") or raw.get("rope_local_base_freq") or 10000.0
        return dict(sliding_window=window, sliding_layers=sliding, local_rope_theta=float(local_theta))
    window = raw.get("sliding_window") if raw.get("use_sliding_window", arch in ("mistral", "phi3")) else None
    if not window or window >= context:
        return {}
    if arch not in ("mistral", "phi3"):  # Qwen2's windows start at `max_window_layers`
        raise ValueError(f"sliding-window attention ({window} tokens) of {arch} is not served yet")
    return dict(sliding_window=window, sliding_layers=list(range(layers)))


def _gemma_from_hf(raw: dict) -> dict:
    """Gemma 2's and 3's scales, activation, norms and caps."""
    if raw.get("use_bidirectional_attention"):
        raise ValueError("bidirectional attention (an embedding model's) is not served")
    return dict(
        embedding_scale=raw["hidden_size"] ** 0.5,
        attention_scale=raw.get("query_pre_attn_scalar", 256) ** -0.5,
        mlp_activation="gelu_tanh",
        norm_offset=1.0,
        final_logit_softcap=raw.get("final_logit_softcapping") or 0.0,
        attention_softcap=raw.get("attn_logit_softcapping") or 0.0,
    )


def _gpt_oss_from_hf(raw: dict) -> dict:
    """gpt-oss's sinks, expert biases and clamped SwiGLU."""
    return dict(
        attention_sinks=True,
        expert_bias=True,
        mlp_activation="clamped_swiglu",
        activation_limit=float(raw.get("swiglu_limit", 7.0)),
        activation_alpha=float(raw.get("swiglu_alpha", 1.702)),
    )


def _gpt_oss_from_gguf(header: GgufHeader) -> dict:
    """gpt-oss as llama.cpp reads it: every other layer local, from the first; its SwiGLU's clamp
    and slope are llama.cpp's constants (the file holds neither)."""
    layers = header.get("gpt-oss.block_count")
    return dict(
        sliding_window=header.get("gpt-oss.attention.sliding_window"),
        sliding_layers=list(range(0, layers, 2)),
        mlp_activation="clamped_swiglu",
        activation_limit=7.0,
        activation_alpha=1.702,
    )


def _gemma_from_gguf(header: GgufHeader, arch: str) -> dict:
    """Gemma 3's fields as llama.cpp reads them: every layer but each `sliding_window_pattern`th
    (6 unless the file says; Gemma 2's every other, from the first) local, at base
    `rope.freq_base_swa` (10000 unless it says; Gemma 2's the global base), the attention scale by
    the model's size (not in the file: the 27Bs', of 62 and 46 layers, is the hidden size's per
    head, the others' the head size's), its norms' 1 + w already in the file."""
    layers, hidden = header.get(f"{arch}.block_count"), header.get(f"{arch}.embedding_length")
    head_dim = header.get(f"{arch}.attention.key_length")
    pattern = header.get(f"{arch}.attention.sliding_window_pattern", 6 if arch == "gemma3" else 2)
    if isinstance(pattern, list):
        sliding = [i for i, local in enumerate(pattern) if local]
    else:
        sliding = [i for i in range(layers) if pattern == 0 or i % pattern < pattern - 1]
    window = header.get(f"{arch}.attention.sliding_window") or 0
    largest = layers == (62 if arch == "gemma3" else 46)
    per_head = hidden // header.get(f"{arch}.attention.head_count") if largest else head_dim
    local_theta = float(header.get(f"{arch}.rope.freq_base_swa", 10000.0)) if arch == "gemma3" else 0.0
    return dict(
        sliding_window=window,
        sliding_layers=sliding if window else [],
        local_rope_theta=local_theta,
        embedding_scale=hidden**0.5,
        attention_scale=per_head**-0.5,
        mlp_activation="gelu_tanh",
        final_logit_softcap=float(header.get(f"{arch}.final_logit_softcapping", 0.0)),
        attention_softcap=float(header.get(f"{arch}.attn_logit_softcapping", 0.0)),
    )
