"""Weight-only quantized linear layers on grid-quantized weights (kernels/grid.py), each on
Shardline's kernel or torch's int4 one, whichever the machine measured faster (kernels/choice.py,
kernels/operands.py).

A step of many rows is faster on dense weights, by how much depends on the CPU. So an int8 layer
(in practice the LM head) always keeps a dense copy, and int4 layers keep one when asked (for
prefill, `dense_copy`); its kind and the row count above which it multiplies are measured once per
machine and layer shape. Shardline's int4 kernel needs no copy for that: above a row count it also
measures (`direct_rows`), it multiplies through an fp32 GEMM on slices it dequantizes on the fly;
and where torch's int4 kernel measured faster from some row count on (`torch_rows`: CPUs with
native bf16), a layer keeps its operands too and uses it there.
"""

from __future__ import annotations

import functools
import itertools

import torch
import torch.nn.functional as F
from torch import nn

from shardline.kernels.choice import ALWAYS, DenseKind, crossover, dense_kind, kernel_for
from shardline.kernels.grid import grid_groups, grid_weights
from shardline.kernels.linear import onednn_linear
from shardline.kernels.operands import Kernel, multiply, native_rows, operands, torch_operands


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


def _clone(nested):
    return nested.clone() if isinstance(nested, torch.Tensor) else [_clone(part) for part in nested]


class DenseCopy(nn.Module):
    """A quantized layer's weights, dense, for steps of many rows (see `dense_kind`)."""

    def __init__(self, weights: torch.Tensor):
        super().__init__()
        self.kind = dense_kind()
        self.register_buffer(
            "weight",
            weights.bfloat16() if self.kind is DenseKind.BF16 else weights.float().to_mkldnn(),
            persistent=False,
        )

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [n, K] -> fp32 [n, N]."""
        if self.kind is DenseKind.BF16:
            return F.linear(rows.bfloat16(), self.weight).float()
        return onednn_linear(rows, self.weight)


class QuantizedLinear(nn.Module):
    """A linear layer on `bits`-bit codes in groups of 32 (w = lo + scale * code).

    `kernel_for` says which kernel multiplies it, per machine, and only that kernel's operands
    are kept. Above the rows where a dense copy measures faster (`crossover`), the copy
    multiplies: 8-bit layers always keep one, 4-bit ones when asked (for prefill, `dense_copy`).
    `keep_rows`: keep what `rows` needs to look up weight rows (a tied embedding's)."""

    def __init__(self, linear: nn.Linear, bits: int, dense_copy: bool = False, keep_rows: bool = False):
        super().__init__()
        self.bits = bits
        self.out_features, self.in_features = linear.weight.shape
        codes, scale, lo, self.exact = grid_groups(linear.weight.detach(), 16 if bits == 4 else 255)
        self.kernel = kernel_for(bits)
        self.operands = operands(self.kernel, codes, scale, lo, bits)
        if keep_rows:  # rows as the kept kernel's operands hold them, or the codes as well
            self.rows_from = self.operands if self.kernel is Kernel.NATIVE else (codes.to(torch.uint8), scale, lo)
        # as buffers too, so that the shard's weight bytes (Info) count them
        for i, t in enumerate(_flat([self.operands, getattr(self, "rows_from", ())])):
            self.register_buffer(f"held{i}", t, persistent=False)
        self.dense = DenseCopy(grid_weights(codes, scale, lo)) if dense_copy or bits == 8 else None
        if linear.bias is None:
            self.bias = None
        else:  # a buffer, so that the shard's weight bytes count it
            self.register_buffer("bias", linear.bias.detach(), persistent=False)
        self._forward_hooks = linear._forward_hooks
        shape = f"{self.out_features}x{self.in_features}-{torch.get_num_threads()}threads"
        self.direct_rows, self.torch_rows, self.torch_operands = ALWAYS, ALWAYS, None
        if self.kernel is Kernel.NATIVE and bits == 4:
            self.direct_rows = crossover(
                f"int4-direct-{shape}",
                self._quantized,
                lambda rows: multiply(self.kernel, self.operands, rows, direct_rows=0),
                self.in_features,
            )
            # Where the CPU computes bf16 natively, torch's int4 kernel may beat ours at batch rows:
            # kept for those only where it measured faster (measured cold, never with the AVX2 build).
            held = functools.cache(lambda: torch_operands(codes, scale, lo, bits))  # built only if needed
            ours, theirs = _cold(lambda: self.operands), _cold(held)
            self.torch_rows = crossover(
                f"int4-torch-{shape}",
                lambda rows: multiply(self.kernel, next(ours), rows, self.direct_rows),
                lambda rows: multiply(Kernel.TORCH, next(theirs), rows),
                self.in_features,
                margin=1.1,
            )  # ours rounds activations to int16, torch's to bf16
            if self.torch_rows < ALWAYS:
                self.torch_operands = held()
                for i, t in enumerate(_flat(self.torch_operands)):
                    self.register_buffer(f"torch_held{i}", t, persistent=False)
        self.max_rows = (
            ALWAYS
            if self.dense is None
            else crossover(
                f"int{bits}-{self.kernel.value}-{self.dense.kind.value}-{shape}",
                self._quantized,
                self.dense,
                self.in_features,
            )
        )

    def _quantized(self, rows: torch.Tensor) -> torch.Tensor:
        if rows.shape[0] > self.torch_rows:
            return multiply(Kernel.TORCH, self.torch_operands, rows)
        y = multiply(self.kernel, self.operands, rows, self.direct_rows)
        return y if y.shape[1] == self.out_features else y[:, : self.out_features]  # a padded block's zeros

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        y = (self._quantized(rows) if rows.shape[0] <= self.max_rows else self.dense(rows)).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def rows(self, tokens: torch.Tensor) -> torch.Tensor:
        """The weights' rows `tokens`, fp32 (needs keep_rows; 8-bit codes only)."""
        if self.kernel is Kernel.NATIVE:
            codes, scale, lo = native_rows(self.rows_from, tokens)
        else:
            codes, scale, lo = (t.index_select(0, tokens) for t in self.rows_from)
        return grid_weights(codes.float(), scale.float(), lo.float())


class Int8Embedding(nn.Module):
    """An embedding that reads its rows from an 8-bit `QuantizedLinear`'s codes (a tied LM head's)."""

    def __init__(self, table: QuantizedLinear, dtype: torch.dtype):
        super().__init__()
        self.table, self.dtype = table, dtype

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.table.rows(tokens).to(self.dtype)
