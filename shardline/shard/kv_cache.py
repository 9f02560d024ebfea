"""KV page tensors of one shard: per layer it runs, K and V of shape [pages + 1, page_size,
kv_heads, head_dim] for its own KV heads. The extra last page of a pool is reserved padding: a
shard never gets it from the router.

There are one or two pools. Every layer keeps its pages in the main pool of `num_pages`, unless
the router asked for a window pool (`window_pages`, shard.proto's WarmupRequest): then the
sliding-window layers keep theirs there, where a sequence holds only the pages its window still
reaches, and the main pool holds the full-attention layers' pages only."""

from __future__ import annotations

import numpy as np
import torch

from shardline.shard.config import ModelConfig


def bytes_per_page(cfg: ModelConfig, windows: list[int], page_size: int, dtype: torch.dtype) -> tuple[int, int]:
    """K and V of one page over the layers whose `windows` are given (0: full attention), and
    over the windowed ones among them."""
    elem = torch.empty((), dtype=dtype).element_size()
    per_layer = 2 * page_size * cfg.num_kv_heads * cfg.head_dim * elem
    return per_layer * len(windows), per_layer * sum(1 for w in windows if w)


class KVPages:
    def __init__(
        self,
        cfg: ModelConfig,
        num_pages: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device,
        windows: list[int] | None = None,
        window_pages: int = 0,
    ):
        """`windows`: each layer's sliding window (0: none), as the layers run (None: the
        model's layers, each in the main pool)."""
        windows = [0] * cfg.num_layers if windows is None else windows
        self.padding_page, self.window_padding_page = num_pages, window_pages
        own = [bool(window_pages and w) for w in windows]  # the layers in the window pool
        page = (page_size, cfg.num_kv_heads, cfg.head_dim)
        main = _pool(own.count(False), num_pages + 1, page, dtype, device)
        windowed = _pool(own.count(True), window_pages + 1, page, dtype, device)
        main_layers, window_layers = iter(main), iter(windowed)
        self.layers = [next(window_layers if o else main_layers) for o in own]

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for pair in self.layers for t in pair)


def _pool(layers: int, pages: int, page: tuple, dtype: torch.dtype, device: torch.device) -> list[tuple]:
    """(K, V) of `layers` layers, each [pages, *page], from one allocation."""
    if not layers:
        return []
    shape = (pages, *page)
    pool = _zeros(2 * layers * int(np.prod(shape)), dtype, device).view(layers, 2, *shape)
    return [(pool[i, 0], pool[i, 1]) for i in range(layers)]


def _zeros(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """n zeros. On the CPU from calloc (numpy's zeros): a pool that size is mapped from the kernel's
    zero pages, which become resident as KV is written, so a start does not write the whole pool
    (torch.zeros did: a third of a second for 1.25 GB on two cores, of a two-second start)."""
    if device.type != "cpu":
        return torch.zeros(n, dtype=dtype, device=device)
    return torch.from_numpy(np.zeros(n * dtype.itemsize, dtype=np.uint8)).view(dtype)
