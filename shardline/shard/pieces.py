"""A long prefill step cut into pieces, run one after the other: each piece's spans are the
consecutive tokens of some sequences that one forward pass computes (shard/runner.py)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from shardline.kernels.attention import AttentionBatch

# A piece holds at most PREFILL_PIECE_TOKENS tokens, and fewer where its largest activations (the
# MLP's gate and up rows and their product: 3 x intermediate values a token) would pass
# PREFILL_PIECE_BYTES (shard/footprint.py, which counts them in a shard's memory), so that a long
# prompt's activations stay bounded whatever the model. Larger pieces amortize each layer's
# weight reads over more tokens, up to about this size, past which a 2-core host measured no
# gain (the commit that set it has the figures). Each piece after the first attends to the
# cached context apart from its own tokens and merges the two.
PREFILL_PIECE_TOKENS = 1024


@dataclass(frozen=True)
class Span:
    """Some consecutive tokens of one sequence's step: what one forward pass computes for it."""

    token_ids: Sequence[int]
    start_pos: int
    block_table: torch.Tensor  # the sequence's pages
    rotary_base: int = 0  # the rotary tables' row of its position 0 (SequenceState's)
    window_table: torch.Tensor | None = None  # its window pages, with a window pool


def pieces(seqs: list[Span], limit: int) -> list[list[tuple[int, Span]]]:
    """Cuts a prefill step into pieces of at most `limit` tokens: [(index in seqs, span)] each."""
    out, piece, room = [], [], limit
    for i, s in enumerate(seqs):
        done = 0
        while done < len(s.token_ids):
            n = min(room, len(s.token_ids) - done)
            piece.append((i, replace(s, token_ids=s.token_ids[done : done + n], start_pos=s.start_pos + done)))
            done, room = done + n, room - n
            if room == 0:
                out.append(piece)
                piece, room = [], limit
    if piece:
        out.append(piece)
    return out


def spans_batch(
    spans: list[Span], positions, tables: list, padding: int, page_size: int, as_rows: bool
) -> AttentionBatch:
    """The attention batch of a piece's spans at `positions` over block `tables` (one per span)
    of one pool, whose padding page is `padding`: as decode rows (a row per token), or as chunks."""
    if as_rows:
        width = max(len(table) for table in tables)
        rows = [
            F.pad(table, (0, width - len(table)), value=padding).expand(len(s.token_ids), width)
            for s, table in zip(spans, tables)
        ]
        return AttentionBatch.decode(torch.cat(rows), positions, page_size)
    counts = [len(s.token_ids) for s in spans]
    slots = [
        table[pos // page_size] * page_size + pos % page_size for table, pos in zip(tables, positions.split(counts))
    ]
    return AttentionBatch(
        slots=torch.cat(slots),
        is_decode=False,
        query_lens=counts,
        start_positions=[s.start_pos for s in spans],
        block_tables_list=tables,
    )
