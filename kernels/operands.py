"""The two kernels that multiply grid-quantized weights (kernels/grid.py), and the operands each
takes:

- `Kernel.TORCH`: torch's int4 CPU kernel (`_weight_int4pack_mm_for_cpu`, bf16 activations and
  scales); an 8-bit layer multiplies as two int4 halves of its codes.
- `Kernel.NATIVE`: Shardline's own, fp32 scales: for 8 bits kernels/int8_linear.cpp (activations
  quantized to int8 per group of 32 as llama.cpp does, integer dot products), for 4 bits
  kernels/int4_linear.cpp (codes unpacked in registers, activations rounded to int16 per group;
  many rows through an fp32 GEMM on slices dequantized on the fly).
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
    """The operands of Shardline's kernel. 8 bits (codes 0..254): the codes shifted to int8, the
    shift folded into lo, for `int8_linear`; 4 bits: the codes packed by `int4_pack`."""
    if bits == 4:
        packed = native.ops().int4_pack(codes)
        pad = packed.shape[1] * 8 // GROUP - scale.shape[1]  # the groups of zeros that pad K to whole tiles
        return packed, F.pad(scale.float(), (0, pad)).contiguous(), F.pad(lo.float(), (0, pad)).contiguous()
    return (codes - 128).to(torch.int8), scale.float().contiguous(), (lo + 128 * scale).float()


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
