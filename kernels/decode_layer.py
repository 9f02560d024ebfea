"""Decode steps through each quantized layer as one operator (kernels/decode_layer.cpp).

Like quantization, this is a transformation of a plain `Transformer`, applied after it:
`fuse_decode` wraps each block whose four linear layers are quantized (and carry no forward
hooks: a TP-sliced block all-reduces between them) in a `FusedDecodeBlock`. A decode step's
block then runs as one call: one Python dispatch per layer instead of some twenty operators,
which at one stream cost more than the layer's arithmetic. Everything else (prefill, chunks,
decode graphs, batches above a layer's dense-copy crossover) runs the block as before.
"""
from __future__ import annotations

import torch
from torch import nn

from kernels import native
from kernels.attention import AttentionBatch
from kernels.quantized import QuantizedLinear

# The operand layouts decode_layer.cpp takes, by (kernel, bits).
_KINDS = {("torch", 4): 0, ("torch", 8): 1, ("native", 8): 2}


def _operands(layer: QuantizedLinear) -> list[torch.Tensor]:
    if layer.kernel == "native":
        return list(layer.operands)
    return [t for pair in layer.operands for t in pair]


class FusedDecodeBlock(nn.Module):
    """A `Block` whose decode steps run as one `decode_layer` call. The block stays inside,
    holding the weights, and runs every other step itself."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block
        attn, linears = block.attn, _linears(block)
        self.max_rows = min(layer.max_rows for layer in linears)
        qk_norms = (attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.eps) if attn.q_norm else (None, None, 0.0)
        # decode_layer's arguments before and after the step's own, in its schema's order
        self.leading = (block.attn_norm.weight, block.mlp_norm.weight, block.attn_norm.eps,
                        *(_operands(layer) for layer in linears),
                        [_KINDS[(layer.kernel, layer.bits)] for layer in linears], attn.wqkv.bias)
        self.qk_norms, self.heads, self.scale = qk_norms, attn.num_heads, attn.scale

    def forward(self, x, cos_sin, k_pages, v_pages, batch: AttentionBatch):
        if not batch.is_decode or batch.opaque or x.shape[0] > self.max_rows or not native.usable(x):
            return self.block(x, cos_sin, k_pages, v_pages, batch)
        return native.ops().decode_layer(x, *self.leading, cos_sin[0], cos_sin[1], *self.qk_norms, k_pages, v_pages,
                                         batch.slots, batch.block_tables, batch.context_lens, self.heads, self.scale)


def _linears(block: nn.Module) -> list[nn.Module]:
    return [block.attn.wqkv, block.attn.wo, block.mlp.w13, block.mlp.w2]


def fusable(block: nn.Module) -> bool:
    linears = _linears(block)
    return (all(isinstance(layer, QuantizedLinear) and not layer._forward_hooks for layer in linears)
            and all(layer.bias is None for layer in linears[1:]))


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
