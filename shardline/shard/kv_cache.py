"""KV page tensors of one shard: per layer it runs, K and V of shape [num_pages + 1, page_size,
kv_heads, head_dim] for its own KV heads. The extra last page is reserved padding: a shard never
gets it from the router."""

from __future__ import annotations

import numpy as np
import torch

from shardline.shard.config import ModelConfig


def bytes_per_page(cfg: ModelConfig, page_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_layers * page_size * cfg.num_kv_heads * cfg.head_dim * elem


class KVPages:
    def __init__(self, cfg: ModelConfig, num_pages: int, page_size: int, dtype: torch.dtype, device: torch.device):
        shape = (num_pages + 1, page_size, cfg.num_kv_heads, cfg.head_dim)
        self.padding_page = num_pages
        pool = _zeros(2 * cfg.num_layers * int(np.prod(shape)), dtype, device).view(cfg.num_layers, 2, *shape)
        self.layers = [(pool[i, 0], pool[i, 1]) for i in range(cfg.num_layers)]

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for pair in self.layers for t in pair)


def _zeros(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """n zeros. On the CPU from calloc (numpy's zeros): a pool that size is mapped from the kernel's
    zero pages, which become resident as KV is written, so a start does not write the whole pool
    (torch.zeros did: a third of a second for 1.25 GB on two cores, of a two-second start)."""
    if device.type != "cpu":
        return torch.zeros(n, dtype=dtype, device=device)
    return torch.from_numpy(np.zeros(n * dtype.itemsize, dtype=np.uint8)).view(dtype)
