"""What every benchmark records next to its numbers: the machine, the commit, where output goes."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from pathlib import Path

OUT = Path(__file__).resolve().parent / "out"


# Variables that make an AVX-512 host compute as an AVX2 one (the closing notes say which ran)
FORCING = ("SHARDLINE_CPU_ISA", "ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA")


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def isa_flags() -> list[str]:
    """The CPU's vector-ISA flags (as lscpu lists them): avx2, avx512*, amx*, vnni, f16c, fma."""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return sorted(
                {f for f in line.split(":", 1)[1].split() if f.startswith(("avx", "amx")) or f in ("fma", "f16c")}
            )
    return []


def llama_cpp_model(model: str = "smollm2", n_ctx: int = 2048, **options):
    """llama.cpp (`llama-cpp-python`, the optional `peers` extra) on the model's GGUF with all the
    machine's threads, or None where it is not installed."""
    import importlib.util

    if importlib.util.find_spec("llama_cpp") is None:
        return None
    import llama_cpp

    from shardline.common.model_source import resolve_model

    return llama_cpp.Llama(
        model_path=str(resolve_model(model).path),
        n_ctx=n_ctx,
        n_threads=os.cpu_count(),
        n_threads_batch=os.cpu_count(),
        verbose=False,
        **options,
    )


# Shardline's flags where a benchmark races a peer that decodes a token a step (llama-server
# without --spec-type): its workloads repeat their prompts, whose earlier answers suffix decoding
# would propose. Speculation races the peer's own in bench/speculative.py.
PLAIN_DECODE = ("--speculative", "off")


def machine() -> dict:
    import torch

    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=OUT.parent
    ).stdout.strip()
    return {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "commit": commit,
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cpu": cpu_model(),
        "isa_flags": isa_flags(),
        "forced": {k: os.environ[k] for k in FORCING if k in os.environ},
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


def out_path(name: str) -> Path:
    """bench/out/<name>-<timestamp> without a suffix; callers add .json and .png."""
    OUT.mkdir(exist_ok=True)
    return OUT / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"


def save(name: str, result: dict, plot) -> Path:
    """Writes bench/out/<name>-<timestamp>.json and the PNG that `plot(result, png_path)` draws."""
    import json

    import matplotlib

    matplotlib.use("Agg")  # no screen needed
    path = out_path(name)
    path.with_suffix(".json").write_text(json.dumps(result, indent=2))
    plot(result, path.with_suffix(".png"))
    print(f"wrote {path.with_suffix('.json')} and .png")
    return path
