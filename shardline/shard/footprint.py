"""What serving a model takes, known before a byte of its weights is read: whether Shardline serves
it at all, and the memory each shard needs against what the machine (or its container) has.

A model Shardline does not serve (an architecture it has no model code for) or one that does not
fit raises `Unservable`; the shard and `shardline serve` then exit with
status 2 and the message, once, and the launcher does not start the shards again.

A shard's memory, from the file's header and the flags (torch-free: the launcher checks every
shard of its host before it starts one):
- its weights as it serves them: a GGUF's 4-bit blocks as int4 records, its other quantized
  blocks as int8 ones, float tensors in the serving dtype (shard/transforms.py);
  only its pipeline stage's layers, its TP rank's slice of them, the LM head on the sampling shard;
- its KV page pool, `--kv-memory-gb`;
- a step's working buffers: a prefill piece's activations (at most PREFILL_PIECE_BYTES) and the
  logits of a batch;
- while loading: with a GGUF read straight into the serving layout (`--weights native` on the
  CPU), its weights, the largest layer being made and a few copies of the slice of one tensor
  being read; otherwise the whole model in fp32 twice over (the tensors, and the model built from
  them), which is the peak.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from shardline.common.files import publish
from shardline.common.gguf_header import read_header
from shardline.common.model_source import ModelSource
from shardline.shard.config import ModelConfig
from shardline.shard.layout import layer_range

# architectures: Hugging Face model_type, GGUF general.architecture (Mixtral's is llama's)
SERVED = (
    *("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe"),
    *("smollm3", "granite", "olmo2", "phi3", "gemma2", "gemma3_text", "gpt_oss"),
)
SERVED_GGUF = (
    *(
        "llama",
        "qwen2",
        "qwen3",
        "qwen2moe",
        "qwen3moe",
        "smollm3",
        "granite",
        "olmo2",
        "phi3",
        "gemma2",
        "gemma3",
        "gpt-oss",
    ),
)
# GGUF architectures whose Q and K rows llama.cpp's converter interleaves for its RoPE (its
# LlamaModel and the converters built on it): the loaders undo it
QK_PERMUTED = ("llama", "smollm3", "granite")
# GGUF types whose blocks int4 holds exactly (groups of 32 on a 4-bit grid), and those of floats:
# what the loader, the quantization rule and this estimate all read a tensor's type by
FOUR_BIT = {"Q4_0", "Q4_1", "Q4_K"}
FLOAT = {"F32", "F16", "BF16", "F64"}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# a record per 8 outputs x 32 inputs (kernels/operands.py), per weight
RECORD_BYTES = {4: 160 / 256, 6: 224 / 256, 8: 288 / 256, "Q4_K": 1184 / 2048}
INT4_BYTES = RECORD_BYTES[4]
PREFILL_PIECE_BYTES = 128 << 20  # the bound on a prefill piece's MLP activations (shard/pieces.py)
WEIGHTS_AT_ONCE = 1 << 21  # weights of a slice the GGUF loader (and the operand packing) takes at once
STREAM_COPIES = 8  # fp32-sized copies of such a slice the loader's steps hold at their peak
# a layer being made holds its codes (a byte a weight), scales and los (8 bytes a group of 32) and
# the records packed from them (up to 288 bytes a block of 256) at once
MAKING_BYTES = 1 + 8 / 32 + 288 / 256
LOADER_BYTES = 64 << 20  # and what reading brings in besides: the gguf package's code, malloc's slack
# a layer shape new to the machine is timed once (kernels/choice.py) on copies of its operands
# beyond the caches (kernels/quantized.py's COLD_BYTES, ours and torch's) and torch's of the layer
MEASURING_BYTES = 2 * (16 << 20)
LINEARS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down", "attn_qkv")
_AS_GGUF = dict(zip(("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj"), LINEARS))
_AS_GGUF |= {"gate_up_proj": "ffn_up"}  # Phi-3's, fused (as its GGUF's ffn_up)
_AS_GGUF |= {"w1": "ffn_gate", "w3": "ffn_up", "w2": "ffn_down"}  # Mixtral's experts
# a mixture's experts (3-D: every expert's in one) and shared expert, held as the dense MLP's are
EXPERT_LINEARS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp")


REFUSED = 2  # the exit status of a process that refuses to serve its model


class Unservable(Exception):
    """A model this server cannot serve, and why, in words for whoever started it."""


@dataclass(frozen=True)
class Tensor:
    name: str  # GGUF's name (blk.3.attn_q.weight, token_embd.weight, ...)
    params: int
    kind: str  # GGUF type name (Q4_K, F32, ...), or the checkpoint's dtype for a Hugging Face folder
    dims: tuple[int, ...] = ()  # a GGUF tensor's, innermost first, as the file lists them
    offset: int = -1  # where a GGUF tensor's data starts in the file, in bytes


@dataclass(frozen=True)
class Footprint:
    """Bytes one shard needs."""

    weights: int
    kv_pool: int
    buffers: int
    loading: int  # the peak while its weights load, beside nothing else of its own

    @property
    def serving(self) -> int:
        return self.weights + self.kv_pool + self.buffers

    @property
    def peak(self) -> int:
        return max(self.loading, self.serving)


@dataclass(frozen=True)
class Description:
    """What a model's files say of it before a byte of its weights is read: its config and its
    tensors (name, size, type, where a GGUF's lie). Read once per process (`describe`); the
    footprint, the GGUF loader and the quantization rule all read this one."""

    source: ModelSource
    cfg: ModelConfig
    tensors: list[Tensor]


def describe(source: ModelSource) -> Description:
    """The model's description from its header alone; Unservable for what is not served.
    A GGUF's header takes seconds to parse (and 165 MB for a vocabulary of 49,152: its fields are
    read into many small arrays): what it says is kept beside its converted weights."""
    if source.kind == "gguf":
        header = source.cache_dir / f"gguf_header-{HEADER_VERSION}.json"
        if not header.is_file():
            cfg, tensors = _read_gguf_header(source)
            publish(header, lambda tmp: tmp.write_text(json.dumps({"config": asdict(cfg), "tensors": tensors})))
        kept = json.loads(header.read_text())
        tensors = [Tensor(n, p, k, tuple(d), o) for n, p, k, d, o in kept["tensors"]]
        return Description(source, ModelConfig(**kept["config"]), tensors)
    raw = json.loads((source.path / "config.json").read_text())
    arch = raw.get("model_type", "llama")
    if arch not in SERVED:
        raise Unservable(f"{source.path.name}: the architecture {arch!r} is not served ({', '.join(SERVED)} are)")
    if method := (raw.get("quantization_config") or {}).get("quant_method"):  # gpt-oss's MXFP4, GPTQ, AWQ, ...
        raise Unservable(
            f"{source.path.name}: its weights are quantized ({method}), which is read from a GGUF only "
            "(llama.cpp's convert_hf_to_gguf.py writes one), or from a checkpoint of float weights"
        )
    try:
        cfg = ModelConfig.from_hf(source.path)
    except (KeyError, ValueError) as e:
        raise Unservable(f"{source.path.name}: its config.json cannot be served: {e}") from None
    return Description(source, cfg, _safetensors_tensors(source.path))


def streams(model: Description, args, device_type: str) -> bool:
    """Whether a shard reads its GGUF straight into the serving layout (shard/gguf_loader.py),
    rather than building the whole model in fp32 and transforming it (shard/weights.py): a GGUF
    with `--weights native`, nothing to quantize at load, on the CPU."""
    return model.source.kind == "gguf" and args.weights == "native" and args.quantize == "none" and device_type == "cpu"


HEADER_VERSION = 4  # what a kept header holds: a new version is read from the file again


def _read_gguf_header(source: ModelSource) -> tuple[ModelConfig, list[tuple]]:
    header = read_header(source.path)
    arch = header.get("general.architecture")
    if arch not in SERVED_GGUF:
        raise Unservable(f"{source.path.name}: the architecture {arch!r} is not served ({', '.join(SERVED_GGUF)} are)")
    return ModelConfig.from_gguf(header, source.name), [
        (t.name, t.n_elements, t.kind, list(t.shape), t.offset) for t in header.tensors
    ]


def _safetensors_tensors(folder: Path) -> list[Tensor]:
    """Names (as GGUF's), sizes and dtypes from each file's header (its first 8 bytes + JSON)."""
    tensors = []
    for f in sorted(folder.glob("*.safetensors")):
        with open(f, "rb") as fh:
            header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
        for name, meta in header.items():
            if name != "__metadata__":
                params = 1
                for d in meta["shape"]:
                    params *= d
                tensors.append(Tensor(_gguf_name(name), params, meta["dtype"]))
    return tensors


def _gguf_name(hf: str) -> str:
    """model.layers.3.self_attn.q_proj.weight -> blk.3.attn_q.weight: a layer's linears as GGUF
    names them, its other tensors as blk.3.<their name>, the embedding and LM head as GGUF's."""
    parts = hf.split(".")
    if len(parts) >= 5 and parts[:2] == ["model", "layers"]:
        part = _AS_GGUF[parts[-2]] if parts[-2] in _AS_GGUF else "_".join(parts[3:-1])
        return f"blk.{parts[2]}.{part}.{parts[-1]}"
    return {"lm_head.weight": "output.weight", "model.embed_tokens.weight": "token_embd.weight"}.get(hf, hf)


# The linears a layer serves fused: their tensors are held at one width, that of the widest.
FUSED = {"attn_q": "wqkv", "attn_k": "wqkv", "attn_v": "wqkv", "attn_qkv": "wqkv", "ffn_gate": "w13", "ffn_up": "w13"}
FUSED |= {f"ffn_{p}_{x}": f"w13_{x}" for p in ("gate", "up") for x in ("exps", "shexp")}


def _in_w13(name: str) -> bool:
    parts = name.split(".")
    return len(parts) == 4 and FUSED.get(parts[2], "").startswith("w13")


def served_bits(kinds: set[str], quantize: str = "none", head: bool = False) -> int | None:
    """The rule for how a linear layer is held, whose weights are of these GGUF types (floats for a
    checkpoint's): 4 or 8 bits a weight, or None: dense, in the serving dtype. `quantize` (as
    `--quantize` says: "int4", "int8" or "none") quantizes dense layers at load, the LM head
    (`head`) at int8 under int4: its logits suffer most from 4 bits. Otherwise 4-bit block types
    take int4 and other quantized types int8. (Streamed from a GGUF, Q4_K and Q6_K layers keep
    their own blocks instead: shard/gguf_loader.py.)"""
    if quantize != "none":
        return 8 if quantize == "int8" or head else 4
    if kinds <= FLOAT:
        return None
    return 4 if kinds <= FOUR_BIT else 8


def _bits(kinds: set[str], layer: str, weights: str, quantize: str) -> int | str | None:
    """`served_bits` as the estimate counts it: "Q4_K" for a Q4_K layer kept in its own blocks (4.6
    bits), 6 for a Q6_K one."""
    bits = served_bits(kinds if weights == "native" else {"F32"}, quantize, head=layer == "output")
    if bits is None or quantize != "none":
        return bits
    return "Q4_K" if kinds == {"Q4_K"} else 6 if kinds == {"Q6_K"} else bits


def _held(params: int, bits: int | None, dtype: str, dense_copy: bool = False) -> float:
    """A linear layer's bytes as it is held (kernels/quantized.py): its int4 or int8 records, and
    where asked (`--dense-prefill`) a dense copy for steps of many rows, counted at the serving
    dtype's width (bf16 where that measured faster: then less)."""
    dense = DTYPE_BYTES[dtype] * params
    if bits is None:
        return dense
    return RECORD_BYTES[bits] * params + (dense if dense_copy else 0)


def shard_footprint(
    cfg: ModelConfig,
    tensors: list[Tensor],
    *,
    tp: int,
    pp: int,
    tp_rank: int,
    pp_stage: int,
    dtype: str,
    weights: str,
    quantize: str,
    dense_copy: bool,
    kv_memory_gb: float,
    max_batch: int,
    streamed: bool = False,
) -> Footprint:
    """One shard's bytes (the module docstring says what each part holds). `streamed`: its GGUF
    is read straight into the serving layout (shard/gguf_loader.py), not through fp32."""
    layers = layer_range(cfg.num_layers, pp_stage, pp)
    first, samples = pp_stage == 0, pp_stage == pp - 1 and tp_rank == 0
    by_name = {t.name: t for t in tensors}
    held = 0.0
    for t in tensors:
        parts = t.name.split(".")
        if parts[0] == "blk":
            if int(parts[1]) not in layers:
                continue
            if parts[2] in LINEARS + EXPERT_LINEARS and parts[-1] == "weight":
                group = [p for p, f in FUSED.items() if f == FUSED.get(parts[2])] or [parts[2]]
                kinds = {
                    by_name[f"blk.{parts[1]}.{p}.weight"].kind for p in group if f"blk.{parts[1]}.{p}.weight" in by_name
                }
                held += _held(t.params, _bits(kinds, parts[2], weights, quantize), dtype, dense_copy) / tp
            else:  # norms, biases
                held += t.params * DTYPE_BYTES[dtype]
        elif t.name == "token_embd.weight":
            tied, bits = "output.weight" not in by_name, _bits({t.kind}, "output", weights, quantize)
            if samples and tied:
                held += _held(t.params, bits, dtype)
            # A tied LM head that is dense is the embedding; a quantized one serves its lookups too.
            if first and not (samples and tied):
                held += t.params * DTYPE_BYTES[dtype]
        elif t.name == "output.weight" and samples:
            held += _held(t.params, _bits({t.kind}, "output", weights, quantize), dtype)
        elif t.name != "output.weight" and samples:  # the final norm (and rope tables)
            held += t.params * DTYPE_BYTES[dtype]
    logits = 2 * max_batch * cfg.vocab_size * 4 if samples else 0
    if streamed:  # a layer at a time, a slice of rows at a time, beside what is made
        largest = max(  # an expert's: the loader makes them one at a time
            (t.params // (t.dims[2] if len(t.dims) == 3 else 1) * (2 if _in_w13(t.name) else 1) for t in tensors),
            default=0,
        )
        making = (MAKING_BYTES + INT4_BYTES) * largest + MEASURING_BYTES
        loading = held + making + STREAM_COPIES * WEIGHTS_AT_ONCE * 4 + LOADER_BYTES
    else:
        loading = 8 * sum(t.params for t in tensors)
    return Footprint(
        weights=int(held),
        kv_pool=int(kv_memory_gb * 2**30),
        buffers=PREFILL_PIECE_BYTES + logits,
        loading=int(loading),
    )


def available_bytes(cgroup: Path = Path("/sys/fs/cgroup")) -> int:
    """Memory this process may still take: what the machine has available, or less where a
    cgroup (a container's limit) allows less."""
    import psutil

    available = psutil.virtual_memory().available
    limit, used = cgroup / "memory.max", cgroup / "memory.current"  # cgroup v2
    if limit.is_file() and used.is_file():
        text = limit.read_text().strip()
        if text != "max":
            available = min(available, int(text) - int(used.read_text()))
    return available


def _gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB"


def check_fits(footprints: list[Footprint], available: int, what: str) -> None:
    """Unservable unless the shards that load on this host together fit in `available`: every
    one loads at once, then serves."""
    loading = sum(f.peak for f in footprints)
    if loading <= available:
        return
    weights, kv, buffers = (sum(getattr(f, k) for f in footprints) for k in ("weights", "kv_pool", "buffers"))
    serving = weights + kv + buffers
    hint = []
    if kv > serving - available and kv > 0:
        hint.append(f"--kv-memory-gb {max(0.0, (available - weights - buffers) / 2**30 / len(footprints)):.1f} or less")
    if max(f.loading for f in footprints) > max(f.serving for f in footprints):
        hint.append("more memory while it loads: GGUF weights are converted through fp32")
    raise Unservable(
        f"{what} needs {_gb(loading)} of memory and this machine has {_gb(available)} available: "
        f"{len(footprints)} shard(s) hold {_gb(weights)} of weights, {_gb(kv)} of KV pool and {_gb(buffers)} of "
        f"step buffers, and loading peaks at {_gb(sum(f.loading for f in footprints))}"
        + (f" (try {'; '.join(hint)})" if hint else "")
    )


def footprints(model: Description, args, shards: list[tuple[int, int]], streamed: bool) -> list[Footprint]:
    """The footprint of each given (pp_stage, tp_rank) shard of the model. `args`: a shard's or
    `serve`'s flags."""
    return [
        shard_footprint(
            model.cfg,
            model.tensors,
            tp=args.tp,
            pp=args.pp,
            tp_rank=rank,
            pp_stage=stage,
            dtype=args.dtype,
            weights=args.weights,
            quantize=args.quantize,
            dense_copy=args.dense_prefill == "on",
            kv_memory_gb=args.kv_memory_gb,
            max_batch=getattr(args, "max_batch", 32),
            streamed=streamed,
        )
        for stage, rank in shards
    ]


def check_layout(source: ModelSource, args, shards: list[tuple[int, int]]) -> None:
    """The launcher's check, before it starts a shard: Unservable unless the model is served and
    the given (pp_stage, tp_rank) shards of it, all on this host, fit in its memory. Torch-free,
    it plans a shard without `--device` as on the CPU (where loading peaks lower, streamed); a
    shard that finds a GPU checks itself again (shard/load.py)."""
    model = describe(source)
    device_type = "cuda" if args.device.startswith("cuda") else "cpu"
    check_fits(footprints(model, args, shards, streams(model, args, device_type)), available_bytes(), source.name)
