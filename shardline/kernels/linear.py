"""Linear layers with their weights in oneDNN's blocked layout, for fp32 on CPU.

At decode shapes (a few rows against a large weight read from memory), MKL's sgemm reads the
weights well below the machine's memory bandwidth; oneDNN's blocked layout does not. Measured on
the 2-core AMD EPYC development machine, SmolLM2 fp32, a shard step in process: batch 1 57-60 ms
with MKL against 44-46 ms with oneDNN, batch 8 82-96 against 69-74, batch 32 175-179 against
142-148; a 2048-token prefill 4.1-4.4 s against 3.7-4.3 s. The arithmetic is fp32 either way.

`shard.transforms.use_onednn` swaps a model's `nn.Linear` modules for these, after any TP slicing
(which works on dense weights), carrying over the forward hooks that slicing added (the
all-reduces).
"""

from __future__ import annotations

import torch
from torch import nn


class OneDnnLinear(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        # From the weight, not the module's attributes: TP slicing replaces weights only.
        self.out_features, self.in_features = linear.weight.shape
        self.register_buffer("weight", linear.weight.detach().to_mkldnn(), persistent=False)
        if linear.bias is None:
            self.bias = None
        else:  # a buffer, so that the shard's weight bytes count it
            self.register_buffer("bias", linear.bias.detach(), persistent=False)
        self._forward_hooks = linear._forward_hooks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = onednn_linear(x.reshape(-1, self.in_features), self.weight)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)


def onednn_linear(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """rows [n, K] (fp32) times a weight already in oneDNN's layout (`w.to_mkldnn()`) -> [n, N]."""
    return torch._C._nn.mkldnn_linear(rows.float().contiguous().to_mkldnn(), weight, None).to_dense()
