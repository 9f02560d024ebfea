"""Runs step plans on the model: checks each sequence's entry, builds the step's tensors, runs the
layers, samples.

Slots are derived here from each sequence's block table and positions; a decode step is
vectorized over the batch (no per-token Python work beyond building the step's index tensors).

A long prefill step runs in pieces of at most PREFILL_PIECE_TOKENS tokens, one after the other
(a long prompt is cut as chunked prefill cuts it), so that its activations stay within tens of
megabytes whatever the prompt's length. The router still sees one step.

A plan entry that cannot be served (a page id outside the pool, positions its block table does
not cover, a token outside the vocabulary) fails its sequence alone: it is left out of the step
and reported. Every shard of a replica receives the same plan and judges it the same way, so
every rank leaves out the same sequences and the collectives stay matched.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from kernels.attention import AttentionBatch
from shard.kv_cache import KVPages
from shard.model import Transformer
from shard.parallel import Layout
from shard.sampler import SamplingParams, sample


PREFILL_PIECE_TOKENS = 512


@dataclass(frozen=True)
class Span:
    """Some consecutive tokens of one sequence's step: what one forward pass computes for it."""

    token_ids: list[int]
    start_pos: int
    block_table: list[int]


def pieces(seqs, limit: int) -> list[list[tuple[int, Span]]]:
    """Cuts a prefill step into pieces of at most `limit` tokens: [(index in seqs, span)] each."""
    out, piece, room = [], [], limit
    for i, s in enumerate(seqs):
        done = 0
        while done < len(s.token_ids):
            n = min(room, len(s.token_ids) - done)
            piece.append((i, Span(s.token_ids[done:done + n], s.start_pos + done, s.block_table)))
            done, room = done + n, room - n
            if room == 0:
                out.append(piece)
                piece, room = [], limit
    if piece:
        out.append(piece)
    return out


@dataclass
class StepOutput:
    tokens: list[int] = field(default_factory=list)       # per emitting sequence that did not fail
    failures: dict[int, str] = field(default_factory=dict)  # seq_id -> why


class ModelRunner:
    def __init__(self, model: Transformer, page_size: int, dtype: torch.dtype, device: torch.device,
                 layout: Layout = Layout(), vocab_size: int | None = None, max_position: int | None = None):
        self.model, self.page_size, self.dtype, self.device = model, page_size, dtype, device
        self.layout = layout
        self.vocab_size = vocab_size or model.cfg.vocab_size
        self.max_position = max_position or model.cfg.max_position
        self.kv: KVPages | None = None
        self.lm_head_calls = 0

    def allocate(self, num_pages: int) -> None:
        self.kv = None  # let the old pool go before the new one is allocated
        self.kv = KVPages(self.model.cfg, num_pages, self.page_size, self.dtype, self.device)

    def _tensor(self, data, dtype=torch.int64) -> torch.Tensor:
        return torch.tensor(data, dtype=dtype, device=self.device)

    def check(self, s) -> str | None:
        """Why this plan entry cannot be served, or None."""
        n, end = len(s.token_ids), s.start_pos + len(s.token_ids)
        if n == 0:
            return "no input tokens"
        if end > self.max_position:
            return f"positions up to {end} exceed the model's context of {self.max_position}"
        if len(s.block_table) * self.page_size < end:
            return f"block table of {len(s.block_table)} pages does not cover {end} positions"
        if max(s.block_table) >= self.kv.padding_page:
            return f"page id {max(s.block_table)} outside the pool of {self.kv.padding_page} pages"
        if max(s.token_ids) >= self.vocab_size:
            return f"token id {max(s.token_ids)} outside the vocabulary of {self.vocab_size}"
        sp = s.sampling
        if not (math.isfinite(sp.temperature) and sp.temperature >= 0 and 0 <= sp.top_p <= 1):
            return f"invalid sampling parameters {sp}"
        return None

    def _decode_batch(self, seqs) -> tuple[torch.Tensor, torch.Tensor, AttentionBatch]:
        ps = self.page_size
        tokens = self._tensor([s.token_ids[0] for s in seqs])
        positions = self._tensor([s.start_pos for s in seqs])
        width = max(len(s.block_table) for s in seqs)
        pad = self.kv.padding_page
        tables = self._tensor([list(s.block_table) + [pad] * (width - len(s.block_table)) for s in seqs])
        rows = torch.arange(len(seqs), device=self.device)
        slots = tables[rows, positions // ps] * ps + positions % ps
        batch = AttentionBatch(slots=slots, is_decode=True, block_tables=tables,
                               context_lens=positions + 1)
        return tokens, positions, batch

    def _prefill_batch(self, seqs) -> tuple[torch.Tensor, torch.Tensor, AttentionBatch]:
        ps = self.page_size
        tokens = self._tensor([t for s in seqs for t in s.token_ids])
        positions = torch.cat([torch.arange(s.start_pos, s.start_pos + len(s.token_ids),
                                            device=self.device) for s in seqs])
        tables = [self._tensor(list(s.block_table)) for s in seqs]
        slots = torch.cat([table[pos // ps] * ps + pos % ps for table, pos in
                           zip(tables, positions.split([len(s.token_ids) for s in seqs]))])
        batch = AttentionBatch(slots=slots, is_decode=False, query_lens=[len(s.token_ids) for s in seqs],
                               start_positions=[s.start_pos for s in seqs], block_tables_list=tables)
        return tokens, positions, batch

    def _forward(self, tokens, positions, batch) -> torch.Tensor | None:
        """Runs this shard's layers; the hidden states [T, hidden] on the last stage, else None
        (they went to the next stage)."""
        layout, hidden_in = self.layout, None
        if not layout.is_first_stage:
            hidden_in = torch.empty(len(tokens), self.model.cfg.hidden_size, dtype=self.dtype, device=self.device)
            dist.recv(hidden_in, src=layout.peer(layout.pp_stage - 1))
        hidden = self.model(tokens, positions, self.kv.layers, batch, hidden_in)
        if not layout.is_last_stage:
            dist.send(hidden, dst=layout.peer(layout.pp_stage + 1))
            return None
        return hidden

    @torch.inference_mode()
    def step(self, plan_seqs) -> StepOutput:
        """plan_seqs: SequenceStep messages. Samples one token per valid sequence with emit set
        (on the sampling shard). An exception here leaves the shard's state unknown."""
        out = StepOutput()
        seqs = []
        for s in plan_seqs:
            why = self.check(s)
            if why is None:
                seqs.append(s)
            else:
                out.failures[s.seq_id] = why
        if not seqs:
            return out
        if all(len(s.token_ids) == 1 for s in seqs):
            last = self._forward(*self._decode_batch(seqs))  # one row per sequence
        else:
            rows = [None] * len(seqs)  # the hidden state of each sequence's last token
            for piece in pieces(seqs, PREFILL_PIECE_TOKENS):
                hidden = self._forward(*self._prefill_batch([span for _, span in piece]))
                ends = torch.tensor([len(span.token_ids) for _, span in piece]).cumsum(0) - 1
                for (i, _), end in zip(piece, ends.tolist()):
                    rows[i] = None if hidden is None else hidden[end].clone()  # not a view: frees the piece
            last = None if rows[0] is None else torch.stack(rows)
        emitting = [i for i, s in enumerate(seqs) if s.emit]
        if not emitting or not self.layout.samples:
            return out
        self.lm_head_calls += 1
        logits = self.model.logits(last[torch.tensor(emitting, device=self.device)])
        params = [SamplingParams(s.sampling.temperature, s.sampling.top_p or 1.0, s.sampling.top_k,
                                 s.sampling.seed) for s in (seqs[i] for i in emitting)]
        sampled_at = [seqs[i].start_pos + len(seqs[i].token_ids) for i in emitting]
        for i, token in zip(emitting, sample(logits, params, sampled_at)):
            if isinstance(token, str):
                out.failures[seqs[i].seq_id] = token
            else:
                out.tokens.append(token)
        return out
