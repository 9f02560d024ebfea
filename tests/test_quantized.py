"""Quantized linear layers: GGUF blocks are recovered exactly, the int4 and int8 layers compute
what their (dequantized) weights say at every batch size, and `quantize` swaps tagged layers of a
model in place, keeping TP hooks and a tied embedding."""

import itertools
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from gguf.quants import quantize as gguf_quantize

from shardline.kernels import choice, native
from shardline.kernels.grid import GROUP, grid_groups
from shardline.kernels.operands import Kernel, multiply, native_operands, native_rows, torch_operands
from shardline.kernels.quantized import QuantizedLinear, TiedEmbedding
from shardline.shard.config import ModelConfig
from shardline.shard.model import Transformer
from shardline.shard.transforms import swap_quantized

pytestmark = pytest.mark.usefixtures("own_machine_choices")


def _gguf_roundtrip(w: torch.Tensor, qtype) -> torch.Tensor:
    blocks = gguf_quantize(w.numpy(), qtype)
    return torch.from_numpy(dequantize(blocks, qtype).astype(np.float32).reshape(w.shape))


@pytest.mark.parametrize(
    "qtype,levels",
    [(GGMLQuantizationType.Q4_0, 16), (GGMLQuantizationType.Q4_1, 16), (GGMLQuantizationType.Q8_0, 255)],
    ids=["Q4_0", "Q4_1", "Q8_0"],
)
def test_gguf_blocks_are_recovered_exactly(qtype, levels):
    w = _gguf_roundtrip(torch.randn(96, 256) * torch.rand(96, 1), qtype)
    codes, scale, lo, exact = grid_groups(w, levels)
    assert exact == 1.0
    assert codes.min() >= 0 and codes.max() <= levels - 1
    back = lo.repeat_interleave(GROUP, 1) + scale.repeat_interleave(GROUP, 1) * codes
    torch.testing.assert_close(back, w, rtol=0, atol=1e-6)


def test_q4_k_blocks_are_recovered_exactly():
    """gguf-py cannot quantize to Q4_K, so the blocks are random bytes (every byte pattern of the
    scales and codes is a valid block) with finite fp16 super-block scales."""
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, size=(96 * 256 // 256, 144), dtype=np.uint8)
    blocks[:, 0:4] = np.array([0.01, 0.02], dtype=np.float16).view(np.uint8)  # d, dmin
    w = torch.from_numpy(dequantize(blocks.reshape(96, -1), GGMLQuantizationType.Q4_K).astype(np.float32))
    codes, scale, lo, exact = grid_groups(w, 16)
    assert exact == 1.0
    back = lo.repeat_interleave(GROUP, 1) + scale.repeat_interleave(GROUP, 1) * codes
    torch.testing.assert_close(back, w, rtol=0, atol=1e-6)


def test_dense_weights_are_rounded_to_their_nearest_level():
    w = torch.randn(64, 128)
    for levels in (16, 255):
        codes, scale, lo, exact = grid_groups(w, levels)
        assert exact == 0.0
        back = lo.repeat_interleave(GROUP, 1) + scale.repeat_interleave(GROUP, 1) * codes
        assert ((back - w).abs() <= scale.repeat_interleave(GROUP, 1) / 2 + 1e-6).all()


def _reference(layer_weight: torch.Tensor, x: torch.Tensor, bias=None) -> torch.Tensor:
    return F.linear(x.bfloat16().float(), layer_weight, bias)


@pytest.mark.parametrize("rows", [1, 3, 9, 33])
def test_quantized_layers_compute_their_weights(rows):
    torch.manual_seed(rows)
    dense = nn_linear(256, 96, bias=True)
    q4 = _gguf_roundtrip(dense.weight.detach(), GGMLQuantizationType.Q4_1)
    q8 = _gguf_roundtrip(dense.weight.detach(), GGMLQuantizationType.Q8_0)
    x = torch.randn(1, rows, 256)
    for layer, w in [
        (QuantizedLinear(nn_linear(256, 96, weight=q4, bias=dense.bias), 4), q4),
        (QuantizedLinear(nn_linear(256, 96, weight=q4, bias=dense.bias), 4, dense_copy=True), q4),
        (QuantizedLinear(nn_linear(256, 96, weight=q8, bias=dense.bias), 8), q8),
        (QuantizedLinear(nn_linear(256, 96, weight=q8, bias=dense.bias), 8, dense_copy=True), q8),
    ]:
        codes, scale, lo, _ = grid_groups(w, 16 if layer.bits == 4 else 255)
        kernels = {
            Kernel.TORCH: torch_operands(codes, scale, lo, layer.bits),
            Kernel.NATIVE: native_operands(codes, scale, lo, layer.bits),
        }
        for layer.kernel, layer.operands in kernels.items():  # whichever measured faster here, and the other
            # the dense copy too (each loop sets an attribute of the layer)
            for layer.max_rows in [0, 1 << 30] if layer.dense is not None else [1 << 30]:  # noqa: B020
                for layer.direct_rows in [0, 1 << 30]:  # native int4: many rows through the GEMM, or straight
                    got = layer(x)
                    assert got.shape == (1, rows, 96) and got.dtype == torch.float32
                    want = _reference(w, x, dense.bias)
                    # bf16 (torch) or int8 per group of 32 (native) activations, fp16 scales: parts in a hundred.
                    assert (got - want).abs().max() <= 1e-2 * want.abs().max(), (
                        layer.bits,
                        layer.kernel,
                        layer.max_rows,
                    )


@pytest.mark.parametrize(
    "qtype, bits", [(GGMLQuantizationType.Q4_1, 4), (GGMLQuantizationType.Q4_0, 4), (GGMLQuantizationType.Q8_0, 8)]
)
def test_the_native_records_hold_ggufs_blocks_exactly(qtype, bits):
    """The records keep scales and los in fp16, as GGUF's blocks keep theirs, so Q4_0, Q4_1 and
    Q8_0 weights come back bit for bit: an 8-bit group's codes count from the code of zero, so its
    folded lo is 0 (counted from 128, Q8_0's lo + 128 * scale would round in fp16)."""
    assert native.available(), "Shardline's kernels did not build (the README's setup builds them)"
    torch.manual_seed(bits)
    w = _gguf_roundtrip(torch.randn(16, 128) / 10, qtype)
    codes, scale, lo, exact = grid_groups(w, 16 if bits == 4 else 255)
    assert exact == 1.0
    held = native_operands(codes, scale, lo, bits)
    torch.testing.assert_close(native_rows(held, torch.arange(16)), w, rtol=0, atol=0)
    # one-hot rows through the GEMM path read back each weight, fp32 products of exact values, or
    # those rounded to bf16 (to nearest even) where the GEMM computes in bf16
    eye = torch.eye(128)
    torch.testing.assert_close(multiply(Kernel.NATIVE, held, eye, direct_rows=0), w.t(), rtol=0, atol=0)
    in_bf16 = multiply(Kernel.NATIVE, held, eye, direct_rows=0, bf16_gemm=True)
    torch.testing.assert_close(in_bf16, w.t().bfloat16().float(), rtol=0, atol=0)


def test_a_native_int8_layer_of_outputs_not_whole_blocks_of_8_drops_the_padding(monkeypatch):
    """The kernels interleave 8 outputs across the vector lanes; an LM head of an odd vocabulary
    (20 here) is padded with zero weights to 24, and the layer returns exactly its 20, and looks
    up its own rows (a tied embedding's) from the padded codes. (A 4-bit layer needs N a multiple
    of 16 anyway: torch's int4 kernel, measured against ours, packs no other.)"""
    monkeypatch.setattr("shardline.kernels.quantized.kernel_for", lambda bits: Kernel.NATIVE)
    # The kernel multiplies every row count here. Measured (in this test's own folder of machine
    # choices), the crossover to the layer's bf16 copy fell at 4 rows in a busy run, and the copy's
    # rounding failed the comparison at 5.
    monkeypatch.setattr("shardline.kernels.quantized.crossover", lambda *args, **kwargs: choice.ALWAYS)
    torch.manual_seed(20)
    w = _gguf_roundtrip(torch.randn(20, 64) / 10, GGMLQuantizationType.Q8_0)  # an LM head's type: fp16 holds its grid
    layer = QuantizedLinear(nn_linear(64, 20, weight=w, bias=None), 8, keep_rows=True)
    codes, scale, lo, _ = grid_groups(w, 255)
    grid = lo.repeat_interleave(GROUP, 1) + scale.repeat_interleave(GROUP, 1) * codes
    for rows in (1, 5):
        x = torch.randn(rows, 64)
        got = layer(x)
        assert got.shape == (rows, 20)
        # within the activations' rounding to int8 per group of 32 (half a step of the group's largest over 127)
        half_step = (x.abs().reshape(rows, -1, GROUP).amax(-1) / 127 / 2).repeat_interleave(GROUP, 1)
        assert ((got - x @ grid.t()).abs() <= half_step @ grid.abs().t() + 1e-5).all()
    tokens = torch.tensor([19, 0, 8])
    torch.testing.assert_close(layer.rows(tokens), grid[tokens], rtol=0, atol=1e-6)


def _torch_measured_faster_above(rows: int, monkeypatch) -> None:
    """Shardline's kernel for int4 layers, and torch's int4 kernel measured faster above `rows`."""
    measured = choice.crossover
    monkeypatch.setattr(
        "shardline.kernels.quantized.crossover",
        lambda name, *a, **kw: rows if name.startswith("int4-torch") else measured(name, *a, **kw),
    )
    monkeypatch.setattr("shardline.kernels.quantized.kernel_for", lambda bits: Kernel.NATIVE)


def test_a_native_int4_layer_hands_batch_rows_to_torchs_kernel_where_that_measured_faster(monkeypatch):
    _torch_measured_faster_above(2, monkeypatch)
    layer = QuantizedLinear(nn_linear(256, 96, weight=torch.randn(96, 256) / 10, bias=None), 4)
    assert layer.torch_rows == 2 and layer.torch_operands is not None
    for rows in (1, 2, 3, 8):
        x = torch.randn(rows, 256)
        want = (
            multiply(Kernel.TORCH, layer.torch_operands, x)
            if rows > 2
            else multiply(Kernel.NATIVE, layer.operands, x, layer.direct_rows)
        )
        torch.testing.assert_close(layer(x), want, rtol=0, atol=0)


def test_a_layer_where_torchs_kernel_won_at_every_row_count_keeps_only_its_operands(monkeypatch):
    _torch_measured_faster_above(0, monkeypatch)
    weight = torch.randn(96, 256) / 10
    layer = QuantizedLinear(nn_linear(256, 96, weight=weight, bias=None), 4)
    assert layer.kernel is Kernel.TORCH and layer.torch_operands is None
    held = {id(t) for t in layer.buffers()}
    assert held == {id(t) for pair in layer.operands for t in pair}  # torch's operands, and nothing else
    for rows in (1, 8):
        x = torch.randn(rows, 256)
        torch.testing.assert_close(layer(x), multiply(Kernel.TORCH, layer.operands, x), rtol=0, atol=0)


@pytest.mark.parametrize("k", [64, 288, 576])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 33])
def test_the_native_int4_kernel_computes_the_dequantized_weights(rows, k):
    """At every row count, whether or not the input dimension is whole tiles of 64 (288: a TP
    rank's slice): through the GEMM, the fp32 product up to the order of summation (in bf16, within
    its rounding of activations, weights and outputs); straight from
    the codes, within the rounding of the activations to int8 per group of 32 (half a step of
    the group's largest value over 127, times each weight)."""
    torch.manual_seed(rows * k)
    codes = torch.randint(0, 16, (40, k), dtype=torch.int32)
    codes[0] = 15  # every nibble set: the top one carries the word's sign bit
    # scales and los that fp16 holds exactly, as the records keep them (GGUF's blocks' are fp16)
    scale, lo = (torch.rand(40, k // GROUP) / 50).half().float(), (torch.randn(40, k // GROUP) / 10).half().float()
    x = torch.randn(rows, k)
    x[0, :GROUP] *= 1000  # a group of outliers beside ordinary groups
    weights = lo.repeat_interleave(GROUP, 1) + scale.repeat_interleave(GROUP, 1) * codes
    want = x.double() @ weights.double().t()
    half_step = (x.abs().reshape(rows, -1, GROUP).amax(-1) / 127 / 2).repeat_interleave(GROUP, 1)
    rounding = half_step.double() @ weights.abs().double().t()
    held = native_operands(codes, scale, lo, 4)
    fp32 = 1e-5 * want.abs().max()
    # bf16 (8 bits of mantissa): activations and weights rounded, each product's error within 2^-8
    # of |x| |w|, and the output rounded once more
    bf16 = 2**-8 * (x.abs().double() @ weights.abs().double().t()) + 2**-8 * want.abs()
    for direct_rows, bf16_gemm, allowed in ((0, False, fp32), (1 << 30, False, rounding + fp32), (0, True, bf16)):
        got = multiply(Kernel.NATIVE, held, x, direct_rows, bf16_gemm).double()
        assert ((got - want).abs() <= allowed).all(), (direct_rows, bf16_gemm)


def test_the_crossover_is_the_last_row_count_before_the_dense_kernel_measures_faster(own_machine_choices):
    # Sleeps of 10 and 20 ms, not 1 and 2: a fresh-clone suite once measured test-2's 2 ms sleep
    # no slower than the 1 ms one (a loaded machine oversleeps by a millisecond or more).
    def slow_above(n):  # quantized: free up to n rows, then slower than dense
        return lambda x: time.sleep(0.02 if x.shape[0] > n else 0)

    dense = lambda x: time.sleep(0.01)  # noqa: E731
    assert choice.crossover("test-1", slow_above(4), dense, 8) == 4
    assert choice.crossover("test-2", slow_above(0), dense, 8) == 0
    assert choice.crossover("test-3", slow_above(1 << 20), dense, 8) >= 1 << 20


def test_one_probe_that_noise_hands_to_the_dense_kernel_does_not_settle_the_crossover(own_machine_choices):
    """A busy machine (a first start converts the tokenizer beside the shard that measures) once
    made torch's kernel serve a layer at every row count, and a GEMM path one row: the dense side
    must win at two row counts in a row, and the fastest of several runs is each side's time."""
    dense = lambda x: time.sleep(0.01)  # noqa: E731
    spike = lambda x: time.sleep(0.02 if x.shape[0] == 2 else 0)  # noqa: E731 - slow at 2 rows only
    assert choice.crossover("spike", spike, dense, 8) >= 1 << 20
    busy = itertools.cycle([0.03, 0.03, 0.0])  # two calls in three slowed by a neighbour: the median too
    assert choice.crossover("busy", lambda x: time.sleep(next(busy)), dense, 8) >= 1 << 20


def test_the_gemm_path_is_probed_as_far_as_a_prefill_chunk(own_machine_choices):
    """The direct path's time grows with the rows and the GEMM path's unpacking does not: a
    crossover past 64 rows is found where the probe goes that far (a Llama-3.2-1B's FFN measured
    its direct path faster up to 64 rows, and served 512-row prefills from it, 3.4x slower)."""
    dense = lambda x: time.sleep(0.01)  # noqa: E731
    slow_above_100 = lambda x: time.sleep(0.02 if x.shape[0] > 100 else 0)  # noqa: E731
    assert choice.crossover("to-64", slow_above_100, dense, 8) >= 1 << 20
    assert choice.crossover("to-512", slow_above_100, dense, 8, max_rows=choice.PREFILL_PROBE_ROWS) == 64


def test_the_crossover_keeps_the_quantized_kernel_unless_dense_wins_by_the_margin(own_machine_choices):
    # Tens of milliseconds: a loaded machine oversleeps by a fraction of one, which at 2 ms against
    # 1.5 ms once crossed the 1.5 margin (a fresh-clone CI run measured 8 rows).
    slower = lambda x: time.sleep(0.02)  # noqa: E731 - the kernel being kept, 33% slower
    assert choice.crossover("margin-1", slower, lambda x: time.sleep(0.015), 8) == 0
    assert choice.crossover("margin-2", slower, lambda x: time.sleep(0.015), 8, margin=1.5) >= 1 << 20


def test_the_crossover_is_measured_once_per_machine(own_machine_choices):
    """Two processes (or two starts of one server) compute a batch with the same kernel: the
    second reads the first one's answer, whatever its own timing would say."""

    def slow_above(n):
        return lambda x: time.sleep(0.002 if x.shape[0] > n else 0)

    assert choice.crossover("layer", slow_above(4), lambda x: time.sleep(0.001), 8) == 4
    assert choice.crossover("layer", slow_above(0), lambda x: time.sleep(0.001), 8) == 4
    name = f"crossover-layer-torch-{choice.torch_level()}-m{choice.MEASURED_BY}.txt"
    assert (own_machine_choices / name).read_text() == "4"


def test_choices_are_kept_per_torch_level(own_machine_choices, monkeypatch):
    """torch capped to AVX2 on an AVX-512 host (README) measures its own answers: a choice made
    with torch at full speed would hand forced-AVX2 runs torch's kernels where ours are faster."""

    def slow_above(n):
        return lambda x: time.sleep(0.002 if x.shape[0] > n else 0)

    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "AVX2")
    assert choice.crossover("level", slow_above(4), lambda x: time.sleep(0.001), 8) == 4
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    monkeypatch.delenv("MKL_ENABLE_INSTRUCTIONS")
    assert choice.crossover("level", slow_above(0), lambda x: time.sleep(0.001), 8) == 0
    assert len(list(own_machine_choices.glob("crossover-level-torch-*.txt"))) == 2


def nn_linear(k, n, weight=None, bias=None):
    layer = torch.nn.Linear(k, n, bias=bias is not None or weight is None)
    with torch.no_grad():
        if weight is not None:
            layer.weight.copy_(weight)
        if bias is not None and not isinstance(bias, bool):
            layer.bias.copy_(bias)
    return layer


def test_input_dimension_must_hold_whole_groups():
    with pytest.raises(ValueError, match="divisible by 32"):
        QuantizedLinear(torch.nn.Linear(48, 8), 4)


@pytest.mark.parametrize("kernel", list(Kernel), ids=[k.value for k in Kernel])
def test_quantize_swaps_tagged_layers_keeps_hooks_and_feeds_a_tied_embedding(kernel, monkeypatch):
    monkeypatch.setattr("shardline.kernels.quantized.kernel_for", lambda bits: kernel if bits == 8 else Kernel.TORCH)
    cfg = ModelConfig(
        architecture="llama",
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        max_position=64,
        tie_word_embeddings=True,
        eos_token_ids=[0],
    )
    model = Transformer(cfg).eval().requires_grad_(False)
    model.lm_head.weight = model.embed.weight
    calls = []
    model.layers[0].mlp.w2.register_forward_hook(lambda *_: calls.append(1))
    for block in model.layers:
        block.attn.wqkv.quant_bits = block.mlp.w13.quant_bits = block.mlp.w2.quant_bits = 4
    model.lm_head.quant_bits = 8
    table = model.embed.weight.clone()
    swap_quantized(model)
    assert model.layers[1].attn.wqkv.bits == 4 and model.layers[0].mlp.w2.bits == 4
    assert type(model.layers[0].attn.wo) is torch.nn.Linear  # untagged: left alone
    assert model.lm_head.bits == 8 and isinstance(model.embed, TiedEmbedding) and model.lm_head.kernel == kernel
    # what each layer holds is in its buffers (the shard's Info counts weight bytes from them)
    layers = [model.lm_head, *(b.attn.wqkv for b in model.layers)]
    held = {
        id(t): t.numel() * t.element_size() for layer in layers for t in layer._buffers.values()
    }  # own, not the copy's
    codes = 128 * 64 + sum(b.attn.wqkv.out_features * 64 // 2 for b in model.layers)  # int8 head + int4 qkv
    assert sum(held.values()) >= codes
    model.layers[0].mlp.w2(torch.randn(3, 128))
    assert calls == [1]
    tokens = torch.tensor([5, 0, 127])
    torch.testing.assert_close(model.embed(tokens), table[tokens], atol=table.abs().max().item() / 100, rtol=0)


@pytest.mark.parametrize("kernel", [Kernel.TORCH, Kernel.NATIVE])
@pytest.mark.parametrize("bits", [4, 8])
def test_a_layer_taller_than_a_slice_is_packed_slice_by_slice_into_the_same_operands(kernel, bits, monkeypatch):
    """Large layers are packed a slice of rows at a time (grid.rows_at_once), and the slices'
    operands stacked. Here a slice would be 80 rows of 64 weights: torch's int4 packing for the
    CPU interleaves blocks of 64 rows, so slices of 80 rows stacked multiplied the wrong weights
    (an 8B's FFN down projection, whose slices were 144 rows, and SmolLM2's every layer as two int4
    halves, answered noise)."""
    from shardline.kernels import grid

    if kernel is Kernel.NATIVE:
        assert native.available(), "Shardline's kernels did not build (the README's setup builds them)"
    torch.manual_seed(bits)
    codes = torch.randint(0, 16 if bits == 4 else 255, (224, 64), dtype=torch.int32)
    scale, lo = (torch.rand(224, 2) / 50).half().float(), (torch.randn(224, 2) / 10).half().float()
    make = torch_operands if kernel is Kernel.TORCH else native_operands
    whole = make(codes, scale, lo, bits)
    monkeypatch.setattr(grid, "WEIGHTS_AT_ONCE", 80 * 64)
    sliced = make(codes, scale, lo, bits)
    x = torch.randn(3, 64)
    torch.testing.assert_close(multiply(kernel, sliced, x), multiply(kernel, whole, x), rtol=0, atol=0)
