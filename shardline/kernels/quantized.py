"""Weight-only quantized linear layers on grid-quantized weights (kernels/grid.py), each on
Shardline's kernel or torch's int4 one, whichever the machine measured faster (kernels/choice.py,
kernels/operands.py).

A step of many rows is faster on dense weights, by how much depends on the CPU. So a layer keeps a
dense copy when asked (`dense_copy`, for prefill), of a kind and used above a row count measured
once per machine and layer shape, and none where it never measured faster: a copy costs 2 or 4
bytes a weight beside the codes' 0.6 or 1.1. Shardline's kernels need no copy for that: above a row
count they also measure (`direct_rows`), they multiply through a GEMM on slices they dequantize on
the fly (fp32, or bf16 where the machine computes it natively: `gemm_in_bf16`);
and where torch's int4 kernel measured faster from some row count on (`torch_rows`: CPUs with
native bf16), a layer keeps its operands too and uses it there.
"""

from __future__ import annotations

import functools
import itertools

import torch
import torch.nn.functional as F
from torch import nn

from shardline.kernels import native
from shardline.kernels.choice import (
    ALWAYS,
    PREFILL_PROBE_ROWS,
    PROBE_OUTPUTS,
    DenseKind,
    crossover,
    dense_kind,
    gemm_in_bf16,
    kernel_for,
)
from shardline.kernels.grid import grid_groups, grid_weights, rows_at_once
from shardline.kernels.linear import onednn_linear
from shardline.kernels.operands import (
    Kernel,
    in_features,
    multiply,
    native_operands,
    native_rows,
    operands,
    record_format,
    torch_operands,
)


def _flat(nested) -> list[torch.Tensor]:
    if isinstance(nested, torch.Tensor):
        return [nested]
    return [t for part in nested for t in _flat(part)]


COLD_BYTES = 16 << 20  # more than two cores' L2, as decode's stream of every layer's weights is


def _cold(make):
    """An endless iterator over copies of the operands `make()` returns, made at the first next()
    (a measurement read back from the machine's choices never asks), enough copies (up to 64: a
    tiny layer needs no thousands) that each multiply reads its weights from beyond the L2 cache:
    in the model, decode streams every layer's weights once per step, and a kernel timed on one
    warm copy measures another case (with the AVX2 build, torch's measured faster warm from 2-4
    rows, and made 16 streams slower)."""
    first = make()
    copies = max(1, min(64, COLD_BYTES // sum(t.numel() * t.element_size() for t in _flat(first))))
    yield from itertools.cycle([first, *(_clone(first) for _ in range(copies - 1))])


def _leading(operands, n: int):
    """Native operands of a layer's first `n` outputs (whole blocks of 8): its records' first blocks."""
    (records,) = operands
    return operands if n >= records.shape[0] * 8 else (records[: -(-n // 8)],)


def _shape_of(nested) -> list | None:
    """The nesting of tuples and lists of tensors, with the tensors' places: [[-1], [-1, -1]]."""
    if nested is None:
        return None
    if isinstance(nested, torch.Tensor):
        return -1
    return [_shape_of(part) for part in nested]


def _from_shape(shape, tensors):
    """Tensors (an iterator, in `_flat`'s order) nested as `_shape_of` said."""
    if shape == -1:
        return next(tensors)
    return [_from_shape(part, tensors) for part in shape]


def _clone(nested):
    return nested.clone() if isinstance(nested, torch.Tensor) else [_clone(part) for part in nested]


class DenseCopy(nn.Module):
    """A quantized layer's weights, dense, for steps of many rows (see `dense_kind`), made a slice
    of rows at a time (no fp32 copy of a large layer beside a bf16 one): `weights(rows)`, fp32."""

    def __init__(self, shape: tuple[int, int], weights):
        super().__init__()
        self.kind = dense_kind()
        dense = torch.empty(shape, dtype=torch.bfloat16 if self.kind is DenseKind.BF16 else torch.float32)
        step = rows_at_once(shape[1])
        for i in range(0, shape[0], step):
            rows = slice(i, min(shape[0], i + step))
            dense[rows] = weights(rows)
        self.register_buffer("weight", dense if self.kind is DenseKind.BF16 else dense.to_mkldnn(), persistent=False)

    @classmethod
    def of_weight(cls, weight: torch.Tensor, kind: DenseKind) -> DenseCopy:
        """A copy kept between starts: bf16, or fp32 to lay out for oneDNN again."""
        copy = cls.__new__(cls)
        nn.Module.__init__(copy)
        copy.kind = kind
        copy.register_buffer("weight", weight if kind is DenseKind.BF16 else weight.to_mkldnn(), persistent=False)
        return copy

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [n, K] -> fp32 [n, N]."""
        if self.kind is DenseKind.BF16:
            return F.linear(rows.bfloat16(), self.weight).float()
        return onednn_linear(rows, self.weight)


class QuantizedLinear(nn.Module):
    """A linear layer on `bits`-bit codes in groups of 32 (w = lo + scale * code).

        `kernel_for` says which kernel multiplies it, per machine, and only that kernel's operands
        are kept (torch's alone where it measured faster at every row count, ours too where it did from
    some row count on). Above the rows where a dense copy measures faster (`crossover`), the copy
        multiplies, where one was asked for (`dense_copy`).
        `keep_rows`: keep what `rows` needs to look up weight rows (a tied embedding's)."""

    def __init__(self, linear: nn.Linear, bits: int, dense_copy: bool = False, keep_rows: bool = False):
        codes, scale, lo, exact = grid_groups(linear.weight.detach(), 16 if bits == 4 else 255)
        groups = lambda: (codes, scale, lo)  # noqa: E731
        self._init(codes.shape, groups, bits, linear.bias, exact, dense_copy, keep_rows, count_down=True)
        self._forward_hooks = linear._forward_hooks  # a layer swapped after its hooks were added keeps them

    @classmethod
    def from_groups(
        cls,
        codes: torch.Tensor,
        scale: torch.Tensor,
        lo: torch.Tensor,
        bits: int,
        bias: torch.Tensor | None = None,
        exact: float = 1.0,
        dense_copy: bool = False,
        keep_rows: bool = False,
    ) -> QuantizedLinear:
        """A layer of weights already in groups (`codes` [N, K] in 0..15 or 0..254, `scale` and
        `lo` [N, K/32]): a GGUF's blocks, read straight into them (kernels/gguf_groups.py). Or,
        `bits` 6, Q6_K's: codes 0..63, its int8 scales [N, K/16] in place of `scale` and its d per
        group in place of `lo` (Shardline's kernel only).
        `exact`: the share of groups the records' fp16 holds exactly. A block's grid starts where the
        file's does (Q4_0's -8d and Q4_1's m are fp16 numbers already; of Q4_K's -dmin * m, no value
        of its grid is one in 99% of groups), so no origin that fp16 holds is looked for: at 7 ns a
        weight, that search took the 8B shape's load 50 s for nothing."""
        layer = cls.__new__(cls)
        layer._init(codes.shape, lambda: (codes, scale, lo), bits, bias, exact, dense_copy, keep_rows, count_down=False)
        return layer

    @classmethod
    def from_records(
        cls,
        records: torch.Tensor,
        bits: int,
        n: int,
        bias: torch.Tensor | None = None,
        exact: float = 1.0,
        dense_copy: bool = False,
        keep_rows: bool = False,
    ) -> QuantizedLinear:
        """A layer of `n` outputs whose native records (4 or 6 bits) were made straight from a GGUF's
        blocks (`q4_k_pack`, `q6_k_pack`): its groups are unpacked from them only if torch's kernel
        needs them."""
        layer = cls.__new__(cls)
        groups = functools.cache(lambda: tuple(t[:n] for t in native.ops().int4_groups(records)))
        shape = (n, in_features(records))
        layer._init(shape, groups, bits, bias, exact, dense_copy, keep_rows, count_down=False, records=records)
        return layer

    def _init(self, shape, groups, bits, bias, exact, dense_copy, keep_rows, count_down: bool, records=None) -> None:
        """`groups()`: the layer's (codes, scale, lo), made when needed; `records`: its native
        operands, where made already."""
        nn.Module.__init__(self)
        self.bits, self.exact = bits, exact
        self.out_features, self.in_features = shape
        self.kernel = Kernel.NATIVE if bits == 6 else kernel_for(bits)
        if records is not None and self.kernel is Kernel.NATIVE:
            self.operands = (records,)
        else:
            self.operands = operands(self.kernel, *groups(), bits, count_down)
        self.torch_operands = None
        if keep_rows:  # rows as the kept kernel's operands hold them, or the codes as well
            self.rows_from = self.operands if self.kernel is Kernel.NATIVE else self._codes(groups)
        self._hold()
        self.dense = DenseCopy(shape, self._weights(groups)) if dense_copy else None
        if bias is None:
            self.bias = None
        else:  # a buffer, so that the shard's weight bytes count it
            self.register_buffer("bias", bias.detach(), persistent=False)
        threads = f"{torch.get_num_threads()}threads"
        # The paths' crossovers are measured on the layer's leading PROBE_OUTPUTS outputs, so that
        # the layers of one format and input width share one measurement.
        probe = min(self.out_features, PROBE_OUTPUTS)
        shape = f"{probe}x{self.in_features}-{threads}"
        self.direct_rows, self.torch_rows, self.bf16_gemm = ALWAYS, ALWAYS, gemm_in_bf16()
        held_as = record_format(self.operands[0]) if self.kernel is Kernel.NATIVE else f"int{bits}"
        if self.kernel is Kernel.NATIVE:
            gemm, probed = "bf16" if self.bf16_gemm else "fp32", _leading(self.operands, probe)
            self.direct_rows = crossover(
                f"{held_as}-direct-{gemm}-{shape}",
                lambda rows: multiply(self.kernel, probed, rows, bf16_gemm=self.bf16_gemm),
                lambda rows: multiply(self.kernel, probed, rows, direct_rows=0, bf16_gemm=self.bf16_gemm),
                self.in_features,
                max_rows=PREFILL_PROBE_ROWS,  # the direct path's time grows with the rows, the GEMM's unpacking not
            )
        if self.kernel is Kernel.NATIVE and bits == 4:
            # Where the CPU computes bf16 natively, torch's int4 kernel may beat ours at batch rows:
            # kept for those only where it measured faster (measured cold, never with the AVX2 build).
            held = functools.cache(lambda: torch_operands(*groups(), bits))  # built only if needed
            ours = _cold(lambda: _leading(self.operands, probe))
            theirs = _cold(lambda: torch_operands(*(t[:probe] for t in groups()), bits))
            self.torch_rows = crossover(
                f"{held_as}-torch-{shape}",
                lambda rows: multiply(self.kernel, next(ours), rows, self.direct_rows, self.bf16_gemm),
                lambda rows: multiply(Kernel.TORCH, next(theirs), rows),
                self.in_features,
                margin=1.1,
            )  # ours rounds activations to int8 per group of 32, torch's to bf16
            if self.torch_rows == 0 and not keep_rows:  # torch's faster at every row count: ours go
                self.kernel, self.operands = Kernel.TORCH, held()
                self.direct_rows = self.torch_rows = ALWAYS
                self._hold()
            elif self.torch_rows < ALWAYS:
                self.torch_operands = held()
                self._hold()
        self.max_rows = (
            ALWAYS
            if self.dense is None
            else crossover(
                f"{held_as}-{self.kernel.value}-{self.dense.kind.value}-{self.out_features}x{self.in_features}-{threads}",
                self._quantized,
                self.dense,
                self.in_features,
            )
        )
        if self.max_rows >= ALWAYS:  # a copy that never measured faster is memory for nothing
            self.dense = None

    @staticmethod
    def _codes(groups) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        codes, scale, lo = groups()
        return codes.to(torch.uint8), scale, lo

    def _weights(self, groups):
        """fp32 rows of the layer's weights, by a slice of rows: read back from the records, or
        from the groups for torch's kernel."""
        if self.kernel is Kernel.NATIVE:
            return lambda rows: native_rows(self.operands, torch.arange(rows.start, rows.stop))
        codes, scale, lo = groups()
        return lambda rows: grid_weights(codes[rows].float(), scale[rows].float(), lo[rows].float())

    def _hold(self) -> None:
        """Every tensor kept as a buffer too, so that the shard's weight bytes (Info) count them."""
        for name in [name for name in self._buffers if name.startswith("held")]:
            del self._buffers[name]
        held = [self.operands, getattr(self, "rows_from", ()), self.torch_operands or ()]
        for i, t in enumerate(dict.fromkeys(_flat(held))):  # rows_from may be the operands themselves
            self.register_buffer(f"held{i}", t, persistent=False)

    # -- kept between starts (shard/served_cache.py) ------------------------------------------------
    def state(self) -> tuple[dict, dict[str, torch.Tensor]]:
        """What the layer is, as plain values, and the tensors it holds, by name: `from_state`
        makes it again without packing or measuring anything."""
        rows_from = getattr(self, "rows_from", None)
        spec = {
            "bits": self.bits,
            "exact": self.exact,
            "kernel": self.kernel.value,
            "shape": [self.out_features, self.in_features],
            "direct_rows": self.direct_rows,
            "torch_rows": self.torch_rows,
            "max_rows": self.max_rows,
            "operands": _shape_of(self.operands),
            "torch_operands": _shape_of(self.torch_operands),
            "rows_from": "operands" if rows_from is self.operands else _shape_of(rows_from),
            "dense": self.dense.kind.value if self.dense is not None else None,
        }
        tensors = {}
        for part in ("operands", "torch_operands", "rows_from"):
            if isinstance(spec[part], list):
                tensors.update({f"{part}.{i}": t for i, t in enumerate(_flat(getattr(self, part)))})
        if self.bias is not None:
            tensors["bias"] = self.bias
        if self.dense is not None:
            w = self.dense.weight
            tensors["dense"] = w.to_dense() if w.is_mkldnn else w
        return spec, tensors

    @classmethod
    def from_state(cls, spec: dict, tensors: dict[str, torch.Tensor]) -> QuantizedLinear:
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.bits, layer.exact, layer.kernel = spec["bits"], spec["exact"], Kernel(spec["kernel"])
        layer.out_features, layer.in_features = spec["shape"]
        layer.direct_rows, layer.torch_rows, layer.max_rows = spec["direct_rows"], spec["torch_rows"], spec["max_rows"]
        layer.bf16_gemm = gemm_in_bf16()
        for part in ("operands", "torch_operands", "rows_from"):
            if isinstance(spec[part], list):
                setattr(layer, part, _from_shape(spec[part], iter(tensors[f"{part}.{i}"] for i in range(len(tensors)))))
        if spec["torch_operands"] is None:
            layer.torch_operands = None
        if spec["rows_from"] == "operands":
            layer.rows_from = layer.operands
        layer._hold()
        layer.bias = None
        if "bias" in tensors:
            layer.register_buffer("bias", tensors["bias"], persistent=False)
        layer.dense = None if spec["dense"] is None else DenseCopy.of_weight(tensors["dense"], DenseKind(spec["dense"]))
        return layer

    def _quantized(self, rows: torch.Tensor) -> torch.Tensor:
        if rows.shape[0] > self.torch_rows:
            return multiply(Kernel.TORCH, self.torch_operands, rows)
        y = multiply(self.kernel, self.operands, rows, self.direct_rows, self.bf16_gemm)
        return y if y.shape[1] == self.out_features else y[:, : self.out_features]  # a padded block's zeros

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        y = (self._quantized(rows) if rows.shape[0] <= self.max_rows else self.dense(rows)).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def rows(self, tokens: torch.Tensor) -> torch.Tensor:
        """The weights' rows `tokens`, fp32 (needs keep_rows)."""
        if self.kernel is Kernel.NATIVE:
            return native_rows(self.rows_from, tokens)
        codes, scale, lo = (t.index_select(0, tokens) for t in self.rows_from)
        return grid_weights(codes.float(), scale.float(), lo.float())


class TiedEmbedding(nn.Module):
    """An embedding that reads its rows from a `QuantizedLinear` kept with `keep_rows` (a tied LM
    head's codes: 8 bits, or Q6_K's 6 on Shardline's kernel)."""

    def __init__(self, table: QuantizedLinear, dtype: torch.dtype):
        super().__init__()
        self.table, self.dtype = table, dtype

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.table.rows(tokens).to(self.dtype)


class QuantizedEmbedding(nn.Module):
    """An embedding held as int8 groups (a GGUF's blocks read straight, kernels/gguf_groups.py: 4-bit
    codes fit the 8-bit grid), in the records Shardline's int8 kernel reads where it is built,
    each lookup dequantizing its rows: 1.125 bytes a weight where the dtype took 2 or 4."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor, dtype: torch.dtype):
        super().__init__()
        self.dtype, self.num_embeddings = dtype, codes.shape[0]
        if native.available():
            self.held = native_operands(codes, scale, lo, 8)
        else:
            self.held = (codes.to(torch.uint8), scale.half(), lo.half())
        for i, t in enumerate(self.held):  # buffers, so that the shard's weight bytes count them
            self.register_buffer(f"held{i}", t, persistent=False)

    @classmethod
    def of_held(cls, held: list[torch.Tensor], rows: int, dtype: torch.dtype) -> QuantizedEmbedding:
        """An embedding kept between starts: the tensors `held` as this machine held them."""
        embed = cls.__new__(cls)
        nn.Module.__init__(embed)
        embed.dtype, embed.num_embeddings, embed.held = dtype, rows, tuple(held)
        for i, t in enumerate(held):
            embed.register_buffer(f"held{i}", t, persistent=False)
        return embed

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if native.available():
            return native_rows(self.held, tokens).to(self.dtype)
        codes, scale, lo = (t.index_select(0, tokens) for t in self.held)
        return grid_weights(codes.float(), scale.float(), lo.float()).to(self.dtype)
