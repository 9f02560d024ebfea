"""Loads Shardline's CPU kernels (kernels/*.cpp) as torch operators, `torch.ops.shardline_native.*`.

The source is compiled on first use for the machine it runs on (`-march=native`: AVX2, and
AVX-512 VNNI where the CPU has it, or the x86 level SHARDLINE_CPU_ISA forces), into the cache
folder beside the converted weights, keyed by the source, the flags and the CPU's; `./setup.sh`
builds it once (`python -m kernels`), so servers start without the wait. Where it cannot be built
(no C++ compiler, a CUDA-only deployment), `available()` is False and the callers keep torch's own
kernels; `SHARDLINE_NATIVE_KERNELS=0` asks for that (comparisons).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import platform
from pathlib import Path

import torch

from shardline.common.files import cache_root, publish

log = logging.getLogger(__name__)
HERE = Path(__file__).parent
SOURCES = [
    HERE / f
    for f in (
        "native.cpp",
        "int8_linear.cpp",
        "int6_linear.cpp",
        "int4_linear.cpp",
        "paged_decode.cpp",
        "decode_layer.cpp",
        "token_mask.cpp",
    )
]
# The instruction set the kernels are compiled for: the host's own, or a lower level forced by
# SHARDLINE_CPU_ISA (`avx2`: x86-64-v3, AVX2 + FMA without AVX-512, so that an AVX-512 host builds
# and tests the AVX2 paths too; `generic`: x86-64, the scalar fallbacks). Each level builds into its
# own folder, and the per-machine measurements (kernels/choice.py) live beside each build.
ISA_LEVELS = {"native": "-march=native", "avx2": "-march=x86-64-v3", "generic": "-march=x86-64"}


def isa_flag() -> str:
    level = os.environ.get("SHARDLINE_CPU_ISA", "native")
    if level not in ISA_LEVELS:
        raise ValueError(f"SHARDLINE_CPU_ISA must be one of {', '.join(ISA_LEVELS)}, not {level!r}")
    return ISA_LEVELS[level]


# fast-math: lets the compiler reassociate the attention and norm sums into vector lanes and call
# vectorized exp (attention at batch 16 ran 1.7x faster); no input here is inf or NaN by design.
def flags() -> list[str]:
    return ["-O3", isa_flag(), "-fopenmp", "-ffast-math"]


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


@functools.cache
def build_folder() -> Path:
    text = " ".join(
        [*(f.read_text() for f in [*SOURCES, *sorted(HERE.glob("*.h"))]), *flags(), _cpu_flags(), torch.__version__]
    )
    key = hashlib.sha256(text.encode()).hexdigest()[:16]
    return cache_root() / "kernels" / key


_loaded: bool | None = None  # a plain global: a compiled decode graph reads it without tracing the build


def available() -> bool:
    """Builds (once per machine and source) and loads the kernels; False, with the reason logged,
    where that fails."""
    global _loaded
    if _loaded is None:
        _loaded = os.environ.get("SHARDLINE_NATIVE_KERNELS", "1") != "0" and _load()
    return _loaded


def _load() -> bool:
    folder = build_folder()
    built = folder / "built"  # written once a build of this folder's key has loaded
    if built.is_file():
        # The folder's key is the sources', flags' and torch's: what was built there is current.
        # Loaded as it is, without asking ninja (a quarter of a second of every shard's start).
        try:
            torch.ops.load_library(folder / "shardline_native.so")
            _register_fakes()
            return True
        except OSError as e:  # damaged: built again below
            log.warning("rebuilding Shardline's CPU kernels: %s", e)
    from torch.utils import cpp_extension

    try:  # the `ninja` package's binary, which a venv that is not activated leaves off PATH
        import ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    except ImportError:
        pass

    try:
        folder.mkdir(parents=True, exist_ok=True)
        with _building(folder):
            cpp_extension.load(
                name="shardline_native",
                sources=[str(f) for f in SOURCES],
                build_directory=str(folder),
                extra_cflags=flags(),
                extra_ldflags=["-fopenmp"],
                is_python_module=False,
                verbose=False,
            )
    except Exception as e:  # noqa: BLE001 - any build failure means: use torch's kernels
        log.warning("Shardline's CPU kernels could not be built (%s); using torch's", str(e).splitlines()[0])
        return False
    publish(built, lambda tmp: tmp.write_text(""))
    _register_fakes()
    return True


@contextlib.contextmanager
def _building(folder: Path):
    """One process at a time loads (and, where the sources changed, builds) the kernels of a
    folder, under a lock the kernel releases when its holder dies. torch's own lock is a file
    (`lock`) that every other loader waits on until it is gone: a process killed while loading
    (an OOM kill, a SIGKILL of a starting server) leaves it behind, and every later start would
    wait forever. Under this lock nobody else is loading, so such a file is stale: removed."""
    with open(folder / "build.flock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        try:
            (folder / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)


def _register_fakes() -> None:
    """Output shapes for tracing (a compiled decode graph calls the linear and MLP kernels)."""

    for name in ("int8_linear", "int6_linear", "int4_linear", "q4_k_linear"):

        @torch.library.register_fake(f"shardline_native::{name}")
        def _(x, records, max_direct_rows, bf16_gemm):
            return x.new_empty(x.shape[0], records.shape[0] * 8)

    @torch.library.register_fake("shardline_native::silu_mul")
    def _(x):
        return x.new_empty(x.shape[0], x.shape[1] // 2)


def ops():
    return torch.ops.shardline_native


def usable(t: torch.Tensor) -> bool:
    """Whether the kernels can take this tensor's computation: float32 on the CPU, kernels built.
    A graph being compiled reads only whether they were loaded before (a build cannot be traced)."""
    if _loaded is None and not torch.compiler.is_compiling():
        available()
    return t.device.type == "cpu" and t.dtype == torch.float32 and bool(_loaded)
