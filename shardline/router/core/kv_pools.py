"""How big the KV pools are: the page pool, and for a model with sliding-window layers the window
pool, where a sequence holds only the pages its window still reaches (kv_manager.py).

Rule: a window pool exists where a sequence's window reaches fewer pages than the context holds
(`window_span` < the context's pages). It then gets the window pages of `max_batch` sequences,
so that it never keeps a sequence waiting that the batch has room for, or half of the smallest
shard's budget where that is less; the page pool gets what is left of every shard's budget, or
(`--num-pages`) less. Where no shard runs a full-attention layer, a page pool page costs nothing
(it is the prefix index's): the window pool then gets the whole budget, and the page pool the
pages of `max_batch` whole contexts. Without a window pool the page pool is what every shard's
budget holds of pages of all its layers, or less.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from shardline.router.core.shards import ShardInfo


@dataclass(frozen=True)
class PoolSizes:
    pages: int  # in the page pool
    window_pages: int = 0  # in the window pool (0: none; the windowed layers use the page pool)


def window_span(window: int, step_tokens: int, page_size: int) -> int:
    """The most window pages a sequence holds at once: those of the `window - 1` positions before
    a step's first and of the step's `step_tokens`, on pages that need not start at either."""
    return -(-(window - 1 + step_tokens) // page_size) + 1


def pool_sizes(infos: Sequence[ShardInfo], max_batch: int, span: int, num_pages: int, context_pages: int) -> PoolSizes:
    """The pools of a replica of shards `infos`: `span` window pages a sequence (window_span),
    `num_pages` the flag (0: the budget's), `context_pages` the pages of the model's context."""
    if not span or span >= context_pages:
        capacity = min(i.max_pages for i in infos)
        return PoolSizes(min(num_pages, capacity) if num_pages else capacity)
    windowed = [i for i in infos if i.window_kv_bytes_per_page]
    full = [i for i in infos if i.kv_bytes_per_page > i.window_kv_bytes_per_page]
    if not full:
        window_pages = min(i.kv_budget_bytes // i.window_kv_bytes_per_page for i in windowed) - 1
        return PoolSizes(num_pages or max_batch * context_pages, max(0, window_pages))
    half = min(i.kv_budget_bytes // 2 // i.window_kv_bytes_per_page for i in windowed) - 1
    window_pages = max(0, min(max_batch * span, half))
    capacity = min(
        (i.kv_budget_bytes - (window_pages + 1) * i.window_kv_bytes_per_page)
        // (i.kv_bytes_per_page - i.window_kv_bytes_per_page)
        - 1
        for i in full
    )
    return PoolSizes(min(num_pages, capacity) if num_pages else capacity, window_pages)
