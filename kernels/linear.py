"""Linear layers with their weights in oneDNN's blocked layout, for fp32 on CPU.

At decode shapes (a few rows against a large weight read from memory), MKL's sgemm reads the
weights well below the machine's memory bandwidth; oneDNN's blocked layout does not. Measured on
the 2-core AMD EPYC development machine, SmolLM2 fp32, a shard step in process: batch 1 57-60 ms
with MKL against 44-46 ms with oneDNN, batch 8 82-96 against 69-74, batch 32 175-179 against
142-148; a 2048-token prefill 4.1-4.4 s against 3.7-4.3 s. The arithmetic is fp32 either way.

Like tensor parallelism, this is a transformation of a plain `Transformer`: `use_onednn` swaps its
`nn.Linear` modules in place, after any TP slicing (which works on dense weights), carrying over
the forward hooks that slicing added (the all-reduces).
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
        self.bias = None if linear.bias is None else linear.bias.detach()
        self._forward_hooks = linear._forward_hooks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = onednn_linear(x.reshape(-1, self.in_features), self.weight)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)


def onednn_linear(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """rows [n, K] (fp32) times a weight already in oneDNN's layout (`w.to_mkldnn()`) -> [n, N]."""
    return torch._C._nn.mkldnn_linear(rows.float().contiguous().to_mkldnn(), weight, None).to_dense()


def use_onednn(model: nn.Module) -> int:
    """Swaps every `nn.Linear` whose weight no other module shares (a tied LM head keeps the
    embedding's dense weight) for a `OneDnnLinear`; returns how many were swapped."""
    owners: dict[int, int] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and owners[id(child.weight)] == 1:
                setattr(parent, name, OneDnnLinear(child))
                swapped += 1
    return swapped
