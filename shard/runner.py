"""Runs step plans on the model: builds the step's tensors, runs the layers, samples.

Slots are derived here from each sequence's block table and positions; a decode step is
vectorized over the batch (no per-token Python work beyond building the step's index tensors).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from kernels.attention import AttentionBatch
from shard.kv_cache import KVPages
from shard.model import Transformer
from shard.parallel import Layout
from shard.sampler import SamplingParams, sample


class ModelRunner:
    def __init__(self, model: Transformer, page_size: int, dtype: torch.dtype, device: torch.device,
                 layout: Layout = Layout()):
        self.model, self.page_size, self.dtype, self.device = model, page_size, dtype, device
        self.layout = layout
        self.kv: KVPages | None = None
        self.lm_head_calls = 0

    def allocate(self, num_pages: int) -> None:
        self.kv = KVPages(self.model.cfg, num_pages, self.page_size, self.dtype, self.device)

    def _tensor(self, data, dtype=torch.int64) -> torch.Tensor:
        return torch.tensor(data, dtype=dtype, device=self.device)

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

    @torch.inference_mode()
    def step(self, seqs) -> list[int]:
        """seqs: SequenceStep messages. Returns one sampled token per sequence with emit set."""
        if not seqs:
            return []
        is_decode = all(len(s.token_ids) == 1 for s in seqs)
        tokens, positions, batch = (self._decode_batch if is_decode else self._prefill_batch)(seqs)
        layout, hidden_in = self.layout, None
        if not layout.is_first_stage:
            hidden_in = torch.empty(len(tokens), self.model.cfg.hidden_size, dtype=self.dtype, device=self.device)
            dist.recv(hidden_in, src=layout.peer(layout.pp_stage - 1))
        hidden = self.model(tokens, positions, self.kv.layers, batch, hidden_in)
        if not layout.is_last_stage:
            dist.send(hidden, dst=layout.peer(layout.pp_stage + 1))
        ends = torch.tensor([len(s.token_ids) for s in seqs]).cumsum(0) - 1
        emitting = [i for i, s in enumerate(seqs) if s.emit]
        if not emitting or not layout.samples:
            return []
        self.lm_head_calls += 1
        logits = self.model.logits(hidden[ends[emitting].to(self.device)])
        params = [SamplingParams(s.sampling.temperature, s.sampling.top_p or 1.0, s.sampling.top_k,
                                 s.sampling.seed) for s in (seqs[i] for i in emitting)]
        sampled_at = [seqs[i].start_pos + len(seqs[i].token_ids) for i in emitting]
        return sample(logits, params, sampled_at)
