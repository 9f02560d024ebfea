"""The two kernels that multiply grid-quantized weights (kernels/grid.py), and the operands each
takes:

- `Kernel.TORCH`: torch's int4 CPU kernel (`_weight_int4pack_mm_for_cpu`, bf16 activations and
  scales); an 8-bit layer multiplies as two int4 halves of its codes.
- `Kernel.NATIVE`: Shardline's own for 8 bits (kernels/int8_linear.cpp: activations quantized to
  int8 per group of 32 as llama.cpp does, integer dot products, fp32 scales).
"""
from __future__ import annotations

import enum

import torch

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


def native_operands(codes: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor):
    """The codes, scale and lo of `native.int8_linear` for an 8-bit grid (codes 0..254): codes
    shifted to int8, the shift folded into lo."""
    return (codes - 128).to(torch.int8), scale.float().contiguous(), (lo + 128 * scale).float()


def operands(kernel: Kernel, codes, scale, lo, bits: int):
    return native_operands(codes, scale, lo) if kernel is Kernel.NATIVE else torch_operands(codes, scale, lo, bits)


def multiply(kernel: Kernel, operands, rows: torch.Tensor) -> torch.Tensor:
    """rows [n, K] times the weights that `operands` hold for `kernel` -> fp32 [n, N]."""
    if kernel is Kernel.NATIVE:
        return native.ops().int8_linear(rows.float(), *operands)
    rows = rows.bfloat16()
    out = [torch._weight_int4pack_mm_for_cpu(rows, packed, GROUP, scales_zeros) for packed, scales_zeros in operands]
    return out[0].float() if len(out) == 1 else out[0].float() + out[1].float()
