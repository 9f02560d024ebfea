"""The transformations a shard applies to its plain `Transformer` (gpt-fast style: the model code
knows nothing of ranks, quantization or kernels), in two groups, each in one order.

`serving_layout` lays out the weights of a model built whole in fp32 (shard/weights.py) as they
are served; a GGUF read straight into the serving layout (shard/gguf_loader.py) comes out of
its loader as these four steps leave a model:
1. `mark_quantized`: tag the linear layers to serve quantized;
2. `keep_stage` (shard/parallel.py): drop what this pipeline stage does not run;
3. `slice_tensor_parallel` (shard/parallel.py): keep this TP rank's slice of the weights;
4. `swap_quantized`: swap the tagged layers for `QuantizedLinear` (after slicing, which works on dense
   weights).

`finish` then readies either for serving:
5. `connect_tensor_parallel` (shard/parallel.py): the TP group's all-reduces, as forward hooks;
6. `use_native_ops`: attention's decode step and the MLP's activation on Shardline's CPU kernels;
7. `fuse_decode`: wrap each block whose linear layers (a mixture's: every expert's) are quantized
   (and untouched by TP) so that a decode step runs it as one C++ operator;
8. `use_onednn`: dense fp32 linear layers in oneDNN's blocked layout (without decode graphs).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from shardline.kernels import native
from shardline.kernels.attention import AttentionBatch
from shardline.kernels.linear import OneDnnLinear
from shardline.kernels.operands import Kernel, record_format
from shardline.kernels.quantized import QuantizedLinear, TiedEmbedding
from shardline.kernels.stacked import parts_of
from shardline.shard.footprint import Description, served_bits
from shardline.shard.layout import Layout
from shardline.shard.model import MLP, Attention, MoE, Rotary, Transformer
from shardline.shard.parallel import connect_tensor_parallel, keep_stage, slice_tensor_parallel
from shardline.shard.weights import gguf_types, parameter_sources

log = logging.getLogger(__name__)


def serving_layout(
    model: Transformer,
    description: Description,
    layout: Layout,
    device: torch.device,
    *,
    weights: str,
    quantize: str,
    dense_copy: bool,
) -> None:
    """Steps 1 to 4, in place. `weights` and `quantize`: as the flags say
    (`mark_quantized`); `dense_copy`: int4 layers keep a dense copy for prefill."""
    if device.type == "cpu":
        mark_quantized(model, description, weights, quantize)
    elif quantize != "none" or (weights == "native" and description.source.kind == "gguf"):
        log.warning("quantized weights have CPU kernels only: serving every weight in the serving dtype")
    if layout.world > 1:
        keep_stage(model, layout)
        slice_tensor_parallel(model, layout)
    swap_quantized(model, dense_copy=dense_copy)


def finish(model: Transformer, layout: Layout, tp_group, device: torch.device, *, onednn: bool) -> None:
    """Steps 5 to 8, in place, on a model that holds this shard's weights as served. `tp_group`:
    this stage's TP group (shard/parallel.py's `init_distributed`), None without TP; `onednn`:
    step 8 applies."""
    if layout.tp > 1:
        connect_tensor_parallel(model, layout, tp_group)
    if device.type == "cpu":
        log.info(
            "decode attention and quantized layers %s Shardline's CPU kernels",
            "may use" if native.available() else "use torch's kernels: could not build",
        )
        use_native_ops(model)
        log.info("%d layers decode as one operator each", fuse_decode(model))
    if onednn:
        log.info("%d linear layers use oneDNN's weight layout", use_onednn(model))


# -- 1. which layers are served quantized ------------------------------------------------------
def mark_quantized(model: Transformer, description: Description, weights: str, quantize: str) -> None:
    """Tags each linear layer that is to be served quantized with `quant_bits` (4 or 8, by
    `footprint.served_bits`), for `swap_quantized` to swap after any slicing. `weights="native"` reads a
    GGUF's types; dequantized weights count as floats."""
    types = gguf_types(description) if description.source.kind == "gguf" and weights == "native" else {}
    sources = parameter_sources(model.cfg, types)
    # A mixture's routers stay dense: a token's experts are picked by small differences of scores.
    linears = [
        name
        for name, module in model.named_modules()
        if type(module) is nn.Linear and name.startswith("layers.") and not name.endswith(("mlp.gate", "shared_gate"))
    ]
    for name in [*linears, "lm_head"]:
        bits = served_bits({types.get(t, "F32") for t in sources[name + ".weight"]}, quantize, head=name == "lm_head")
        if bits is not None:
            model.get_submodule(name).quant_bits = bits


# -- 4. quantized layers ---------------------------------------------------------------------------
def swap_quantized(model: nn.Module, dense_copy: bool = False) -> None:
    """Swaps every linear layer tagged with a `quant_bits` attribute (4 or 8) for its quantized
    form, in place. A tied LM head quantized to int8 also serves the embedding's lookups.
    `dense_copy`: int4 layers also keep a dense copy, for steps of many rows (prefill)."""
    embed, head = getattr(model, "embed", None), getattr(model, "lm_head", None)
    tied = embed is not None and head is not None and head.weight is embed.weight
    for name, linear in list(model.named_modules()):
        bits = getattr(linear, "quant_bits", None)
        if bits is None:
            continue
        parent_name, _, attr = name.rpartition(".")
        new = QuantizedLinear(linear, bits, dense_copy=dense_copy, keep_rows=tied and linear is head and bits == 8)
        setattr(model.get_submodule(parent_name), attr, new)
    if tied and isinstance(model.lm_head, QuantizedLinear) and model.lm_head.bits == 8:
        model.embed = TiedEmbedding(model.lm_head, embed.weight.dtype)


def is_quantized(model: nn.Module) -> bool:
    return any(isinstance(m, QuantizedLinear) for m in model.modules())


# -- 6. Shardline's CPU kernels in attention and the MLP ------------------------------------------
class NativeAttention(Attention):
    """Attention whose decode step is one operator for the q/k norms, the rotation, the K/V write
    and attention over the pages; other steps (and tensors the kernels do not take) as `Attention`."""

    def forward(self, x, cos_sin, k_pages, v_pages, batch: AttentionBatch):
        native_step = batch.is_decode and not batch.opaque and native.usable(k_pages)
        # the kernel normalizes q and k per head, and attends over the whole context without sinks
        if not native_step or self.qk_norm_across_heads or self.window or self.sinks is not None or self.softcap:
            return super().forward(x, cos_sin, k_pages, v_pages, batch)
        norms = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if self.q_norm else (None, None, 0.0)
        cos, sin = cos_sin if self.rotates else Rotary.unrotated(cos_sin)
        out = native.ops().paged_decode(
            self.wqkv(x),
            cos,
            sin,
            *norms,
            k_pages,
            v_pages,
            batch.slots,
            batch.block_tables,
            batch.context_lens,
            self.num_heads,
            self.scale,
        )
        return self.wo(out)


class NativeMLP(MLP):
    """The MLP with SiLU(gate) * up as one operator."""

    def forward(self, x):
        if not native.usable(x) or self.activation != "silu":
            return super().forward(x)
        return self.w2(native.ops().silu_mul(self.w13(x)))


def use_native_ops(model: nn.Module) -> None:
    """Turns every `Attention` and `MLP` of `model` into its native form, in place (their weights,
    hooks and names stay). Nothing without the kernels."""
    if not native.available():
        return
    for module in model.modules():
        if type(module) is Attention:
            module.__class__ = NativeAttention
        elif type(module) is MLP:
            module.__class__ = NativeMLP


# -- 7. one operator per decode layer -------------------------------------------------------------
# The operand layouts kernels/decode_layer.cpp takes: torch's by bits, Shardline's by what its
# records hold.
_LAYOUTS = {(Kernel.TORCH, 4): 0, (Kernel.TORCH, 8): 1, "int8": 2, "int4": 3, "int6": 4, "q4_k": 5}


def _layout(layer: QuantizedLinear) -> int:
    if layer.kernel is Kernel.NATIVE:
        return _LAYOUTS[record_format(layer.operands[0])]
    return _LAYOUTS[layer.kernel, layer.bits]


def _operands(layer: QuantizedLinear) -> list[torch.Tensor]:
    if layer.kernel is Kernel.NATIVE:  # and torch's int4 operands, where it serves the batch rows
        return [*layer.operands, *(layer.torch_operands[0] if layer.torch_operands else ())]
    return [t for pair in layer.operands for t in pair]


def _linears(block: nn.Module) -> list[nn.Module]:
    """qkv, wo, then w13 and w2 of each MLP: the dense one, or every expert's and the shared one's."""
    mlps = [block.mlp] if isinstance(block.mlp, MLP) else [*block.mlp.experts, block.mlp.shared]
    return [block.attn.wqkv, block.attn.wo, *(w for mlp in mlps if mlp is not None for w in (mlp.w13, mlp.w2))]


def _parts(linears: list[nn.Module]) -> tuple[list[torch.Tensor], list[int], list[int]]:
    """The DecodeLayer's description of the layers' parts (kernels/decode_layer.h): their operands
    one after the other, per part its kind, direct_rows, torch_rows and count of operands, and the
    count of parts per layer."""
    operands, info, counts = [], [], []
    for layer in linears:
        parts = parts_of(layer)
        counts.append(len(parts))
        for part in parts:
            own = _operands(part)
            operands += own
            info += [_layout(part), part.direct_rows, part.torch_rows, len(own)]
    return operands, info, counts


class FusedDecodeBlock(nn.Module):
    """A `Block` whose decode steps run as one call of a `DecodeLayer` (kernels/decode_layer.cpp),
    which holds the layer's weights, norms and kernel choices: one Python dispatch per layer
    instead of some twenty operators (some two hundred for a mixture of 8 experts a token), which
    at one stream cost more than the layer's arithmetic.
    The block stays inside, holding the weights, and runs every other step itself (prefill,
    chunks, decode graphs, batches above a layer's dense-copy crossover)."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block
        attn, linears = block.attn, _linears(block)
        self.max_rows = min(layer.max_rows for layer in linears)
        qk_norms = (attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.eps) if attn.q_norm else (None, None, 0.0)
        moe = block.mlp if isinstance(block.mlp, MoE) else None
        routing = (None, 0, False, None)
        if moe is not None:
            shared_gate = moe.shared_gate.weight.reshape(-1) if moe.shared is not None else None
            routing = (moe.gate.weight, moe.top_k, moe.norm_topk_prob, shared_gate)
        self.decode = torch.classes.shardline_native.DecodeLayer(
            block.attn_norm.weight,
            block.mlp_norm.weight,
            block.attn_norm.eps,
            *_parts(linears),
            parts_of(linears[0])[0].bf16_gemm,  # a machine's choice: the same for every layer
            attn.wqkv.bias,
            *qk_norms,
            attn.num_heads,
            attn.scale,
            *routing,
            block.residual_scale,
        )

    @property
    def attn(self) -> nn.Module:
        """The block's attention, as the model reads a layer's (its window)."""
        return self.block.attn

    def forward(self, x, cos_sin, k_pages, v_pages, batch: AttentionBatch):
        if not batch.is_decode or batch.opaque or x.shape[0] > self.max_rows or not native.usable(x):
            return self.block(x, cos_sin, k_pages, v_pages, batch)
        cos, sin = cos_sin if self.block.attn.rotates else Rotary.unrotated(cos_sin)
        return self.decode.forward(x, cos, sin, k_pages, v_pages, batch.slots, batch.block_tables, batch.context_lens)


def fusable(block: nn.Module) -> bool:
    """Whether a block's decode step can be one `DecodeLayer`: Llama's block (its norms before each
    sublayer, q/k norms per head; a residual scale it takes), every linear part quantized (a
    mixture's routers are dense fp32 layers beside them) and untouched by TP."""
    if block.attn_norm is None or block.attn_out_norm is not None or block.attn.qk_norm_across_heads:
        return False
    attn = block.attn
    if attn.window or attn.sinks is not None or attn.softcap or getattr(block.mlp, "activation", "silu") != "silu":
        return False  # the kernel's attention is unwindowed, sinkless and uncapped, its MLPs SiLU's
    moe = block.mlp if isinstance(block.mlp, MoE) else None
    if moe is not None and (
        type(moe.gate) is not nn.Linear
        or moe.gate.weight.dtype != torch.float32
        or moe._forward_hooks
        or (moe.shared is not None and moe.shared_gate.weight.dtype != torch.float32)
    ):
        return False
    linears = _linears(block)
    parts = [part for layer in linears for part in parts_of(layer)]
    return (
        all(isinstance(part, QuantizedLinear) and not part._forward_hooks for part in parts)
        and not any(layer._forward_hooks for layer in linears)
        and all(layer.bias is None for layer in linears[1:])
        and all(part.out_features % 8 == 0 for part in parts)
    )  # the kernels' outputs whole (no padded block)


def fuse_decode(model: nn.Module) -> int:
    """Wraps every fusable block of `model` in place; returns how many. Nothing without the kernels."""
    if not native.available():
        return 0
    fused = 0
    for i, block in enumerate(model.layers):
        if fusable(block):
            model.layers[i] = FusedDecodeBlock(block)
            fused += 1
    return fused


# -- 8. oneDNN layouts ----------------------------------------------------------------------------
def use_onednn(model: nn.Module) -> int:
    """Swaps every `nn.Linear` whose weight no other module shares (a tied LM head keeps the
    embedding's dense weight) for a `OneDnnLinear`; returns how many were swapped."""
    owners: dict[int, int] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and owners[id(child.weight)] == 1:
                setattr(parent, name, OneDnnLinear(child))
                swapped += 1
    return swapped
