"""Weight-only quantized linear layers: 4-bit ones on torch's int4 CPU kernel (bf16 activations),
8-bit ones on it as well or on Shardline's own (kernels/int8_linear.cpp: int8 activations, integer
dot products), whichever measures faster on the machine (`kernel_for`).

Weights are held in groups of 32 along the input dimension, w = lo + scale * code:
- int4 (16 levels). GGUF's Q4_0, Q4_1 and Q4_K blocks are such groups, so their weights are
  recovered exactly, up to the rounding of scale and zero (bf16 in torch's kernel, fp16 in ours).
- int8 (255 levels): in torch's kernel two int4 multiplies, one for each half of the code. GGUF's
  Q8_0 blocks are such groups (exact likewise); finer-grained types (Q6_K) are rounded to 8 bits
  per group.

A step of many rows is faster on dense weights, by how much depends on the CPU. So an int8 layer
(in practice the LM head) always keeps a dense copy, and int4 layers keep one when asked (for
prefill, `dense_copy`); its dtype (`dense_kind`) and the row count above which it multiplies
(`crossover`) are measured on the machine at load, once per layer shape. Measured, SmolLM2's LM
head (49152x576), ms at 1/8/16/32 rows:
  2-core EPYC, AVX-512-bf16: int4 kernel 0.76/2.8/-/15, bf16 dense 4.1/5.5/-/11.6;
  2-core EPYC, AVX2:         int4 kernel 2.3/8.8/17/36, bf16 dense 3.7/26/50/109, oneDNN fp32 4.9/12/18/23.
Without a copy, int4 layers multiply every step in the int4 kernel.

Like tensor parallelism, quantization is a transformation of a plain `Transformer`, applied after
any TP slicing: `quantize` swaps the tagged modules in place and carries over their forward hooks.
"""
from __future__ import annotations

import functools
import os
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from kernels import native
from kernels.linear import OneDnnLinear, onednn_linear

GROUP = 32
ROWS_AT_ONCE = 4096  # rows quantized together at load (SmolLM2's LM head has 49152)
MAX_PROBE_ROWS = 64  # `crossover` measures up to this many rows; quantized still faster there: always


def grid_groups(w: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """w [N, K] -> (codes int32 [N, K] in 0..levels-1, scale [N, K/32], lo [N, K/32], share exact),
    with w = lo + scale * code.

    A group of 32 whose weights already lie on such a grid (what a GGUF block dequantizes to:
    Q4_0, Q4_1 and Q4_K with 16 levels, Q8_0 with 255) keeps that grid exactly; any other group is
    rounded to the nearest of `levels` evenly spaced values between its min and max. The last
    value is the share of groups kept exactly."""
    n, k = w.shape
    if k % GROUP:
        raise ValueError(f"quantized layers need an input dimension divisible by {GROUP}, got {k}")
    if n > ROWS_AT_ONCE:  # the temporaries below are several copies of w: bound them
        parts = [grid_groups(w[i:i + ROWS_AT_ONCE], levels) for i in range(0, n, ROWS_AT_ONCE)]
        exact = sum(p[3] * len(p[0]) for p in parts) / n
        return (*(torch.cat([p[j] for p in parts]) for j in range(3)), exact)
    g = w.float().reshape(-1, GROUP)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    span = hi - lo
    scale = torch.where(span > 0, span / (levels - 1), torch.ones_like(span))
    codes = ((g - lo) / scale).round().clamp(0, levels - 1)
    exact = (span == 0) | ((lo + codes * scale - g).abs() <= span * 1e-4).all(-1, keepdim=True)
    # Groups whose codes do not reach both ends: hi and lo are still grid points, so the step is
    # span / (a whole number of steps), and the smallest gap between values is a whole number of
    # steps too (more than one when no two of the codes present are adjacent).
    todo = (~exact).squeeze(-1).nonzero().squeeze(-1)
    t_g, t_lo, t_span = g[todo], lo[todo], span[todo]  # t_: the groups still without a grid
    gaps = t_g.sort(-1).values.diff(dim=-1)
    t_tol = t_span * 1e-4
    t_gap = torch.where(gaps > t_tol, gaps, torch.full_like(gaps, float("inf"))).amin(-1, keepdim=True)
    for per_gap in range(1, 9):
        if not len(todo):
            break
        steps = (per_gap * t_span / t_gap).round()
        trial = t_span / steps
        trial_codes = ((t_g - t_lo) / trial).round()
        fits = (steps <= levels - 1) & ((t_lo + trial_codes * trial - t_g).abs() <= t_tol).all(-1, keepdim=True)
        fits = fits.squeeze(-1)
        rows = todo[fits]
        scale[rows], codes[rows], exact[rows] = trial[fits], trial_codes[fits], True
        rest = ~fits
        todo, t_g, t_lo, t_span, t_tol, t_gap = todo[rest], t_g[rest], t_lo[rest], t_span[rest], t_tol[rest], t_gap[rest]
    return (codes.reshape(n, k).to(torch.int32), scale.reshape(n, k // GROUP), lo.reshape(n, k // GROUP),
            exact.float().mean().item())


def _int4_operands(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor):
    """The packed weight and [K/32, N, 2] scales-and-zeros of `_weight_int4pack_mm_for_cpu`,
    which computes with w = (code - 8) * scale + zero."""
    return (torch._convert_weight_to_int4pack_for_cpu(codes, 2),
            torch.stack([scale.t(), zero.t()], -1).to(torch.bfloat16).contiguous())


def _weights(codes: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """The weights in fp32, [N, K], from their groups."""
    return lo.repeat_interleave(GROUP, 1) + scale.repeat_interleave(GROUP, 1) * codes


def _median_ms(fn, x, runs: int = 3) -> float:
    fn(x)  # warm-up
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def machine_choice(name: str, measure) -> str:
    """`measure()`'s answer, measured once per machine by the first process that asks and kept
    beside the built kernels: a choice that changes numerics or memory must not differ between
    the processes of one machine (or between two starts of one server) with the noise of timing."""
    path = native.build_folder() / f"{name}.txt"
    if not path.is_file():
        answer = measure()
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(answer)
            try:
                os.link(tmp, path)  # the first process to finish decides; the others read its answer
            except FileExistsError:
                pass
            tmp.unlink()
        except OSError:  # a read-only cache: this process's own measurement it is
            return answer
    return path.read_text().strip()


@functools.cache
def dense_kind() -> str:
    """'bf16' or 'onednn' (fp32 in oneDNN's blocked layout) for dense copies, per machine: bf16
    (half the memory) unless oneDNN multiplies a 16-row step at least 10% faster, at SmolLM2's
    LM-head shape. bf16 GEMMs are fast only where the CPU computes in bf16 natively (2-core AVX2
    EPYC, LM head at 16 rows: bf16 50 ms, oneDNN fp32 18 ms)."""
    def measure() -> str:
        with torch.inference_mode():
            w, x = torch.randn(49152, 576), torch.randn(16, 576)
            w_bf16, w_onednn = w.bfloat16(), w.to_mkldnn()  # converted once: only the multiplies are timed
            bf16 = _median_ms(lambda r: F.linear(r.bfloat16(), w_bf16), x, runs=11)
            fp32 = _median_ms(lambda r: onednn_linear(r, w_onednn), x, runs=11)
        return "onednn" if fp32 < 0.9 * bf16 else "bf16"
    return machine_choice("dense-kind", measure)


class DenseCopy(nn.Module):
    """A quantized layer's weights, dense, for steps of many rows (see `dense_kind`)."""

    def __init__(self, weights: torch.Tensor):
        super().__init__()
        self.kind = dense_kind()
        self.register_buffer("weight", weights.bfloat16() if self.kind == "bf16" else weights.float().to_mkldnn(),
                             persistent=False)

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [n, K] -> fp32 [n, N]."""
        if self.kind == "bf16":
            return F.linear(rows.bfloat16(), self.weight).float()
        return onednn_linear(rows, self.weight)


_CROSSOVERS: dict[tuple, int] = {}


def crossover(key: tuple, quantized, dense, in_features: int) -> int:
    """The most rows a step may have for `quantized` to be used rather than `dense`: the row
    count (of 1, 2, 4, ..., MAX_PROBE_ROWS) below the first at which `dense` measured faster
    here. Measured once per process per `key` (a layer type and shape)."""
    if key not in _CROSSOVERS:
        best, rows = 0, 1
        with torch.inference_mode():
            while rows <= MAX_PROBE_ROWS:
                x = torch.randn(rows, in_features)
                if _median_ms(quantized, x) > _median_ms(dense, x):
                    break
                best, rows = rows, rows * 2
        _CROSSOVERS[key] = best if best < MAX_PROBE_ROWS else 1 << 30
    return _CROSSOVERS[key]


def _native_operands(codes: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor):
    """The codes, scale and lo of `native.int8_linear` for an 8-bit grid (codes 0..254): codes
    shifted to int8, the shift folded into lo."""
    return (codes - 128).to(torch.int8), scale.float().contiguous(), (lo + 128 * scale).float()


@functools.cache
def kernel_for(bits: int) -> str:
    """'native' or 'torch' for 8-bit layers: ours unless torch's multiplies one row (decode's
    usual case) at least 10% faster on this machine, since ours also serves a tied embedding from
    the same codes (torch's needs a second copy: 28 MB for SmolLM2). Measured on a layer of
    SmolLM2's LM-head shape, larger than a 2-core EPYC's L3 as decode's weights are, once per
    machine (`machine_choice`: the two differ by their activations' rounding, int8 or bf16).
    4 bits: torch's (int8_linear.cpp says why ours has no 4-bit form)."""
    if bits == 4 or not native.available():
        return "torch"

    def measure() -> str:
        n, k = 49152, 576
        codes = torch.randint(0, 255, (n, k), dtype=torch.int32)
        scale, lo = torch.rand(n, k // GROUP) / 100, torch.randn(n, k // GROUP) / 10
        torch_ops, native_ops = _torch_operands(codes, scale, lo, bits), _native_operands(codes, scale, lo)
        with torch.inference_mode():
            x = torch.randn(1, k)
            times = {"torch": _median_ms(lambda r: _torch_multiply(torch_ops, r), x, runs=21),
                     "native": _median_ms(lambda r: native.ops().int8_linear(r, *native_ops), x, runs=21)}
        return "torch" if times["torch"] < 0.9 * times["native"] else "native"
    return machine_choice(f"kernel-int{bits}", measure)


def _torch_operands(codes, scale, lo, bits: int) -> list:
    """torch's int4 kernel computes with w = (code - 8) * scale + zero; an 8-bit layer multiplies
    as two int4 halves: code = 16 * high + low, so w = [(high - 8) * 16 scale + (lo + 128 scale)] +
    [(low - 8) * scale + 8 scale]."""
    if bits == 4:
        return [_int4_operands(codes, scale, lo + 8 * scale)]
    return [_int4_operands(codes >> 4, 16 * scale, lo + 128 * scale), _int4_operands(codes & 15, scale, 8 * scale)]


def _flat(nested) -> list[torch.Tensor]:
    if isinstance(nested, torch.Tensor):
        return [nested]
    return [t for part in nested for t in _flat(part)]


def _torch_multiply(operands: list, rows: torch.Tensor) -> torch.Tensor:
    rows = rows.bfloat16()
    out = [torch._weight_int4pack_mm_for_cpu(rows, packed, GROUP, scales_zeros) for packed, scales_zeros in operands]
    return out[0].float() if len(out) == 1 else out[0].float() + out[1].float()


class QuantizedLinear(nn.Module):
    """A linear layer on `bits`-bit codes in groups of 32 (w = lo + scale * code).

    torch's int4 CPU kernel multiplies it (bf16 activations; 8 bits as two int4 halves), or for 8
    bits Shardline's own (kernels/int8_linear.cpp: int8 activations, integer dot products);
    `kernel_for` says which, per machine, and only that kernel's operands are kept. Above the rows
    where a dense copy measures faster (`crossover`), the copy multiplies:
    8-bit layers always keep one, 4-bit ones when asked (for prefill, `dense_copy`).
    `keep_rows`: keep what `rows` needs to look up weight rows (a tied embedding's)."""

    def __init__(self, linear: nn.Linear, bits: int, dense_copy: bool = False, keep_rows: bool = False):
        super().__init__()
        self.bits = bits
        self.out_features, self.in_features = linear.weight.shape
        codes, scale, lo, self.exact = grid_groups(linear.weight.detach(), 16 if bits == 4 else 255)
        self.kernel = kernel_for(bits)
        self.operands = (_native_operands(codes, scale, lo) if self.kernel == "native"
                         else _torch_operands(codes, scale, lo, bits))
        if keep_rows:  # rows as the kept kernel's operands hold them, or the codes as well
            self.rows_from = self.operands if self.kernel == "native" else (codes.to(torch.uint8), scale, lo)
        # as buffers too, so that the shard's weight bytes (Info) count them
        for i, t in enumerate(_flat([self.operands, getattr(self, "rows_from", ())])):
            self.register_buffer(f"held{i}", t, persistent=False)
        self.dense = DenseCopy(_weights(codes, scale, lo)) if dense_copy or bits == 8 else None
        self.bias = None if linear.bias is None else linear.bias.detach()
        self._forward_hooks = linear._forward_hooks
        self.max_rows = 1 << 30 if self.dense is None else crossover(
            (bits, *linear.weight.shape, self.kernel, self.dense.kind), functools.partial(self._multiply, self.kernel, self.operands),
            self.dense, self.in_features)

    def _multiply(self, kernel: str, operands, rows: torch.Tensor) -> torch.Tensor:
        if kernel == "native":
            return native.ops().int8_linear(rows.float(), *operands)
        return _torch_multiply(operands, rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        y = (self._multiply(self.kernel, self.operands, rows) if rows.shape[0] <= self.max_rows
             else self.dense(rows)).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def rows(self, tokens: torch.Tensor) -> torch.Tensor:
        """The weights' rows `tokens`, fp32 (needs keep_rows; 8-bit codes only)."""
        codes, scale, lo = self.rows_from
        return _weights(codes.index_select(0, tokens).float(), scale.index_select(0, tokens).float(),
                        lo.index_select(0, tokens).float())


class Int8Embedding(nn.Module):
    """An embedding that reads its rows from an 8-bit `QuantizedLinear`'s codes (a tied LM head's)."""

    def __init__(self, table: QuantizedLinear, dtype: torch.dtype):
        super().__init__()
        self.table, self.dtype = table, dtype

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.table.rows(tokens).to(self.dtype)


def quantize(model: nn.Module, dense_copy: bool = False) -> None:
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
        model.embed = Int8Embedding(model.lm_head, embed.weight.dtype)


def weight_format(module: nn.Module) -> str:
    """How a layer's weights are held, in words, for `Info`."""
    if isinstance(module, QuantizedLinear):
        kernel = "Shardline's kernel" if module.kernel == "native" else "torch's int4 kernel"
        if module.bits == 8 and module.kernel == "torch":
            kernel += " as two int4 halves"
        copy = f", {module.dense.kind} copy above {module.max_rows} rows" if module.dense is not None else ""
        return f"int{module.bits} g{GROUP} ({module.exact:.0%} of groups exact), {kernel}{copy}"
    if isinstance(module, Int8Embedding):
        return "the LM head's int8 codes"
    if isinstance(module, OneDnnLinear):
        return "float32 oneDNN"
    return str(module.weight.dtype).removeprefix("torch.")
