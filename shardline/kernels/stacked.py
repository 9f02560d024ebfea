"""A linear layer whose output rows come in parts held at different widths: a fused QKV of a
Q4_K_M file, say, whose Q and K are Q4_K and whose V is Q6_K in half its layers. Each part is a
`QuantizedLinear` of its own GGUF blocks, exactly (held together at the widest, the Q4_K rows
were 9 bits a weight and the Q6_K ones rounded to an 8-bit grid); the layer's output is theirs
side by side."""

from __future__ import annotations

import torch
from torch import nn

from shardline.kernels.quantized import QuantizedLinear


class StackedLinear(nn.Module):
    """`parts`' outputs side by side. The parts hold no bias; the layer does, whole."""

    def __init__(self, parts: list[nn.Module], bias: torch.Tensor | None = None):
        super().__init__()
        self.parts = nn.ModuleList(parts)
        if bias is None:
            self.bias = None
        else:  # a buffer, so that the shard's weight bytes count it
            self.register_buffer("bias", bias.detach(), persistent=False)

    @property
    def in_features(self) -> int:
        return self.parts[0].in_features

    @property
    def out_features(self) -> int:
        return sum(p.out_features for p in self.parts)

    @property
    def max_rows(self) -> int:
        return min(p.max_rows for p in self.parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.cat([p(x) for p in self.parts], -1)
        return y if self.bias is None else y + self.bias


def parts_of(layer: nn.Module) -> list[QuantizedLinear]:
    """A quantized layer's parts: a stacked one's, or the layer itself."""
    return list(layer.parts) if isinstance(layer, StackedLinear) else [layer]
