"""KV page tensors of one shard: per layer it runs, K and V of shape [num_pages + 1, page_size,
kv_heads, head_dim] for its own KV heads. The extra last page is reserved padding: a shard never
gets it from the router."""

from __future__ import annotations

import torch

from shardline.shard.config import ModelConfig


def bytes_per_page(cfg: ModelConfig, page_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_layers * page_size * cfg.num_kv_heads * cfg.head_dim * elem


class KVPages:
    def __init__(self, cfg: ModelConfig, num_pages: int, page_size: int, dtype: torch.dtype, device: torch.device):
        shape = (num_pages + 1, page_size, cfg.num_kv_heads, cfg.head_dim)
        self.padding_page = num_pages
        self.layers = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(cfg.num_layers)
        ]

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for pair in self.layers for t in pair)
