"""Tensor and pipeline parallelism as transformations of a plain `Transformer` (gpt-fast style):
the model code knows nothing of ranks; these functions slice its weights and add the collectives.

Layout: shard (stage s, TP rank r) is global rank s * tp + r of one torch.distributed group
(gloo on CPU, NCCL on CUDA). Each stage has its own TP subgroup. Activations flow stage to stage
between equal TP ranks with point-to-point send/recv.
"""

from __future__ import annotations

import uuid
from dataclasses import replace
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from shardline.shard.layout import Layout, layer_range
from shardline.shard.model import MLP, MoE, RMSNorm, Transformer


def init_distributed(layout: Layout, init_method: str, device: torch.device):
    """Joins the replica's process group; returns this stage's TP group (None without TP)."""
    if layout.world == 1:
        return None
    backend = "nccl" if device.type == "cuda" else "gloo"
    # A bounded timeout: if a peer dies, a collective fails instead of hanging forever.
    dist.init_process_group(
        backend, init_method=init_method, rank=layout.rank, world_size=layout.world, timeout=timedelta(seconds=60)
    )
    groups = [dist.new_group(list(range(s * layout.tp, (s + 1) * layout.tp))) for s in range(layout.pp)]
    return groups[layout.pp_stage] if layout.tp > 1 else None


def group_id(layout: Layout) -> str:
    """An id of this start of the process group, the same on every rank (rank 0's, broadcast)."""
    ids = [uuid.uuid4().hex]
    if layout.world > 1:
        dist.broadcast_object_list(ids, src=0)
    return ids[0]


def keep_stage(model: Transformer, layout: Layout) -> None:
    """Drops what this pipeline stage does not run: other stages' layers, the embedding outside
    the first stage, the final norm and LM head outside the sampling shard."""
    keep = layer_range(model.cfg.num_layers, layout.pp_stage, layout.pp)
    model.layers = nn.ModuleList(model.layers[i] for i in keep)
    model.cfg = replace(model.cfg, num_layers=len(keep))
    if not layout.is_first_stage:
        model.embed = None
    if not layout.samples:
        model.norm = model.lm_head = None


def _rows(w: torch.Tensor, start: int, size: int) -> torch.Tensor:
    return w.narrow(0, start, size).clone()


def _cols(w: torch.Tensor, start: int, size: int) -> torch.Tensor:
    return w.narrow(1, start, size).clone()


def head_split(heads: int, kv_heads: int, tp: int, rank: int) -> tuple[range, range]:
    """(q heads, KV heads) of one TP rank. KV heads are split as evenly as possible, each with
    the q heads that read it, so every rank keeps a uniform GQA grouping (SmolLM2's 9 heads and 3
    KV heads split 6+3 over two ranks). With fewer KV heads than ranks, each KV head is replicated
    on tp / kv_heads ranks, which split its q heads."""
    group = heads // kv_heads
    if kv_heads >= tp:
        kv = layer_range(kv_heads, rank, tp)
        return range(kv.start * group, kv.stop * group), kv
    if tp % kv_heads or tp // kv_heads > group:
        raise ValueError(f"cannot split {heads} heads / {kv_heads} KV heads over {tp} ranks")
    per_kv = tp // kv_heads
    kv = rank // per_kv
    q = layer_range(group, rank % per_kv, per_kv)
    return range(kv * group + q.start, kv * group + q.stop), range(kv, kv + 1)


def tp_slice(cfg, layout: Layout) -> tuple[range, range, range]:
    """This TP rank's (q heads, KV heads, MLP units): what `slice_tensor_parallel` keeps of each
    layer, and what a GGUF is read for (shard/gguf_loader.py)."""
    q_heads, kv = head_split(cfg.num_heads, cfg.num_kv_heads, layout.tp, layout.tp_rank)
    return q_heads, kv, layer_range(cfg.intermediate_size, layout.tp_rank, layout.tp)


def mlp_units(size: int, layout: Layout) -> range:
    """This TP rank's units of an MLP `size` wide (a dense layer's, an expert's, the shared expert's)."""
    return layer_range(size, layout.tp_rank, layout.tp)


def _summed_once(bias: torch.Tensor, layout: Layout) -> nn.Parameter:
    """A row-parallel layer's bias, which the all-reduce of its ranks' outputs adds once: rank 0's."""
    return nn.Parameter(bias.clone() if layout.tp_rank == 0 else torch.zeros_like(bias), requires_grad=False)


def _split_mlp(mlp: MLP, units: range, layout: Layout) -> None:
    inter = mlp.w2.weight.shape[1]

    def gate_up(t: torch.Tensor) -> nn.Parameter:
        gate, up = _rows(t, units.start, len(units)), _rows(t, inter + units.start, len(units))
        return nn.Parameter(torch.cat([gate, up]), requires_grad=False)

    mlp.w13.weight = gate_up(mlp.w13.weight)
    mlp.w2.weight = nn.Parameter(_cols(mlp.w2.weight, units.start, len(units)), requires_grad=False)
    if mlp.w13.bias is not None:  # gpt-oss's experts'
        mlp.w13.bias, mlp.w2.bias = gate_up(mlp.w13.bias), _summed_once(mlp.w2.bias, layout)


def slice_tensor_parallel(model: Transformer, layout: Layout) -> None:
    """Keeps this TP rank's slice of attention heads and of the MLP, in place; the all-reduces
    come after (`connect_tensor_parallel`), as for a model read already sliced.

    wqkv and w13 are split by output rows (column parallel), wo and w2 by input columns (row
    parallel), whose outputs are then summed over the ranks. A mixture of experts splits every
    expert's units alike (and the shared expert's), its router whole on every rank: each rank
    sums its part of every picked expert's output, and one all-reduce of the sum per layer adds
    them up, as one of w2's does in a dense layer. The LM head stays whole on the one shard that
    samples: it then needs no collective per step, which on gloo costs more than the replicated
    weights save.
    """
    tp, cfg = layout.tp, model.cfg
    if tp == 1:
        return
    hd = cfg.head_dim
    q_heads, kv, units = tp_slice(cfg, layout)
    q_size, kv_size = cfg.num_heads * hd, cfg.num_kv_heads * hd

    def split_qkv(t: torch.Tensor) -> torch.Tensor:
        return torch.cat(
            [
                _rows(t, q_heads.start * hd, len(q_heads) * hd),
                _rows(t, q_size + kv.start * hd, len(kv) * hd),
                _rows(t, q_size + kv_size + kv.start * hd, len(kv) * hd),
            ]
        )

    for block in model.layers:
        attn, mlp = block.attn, block.mlp
        if attn.qk_norm_across_heads:  # OLMo 2's norms' weights, one per q (k) row: this rank's rows
            q_norm, k_norm = (
                _rows(attn.q_norm.weight, q_heads.start * hd, len(q_heads) * hd),
                _rows(attn.k_norm.weight, kv.start * hd, len(kv) * hd),
            )
            attn.q_norm.weight = nn.Parameter(q_norm, requires_grad=False)
            attn.k_norm.weight = nn.Parameter(k_norm, requires_grad=False)
        attn.wqkv.weight = nn.Parameter(split_qkv(attn.wqkv.weight), requires_grad=False)
        if attn.wqkv.bias is not None:
            attn.wqkv.bias = nn.Parameter(split_qkv(attn.wqkv.bias), requires_grad=False)
        attn.wo.weight = nn.Parameter(_cols(attn.wo.weight, q_heads.start * hd, len(q_heads) * hd), requires_grad=False)
        if attn.wo.bias is not None:
            attn.wo.bias = _summed_once(attn.wo.bias, layout)
        if attn.sinks is not None:
            attn.sinks = nn.Parameter(_rows(attn.sinks, q_heads.start, len(q_heads)), requires_grad=False)
        if isinstance(mlp, MoE):
            for expert in mlp.experts:
                _split_mlp(expert, mlp_units(cfg.expert_intermediate_size, layout), layout)
            if mlp.shared is not None:
                _split_mlp(mlp.shared, mlp_units(cfg.shared_expert_intermediate_size, layout), layout)
        else:
            _split_mlp(mlp, units, layout)


def connect_tensor_parallel(model: Transformer, layout: Layout, group) -> None:
    """A model whose layers hold this TP rank's slice (`tp_slice`), read so or sliced: each
    attention's head counts, and an all-reduce of the row-parallel outputs (wo's, w2's; a
    mixture's summed experts)."""

    def all_reduce(_module, _inputs, output):
        dist.all_reduce(output, group=group)
        return output

    cfg = model.cfg
    q_heads, kv, units = tp_slice(cfg, layout)
    ranks = [tp_slice(cfg, replace(layout, tp_rank=r)) for r in range(layout.tp)]
    for block in model.layers:
        block.attn.num_heads, block.attn.num_kv_heads = len(q_heads), len(kv)
        if block.attn.qk_norm_across_heads:  # every rank's rows, as one vector: its sum over ranks
            attn, hd = block.attn, cfg.head_dim
            attn.q_norm = RanksRMSNorm(attn.q_norm, sum(len(q) for q, _, _ in ranks) * hd, group)
            attn.k_norm = RanksRMSNorm(attn.k_norm, sum(len(k) for _, k, _ in ranks) * hd, group)
        block.attn.wo.register_forward_hook(all_reduce)
        (block.mlp if isinstance(block.mlp, MoE) else block.mlp.w2).register_forward_hook(all_reduce)
    model.cfg = replace(
        cfg,
        num_heads=len(q_heads),
        num_kv_heads=len(kv),
        intermediate_size=len(units),
        expert_intermediate_size=len(mlp_units(cfg.expert_intermediate_size, layout)),
        shared_expert_intermediate_size=len(mlp_units(cfg.shared_expert_intermediate_size, layout)),
    )


class RanksRMSNorm(nn.Module):
    """An RMSNorm over a vector whose parts are on the TP ranks (OLMo 2's q/k norms across all
    heads): each rank's sum of squares, all-reduced, over `width`, the count of the values the
    ranks hold together (a KV head on several ranks counted on each, as its squares are)."""

    def __init__(self, norm: RMSNorm, width: int, group):
        super().__init__()
        self.weight, self.eps, self.width, self.group = norm.weight, norm.eps, width, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        squares = xf.pow(2).sum(-1, keepdim=True)
        dist.all_reduce(squares, group=self.group)
        return self.weight * (xf * torch.rsqrt(squares / self.width + self.eps)).to(x.dtype)
