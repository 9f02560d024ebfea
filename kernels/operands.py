"""The two kernels that multiply grid-quantized weights (kernels/grid.py), and the operands each
takes:

- `Kernel.TORCH`: torch's int4 CPU kernel (`_weight_int4pack_mm_for_cpu`, bf16 activations and
  scales); an 8-bit layer multiplies as two int4 halves of its codes.
- `Kernel.NATIVE`: Shardline's own, fp32 scales, 8 outputs across the vector lanes, activations
  rounded to int16 per group of 32 and integer dot products: kernels/int8_linear.cpp for 8 bits,
  kernels/int4_linear.cpp for 4 (codes unpacked in registers; many rows through an fp32 GEMM on
  slices dequantized on the fly).
"""
from __future__ import annotations

import enum

import torch
import torch.nn.functional as F

from kernels import native
from kernels.grid import GROUP


class Kernel(enum.Enum):
    TORCH = "torch"
    NATIVE = "native"


def _int4_operands(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor):
    """The packed weight and [K/32, N, 2] scales-and-zeros of `_weight_int4pack_mm_for_cpu`,
    which computes with w = (code - 8) * scale + zero."""
    return (torch._convert_weight_to_int4pack_for_cpu(codes, 2),
            torch.stack([scale.t(), zero.t()], -1).to(torch.bfloat16).contiguous())


def torch_operands(codes, scale, lo, bits: int) -> list:
    """torch's int4 kernel computes with w = (code - 8) * scale + zero; an 8-bit layer multiplies
    as two int4 halves: code = 16 * high + low, so w = [(high - 8) * 16 scale + (lo + 128 scale)] +
    [(low - 8) * scale + 8 scale]."""
    if bits == 4:
        return [_int4_operands(codes, scale, lo + 8 * scale)]
    return [_int4_operands(codes >> 4, 16 * scale, lo + 128 * scale), _int4_operands(codes & 15, scale, 8 * scale)]


def native_operands(codes: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor, bits: int):
    """The operands of Shardline's kernels: the codes with each block of 8 outputs interleaved
    (4 bits: packed by `int4_pack`; 8 bits, 0..254: shifted to int8, the shift folded into lo, by
    `int8_interleave`), and scale and lo [N/8, K/32, 8], a block's 8 outputs side by side per
    group. N is padded with zero weights to whole blocks; the kernels return those outputs too
    (zeros), and `QuantizedLinear` drops them."""
    pad = -codes.shape[0] % 8
    if pad:
        codes, scale, lo = (F.pad(t, (0, 0, 0, pad)) for t in (codes, scale, lo))
    n, groups = scale.shape

    def blocked(t):
        return t.float().reshape(n // 8, 8, groups).transpose(1, 2).contiguous()
    if bits == 4:
        return native.ops().int4_pack(codes), blocked(scale), blocked(lo)
    return native.ops().int8_interleave((codes - 128).to(torch.int8)), blocked(scale), blocked(lo + 128 * scale)


def native_rows(held, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The weights' rows `tokens` of an 8-bit layer's native operands, as (codes [T, K], scale
    and lo [T, K/32]) for `grid_weights` (a tied embedding's lookup)."""
    codes, scale, lo = held
    n, k = codes.shape
    block, lane = tokens // 8, tokens % 8
    rows = codes.view(n // 8, k // 2, 8, 2)[block, :, lane].reshape(-1, k)
    return rows, scale[block, :, lane], lo[block, :, lane]


def operands(kernel: Kernel, codes, scale, lo, bits: int):
    return native_operands(codes, scale, lo, bits) if kernel is Kernel.NATIVE else torch_operands(codes, scale, lo, bits)


def multiply(kernel: Kernel, operands, rows: torch.Tensor, direct_rows: int = 1 << 30) -> torch.Tensor:
    """rows [n, K] times the weights that `operands` hold for `kernel` -> fp32 [n, N]. A native 4-bit
    layer multiplies up to `direct_rows` rows straight from its codes, more through the GEMM."""
    if kernel is Kernel.NATIVE:
        if operands[0].dtype == torch.int32:  # int4_pack's words
            return native.ops().int4_linear(rows.float(), *operands, direct_rows)
        return native.ops().int8_linear(rows.float(), *operands)
    rows = rows.bfloat16()
    out = [torch._weight_int4pack_mm_for_cpu(rows, packed, GROUP, scales_zeros) for packed, scales_zeros in operands]
    return out[0].float() if len(out) == 1 else out[0].float() + out[1].float()
