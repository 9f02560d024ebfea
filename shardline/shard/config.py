"""The model hyper-parameters a shard needs, read from a Hugging Face config.json or GGUF metadata."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass
class ModelConfig:
    """Llama-family decoder: Llama 2/3, SmolLM2, Qwen2/2.5 (qkv bias), Qwen3 (q/k norm)."""

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

    @property
    def attention_pair_cost(self) -> float:
        """One attention pair's multiply-adds (q·k and p·v over every head for a new token and one
        token it sees) over one token's through the weights of a layer."""
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        weights = self.hidden_size * (2 * q + 2 * kv + 3 * self.intermediate_size)
        return 2 * q / weights

    @classmethod
    def from_hf(cls, path: Path) -> ModelConfig:
        raw = json.loads((path / "config.json").read_text())
        arch = raw.get("model_type", "llama")
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise ValueError(f"rope scaling {rope} is not supported")
        heads = raw["num_attention_heads"]
        eos = raw.get("eos_token_id")
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        return cls(
            architecture=arch,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads", heads),
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rope_theta=float(raw.get("rope_theta") or rope.get("rope_theta", 10000.0)),
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            max_position=raw.get("max_position_embeddings", 4096),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            qkv_bias=arch == "qwen2" or raw.get("attention_bias", False),
            qk_norm=arch == "qwen3",
            eos_token_ids=eos,
            name=raw.get("_name_or_path") or path.name,
        )

    @classmethod
    def from_gguf(cls, reader, name: str) -> ModelConfig:
        def field_value(key, default=None):
            f = reader.fields.get(key)
            return f.contents() if f is not None else default

        arch = field_value("general.architecture")
        if arch not in ("llama", "qwen2", "qwen3"):
            raise ValueError(f"GGUF architecture {arch!r} is not supported")
        tensors = {t.name for t in reader.tensors}
        hidden = field_value(f"{arch}.embedding_length")
        heads = field_value(f"{arch}.attention.head_count")
        eos = field_value("tokenizer.ggml.eos_token_id")
        return cls(
            architecture=arch,
            vocab_size=len(reader.fields["tokenizer.ggml.tokens"].data),
            hidden_size=hidden,
            intermediate_size=field_value(f"{arch}.feed_forward_length"),
            num_layers=field_value(f"{arch}.block_count"),
            num_heads=heads,
            num_kv_heads=field_value(f"{arch}.attention.head_count_kv", heads),
            head_dim=field_value(f"{arch}.attention.key_length", hidden // heads),
            rope_theta=float(field_value(f"{arch}.rope.freq_base", 10000.0)),
            rms_norm_eps=float(field_value(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
            max_position=field_value(f"{arch}.context_length", 4096),
            tie_word_embeddings="output.weight" not in tensors,
            qkv_bias="blk.0.attn_q.bias" in tensors,
            qk_norm="blk.0.attn_q_norm.weight" in tensors,
            eos_token_ids=[] if eos is None else [int(eos)],
            name=name,
        )

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> ModelConfig:
        return cls(**json.loads(text))
