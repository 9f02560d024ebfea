"""The two kernels that multiply grid-quantized weights (kernels/grid.py), and the operands each
takes:

- `Kernel.TORCH`: torch's int4 CPU kernel (`_weight_int4pack_mm_for_cpu`, bf16 activations and
  scales); an 8-bit layer multiplies as two int4 halves of its codes.
- `Kernel.NATIVE`: Shardline's own, fp16 scales beside the codes, 8 outputs across the vector
  lanes, activations rounded to int8 per group of 32 and integer dot products:
  kernels/int8_linear.cpp for 8 bits, kernels/int4_linear.cpp for 4 (codes unpacked in
  registers; many rows through a GEMM on slices dequantized on the fly), and
  kernels/int6_linear.cpp for GGUF's Q6_K blocks (6 bits, no torch kernel to compare).
"""

from __future__ import annotations

import enum

import torch
import torch.nn.functional as F

from shardline.kernels import native
from shardline.kernels.grid import GROUP, rows_at_once


class Kernel(enum.Enum):
    TORCH = "torch"
    NATIVE = "native"


def _int4_operands(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor):
    """The packed weight and [K/32, N, 2] scales-and-zeros of `_weight_int4pack_mm_for_cpu`,
    which computes with w = (code - 8) * scale + zero."""
    return (
        torch._convert_weight_to_int4pack_for_cpu(codes, 2),
        torch.stack([scale.t(), zero.t()], -1).to(torch.bfloat16).contiguous(),
    )


def torch_operands(codes, scale, lo, bits: int) -> list:
    """torch's int4 kernel computes with w = (code - 8) * scale + zero; an 8-bit layer multiplies
    as two int4 halves: code = 16 * high + low, so w = [(high - 8) * 16 scale + (lo + 128 scale)] +
    [(low - 8) * scale + 8 scale]."""
    n = codes.shape[0]
    if n > (step := rows_at_once(codes.shape[1])):  # packed weights stack by rows, scales and zeros by columns
        parts = [torch_operands(*(t[i : i + step] for t in (codes, scale, lo)), bits) for i in range(0, n, step)]
        return [
            (torch.cat([p[h][0] for p in parts]), torch.cat([p[h][1] for p in parts], 1)) for h in range(len(parts[0]))
        ]
    codes = codes.to(torch.int32)
    if bits == 4:
        return [_int4_operands(codes, scale, lo + 8 * scale)]
    return [_int4_operands(codes >> 4, 16 * scale, lo + 128 * scale), _int4_operands(codes & 15, scale, 8 * scale)]


# A native layer's records (kernels/interleaved.h): per block of LANES outputs and group, the
# codes (4, 6 or 8 bits each), then their scales: LANES fp16 scales and LANES fp16 los (4 and 8
# bits), or 2 x LANES int8 scales and LANES fp16 d (6 bits, kernels/int6_linear.cpp); Q4_K's
# records are 8 groups' codes, scales and mins with their super-block's d and dmin
# (kernels/int4_linear.cpp). A tensor [N/8, K/(32 x groups a record), bytes]; records of a size are
# one kernel's: by their size, (the kernel's name, groups a record).
LANES = 8
RECORD_BYTES = {4: GROUP * LANES // 2 + 4 * LANES, 6: GROUP * LANES * 6 // 8 + 4 * LANES, 8: GROUP * LANES + 4 * LANES}
Q4_K_RECORD = 8 * (GROUP * LANES // 2 + 2 * LANES) + 4 * LANES
FORMATS = {RECORD_BYTES[bits]: (f"int{bits}", 1) for bits in RECORD_BYTES} | {Q4_K_RECORD: ("q4_k", 8)}


def record_format(records: torch.Tensor) -> str:
    """What records hold: int4, int6, int8 or q4_k."""
    return FORMATS[records.shape[-1]][0]


def in_features(records: torch.Tensor) -> int:
    return records.shape[1] * FORMATS[records.shape[-1]][1] * GROUP


def native_operands(codes: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor, bits: int, count_down: bool = True):
    """The operands of Shardline's kernels: one record per block of 8 outputs and group of 32
    weights, the block's codes interleaved beside its scales and los, both rounded to fp16 (4 bits:
    `int4_pack`; 8 bits, 0..254: shifted to int8, the shift folded into lo, `int8_pack`). 6 bits:
    Q6_K's codes 0..63, and in place of scale and lo its int8 scales [N, K/16] and d [N, K/32]
    (`int6_pack`: w = d * sc * (code - 32), exactly). N is padded with zero weights to whole
    blocks; the kernels return those outputs too (zeros), and `QuantizedLinear` drops them. Codes
    of any integer dtype (uint8 holds them in a quarter)."""
    n, k = codes.shape
    if n > (step := rows_at_once(k)):  # the temporaries are several copies of the codes
        records = torch.empty((-(-n // LANES), k // GROUP, RECORD_BYTES[bits]), dtype=torch.uint8)
        for i in range(0, n, step):  # whole blocks of 8 rows a slice, but for the last one's padding
            part = native_operands(*(t[i : i + step] for t in (codes, scale, lo)), bits, count_down)[0]
            records[i // LANES : i // LANES + len(part)] = part
        return (records,)
    pad = -codes.shape[0] % LANES
    if pad:
        codes, scale, lo = (F.pad(t, (0, 0, 0, pad)) for t in (codes, scale, lo))
    if bits == 6:
        return (native.ops().int6_pack(codes, scale, lo),)
    codes, scale, lo = codes.to(torch.int32), scale.float(), lo.float()
    if bits == 4:
        if count_down:
            codes, scale, lo = _counted_down_where_fp16_holds_it(codes, scale, lo, 16)
        return (native.ops().int4_pack(codes, scale, lo),)
    codes, lo = _int8_grid(codes, scale, lo)
    return (native.ops().int8_pack(codes, scale, lo),)


def _counted_down_where_fp16_holds_it(codes, scale, lo, levels: int):
    """Groups whose lowest value fp16 does not hold count down from a grid value that it does, where
    one lies above every code: codes c -> j - c, scale negated, lo the value at j. Q4_0's blocks are
    d * (q - 8) with a d of either sign, and where d is negative the grid's lowest value is some
    -k|d|, k < 8, rarely an fp16 number; its value at q = 0, -8d, is one."""
    unheld = lo.half().float() != lo
    if not unheld.any():  # Q4_1's layers, say: every lo is an fp16 number already
        return codes, scale, lo
    groups = codes.view(codes.shape[0], -1, GROUP)
    at = unheld.nonzero(as_tuple=True)  # only the groups in question: Q4_K's are most, Q4_0's few
    low, high, base, step = groups.amin(-1)[at], groups.amax(-1)[at], lo[at], scale[at]
    origin, top, todo = base.clone(), torch.zeros_like(low), torch.ones_like(low, dtype=torch.bool)
    for j_over_high in range(levels):  # the lowest j that fits: from high up, while j - low < levels
        j = high + j_over_high
        can = todo & (j <= levels - 1) & (j - low <= levels - 1)
        if not can.any():
            break
        value = base + j * step
        held = value.half().float()
        fits = can & ((held - value).abs() <= 1e-6 * step.abs())
        origin, top, todo = torch.where(fits, held, origin), torch.where(fits, j, top), todo & ~fits
    down = ~todo
    if not down.any():
        return codes, scale, lo
    flip, top_at = torch.zeros_like(unheld), torch.zeros(unheld.shape, dtype=top.dtype)
    flip[at], top_at[at] = down, top
    new_lo, new_scale = lo.clone(), scale.clone()
    new_lo[at] = torch.where(down, origin, base)
    new_scale[at] = torch.where(down, -step, step)
    codes = torch.where(flip.repeat_interleave(GROUP, 1), top_at.repeat_interleave(GROUP, 1) - codes, codes)
    return codes, new_scale, new_lo


def _int8_grid(codes: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The codes 0..254 as int8, and lo with the shift folded in. A group counts from its code of
    zero where zero lies on its grid (Q8_0's blocks), so that its lo is exactly 0, which fp16
    holds (lo + 128 * scale would round); else from 0 where its codes fit int8 as they are (a
    4-bit block's, say: its lo stays as it was); any other group from 128."""
    groups = codes.view(codes.shape[0], -1, GROUP)
    zero = (-lo / scale.clamp_min(torch.finfo(torch.float32).tiny)).round()
    high = groups.amax(-1)
    on_grid = (
        ((lo + zero * scale).abs() <= 1e-6 * scale.abs()) & (groups.amin(-1) - zero >= -128) & (high - zero <= 127)
    )
    shift = torch.where(on_grid, zero, torch.where(high <= 127, 0.0, 128.0)).to(codes.dtype)
    folded = torch.where(on_grid, torch.zeros_like(lo), lo + shift * scale)
    return (codes - shift.repeat_interleave(GROUP, 1)).to(torch.int8), folded


def native_rows(held, tokens: torch.Tensor) -> torch.Tensor:
    """The weights' rows `tokens` of a layer's native operands, fp32 [T, K] (a tied embedding's
    lookups)."""
    return native.ops().record_rows(held[0], tokens)


def operands(kernel: Kernel, codes, scale, lo, bits: int, count_down: bool = True):
    if kernel is Kernel.NATIVE:
        return native_operands(codes, scale, lo, bits, count_down)
    return torch_operands(codes, scale, lo, bits)


def multiply(
    kernel: Kernel, operands, rows: torch.Tensor, direct_rows: int = 1 << 30, bf16_gemm: bool = False
) -> torch.Tensor:
    """rows [n, K] times the weights that `operands` hold for `kernel` -> fp32 [n, N]. A native
    layer multiplies up to `direct_rows` rows straight from its codes, more through a GEMM on
    slices it dequantizes (in bf16 where `bf16_gemm`: kernels/choice.py, `gemm_in_bf16`)."""
    if kernel is Kernel.NATIVE:
        records = operands[0]
        linear = getattr(native.ops(), f"{record_format(records)}_linear")
        return linear(rows.float(), records, direct_rows, bf16_gemm)
    rows = rows.bfloat16()
    out = [torch._weight_int4pack_mm_for_cpu(rows, packed, GROUP, scales_zeros) for packed, scales_zeros in operands]
    return out[0].float() if len(out) == 1 else out[0].float() + out[1].float()
