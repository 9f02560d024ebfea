"""The kernels built for a lower instruction set than the host's (SHARDLINE_CPU_ISA): an AVX-512
host builds and runs the AVX2 paths too, and they compute what the weights say."""

import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import pytest
from torch.utils.cpp_extension import get_cxx_compiler

from shardline.kernels.native import HERE, ISA_LEVELS, SOURCES

pytestmark = pytest.mark.processes  # every test here starts processes

ROOT = Path(__file__).resolve().parents[1]

CHECK = r"""
import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from shardline.kernels import native
from shardline.kernels.operands import Kernel, multiply, native_operands
assert native.available(), "the kernels did not build"
assert native.isa_flag() in native.flags(), native.flags()
print(native.isa_flag(), native.build_folder())
torch.manual_seed(0)


def check(name, held, weights):
    k = weights.shape[1]
    for rows in (1, 2, 3, 5, 17):
        x = torch.randn(rows, k)
        want = x.double() @ weights.double().t()
        # the activations' rounding to int8 per group of 32 (straight from the codes)
        half_step = (x.abs().reshape(rows, -1, 32).amax(-1) / 127 / 2).repeat_interleave(32, 1)
        rounding = half_step.double() @ weights.abs().double().t() + 1e-5 * want.abs().max()
        # through a bf16 GEMM: activations, weights and outputs rounded to 8 bits of mantissa
        bf16 = 2**-8 * (x.abs().double() @ weights.abs().double().t()) + 2**-8 * want.abs()
        limits = {(0, False): 1e-5 * want.abs().max(), (0, True): bf16, (1 << 30, False): rounding}  # fp32 GEMM: exact
        for (direct_rows, bf16_gemm), limit in limits.items():
            got = multiply(Kernel.NATIVE, held, x, direct_rows, bf16_gemm).double()
            assert ((got - want).abs() <= limit).all(), (name, rows, direct_rows, bf16_gemm, (got - want).abs().max())
    # one-hot rows read each weight back, rounded to bf16 to nearest even (ties included)
    got = multiply(Kernel.NATIVE, held, torch.eye(k), direct_rows=0, bf16_gemm=True)
    assert torch.equal(got, weights.t().bfloat16().float()), name
    assert torch.equal(native.ops().record_rows(held[0], torch.arange(len(weights))), weights), name


for bits, levels in ((4, 16), (6, 64), (8, 255)):
    codes = torch.randint(0, levels, (72, 288), dtype=torch.int32)
    # the records hold scales and los in fp16 (as GGUF's blocks do): values it holds exactly
    scale, lo = (torch.rand(72, 9) / 50).half().float(), (torch.randn(72, 9) / 10).half().float()
    if bits == 8:  # symmetric, as Q8_0's blocks: zero on the grid
        lo = -128 * scale
    weights = lo.repeat_interleave(32, 1) + scale.repeat_interleave(32, 1) * codes
    if bits == 6:  # Q6_K's: an int8 scale per 16 weights (in scale's place), d per group (in lo's)
        scale, lo = torch.randint(-128, 128, (72, 18), dtype=torch.int8), (torch.rand(72, 9) / 5000).half().float()
        weights = lo.repeat_interleave(32, 1) * scale.float().repeat_interleave(16, 1) * (codes - 32)
    check(f"int{bits}", native_operands(codes, scale, lo, bits), weights)
# Q4_K's blocks as they are: random bytes with finite fp16 d and dmin
blocks = np.random.default_rng(0).integers(0, 256, (72, 2, 144), dtype=np.uint8)
d_and_dmin = np.random.default_rng(1).uniform(0.001, 0.02, (72, 2, 2)).astype(np.float16)
blocks[..., :4] = d_and_dmin.view(np.uint8).reshape(72, 2, 4)
raw = blocks.reshape(72, -1)
weights = torch.from_numpy(dequantize(raw, GGMLQuantizationType.Q4_K).reshape(72, 512))
check("q4_k", (native.ops().q4_k_pack(torch.from_numpy(raw)),), weights)
print("ok")
"""


def _has(flag: str) -> bool:
    try:
        return flag in Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False


def _paths(level: str) -> set[str]:
    """The instruction-set macros the kernels' sources branch on that a build for `level` defines:
    which of their paths it compiles."""
    sources = " ".join(f.read_text() for f in (*SOURCES, *HERE.glob("*.h")))
    tested = set(re.findall(r"__(?:AVX\w*|FMA|F16C)__", sources))
    defined = subprocess.run(
        [get_cxx_compiler(), ISA_LEVELS[level], "-dM", "-E", "-x", "c++", os.devnull],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return tested & set(defined)


@pytest.mark.parametrize("level", ["avx2", "generic"])
def test_a_lower_isa_build_computes_the_weights(level):
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip(f"the forced levels are x86 ones; this CPU is {platform.machine()}")
    if level == "avx2" and not _has("avx2"):
        pytest.skip("this x86 CPU has no AVX2, so it cannot run the AVX2 build")
    if level == "avx2" and _paths("native") == _paths("avx2"):
        level = "native"  # an AVX2 host without AVX-512 or AVX-VNNI: its own build (setup's) has the same paths
    env = {**os.environ, "SHARDLINE_CPU_ISA": level}
    done = subprocess.run([sys.executable, "-c", CHECK], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout + done.stderr
    assert {"avx2": "x86-64-v3", "generic": "x86-64 ", "native": "-march=native"}[level] in done.stdout + " "


def test_an_unknown_isa_level_is_refused():
    env = {**os.environ, "SHARDLINE_CPU_ISA": "avx9"}
    done = subprocess.run(
        [sys.executable, "-c", "from shardline.kernels import native; native.available()"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0 and "SHARDLINE_CPU_ISA must be one of" in done.stderr
