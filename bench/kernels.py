"""The quantized kernels alone, at decode's row counts: Shardline's 4-bit kernel straight from the
codes and through its GEMM path, torch's int4 kernel, and a dense fp32 GEMM, on SmolLM2's layer
shapes and its LM head's (4-bit here, to compare kernels), at 1, 8, 16 and 32 rows; the LM head
as the model holds it too (8-bit: Shardline's int8 kernel against the oneDNN fp32 dense copy that
takes over from a measured row count); and the machine's read bandwidth over a buffer of the
model's 4-bit weights' size, to which the one-row figures compare (GB/s of quantized weights read).

    python -m bench.kernels [--runs 21]

Run under the AVX2 forcing variables (README) to measure an AVX-512 host as an AVX2 one.
Writes bench/out/kernels-<time>.json and .png.
"""

from __future__ import annotations

import argparse
import functools

import torch

from bench.common import machine, save
from shardline.kernels import native
from shardline.kernels.choice import median_ms
from shardline.kernels.linear import onednn_linear
from shardline.kernels.operands import Kernel, multiply, native_operands, torch_operands

SHAPES = {
    "qkv 960x576": (960, 576),
    "wo 576x576": (576, 576),
    "w13 3072x576": (3072, 576),
    "w2 576x1536": (576, 1536),
    "LM head 49152x576": (49152, 576),
}
ROWS = (1, 8, 16, 32)


def read_gb_s(mb: int = 53, runs: int = 21) -> float:
    x = torch.ones(mb * 2**20 // 4)
    return mb * 2**20 / median_ms(lambda _: x.sum(), x, runs) / 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=21)
    args = ap.parse_args()
    assert native.available(), "Shardline's kernels did not build"
    result = {
        "benchmark": "kernels",
        **machine(),
        "isa_build": native.isa_flag(),
        "threads": torch.get_num_threads(),
        "read_gb_s": read_gb_s(),
        "ms": {},
        "one_row_gb_s": {},
    }
    with torch.inference_mode():
        for name, (n, k) in SHAPES.items():
            codes = torch.randint(0, 16, (n, k), dtype=torch.int32)
            scale, lo = torch.rand(n, k // 32) / 50, torch.randn(n, k // 32) / 10
            ours, theirs = native_operands(codes, scale, lo, 4), torch_operands(codes, scale, lo, 4)
            dense = (lo.repeat_interleave(32, 1) + scale.repeat_interleave(32, 1) * codes).contiguous()
            kernels = {
                "ours, direct": functools.partial(multiply, Kernel.NATIVE, ours, direct_rows=1 << 30),
                "ours, GEMM": functools.partial(multiply, Kernel.NATIVE, ours, direct_rows=0),
                "torch int4": functools.partial(multiply, Kernel.TORCH, theirs),
                "fp32 dense": lambda x: x @ dense.t(),  # noqa: B023 - called within this iteration
            }
            result["ms"][name] = {
                kernel: {rows: median_ms(fn, torch.randn(rows, k), args.runs) for rows in ROWS}
                for kernel, fn in kernels.items()
            }
            result["one_row_gb_s"][name] = {
                kernel: n * k / 2 / (ms[1] * 1e6) for kernel, ms in result["ms"][name].items()
            }
            print(
                name, {kernel: [round(ms[r], 3) for r in ROWS] for kernel, ms in result["ms"][name].items()}, flush=True
            )
        n, k = 49152, 576
        name = f"LM head {n}x{k}, 8-bit"
        codes = torch.randint(0, 255, (n, k), dtype=torch.int32)
        scale, lo = torch.rand(n, k // 32) / 100, torch.randn(n, k // 32) / 10
        ours = native_operands(codes, scale, lo, 8)
        dense = (lo.repeat_interleave(32, 1) + scale.repeat_interleave(32, 1) * codes).to_mkldnn()
        kernels = {
            "ours, int8": functools.partial(multiply, Kernel.NATIVE, ours),
            "oneDNN fp32 copy": lambda x: onednn_linear(x, dense),
        }
        result["ms"][name] = {
            kernel: {rows: median_ms(fn, torch.randn(rows, k), args.runs) for rows in ROWS}
            for kernel, fn in kernels.items()
        }
        result["one_row_gb_s"][name] = {kernel: n * k / (ms[1] * 1e6) for kernel, ms in result["ms"][name].items()}
        print(name, {kernel: [round(ms[r], 3) for r in ROWS] for kernel, ms in result["ms"][name].items()}, flush=True)
    print(
        f"read bandwidth {result['read_gb_s']:.1f} GB/s; one row, GB/s of 4-bit weights:",
        {name: {k: round(v, 1) for k, v in g.items()} for name, g in result["one_row_gb_s"].items()},
    )
    save("kernels", result, plot)


def plot(result: dict, png) -> None:
    import matplotlib.pyplot as plt

    names = list(result["ms"])
    fig, axes = plt.subplots(1, len(names), figsize=(3.2 * len(names), 3.4), sharey=False)
    for ax, name in zip(axes, names):
        for kernel, ms in result["ms"][name].items():
            rows = [int(r) for r in ms]
            ax.plot(rows, list(ms.values()), "o-", label=kernel)
        ax.set(title=name, xlabel="rows", xscale="log", yscale="log")
        ax.set_xscale("log", base=2)
    axes[0].set_ylabel("ms per multiply (median)")
    axes[0].legend(fontsize=7)
    fig.suptitle(
        f"quantized kernels, {result['isa_build']}, {result['threads']} threads, read {result['read_gb_s']:.0f} GB/s",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(png, dpi=100)


if __name__ == "__main__":
    main()
