"""`python -m kernels` (./setup.sh): builds Shardline's CPU kernels and measures the per-machine
choices now, on a quiet machine, rather than at a server's first start: the kernel of 4-bit and
8-bit layers, the dtype of their GEMM path, the kind of dense copies, and the default model's (SmolLM2's) int8 LM head's
crossover to its dense copy. SHARDLINE_CPU_ISA=avx2 does the same for the AVX2 build. The choices
are kept per torch level (kernels/choice.py: torch_level): cap torch as the README says to measure
what a forced run uses."""

import torch

from shardline.kernels import native
from shardline.kernels.choice import dense_kind, gemm_in_bf16, kernel_for
from shardline.kernels.quantized import QuantizedLinear

print(
    "Shardline CPU kernels:",
    "built" if native.available() else "unavailable (torch's kernels are used)",
    native.build_folder(),
    f"({native.isa_flag()}) - int4 layers use",
    kernel_for(4).value,
    "- int8 layers use",
    kernel_for(8).value,
    "- their GEMM path",
    "bf16" if gemm_in_bf16() else "fp32",
    "- dense copies",
    dense_kind().value,
    end="",
    flush=True,
)
with torch.inference_mode():
    head = QuantizedLinear(torch.nn.Linear(576, 49152, bias=False), bits=8, dense_copy=True)
print(f" above {head.max_rows} rows (SmolLM2's LM head)")
