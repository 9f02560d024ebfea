"""A GGUF's weights read straight into the serving layout, tensor by tensor: `--weights native` on
the CPU. The model is built on the meta device and each of its layers is made from the blocks of
the file's tensors (memory-mapped), so no fp32 copy of the model exists at any time; only this
shard's pipeline stage is read, and of its layers only this TP rank's rows and columns.

How each linear layer is held is `served_bits`'s rule (shard/footprint.py): layers whose
tensors are all 4-bit blocks (Q4_0, Q4_1, Q4_K) as int4 groups, Q4_K's and Q6_K's as their own
blocks on the 4- and 6-bit kernels (where Shardline's kernels are built; a fused layer of both
as a `StackedLinear` of one part each), any other quantized ones as int8, float ones dense in
the serving dtype. A tensor's 4-bit, 5-bit, Q6_K or Q8_0 blocks are read directly
(kernels/gguf_groups.py); other types' rows, and slices that cut a block, are dequantized a
tensor at a time for a grid to be found, as before. The embedding stays quantized (int8 groups,
or the tied LM head's own).
"""

from __future__ import annotations

import logging
import mmap
import time

import numpy as np
import torch
from torch import nn

from shardline.common.process import trim_heap
from shardline.kernels.quantized import QuantizedEmbedding, QuantizedLinear, TiedEmbedding
from shardline.kernels.stacked import StackedLinear
from shardline.shard.footprint import FLOAT, QK_PERMUTED, Description, Unservable
from shardline.shard.gguf_parts import Part, Stored, groups, layer_bits, packable, packed, type_runs, unpermuted
from shardline.shard.layout import Layout, layer_range
from shardline.shard.model import MLP, MoE, Rotary, Transformer, uninitialized
from shardline.shard.parallel import keep_stage, mlp_units, tp_slice

log = logging.getLogger(__name__)


# A block's norms (`Block`'s) -> their GGUF names: before and after attention, before and after the MLP
_NORMS = {
    "attn_norm": "attn_norm",
    "attn_out_norm": "post_attention_norm",
    "mlp_norm": "ffn_norm",
    "mlp_out_norm": "post_ffw_norm",
}
# gpt-oss's MLP input norm goes by the name of OLMo 2's attention output norm (its checkpoint's
# `post_attention_layernorm`, as Llama's)
_GPT_OSS_NORMS = _NORMS | {"mlp_norm": "post_attention_norm"}


class GgufLoader:
    def __init__(self, model: Description, layout: Layout, dtype: torch.dtype, dense_copy: bool):
        self.cfg, source = model.cfg, model.source
        self.file = np.memmap(source.path, dtype=np.uint8, mode="r")
        self.tensors = {t.name: Stored(t, self.file) for t in model.tensors}
        self.name, self.layout, self.dtype, self.dense_copy = source.path.name, layout, dtype, dense_copy
        self._read = []  # tensors read since the last `_release`

    def _part(self, name: str, rows: np.ndarray | None = None, cols: range | None = None) -> Part:
        if name not in self.tensors:
            raise Unservable(f"{self.name} has no tensor {name}, which a {self.cfg.architecture} layer needs")
        if self.tensors[name] not in self._read:
            self._read.append(self.tensors[name])
        return Part(self.tensors[name], rows, cols)

    def _read_ahead(self, prefix: str) -> None:
        """Asks the kernel to read the tensors named `prefix`* from disk meanwhile (the next
        layer's, while this one is repacked): a first start after the file left the page cache
        reads it at the disk's speed, which the repacking then waits for no more."""
        page = mmap.PAGESIZE
        for t in self.tensors.values():
            if t.name.startswith(prefix):
                start = t.offset // page * page
                self.file._mmap.madvise(mmap.MADV_WILLNEED, start, t.offset + t.n_bytes - start)

    def _release(self) -> None:
        """Drops the file's pages of the tensors read since the last call from this process's
        memory (they stay in the page cache): a mapped page once read counts as resident, and the
        whole file would, by the end of a load, beside the weights made of it. And hands the heap's
        free memory back: the slices' temporaries, freed, would otherwise stay resident, layer
        upon layer (malloc keeps them for reuse once it has raised its mmap threshold)."""
        page = mmap.PAGESIZE
        for t in self._read:
            start = -(-t.offset // page) * page
            end = (t.offset + t.n_bytes) // page * page
            if end > start:
                self.file._mmap.madvise(mmap.MADV_DONTNEED, start, end - start)
        self._read = []
        trim_heap()

    def _dense(self, name: str, rows: np.ndarray | None = None) -> torch.Tensor:
        return self._part(name, rows).values().squeeze(-1).to(self.dtype)

    def _linear(self, parts: list[Part], bias: torch.Tensor | None = None, keep_rows: bool = False) -> nn.Module:
        runs = type_runs(parts)
        if len(runs) > 1 and all(packable(run) for run in runs):  # each type at its own width
            return StackedLinear([self._linear(run) for run in runs], bias)
        bits = layer_bits(parts)
        if bits is None:
            linear = nn.Linear(1, 1, bias=bias is not None)
            linear.weight = nn.Parameter(torch.cat([p.values() for p in parts]).to(self.dtype), requires_grad=False)
            if bias is not None:
                linear.bias = nn.Parameter(bias, requires_grad=False)
            linear.in_features, linear.out_features = linear.weight.shape[1], linear.weight.shape[0]
            return linear
        records = packed(parts)
        if records is not None:
            n = sum(len(p.rows) for p in parts)
            return QuantizedLinear.from_records(records, bits, n, bias, 1.0, self.dense_copy, keep_rows)
        bits = 8 if bits == 6 else bits  # Q6_K blocks that `packed` cannot take: a grid of 8 bits
        codes, scale, lo, exact = groups(parts, bits)
        return QuantizedLinear.from_groups(
            codes, scale, lo, bits, bias, exact, dense_copy=self.dense_copy, keep_rows=keep_rows
        )

    def load(self) -> Transformer:
        cfg, layout, t0 = self.cfg, self.layout, time.perf_counter()
        with torch.device("meta"), uninitialized():
            model = Transformer(cfg)
        keep_stage(model, layout)
        hd = cfg.head_dim
        q_heads, kv, units = tp_slice(cfg, layout)
        q_rows = np.arange(q_heads.start * hd, q_heads.stop * hd)
        kv_rows = np.arange(kv.start * hd, kv.stop * hd)
        permuted = cfg.architecture in QK_PERMUTED
        q_order = unpermuted(cfg.num_heads * hd, cfg.num_heads) if permuted else np.arange(cfg.num_heads * hd)
        k_order = unpermuted(cfg.num_kv_heads * hd, cfg.num_kv_heads) if permuted else np.arange(cfg.num_kv_heads * hd)
        head_order = Rotary.head_order(cfg)
        if head_order is not None:  # a partial rotary embedding's dimensions, as the model turns them
            q_order = q_order.reshape(cfg.num_heads, hd)[:, head_order].reshape(-1)
            k_order = k_order.reshape(cfg.num_kv_heads, hd)[:, head_order].reshape(-1)
        for i, block in zip(layer_range(cfg.num_layers, layout.pp_stage, layout.pp), model.layers):
            self._read_ahead(f"blk.{i + 1}.")
            p = f"blk.{i}."
            for mine, theirs in (_GPT_OSS_NORMS if cfg.architecture == "gpt-oss" else _NORMS).items():
                if getattr(block, mine) is not None:
                    getattr(block, mine).weight = nn.Parameter(self._dense(f"{p}{theirs}.weight"), requires_grad=False)
            attn = block.attn
            if cfg.qk_norm:  # per head, or (OLMo 2's) one weight per q and k row: this rank's rows
                q_norm, k_norm = (q_rows, kv_rows) if cfg.qk_norm_across_heads else (None, None)
                attn.q_norm.weight = nn.Parameter(self._dense(p + "attn_q_norm.weight", q_norm), requires_grad=False)
                attn.k_norm.weight = nn.Parameter(self._dense(p + "attn_k_norm.weight", k_norm), requires_grad=False)
            if p + "attn_qkv.weight" in self.tensors:  # Phi-3's, fused: q's rows, then k's, then v's
                k_at, v_at = cfg.num_heads * hd, (cfg.num_heads + cfg.num_kv_heads) * hd
                qkv = [
                    self._part(p + "attn_qkv.weight", q_order[q_rows]),
                    self._part(p + "attn_qkv.weight", k_at + k_order[kv_rows]),
                    self._part(p + "attn_qkv.weight", v_at + kv_rows),
                ]
            else:
                qkv = [
                    self._part(p + "attn_q.weight", q_order[q_rows]),
                    self._part(p + "attn_k.weight", k_order[kv_rows]),
                    self._part(p + "attn_v.weight", kv_rows),
                ]
            bias = None
            if cfg.qkv_bias:
                bias = torch.cat(
                    [
                        self._dense(p + "attn_q.bias", q_order[q_rows]),
                        self._dense(p + "attn_k.bias", k_order[kv_rows]),
                        self._dense(p + "attn_v.bias", kv_rows),
                    ]
                )
            attn.wqkv = self._linear(qkv, bias)
            wo = self._part(p + "attn_output.weight", cols=range(q_rows[0], q_rows[-1] + 1))
            attn.wo = self._linear([wo], self._summed_once(p + "attn_output.bias") if cfg.output_bias else None)
            if cfg.attention_sinks:  # this rank's heads'
                sinks = self._dense(p + "attn_sinks.weight", np.arange(q_heads.start, q_heads.stop))
                attn.sinks = nn.Parameter(sinks, requires_grad=False)
            if isinstance(block.mlp, MoE):
                self._moe(p, block.mlp)
            else:
                self._mlp(block.mlp, p + "ffn_{}.weight", units)
            self._release()
        tied = "output.weight" not in self.tensors
        if model.lm_head is not None:  # the sampling shard
            model.norm.weight = nn.Parameter(self._dense("output_norm.weight"), requires_grad=False)
            head = self._linear([self._part("token_embd.weight" if tied else "output.weight")], keep_rows=tied)
            model.lm_head = head
        if model.embed is not None:
            model.embed = self._embedding(model, tied)
        self._release()
        with torch.device("cpu"):
            model.build_rotary()
        missing = [n for n, x in (*model.named_parameters(), *model.named_buffers()) if x.is_meta]
        if missing:
            raise Unservable(f"{self.name}: nothing in the file fills {', '.join(missing[:5])}")
        del self.file, self.tensors  # the file's mapping goes with them
        log.info("read %s's weights into the serving layout in %.1f s", cfg.name, time.perf_counter() - t0)
        return model.eval().requires_grad_(False)

    def _summed_once(self, name: str, expert: int | None = None) -> torch.Tensor:
        """A row-parallel layer's bias (of a 2-D tensor of experts', `expert`'s), which the
        all-reduce of its ranks' outputs adds once: rank 0's, zeros on the others."""
        part = self._part(name) if expert is None else self._part(name, np.array([expert]))
        bias = part.values().reshape(-1).to(self.dtype)
        return bias if self.layout.tp_rank == 0 else torch.zeros_like(bias)

    def _mlp(self, mlp: MLP, names: str, units: range, expert: int = 0) -> None:
        """An MLP from the tensors `names`.format(gate|up|down): this rank's `units` (gate's and up's
        rows, down's columns); of 3-D tensors, `expert`'s (its rows follow the experts' before it),
        with its biases where it has them (gpt-oss's: 2-D tensors, a row per expert)."""
        rows = np.arange(units.start, units.stop) + expert * self.cfg.expert_intermediate_size
        biases = {}
        if mlp.w13.bias is not None:
            bias = names.replace(".weight", ".bias")
            gate_up = [self._part(bias.format(kind), np.array([expert]), units).values() for kind in ("gate", "up")]
            biases = dict(
                w13=torch.cat(gate_up, 1).reshape(-1).to(self.dtype), w2=self._summed_once(bias.format("down"), expert)
            )
        if self.cfg.architecture != "phi3":
            w13 = [self._part(names.format(kind), rows) for kind in ("gate", "up")]
        else:  # Phi-3's up holds gate's rows, then up's
            up = names.format("up")
            w13 = [self._part(up, rows), self._part(up, rows + self.cfg.intermediate_size)]
        mlp.w13 = self._linear(w13, biases.get("w13"))
        out = expert * self.cfg.hidden_size
        down = self._part(names.format("down"), np.arange(out, out + self.cfg.hidden_size), units)
        mlp.w2 = self._linear([down], biases.get("w2"))

    def _moe(self, p: str, moe: MoE) -> None:
        """A sparse layer: its router whole, and this TP rank's units of every expert (of the
        shared expert too), each expert's blocks read from the 3-D tensors as a layer of its own."""
        bias = self._dense(p + "ffn_gate_inp.bias") if self.cfg.expert_bias else None
        moe.gate = self._linear([self._part(p + "ffn_gate_inp.weight")], bias)
        units = mlp_units(self.cfg.expert_intermediate_size, self.layout)
        for e, expert in enumerate(moe.experts):
            self._mlp(expert, p + "ffn_{}_exps.weight", units, e)
        if moe.shared is not None:
            shared = mlp_units(self.cfg.shared_expert_intermediate_size, self.layout)
            self._mlp(moe.shared, p + "ffn_{}_shexp.weight", shared)
            # a vector in the file ({n_embd}), a one-row layer in the model
            moe.shared_gate = nn.Linear(self.cfg.hidden_size, 1, bias=False, device="cpu", dtype=self.dtype)
            moe.shared_gate.weight.data = self._dense(p + "ffn_gate_inp_shexp.weight").reshape(1, -1)
            moe.shared_gate.requires_grad_(False)

    def _embedding(self, model: Transformer, tied: bool) -> nn.Module:
        part = self._part("token_embd.weight")
        head = model.lm_head
        if tied and isinstance(head, QuantizedLinear):
            return TiedEmbedding(head, self.dtype)  # the LM head's codes serve the lookups too
        if tied and isinstance(head, nn.Linear):
            embed = nn.Embedding(1, 1)
            embed.weight = head.weight  # one tensor, as a tied checkpoint holds it
            return embed
        if part.kind in FLOAT:
            embed = nn.Embedding(1, 1)
            embed.weight = nn.Parameter(part.values().to(self.dtype), requires_grad=False)
            return embed
        codes, scale, lo, _ = groups([part], 8)
        return QuantizedEmbedding(codes, scale, lo, self.dtype)
