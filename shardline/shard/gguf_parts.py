"""The parts of a GGUF's tensors that go into one layer (shard/gguf_loader.py reads a model
with them): a tensor's blocks in the file's mapping, the rows and columns of it a TP rank keeps,
and what they become: dense values, grids of `bits` (kernels/grid.py), or the records Shardline's
kernels hold Q4_K's and Q6_K's blocks in as they are."""

from __future__ import annotations

import warnings

import numpy as np
import torch

from shardline.kernels import native
from shardline.kernels.gguf_groups import BITS, BLOCK_WEIGHTS, dequantized, groups_of
from shardline.kernels.grid import GROUP, grid_groups, rows_at_once
from shardline.kernels.operands import FORMATS, Q4_K_RECORD, RECORD_BYTES
from shardline.shard.footprint import Tensor, Unservable, served_bits


class Stored:
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


class Part:
    """Rows (and columns) of one GGUF tensor that go into a layer: `rows` index the tensor's rows
    as the model orders them (llama.cpp's Q/K rows are permuted for its RoPE: undone here). A 3-D
    tensor of experts is its experts' rows one above the other."""

    def __init__(self, tensor: Stored, rows: np.ndarray | None = None, cols: range | None = None):
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
            raw = Part(self.tensor, self.rows[i : i + step]).raw()
            with warnings.catch_warnings():  # the file's mapping is read-only, and only read here
                warnings.simplefilter("ignore", UserWarning)
                blocks = torch.from_numpy(raw[:, round(self.cols.start * per_byte) : round(self.cols.stop * per_byte)])
            made = pack(blocks)
            records[i // 8 : i // 8 + len(made)] = made

    def _slice(self, rows: np.ndarray, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
        part = Part(self.tensor, rows, self.cols)
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


def groups(parts: list[Part], bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
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


def packable(parts: list[Part]) -> bool:
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


def type_runs(parts: list[Part]) -> list[list[Part]]:
    """The parts in runs of one type, in order (a fused QKV of Q4_K, Q4_K and Q6_K: two)."""
    runs = []
    for p in parts:
        if runs and runs[-1][0].kind == p.kind:
            runs[-1].append(p)
        else:
            runs.append([p])
    return runs


def packed(parts: list[Part]) -> torch.Tensor | None:
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


def layer_bits(parts: list[Part]) -> int | None:
    """`served_bits` for a layer of these parts, but Q6_K's own 6 bits where the kernel for them is
    built and no part's columns cut its blocks (`packed` reads them)."""
    kinds = {p.kind for p in parts}
    if kinds == {"Q6_K"} and native.available() and all(p.aligned() for p in parts):
        return 6
    return served_bits(kinds)


def unpermuted(n_rows: int, n_head: int) -> np.ndarray:
    """Row order that undoes llama.cpp's Q/K permutation (weights.unpermute_rope, as indices)."""
    return np.arange(n_rows).reshape(n_head, n_rows // n_head // 2, 2).swapaxes(1, 2).reshape(-1)
