"""Choices measured once per machine and kept beside the built kernels: which kernel multiplies
quantized layers, in which dtype their GEMM path computes, which dense kernel a layer's dense copy
uses, and from how many rows on the copy (or the GEMM path) takes over.

Each changes which arithmetic computes a step's logits, so a greedy token at a near-tie: measured
per process, the noise of timing could make two starts of one server (or two shards of one
replica) compute different numbers. So the first process on a machine that needs an answer
measures it, publishes it (common/files.py: the first to publish wins), and every later process
reads it. `./setup.sh` measures the kernel choices on a quiet machine (`python -m kernels`).

Measured, SmolLM2's LM head (49152x576), ms at 1/8/16/32 rows:
  2-core EPYC, AVX-512-bf16: int4 kernel 0.76/2.8/-/15, bf16 dense 4.1/5.5/-/11.6;
  2-core EPYC, AVX2:         int4 kernel 2.3/8.8/17/36, bf16 dense 3.7/26/50/109, oneDNN fp32 4.9/12/18/23
  (the kernels before they interleaved 8 outputs across the lanes). With the interleaved 8-bit
  kernel, forced AVX2 on the AVX-512 development host (`bench.kernels`): 0.69/2.3/4.6/9.3 against
  the oneDNN fp32 copy's 2.2/8.8/12/18: that build's crossover now never hands a decode step
  (up to 64 rows, the most it probes) to the copy.
"""

from __future__ import annotations

import enum
import functools
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from shardline.common.files import publish
from shardline.kernels import native
from shardline.kernels.grid import GROUP
from shardline.kernels.linear import onednn_linear
from shardline.kernels.operands import Kernel, multiply, native_operands, torch_operands

MAX_PROBE_ROWS = 64  # `crossover` measures up to this many rows; quantized still faster there: always
PREFILL_PROBE_ROWS = 512  # as far as a kernel's GEMM path is probed: a prefill chunk's rows
# A layer's paths are timed on its leading outputs, at most this many: their costs are per weight,
# so the layers of one format and input width (an 8B's QKV, MLP and LM head) share one
# measurement, and a first start times no LM head of 128K rows at 512 rows a probe.
PROBE_OUTPUTS = 2048
ALWAYS = 1 << 30  # a crossover that is never reached
MEASURED_BY = 2  # how the choices are measured: a change here starts new files of them


class DenseKind(enum.Enum):
    BF16 = "bf16"  # bf16 weights, torch's GEMM
    ONEDNN = "onednn"  # fp32 weights in oneDNN's blocked layout (kernels/linear.py)


def median_ms(fn: Callable[[torch.Tensor], object], x: torch.Tensor, runs: int = 3) -> float:
    fn(x)  # warm-up
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def fastest_ms(fn: Callable[[torch.Tensor], object], x: torch.Tensor, runs: int = 5) -> float:
    """The fastest of `runs` timed calls after a warm-up, for the choices: a busy machine (a first
    start converts the tokenizer beside the shard that measures) only ever adds time, and its
    medians chose torch's kernel for a 2048x2048 layer at one row, or a GEMM path there."""
    fn(x)
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3


def torch_level() -> str:
    """The instruction sets torch's own kernels run at: its ATen capability and the caps on MKL
    and oneDNN (README: forcing an AVX-512 host to compute as an AVX2 one). Choices between our
    kernels and torch's are kept per level, since either side may be capped without the other."""
    caps = [os.environ.get(v, "") for v in ("MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA")]
    return "-".join([torch.backends.cpu.get_cpu_capability(), *(c.lower() for c in caps if c)])


def machine_choice(name: str, measure: Callable[[], str]) -> str:
    """`measure()`'s answer, measured once per machine (and torch level) by the first process
    that asks, and read back by every process after it. Where the cache folder is read-only,
    each process keeps its own measurement."""
    path = native.build_folder() / f"{name}-torch-{torch_level()}-m{MEASURED_BY}.txt"
    if path.is_file():
        return path.read_text().strip()
    answer = measure()
    try:
        publish(path, lambda tmp: tmp.write_text(answer))
        return path.read_text().strip()  # another process's answer, if it published first
    except OSError:
        return answer


@functools.cache
def dense_kind() -> DenseKind:
    """The kind of dense copies, per machine: bf16 (half the memory) unless oneDNN multiplies a
    16-row step at least 10% faster, at SmolLM2's LM-head shape. bf16 GEMMs are fast only where
    the CPU computes in bf16 natively (2-core AVX2 EPYC, LM head at 16 rows: bf16 50 ms, oneDNN
    fp32 18 ms)."""

    def measure() -> str:
        with torch.inference_mode():
            w, x = torch.randn(49152, 576), torch.randn(16, 576)
            w_bf16, w_onednn = w.bfloat16(), w.to_mkldnn()  # converted once: only the multiplies are timed
            bf16 = fastest_ms(lambda r: F.linear(r.bfloat16(), w_bf16), x, runs=11)
            fp32 = fastest_ms(lambda r: onednn_linear(r, w_onednn), x, runs=11)
        return (DenseKind.ONEDNN if fp32 < 0.9 * bf16 else DenseKind.BF16).value

    return DenseKind(machine_choice("dense-kind", measure))


@functools.cache
def kernel_for(bits: int) -> Kernel:
    """The kernel of `bits`-bit layers: Shardline's unless torch's multiplies one row (decode's
    usual case) at least 10% faster on this machine. Ours is preferred at a tie: its 8-bit kernel
    serves a tied embedding from the same codes (torch's needs a second copy: 28 MB for SmolLM2). Measured on a
    layer of SmolLM2's LM-head shape, larger than a 2-core EPYC's L3 as decode's weights are."""
    if not native.available():
        return Kernel.TORCH

    def measure() -> str:
        n, k = 49152, 576
        codes = torch.randint(0, 16 if bits == 4 else 255, (n, k), dtype=torch.int32)
        scale, lo = torch.rand(n, k // GROUP) / 100, torch.randn(n, k // GROUP) / 10
        ops = {
            Kernel.TORCH: torch_operands(codes, scale, lo, bits),
            Kernel.NATIVE: native_operands(codes, scale, lo, bits),
        }
        with torch.inference_mode():
            x = torch.randn(1, k)
            times = {
                kernel: fastest_ms(functools.partial(multiply, kernel, held), x, runs=21)
                for kernel, held in ops.items()
            }
        return (Kernel.TORCH if times[Kernel.TORCH] < 0.9 * times[Kernel.NATIVE] else Kernel.NATIVE).value

    return Kernel(machine_choice(f"kernel-int{bits}", measure))


GEMM_MARGIN = 1.25  # bf16 rounds the activations 2^8 times coarser than fp32: asked to pay for it


@functools.cache
def gemm_in_bf16() -> bool:
    """Whether the native kernels' GEMM path (many rows: kernels/interleaved.h) multiplies its
    dequantized slices in bf16 rather than fp32, per machine: bf16 where it measured at least
    `GEMM_MARGIN` times faster, on a 4-bit layer of 2048x2048 at 128 rows (a prefill chunk's
    shape). CPUs that compute bf16 natively (AMX, AVX-512-bf16) do; on AVX2, torch's bf16 GEMM is
    emulated and several times slower than fp32."""
    if not native.available():
        return False

    def measure() -> str:
        n = k = 2048
        codes = torch.randint(0, 16, (n, k), dtype=torch.int32)
        held = native_operands(codes, torch.rand(n, k // GROUP) / 100, torch.randn(n, k // GROUP) / 10, 4)
        with torch.inference_mode():
            x = torch.randn(128, k)
            times = {
                bf16: fastest_ms(functools.partial(multiply, Kernel.NATIVE, held, direct_rows=0, bf16_gemm=bf16), x)
                for bf16 in (False, True)
            }
        return str(times[False] > GEMM_MARGIN * times[True])

    return machine_choice("gemm-bf16", measure) == "True"


def crossover(
    name: str,
    quantized: Callable,
    dense: Callable,
    in_features: int,
    margin: float = 1.0,
    max_rows: int = MAX_PROBE_ROWS,
) -> int:
    """The most rows a step may have for `quantized` to be used rather than `dense`: of 1, 2, 4,
    ..., `max_rows`, the last row count before `dense` measured faster at two in a row (or at
    `max_rows`), by `margin` (1.1 asks it to be 10% faster, where `quantized` computes more
    exactly and a near-tie should not flip with the noise of timing). A single probe that timing
    noise hands to `dense` does not settle it. Per machine and `name` (a layer's bits, shape,
    kernels and thread count)."""

    def measure() -> str:
        best, rows, dense_won = 0, 1, 0
        with torch.inference_mode():
            while rows <= max_rows:
                x = torch.randn(rows, in_features)
                if fastest_ms(quantized, x) > margin * fastest_ms(dense, x):
                    dense_won += 1
                    if dense_won == 2:
                        break
                else:
                    best, dense_won = rows, 0
                rows *= 2
        return str(best if best < max_rows else ALWAYS)

    return int(machine_choice(f"crossover-{name}", measure))
