"""What a shard process serves, loaded in one pipeline (`load_shard`: describe the model, check
that it fits, lay out its weights, finish them for serving): its device, its model, the dtype of
its KV pages, and the `ShardInfo` it answers the router with."""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from shardline.common.model_source import ModelSource, resolve_model
from shardline.kernels import native
from shardline.kernels.grid import GROUP
from shardline.kernels.linear import OneDnnLinear
from shardline.kernels.operands import Kernel, record_format
from shardline.kernels.quantized import QuantizedEmbedding, QuantizedLinear, TiedEmbedding
from shardline.kernels.stacked import StackedLinear
from shardline.protos import shard_pb2
from shardline.shard import served_cache
from shardline.shard.footprint import Description, available_bytes, check_fits, describe, footprints, streams
from shardline.shard.gguf_loader import GgufLoader
from shardline.shard.kv_cache import bytes_per_page
from shardline.shard.layout import Layout
from shardline.shard.model import Transformer
from shardline.shard.parallel import group_id, init_distributed
from shardline.shard.transforms import finish, is_quantized, serving_layout
from shardline.shard.weights import build_model

log = logging.getLogger("shardline.shard")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedShard:
    model: Transformer
    layout: Layout
    device: torch.device
    dtype: torch.dtype
    kv_dtype: torch.dtype
    decode_graphs: bool
    info: shard_pb2.ShardInfo
    keep: threading.Thread | None = None  # writes the served weights for later starts: start it once warm


def pick_device(flag: str, layout: Layout) -> torch.device:
    """--device, else this rank's GPU when there are any, else the CPU."""
    if flag:
        return torch.device(flag)
    if torch.cuda.is_available():
        return torch.device("cuda", layout.rank % torch.cuda.device_count())
    return torch.device("cpu")


def kv_dtype_for(flag: str, model: Transformer, dtype: torch.dtype) -> torch.dtype:
    """--kv-dtype; `auto` keeps the serving dtype for dense weights (HF parity) and float16 where
    quantized weights are served, as llama.cpp keeps its cache."""
    if flag != "auto":
        return DTYPES[flag]
    return torch.float16 if is_quantized(model) else dtype


def weight_bytes(model: Transformer) -> int:
    """Bytes of the weights this shard holds (each tensor once; not the rotary tables)."""
    tensors = {
        id(t): t
        for t in (*model.parameters(), *model.buffers())
        if t is not model.rotary.cos and t is not model.rotary.sin
    }
    return sum(t.numel() * t.element_size() for t in tensors.values())


def weight_format(module: nn.Module) -> str:
    """How a layer's weights are held, in words."""
    if isinstance(module, StackedLinear):
        return " + ".join(f"{p.out_features} rows {weight_format(p)}" for p in module.parts)
    if isinstance(module, QuantizedLinear):
        kernel = "Shardline's kernel" if module.kernel is Kernel.NATIVE else "torch's int4 kernel"
        if module.bits == 8 and module.kernel is Kernel.TORCH:
            kernel += " as two int4 halves"
        copy = f", {module.dense.kind.value} copy above {module.max_rows} rows" if module.dense is not None else ""
        held = record_format(module.operands[0]) if module.kernel is Kernel.NATIVE else f"int{module.bits}"
        held = {"q4_k": "Q4_K blocks", "int6": "int6 (Q6_K blocks)"}.get(held, held)
        return f"{held} g{GROUP} ({module.exact:.0%} of groups exact), {kernel}{copy}"
    if isinstance(module, TiedEmbedding):
        return f"the LM head's int{module.table.bits} codes"
    if isinstance(module, QuantizedEmbedding):
        return f"int8 g{GROUP} rows"
    if isinstance(module, OneDnnLinear):
        return "float32 oneDNN"
    return str(module.weight.dtype).removeprefix("torch.")


def weight_formats(model: nn.Module) -> dict[str, str]:
    """Per kind of layer (embed, wqkv, wo, w13, w2, lm_head), how its weights are held."""
    return {
        name.rpartition(".")[2]: weight_format(m)
        for name, m in model.named_modules(remove_duplicate=False)
        if name.rpartition(".")[2] in ("embed", "wqkv", "wo", "w13", "w2", "lm_head")
    }


def use_inductor_cache(source: ModelSource) -> None:
    """Keeps compiled decode graphs beside the converted weights (or where TORCHINDUCTOR_CACHE_DIR
    says), so a restart reuses them, and per build of Shardline's kernels, which they call and
    inductor's cache knows nothing of: with one cache for every build (ISA levels, changed
    sources), a test's quantized decode graphs corrupted the heap on a development machine until
    the cache was emptied. (A test that compiled something itself has set the variable to
    torch's default, and the shards it starts inherit it.)"""
    build = native.build_folder().name
    cache = Path(os.environ.get("TORCHINDUCTOR_CACHE_DIR") or source.cache_dir / "inductor")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache if cache.name == build else cache / build)


def weights_as_served(
    description: Description, layout: Layout, dtype: torch.dtype, device: torch.device, args, streamed: bool
) -> tuple[Transformer, threading.Thread | None]:
    """This shard's layers as served, without collectives yet, and the writer that keeps them for
    later starts where they were made now (unstarted: shard/served_cache.py). `streamed`: read
    straight from the GGUF into the serving layout, or from what an earlier start kept of that;
    else the whole model built in fp32 and laid out by shard/transforms.py's `serving_layout`."""
    dense_copy = args.dense_prefill == "on"
    if streamed:
        kept = served_cache.path_for(description.source, layout, dtype, dense_copy)
        if kept.is_file():
            return served_cache.load(description.cfg, layout, dtype, kept), None
        model = GgufLoader(description, layout, dtype, dense_copy).load()
        return model, served_cache.save(model, kept, background=True)
    model = build_model(description.source, dtype, device)
    serving_layout(
        model, description, layout, device, weights=args.weights, quantize=args.quantize, dense_copy=dense_copy
    )
    return model, None


def load_shard(args) -> LoadedShard:
    """One shard's model, in four steps, each taking what the one before it made:
    1. read the model's description (its config and tensors, from its header: shard/footprint.py);
    2. check that this shard of it fits in memory, before a byte of its weights is read;
    3. lay out its weights as served: this stage's layers, this TP rank's slice, each layer held
       as its kernels take it (`weights_as_served`);
    4. apply the transformations that ready it for serving: the TP group's collectives, the CPU
       kernels, fused decode layers (shard/transforms.py's `finish`)."""
    layout = Layout(tp=args.tp, pp=args.pp, tp_rank=args.tp_rank, pp_stage=args.pp_stage)
    device, dtype = pick_device(args.device, layout), DTYPES[args.dtype]
    description = describe(resolve_model(args.model))
    source, full = description.source, description.cfg
    streamed = streams(description, args, device.type)
    here = footprints(description, args, [(layout.pp_stage, layout.tp_rank)], streamed)
    check_fits(here, available_bytes(), source.name)
    use_inductor_cache(source)
    t0 = time.perf_counter()
    model, keep = weights_as_served(description, layout, dtype, device, args, streamed)
    decode_graphs = args.decode_graphs == "on" or (args.decode_graphs == "auto" and device.type == "cuda")
    if decode_graphs and full.num_experts:
        # which experts a step runs is known only once its router has run: no graph to replay
        log.info("a mixture of experts decodes without decode graphs")
        decode_graphs = False
    if decode_graphs and full.rope_long_factors:
        # a graph's rotary rows are its positions: LongRoPE's long rows lie elsewhere
        log.info("a model of long rotary factors decodes without decode graphs")
        decode_graphs = False
    # The group is joined with the weights laid out: every rank of a replica loads at once, slices
    # alike, so they come together, and none holds a half-joined group while it reads.
    tp_group = init_distributed(layout, args.dist_init, device)
    onednn = device.type == "cpu" and dtype == torch.float32 and not decode_graphs
    finish(model, layout, tp_group, device, onednn=onednn)
    log.info(
        "loaded %s (stage %d/%d, TP rank %d/%d, %d layers) in %.1f s",
        source.name,
        layout.pp_stage,
        layout.pp,
        layout.tp_rank,
        layout.tp,
        model.cfg.num_layers,
        time.perf_counter() - t0,
    )
    kv_dtype = kv_dtype_for(args.kv_dtype, model, dtype)
    per_page, window_per_page = bytes_per_page(model.cfg, model.windows, args.page_size, kv_dtype)
    budget = int(args.kv_memory_gb * 2**30)
    info = shard_pb2.ShardInfo(
        model=source.name,
        vocab_size=full.vocab_size,
        context_length=full.max_position,
        page_size=args.page_size,
        max_pages=max(0, budget // per_page - 1),  # - padding
        tp_rank=layout.tp_rank,
        tp_size=layout.tp,
        pp_stage=layout.pp_stage,
        pp_size=layout.pp,
        dtype=args.dtype,
        device=str(device),
        eos_token_ids=full.eos_token_ids,
        weight_bytes=weight_bytes(model),
        kv_bytes_per_page=per_page,
        kv_dtype=str(kv_dtype).removeprefix("torch."),
        weight_formats=weight_formats(model),
        group_id=group_id(layout),
        attention_pair_cost=full.attention_pair_cost,
        num_layers=full.num_layers,
        rope_long_from=full.rope_long_from if full.rope_long_factors else 0,
        window=full.sliding_window if full.sliding_layers else 0,
        window_kv_bytes_per_page=window_per_page,
        kv_budget_bytes=budget,
    )
    log.info("weights: %s", ", ".join(f"{k} {v}" for k, v in info.weight_formats.items()))
    return LoadedShard(model, layout, device, dtype, kv_dtype, decode_graphs, info, keep)
