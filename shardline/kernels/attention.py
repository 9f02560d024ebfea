"""Paged attention over KV pages `[num_pages, page_size, kv_heads, head_dim]`.

The pages may hold a narrower dtype than the model computes in (`--kv-dtype`): new K/V are
rounded to it as they are written, and cached K/V widened back as they are read.

A sliding-window layer (`window` > 0: Gemma 3's local layers, Mistral's) lets a query at position
p see the keys at p - window + 1 .. p only, as transformers masks them (q - k < window).

An attention sink (gpt-oss's: a learned logit per head, `sinks`) is one more term in each
softmax's denominator that adds no value: a head's output is the plain one scaled by
sum(exp(scores)) / (sum(exp(scores)) + exp(sink)), that is by sigmoid(lse - sink), where lse is
the log-sum-exp of the scores that every path here already keeps to merge its blocks.

A soft cap on the scores (Gemma 2's `softcap`: cap * tanh(score / cap), after the scale and
before the mask) leaves torch's fused kernel out: such a layer attends in plain torch.

The portable path is plain torch (runs on CPU and CUDA). On CUDA with flash-attn installed, the
paged-KV entry points of flash-attn are used instead. A slot is `page * page_size + offset`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

try:  # flash-attn only builds with CUDA; everything works without it.
    from flash_attn import flash_attn_with_kvcache
except ImportError:  # pragma: no cover - depends on the machine
    flash_attn_with_kvcache = None


@dataclass
class AttentionBatch:
    """Where a step's tokens live: what attention needs besides q, k and v.

    Decode form (every sequence contributes one query): `block_tables` [B, max_pages] and
    `context_lens` [B] are tensors. Prefill form: per-sequence `query_lens`, `start_positions` and
    `block_tables_list`, because each sequence attends over its own causal window.
    """

    slots: torch.Tensor  # [T] where each new token's K/V is written
    is_decode: bool
    block_tables: torch.Tensor | None = None  # decode: [B, max_pages] int32/int64
    context_lens: torch.Tensor | None = None  # decode: [B] tokens in the cache incl. the new one
    query_lens: list[int] | None = None  # prefill
    start_positions: list[int] | None = None  # prefill
    block_tables_list: list[torch.Tensor] | None = None  # prefill
    opaque: bool = False  # decode inside a compiled graph: attention as one operator
    # decode: the split-KV blocks per window (0: none), worked out by the first layer of each
    blocks: dict[int, list] = field(default_factory=dict)
    # The same step over the sliding-window layers' own pool of pages, where they have one (the
    # shard's KV cache): those layers attend through it.
    windowed: AttentionBatch | None = None

    @classmethod
    def decode(
        cls, block_tables: torch.Tensor, positions: torch.Tensor, page_size: int, opaque: bool = False
    ) -> AttentionBatch:
        """One new token per sequence at `positions` [B], its pages in `block_tables` [B, width]."""
        pages = block_tables.gather(1, (positions // page_size)[:, None])[:, 0]
        return cls(
            slots=pages * page_size + positions % page_size,
            is_decode=True,
            block_tables=block_tables,
            context_lens=positions + 1,
            opaque=opaque,
        )


def write_kv(
    k_pages: torch.Tensor, v_pages: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor
) -> None:
    """Scatters the new tokens' K/V [T, kv_heads, head_dim] into their slots; no other slot changes."""
    kv_heads, head_dim = k_pages.shape[-2:]
    k_pages.view(-1, kv_heads, head_dim).index_copy_(0, slots, k.to(k_pages.dtype))
    v_pages.view(-1, kv_heads, head_dim).index_copy_(0, slots, v.to(v_pages.dtype))


def uses_flash(device: torch.device, dtype: torch.dtype, page_size: int, kv_dtype: torch.dtype) -> bool:
    """Whether attention takes flash-attn's paged path: CUDA, fp16/bf16 pages of the model's dtype,
    and pages of a multiple of 256 tokens (what its paged KV needs)."""
    return (
        flash_attn_with_kvcache is not None
        and device.type == "cuda"
        and page_size % 256 == 0
        and dtype in (torch.float16, torch.bfloat16)
        and kv_dtype == dtype
    )


def decode_capturable(device: torch.device, dtype: torch.dtype, page_size: int, kv_dtype: torch.dtype) -> bool:
    """Whether decode attention can run inside a captured graph on this device. On CUDA only
    flash-attn's paged decode can (the torch path reads context lengths on the host); on CPU the
    graph is compiled, not captured, and the torch path runs as one opaque operator."""
    return device.type != "cuda" or uses_flash(device, dtype, page_size, kv_dtype)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    batch: AttentionBatch,
    scale: float,
    window: int = 0,
    sinks: torch.Tensor | None = None,
    softcap: float = 0.0,
) -> torch.Tensor:
    """q [T, heads, head_dim], k/v [T, kv_heads, head_dim] of this step's tokens -> [T, heads, head_dim].

    Writes k/v into the pages first, then attends each query over its sequence's cached context
    (its last `window` positions, where that is not 0), each head's softmax beside its sink
    (`sinks` [heads]), where there are sinks, its scores capped at `softcap` (0: none).
    """
    if batch.opaque:
        return decode_attention(
            q,
            k,
            v,
            k_pages,
            v_pages,
            batch.slots,
            batch.block_tables,
            batch.context_lens,
            scale,
            window,
            sinks,
            softcap,
        )
    write_kv(k_pages, v_pages, k, v, batch.slots)
    if uses_flash(q.device, q.dtype, k_pages.shape[1], k_pages.dtype):
        return _flash(q, k_pages, v_pages, batch, scale, window, sinks, softcap)
    if batch.is_decode:
        return _decode_torch(q, k_pages, v_pages, batch, scale, window, sinks, softcap)
    return _prefill_torch(q, k, v, k_pages, v_pages, batch, scale, window, sinks, softcap)


def _sunk(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """out [..., d] with its log-sum-exp [...], scaled as the sinks (broadcast to lse's shape)
    make it (module docstring)."""
    return out * torch.sigmoid(lse.float() - sinks.float())[..., None].to(out.dtype)


# Decode attends in blocks of this many context tokens: a batch's temporary K/V copies are at
# most batch x DECODE_BLOCK_TOKENS tokens, however long its longest sequence is.
DECODE_BLOCK_TOKENS = 256


def attend_plain(q, k, v, scale, bias=None, causal=False, softcap=0.0):
    """q [B, h, n, d], k/v [B, h, S, d], an additive bias broadcast to [B, h, n, S] or a causal
    mask (query i sees keys 0..i) -> (out [B, h, n, d], log-sum-exp [B, h, n]), in plain torch;
    the scores capped at `softcap` where that is not 0."""
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    if bias is not None:
        scores = scores + bias
    if causal:
        n, s = scores.shape[-2:]
        scores = scores.masked_fill(torch.ones(n, s, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.matmul(torch.exp(scores - lse[..., None]).to(v.dtype), v), lse


def attend_fused_cpu(q, k, v, scale, bias=None, causal=False):
    """As attend_plain, in torch's fused CPU kernel, which returns the log-sum-exp it computed."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, is_causal=causal, attn_mask=bias, scale=scale
    )


def _attend(q, k, v, scale, bias=None, causal=False, softcap=0.0):
    if softcap:
        return attend_plain(q, k, v, scale, bias, causal, softcap)
    return (attend_fused_cpu if q.device.type == "cpu" else attend_plain)(q, k, v, scale, bias, causal)


def _merge(out, lse, o, o_lse):
    """Merges two attention results over disjoint key sets by their log-sum-exp."""
    m = torch.maximum(lse, o_lse)
    w_old, w_new = torch.exp(lse - m), torch.exp(o_lse - m)
    total = w_old + w_new
    return (out * w_old[..., None] + o.float() * w_new[..., None]) / total[..., None], m + torch.log(total)


def _gathered(pages, table, tokens: int, dtype: torch.dtype):
    """[1, kv_heads, tokens, head_dim]: the first `tokens` cached positions of one sequence."""
    page_size, kv_heads, head_dim = pages.shape[1:]
    used = table[: (tokens + page_size - 1) // page_size]
    return pages.index_select(0, used).view(-1, kv_heads, head_dim)[:tokens].transpose(0, 1)[None].to(dtype)


def _decode_blocks(batch: AttentionBatch, page_size: int, dtype: torch.dtype, window: int) -> list:
    """[(rows or None for all, block tables [n, width], additive mask [n, 1, 1, width * page_size])]
    per block of the context: the same for every layer of a step with this window, so worked out
    once. A block that no row's window reaches is left out."""
    if window in batch.blocks:
        return batch.blocks[window]
    bsz = batch.block_tables.shape[0]
    max_pages = min(batch.block_tables.shape[1], -(-int(batch.context_lens.max()) // page_size))
    block_pages = max(1, DECODE_BLOCK_TOKENS // page_size)
    blocks = batch.blocks[window] = []
    lens = batch.context_lens
    for first in range(0, max_pages, block_pages):
        start, last = first * page_size, min(first + block_pages, max_pages)
        seen = lens > start  # sequences with tokens here
        if window:  # and whose window reaches it
            seen &= lens - window < (last * page_size)
        rows = seen.nonzero().squeeze(1)
        if not len(rows):
            continue
        if len(rows) < bsz:
            tables, ends = batch.block_tables[rows, first:last], lens[rows]
        else:
            rows, tables, ends = None, batch.block_tables[:, first:last], lens
        n, width = tables.shape
        positions = torch.arange(start, start + width * page_size, device=tables.device)[None, :]
        unseen = positions >= ends[:, None]
        if window:
            unseen |= positions < (ends - window)[:, None]
        bias = torch.zeros(n, 1, 1, width * page_size, dtype=dtype, device=tables.device)
        bias.masked_fill_(unseen[:, None, None, :], float("-inf"))
        blocks.append((rows, tables, bias))
    return blocks


def _decode_torch(q, k_pages, v_pages, batch: AttentionBatch, scale, window: int = 0, sinks=None, softcap=0.0):
    """Split-KV decode: the context is read in blocks of DECODE_BLOCK_TOKENS, each block only for
    the sequences that reach into it (with a window: whose window does), and the blocks' partial
    results are merged by their log-sum-exp (as flash-decoding does). A batch of short sequences
    is one block. Block tables may be wider than the longest context (a captured graph's static
    ones are): the blocks stop at the longest context."""
    bsz, heads = q.shape[:2]
    page_size, kv_heads, head_dim = k_pages.shape[1:]
    qg = q.view(bsz, kv_heads, heads // kv_heads, head_dim)
    out = lse = None
    blocks = _decode_blocks(batch, page_size, q.dtype, window)
    if blocks[0][0] is not None:  # some windows start past the first block: nothing seen yet (merged exactly)
        out = torch.zeros(bsz, kv_heads, heads // kv_heads, head_dim, device=q.device)
        lse = torch.full((bsz, kv_heads, heads // kv_heads), float("-inf"), device=q.device)
    for rows, tables, bias in blocks:
        n, width = tables.shape
        # index_select, not k_pages[tables]: the same rows, gathered 5x faster on CPU (45 vs 229 us
        # for 64 pages of SmolLM2's K)
        k = k_pages.index_select(0, tables.flatten()).view(n, width * page_size, kv_heads, head_dim).transpose(1, 2)
        v = v_pages.index_select(0, tables.flatten()).view(n, width * page_size, kv_heads, head_dim).transpose(1, 2)
        k, v = k.to(q.dtype), v.to(q.dtype)
        o, o_lse = _attend(qg if rows is None else qg[rows], k, v, scale, bias, softcap=softcap)
        if out is None:
            out, lse = o.float(), o_lse.float()
        elif rows is None:
            out, lse = _merge(out, lse, o, o_lse)
        else:
            out[rows], lse[rows] = _merge(out[rows], lse[rows], o, o_lse)
    if sinks is not None:  # [B, kv_heads, group, d]: the sinks of a KV head's q heads as rows
        out = _sunk(out, lse, sinks.view(kv_heads, heads // kv_heads))
    return out.to(q.dtype).reshape(bsz, heads, head_dim)


def _prefill_torch(
    q, k_new, v_new, k_pages, v_pages, batch: AttentionBatch, scale, window: int = 0, sinks=None, softcap=0.0
):
    """Per sequence: causal attention over its new tokens and, for a chunk after the first, plain
    attention over its cached context, merged by log-sum-exp. Neither needs a mask, so both run
    in torch's fused kernel (on 4-D inputs; 3-D ones take a slow path) in O(tokens) memory. A
    chunk whose tokens' window leaves keys out attends through a mask (`_windowed`)."""
    kv_heads, head_dim = k_pages.shape[2:]
    if k_pages.dtype != q.dtype:  # as the cache will hold them, so that chunked and whole prompts agree
        k_new, v_new = k_new.to(k_pages.dtype).to(q.dtype), v_new.to(v_pages.dtype).to(q.dtype)
    outs, offset = [], 0
    for n, start, table in zip(batch.query_lens, batch.start_positions, batch.block_tables_list):
        qs, ks, vs = (t[offset : offset + n].transpose(0, 1)[None] for t in (q, k_new, v_new))
        if window and start + n > window:
            out, lse = _windowed(qs, ks, vs, k_pages, v_pages, table, start, window, scale, softcap)
        elif start == 0 and sinks is None and not softcap:
            out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)[0]
        elif start == 0:  # the same, with the log-sum-exp the sinks need (or capped scores)
            group = qs.shape[1] // kv_heads
            kv = ks.repeat_interleave(group, 1), vs.repeat_interleave(group, 1)
            out, lse = _attend(qs, *kv, scale, causal=True, softcap=softcap)
            out, lse = out[0], lse[0]
        else:
            heads = qs.shape[1]
            group = heads // kv_heads
            # The new tokens among themselves, causally (K/V repeated per q head: n tokens only).
            kv = ks.repeat_interleave(group, 1), vs.repeat_interleave(group, 1)
            out, lse = _attend(qs, *kv, scale, causal=True, softcap=softcap)
            # The cached context, which every new token sees whole: each KV head's q heads
            # stacked as its queries, so the context is neither masked nor repeated.
            q_kv = qs[0].reshape(kv_heads, group * n, head_dim)[None]
            cached = _gathered(k_pages, table, start, q.dtype), _gathered(v_pages, table, start, q.dtype)
            o, o_lse = _attend(q_kv, *cached, scale, softcap=softcap)
            out, lse = _merge(out[0].float(), lse[0].float(), o.reshape(heads, n, head_dim), o_lse.reshape(heads, n))
            out = out.to(q.dtype)
        if sinks is not None:  # out [heads, n, d]
            out = _sunk(out, lse, sinks[:, None])
        outs.append(out.transpose(0, 1))
        offset += n
    return torch.cat(outs) if len(outs) > 1 else outs[0]


def _windowed(qs, ks, vs, k_pages, v_pages, table, start: int, window: int, scale, softcap=0.0):
    """One chunk's attention within its window: its new tokens' keys and the cached ones the
    first of them still sees, under a mask of what each token sees (q - k < window, k <= q).
    Returns (out [heads, n, d], log-sum-exp [heads, n])."""
    n, heads = qs.shape[2], qs.shape[1]
    group = heads // k_pages.shape[2]
    lo = max(0, start - window + 1)  # the first position any of the tokens sees
    if start > lo:
        ks = torch.cat([_gathered(k_pages, table, start, qs.dtype)[:, :, lo:], ks], 2)
        vs = torch.cat([_gathered(v_pages, table, start, qs.dtype)[:, :, lo:], vs], 2)
    q_pos = torch.arange(start, start + n, device=qs.device)[:, None]
    k_pos = torch.arange(lo, start + n, device=qs.device)[None, :]
    seen = (k_pos <= q_pos) & (q_pos - k_pos < window)
    bias = torch.zeros(seen.shape, dtype=qs.dtype, device=qs.device).masked_fill_(~seen, float("-inf"))
    out, lse = _attend(qs, ks.repeat_interleave(group, 1), vs.repeat_interleave(group, 1), scale, bias, softcap=softcap)
    return out[0], lse[0]


def _flash(q, k_pages, v_pages, batch: AttentionBatch, scale, window=0, sinks=None, softcap=0.0):  # pragma: no cover
    def attend(q, seqlens, tables):  # q [B, n, heads, d] -> the same
        out = flash_attn_with_kvcache(
            q,
            k_pages,
            v_pages,
            cache_seqlens=seqlens.to(torch.int32),
            block_table=tables.to(torch.int32),
            softmax_scale=scale,
            causal=True,
            window_size=(window - 1 if window else -1, 0 if window else -1),
            softcap=softcap,
            return_softmax_lse=sinks is not None,
        )
        if sinks is None:
            return out
        out, lse = out  # lse [B, heads, n]
        return _sunk(out, lse.transpose(1, 2), sinks)

    if batch.is_decode:
        return attend(q.unsqueeze(1), batch.context_lens, batch.block_tables).squeeze(1)
    outs, offset = [], 0
    for n, start, table in zip(batch.query_lens, batch.start_positions, batch.block_tables_list):
        seqlens = torch.tensor([start + n], device=q.device)
        outs.append(attend(q[offset : offset + n].unsqueeze(0), seqlens, table[None]).squeeze(0))
        offset += n
    return torch.cat(outs)


# A captured decode graph (shard/decode_graphs.py, torch.compile on CPU) calls paged attention as
# one opaque operator, so inductor compiles everything around it and leaves the paged reads to
# the code above. It is declared without mutated arguments although it writes the new tokens'
# K/V into the pages: no other operator of the graph reads those pages, and declaring the write
# would make functionalization copy each layer's whole pool every step (in our measurement it
# made a compiled SmolLM2 decode step several times slower than eager).
@torch.library.custom_op("shardline::decode_attention", mutates_args=())
def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    slots: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int,
    sinks: torch.Tensor | None,
    softcap: float,
) -> torch.Tensor:
    batch = AttentionBatch(slots=slots, is_decode=True, block_tables=block_tables, context_lens=context_lens)
    return paged_attention(q, k, v, k_pages, v_pages, batch, scale, window, sinks, softcap)


@decode_attention.register_fake
def _(q, k, v, k_pages, v_pages, slots, block_tables, context_lens, scale, window, sinks, softcap):
    return torch.empty_like(q)
