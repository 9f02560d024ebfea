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
import warnings

import numpy as np
import torch
from torch import nn

from shardline.common.process import trim_heap
from shardline.kernels import native
from shardline.kernels.gguf_groups import BITS, BLOCK_WEIGHTS, dequantized, groups_of
from shardline.kernels.grid import GROUP, grid_groups, rows_at_once
from shardline.kernels.operands import FORMATS, Q4_K_RECORD, RECORD_BYTES
from shardline.kernels.quantized import QuantizedEmbedding, QuantizedLinear, TiedEmbedding
from shardline.kernels.stacked import StackedLinear
from shardline.shard.footprint import FLOAT, QK_PERMUTED, Description, Tensor, Unservable, served_bits
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


class _Stored:
    """One tensor of the file: its header entry (shard/footprint.py keeps the header read) and its
    data in the file's mapping, as rows of block bytes, or values for F32 and F16."""

    def __init__(self, entry: Tensor, file: np.memmap):
        self.name, self.kind, self.dims, self.offset = entry.name, entry.kind, entry.dims, entry.offset
        # imported here: a start that memory-maps its served weights (shard/served_cache.py) reads
        # no GGUF tensor, and the `gguf` package is a tenth of a second of its imports
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        if self.kind not in GGMLQuantizationType.__members__:
            raise Unservable(f"{self.name} is of a type this gguf package does not know: {self.kind}")
        block_weights, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[self.kind]]
        rows = int(np.prod(self.dims[1:], dtype=np.int64))
        row_bytes = self.dims[0] // block_weights * block_bytes
        self.n_bytes = rows * row_bytes
        data = file[self.offset : self.offset + self.n_bytes]
        if self.kind in ("F32", "F16"):
            data = data.view(np.float32 if self.kind == "F32" else np.float16)
        if self.kind not in ("F32", "F16"):
            self.data = data.reshape(rows, -1)
        else:  # a vector as it is; a matrix (or every expert's, one above the other) as rows
            self.data = data.reshape(rows, self.dims[0]) if len(self.dims) > 1 else data


class _Part:
    """Rows (and columns) of one GGUF tensor that go into a layer: `rows` index the tensor's rows
    as the model orders them (llama.cpp's Q/K rows are permuted for its RoPE: undone here). A 3-D
    tensor of experts is its experts' rows one above the other."""

    def __init__(self, tensor: _Stored, rows: np.ndarray | None = None, cols: range | None = None):
        self.tensor, self.kind = tensor, tensor.kind
        dims = tensor.dims
        self.n, self.k = (int(np.prod(dims[1:])), dims[0]) if len(dims) > 1 else (dims[0], 1)
        self.rows = np.arange(self.n) if rows is None else rows
        self.cols = range(self.k) if cols is None else cols

    def raw(self) -> np.ndarray:
        """The selected rows' bytes (quantized) or values (float), whole rows."""
        data = self.tensor.data
        return data[self.rows] if len(self.rows) != self.n or not np.array_equal(self.rows, np.arange(self.n)) else data

    def aligned(self) -> bool:
        """Whether the columns kept start and end on block boundaries."""
        b = BLOCK_WEIGHTS.get(self.kind, 1)
        return self.cols.start % b == 0 and len(self.cols) % b == 0

    def values(self) -> torch.Tensor:
        """fp32 [rows, cols]."""
        raw = self.raw()
        if self.kind in ("F32", "F16"):
            w = torch.from_numpy(np.array(raw, dtype=np.float32))  # a copy: the mapping is read-only
        else:
            w = dequantized(self.kind, raw, self.k)
        return w.reshape(len(self.rows), self.k)[:, self.cols.start : self.cols.stop]

    def groups_into(self, codes: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor, bits: int) -> float:
        """Fills codes (uint8 [rows, cols]), scale and lo ([rows, cols / 32]) at `bits` and says
        the share held exactly: from the blocks where they are a grid of that width or less and the
        columns cut no block; else found in the dequantized values. A slice of rows at a time, so
        that the temporaries stay a few copies of one slice."""
        step, exact = rows_at_once(len(self.cols)), 0.0
        for i in range(0, len(self.rows), step):
            part = self._slice(self.rows[i : i + step], bits)
            for into, made in zip((codes, scale, lo), part):
                into[i : i + step] = made
            exact += part[3] * len(part[0])
        return exact / len(self.rows)

    def records_into(self, records: torch.Tensor, pack) -> None:
        """Fills records ([ceil(rows / 8), ..]) with `pack`'s records of the blocks of the columns
        kept (`aligned`), a slice of rows at a time (whole blocks of 8 rows, the last aside)."""
        step, per_byte = rows_at_once(len(self.cols)), self.tensor.data.shape[1] / self.k
        for i in range(0, len(self.rows), step):
            raw = _Part(self.tensor, self.rows[i : i + step]).raw()
            with warnings.catch_warnings():  # the file's mapping is read-only, and only read here
                warnings.simplefilter("ignore", UserWarning)
                blocks = torch.from_numpy(raw[:, round(self.cols.start * per_byte) : round(self.cols.stop * per_byte)])
            made = pack(blocks)
            records[i // 8 : i // 8 + len(made)] = made

    def _slice(self, rows: np.ndarray, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
        part = _Part(self.tensor, rows, self.cols)
        if self.kind in BITS and BITS[self.kind] <= bits and self.aligned():
            raw = part.raw()
            per_block = BLOCK_WEIGHTS[self.kind]
            nbytes = raw.shape[1] * per_block // self.k
            codes, scale, lo = groups_of(
                self.kind, raw[:, self.cols.start * nbytes // per_block : self.cols.stop * nbytes // per_block]
            )
            if self.kind != "Q8_0" or codes.min() >= 0:  # a Q8_0 -128: no 255-level grid holds the group
                return codes, scale, lo, _fp16_share(scale, lo, bits)
        # a block type of this width (a slice that cuts its blocks) lies on a grid to be found
        search = self.kind in BITS and BITS[self.kind] <= bits
        return grid_groups(part.values(), 16 if bits == 4 else 255, search)


def groups(parts: list[_Part], bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """The parts' groups one above the other, made in place: (codes uint8, scale, lo, share exact)."""
    n, k = sum(len(p.rows) for p in parts), len(parts[0].cols)
    codes = torch.empty((n, k), dtype=torch.uint8)
    scale, lo = torch.empty((n, k // GROUP)), torch.empty((n, k // GROUP))
    at, exact = 0, 0.0
    for p in parts:
        rows = slice(at, at + len(p.rows))
        exact += p.groups_into(codes[rows], scale[rows], lo[rows], bits) * len(p.rows)
        at = rows.stop
    return codes, scale, lo, exact / n


# The types whose blocks Shardline's kernels hold as they are (kernels/int4_linear.cpp,
# int6_linear.cpp, exactly): their packing operators.
PACKS = {"Q4_K": "q4_k_pack", "Q6_K": "q6_k_pack"}
HELD_AS = {"Q4_K": Q4_K_RECORD, "Q6_K": RECORD_BYTES[6]}  # their records' bytes (kernels/operands.py)


def packable(parts: list[_Part]) -> bool:
    """Whether `packed` takes the parts: all of one type in PACKS, columns that cut no blocks, and
    every part but the last whole blocks of 8 rows."""
    kinds = {p.kind for p in parts}
    return (
        len(kinds) == 1
        and kinds <= PACKS.keys()
        and native.available()
        and all(p.aligned() for p in parts)
        and not any(len(p.rows) % 8 for p in parts[:-1])
    )


def _runs(parts: list[_Part]) -> list[list[_Part]]:
    """The parts in runs of one type, in order (a fused QKV of Q4_K, Q4_K and Q6_K: two)."""
    runs = []
    for p in parts:
        if runs and runs[-1][0].kind == p.kind:
            runs[-1].append(p)
        else:
            runs.append([p])
    return runs


def packed(parts: list[_Part]) -> torch.Tensor | None:
    """The parts' blocks as one layer's native records, one above the other; None where they are
    not `packable`."""
    if not packable(parts):
        return None
    kind = parts[0].kind
    pack, size = getattr(native.ops(), PACKS[kind]), HELD_AS[kind]
    n, k = sum(len(p.rows) for p in parts), len(parts[0].cols)
    records, at = torch.empty((-(-n // 8), k // GROUP // FORMATS[size][1], size), dtype=torch.uint8), 0
    for p in parts:
        p.records_into(records[at // 8 :], pack)
        at += len(p.rows)
    return records


def _fp16_share(scale: torch.Tensor, lo: torch.Tensor, bits: int) -> float:
    """The share of groups whose scale and lo fp16 holds (a Q8_0 lo folds to 0: kernels/operands.py)."""
    held = (scale.half().float() == scale) & ((lo.half().float() == lo) | ((bits == 8) & (lo == -127 * scale)))
    return held.float().mean().item()


def _bits(parts: list[_Part]) -> int | None:
    """`served_bits` for a layer of these parts, but Q6_K's own 6 bits where the kernel for them is
    built and no part's columns cut its blocks (`packed` reads them)."""
    kinds = {p.kind for p in parts}
    if kinds == {"Q6_K"} and native.available() and all(p.aligned() for p in parts):
        return 6
    return served_bits(kinds)


def _unpermuted(n_rows: int, n_head: int) -> np.ndarray:
    """Row order that undoes llama.cpp's Q/K permutation (weights.unpermute_rope, as indices)."""
    return np.arange(n_rows).reshape(n_head, n_rows // n_head // 2, 2).swapaxes(1, 2).reshape(-1)


class GgufLoader:
    def __init__(self, model: Description, layout: Layout, dtype: torch.dtype, dense_copy: bool):
        self.cfg, source = model.cfg, model.source
        self.file = np.memmap(source.path, dtype=np.uint8, mode="r")
        self.tensors = {t.name: _Stored(t, self.file) for t in model.tensors}
        self.name, self.layout, self.dtype, self.dense_copy = source.path.name, layout, dtype, dense_copy
        self._read = []  # tensors read since the last `_release`

    def _part(self, name: str, rows: np.ndarray | None = None, cols: range | None = None) -> _Part:
        if name not in self.tensors:
            raise Unservable(f"{self.name} has no tensor {name}, which a {self.cfg.architecture} layer needs")
        if self.tensors[name] not in self._read:
            self._read.append(self.tensors[name])
        return _Part(self.tensors[name], rows, cols)

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

    def _linear(self, parts: list[_Part], bias: torch.Tensor | None = None, keep_rows: bool = False) -> nn.Module:
        runs = _runs(parts)
        if len(runs) > 1 and all(packable(run) for run in runs):  # each type at its own width
            return StackedLinear([self._linear(run) for run in runs], bias)
        bits = _bits(parts)
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
        q_order = _unpermuted(cfg.num_heads * hd, cfg.num_heads) if permuted else np.arange(cfg.num_heads * hd)
        k_order = _unpermuted(cfg.num_kv_heads * hd, cfg.num_kv_heads) if permuted else np.arange(cfg.num_kv_heads * hd)
        head_order = Rotary.head_order(cfg)
        if head_order is not None:  # a partial rotary embedding's dimensions, as the model turns them
            q_order = q_order.reshape(cfg.num_heads, hd)[:, head_order].reshape(-1)
            k_order = k_order.reshape(cfg.num_kv_heads, hd)[:, head_order].reshape(-1)
        for i, block in zip(layer_range(cfg.num_layers, layout.pp_stage, layout.pp), model.layers):
            self._read_ahead(f"blk.{i + 1}.")
            p = f"blk.{i}."
            for mine, theirs in _NORMS.items():
                if getattr(block, mine) is not None:
                    getattr(block, mine).weight = nn.Parameter(self._dense(f"{p}{theirs}.weight"), requires_grad=False)
            attn = block.attn
            if cfg.qk_norm:
                attn.q_norm.weight = nn.Parameter(self._dense(p + "attn_q_norm.weight"), requires_grad=False)
                attn.k_norm.weight = nn.Parameter(self._dense(p + "attn_k_norm.weight"), requires_grad=False)
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
            attn.wo = self._linear([self._part(p + "attn_output.weight", cols=range(q_rows[0], q_rows[-1] + 1))])
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

    def _mlp(self, mlp: MLP, names: str, units: range, expert: int = 0) -> None:
        """An MLP from the tensors `names`.format(gate|up|down): this rank's `units` (gate's and up's
        rows, down's columns); of 3-D tensors, `expert`'s (its rows follow the experts' before it)."""
        rows = np.arange(units.start, units.stop) + expert * self.cfg.expert_intermediate_size
        if self.cfg.architecture != "phi3":
            mlp.w13 = self._linear([self._part(names.format(kind), rows) for kind in ("gate", "up")])
        else:  # Phi-3's up holds gate's rows, then up's
            up = names.format("up")
            mlp.w13 = self._linear([self._part(up, rows), self._part(up, rows + self.cfg.intermediate_size)])
        out = expert * self.cfg.hidden_size
        mlp.w2 = self._linear([self._part(names.format("down"), np.arange(out, out + self.cfg.hidden_size), units)])

    def _moe(self, p: str, moe: MoE) -> None:
        """A sparse layer: its router whole, and this TP rank's units of every expert (of the
        shared expert too), each expert's blocks read from the 3-D tensors as a layer of its own."""
        moe.gate = self._linear([self._part(p + "ffn_gate_inp.weight")])
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
