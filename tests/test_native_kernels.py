"""Shardline's CPU kernels (kernels/*.cpp) against the torch code they stand in for: decode
attention over pages (with q/k norms and rotation), the MLP's silu-and-multiply. The quantized
linear kernel is checked with the layers in test_quantized.py."""

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from shardline.kernels import native
from shardline.kernels.attention import AttentionBatch, paged_attention
from shardline.shard.config import ModelConfig
from shardline.shard.model import RMSNorm, Rotary


@pytest.fixture(autouse=True)
def built():
    """Loaded for every test here, whichever runs first or alone (`-k`)."""
    native.available()


def test_the_kernels_build_on_this_machine():
    """The README's setup needs a C++ compiler and builds the kernels; a machine where they do
    not build serves on torch's kernels, and that is a failure here, not a skip (the shard logs why)."""
    assert native.available(), f"Shardline's CPU kernels did not build into {native.build_folder()}"


@pytest.mark.processes
def test_a_build_lock_left_by_a_killed_process_does_not_stop_the_next_start():
    """torch's build lock is a file every other loader waits on until it is gone; one left by a
    process killed while loading (an OOM kill of a starting shard) must not hang every later start."""
    stale = native.build_folder() / "lock"
    stale.touch()
    try:
        loaded = subprocess.run(
            [sys.executable, "-c", "from shardline.kernels import native; print(native.available())"],
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        stale.unlink(missing_ok=True)
    assert loaded.stdout.strip() == "True", loaded.stderr[-2000:]


@pytest.fixture
def two_threads():
    """Two threads whatever the machine, so that a batch of one splits its context in two."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _torch_decode(qkv, cos_sin, norms, k_pages, v_pages, batch, heads, kv_heads, d, scale):
    x = qkv.view(-1, heads + 2 * kv_heads, d)
    q, k, v = x[:, :heads], x[:, heads : heads + kv_heads], x[:, heads + kv_heads :]
    if norms is not None:
        q, k = norms[0](q), norms[1](k)
    q, k = Rotary.apply(q, cos_sin), Rotary.apply(k, cos_sin)
    return paged_attention(q, k, v, k_pages, v_pages, batch, scale).reshape(len(qkv), heads * d)


@pytest.mark.parametrize("lens", [[1, 4, 5, 13, 30], [30], [3]], ids=["batch", "one-split", "one-page"])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("heads,kv_heads,qk_norm", [(4, 2, False), (6, 3, True), (2, 2, False)])
@pytest.mark.parametrize("d", [16, 80])
def test_paged_decode_matches_the_torch_path(heads, kv_heads, qk_norm, kv_dtype, lens, d, two_threads):
    """Contexts of one token, a full page, a page and one, several pages; a batch of one has its
    context split between threads (and one of a single page leaves a split empty). Heads of 16
    and of 80 values (the values are weighed 64 at a time, then the rest)."""
    torch.manual_seed(heads + kv_heads)
    page_size, num_pages = 4, 48
    lens = torch.tensor(lens)
    B = len(lens)
    tables = torch.randperm(num_pages - 1)[: B * 8].view(B, 8)  # scattered pages, wider than needed
    rotary = Rotary(ModelConfig("llama", 1, 1, 1, 1, 1, 1, head_dim=d, max_position=64))
    cos_sin = rotary.at(lens - 1, torch.float32)
    norms = None
    if qk_norm:
        norms = (RMSNorm(d, 1e-6), RMSNorm(d, 1e-6))
        for n in norms:
            n.weight.data = torch.rand(d) + 0.5
    qkv = torch.randn(B, (heads + 2 * kv_heads) * d)
    pools = [torch.randn(num_pages, page_size, kv_heads, d).to(kv_dtype) for _ in range(2)]
    batch = AttentionBatch.decode(tables, lens - 1, page_size)
    k_mine, v_mine = (p.clone() for p in pools)
    k_ref, v_ref = (p.clone() for p in pools)
    with torch.inference_mode():
        norm_args = (norms[0].weight, norms[1].weight, 1e-6) if qk_norm else (None, None, 0.0)
        got = native.ops().paged_decode(
            qkv,
            cos_sin[0],
            cos_sin[1],
            *norm_args,
            k_mine,
            v_mine,
            batch.slots,
            tables,
            batch.context_lens,
            heads,
            d**-0.5,
        )
        want = _torch_decode(qkv, cos_sin, norms, k_ref, v_ref, batch, heads, kv_heads, d, d**-0.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the new K/V written, only there; rotated K may differ by rounding, within one step of the pages' dtype
    tol = dict(rtol=1e-5, atol=1e-6) if kv_dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(k_mine, k_ref, **tol)
    torch.testing.assert_close(v_mine, v_ref, rtol=0, atol=0)
    changed = (k_mine != pools[0]).any(-1).any(-1).flatten().nonzero().squeeze(1)
    assert sorted(changed.tolist()) == sorted(batch.slots.tolist())


def test_paged_decode_rejects_a_qkv_width_that_disagrees_with_the_heads():
    k_pages = torch.zeros(4, 4, 2, 16)
    with pytest.raises(RuntimeError, match="qkv width"):
        native.ops().paged_decode(
            torch.zeros(1, 100),
            torch.zeros(1, 16),
            torch.zeros(1, 16),
            None,
            None,
            0.0,
            k_pages,
            k_pages.clone(),
            torch.tensor([0]),
            torch.tensor([[0]]),
            torch.tensor([1]),
            4,
            0.25,
        )


def test_paged_decode_of_no_rows_is_empty():
    """(It split each sequence's context by the thread count over the batch: a division by zero,
    SIGFPE, the process gone.)"""
    k_pages = torch.zeros(4, 4, 2, 16)
    out = native.ops().paged_decode(
        torch.zeros(0, 128),
        torch.zeros(0, 16),
        torch.zeros(0, 16),
        None,
        None,
        0.0,
        k_pages,
        k_pages.clone(),
        torch.zeros(0, dtype=torch.long),
        torch.zeros(0, 1, dtype=torch.long),
        torch.zeros(0, dtype=torch.long),
        4,
        0.25,
    )
    assert out.shape == (0, 64)


@pytest.mark.parametrize("rows", [1, 7])
def test_silu_mul_is_silu_of_the_gate_times_up(rows):
    x = torch.randn(rows, 2 * 96) * 4
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(native.ops().silu_mul(x), F.silu(gate) * up, rtol=1e-5, atol=1e-6)


def test_silu_mul_of_a_very_negative_gate_is_zero_not_nan():
    """exp(-gate) overflows fp32 below -88; built with -ffast-math, gate / inf was NaN (a random
    mixture's expert made it, weighted 1e-8 but NaN all the same)."""
    gate = torch.tensor([[-100.0, -1e4, -88.0, 50.0, 1e4, -3.0]])
    got = native.ops().silu_mul(torch.cat([gate, torch.full_like(gate, 2.0)], 1))
    torch.testing.assert_close(got, F.silu(gate) * 2, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bits", [4, 8])
def test_the_kernels_reject_records_of_another_width_or_shape(bits):
    from shardline.kernels.operands import native_operands

    (records,) = native_operands(torch.zeros(8, 64, dtype=torch.int32), torch.zeros(8, 2), torch.zeros(8, 2), bits)
    (other,) = native_operands(torch.zeros(8, 64, dtype=torch.int32), torch.zeros(8, 2), torch.zeros(8, 2), 12 - bits)
    op = native.ops().int4_linear if bits == 4 else native.ops().int8_linear
    linear = lambda x, r: op(x, r, 1 << 30, False)  # noqa: E731
    assert linear(torch.ones(1, 64), records).shape == (1, 8)
    for x, held in ((torch.zeros(1, 96), records), (torch.zeros(1, 64), other)):  # K of 96, or 8-bit records for 4
        with pytest.raises(RuntimeError, match="must be packed records"):
            linear(x, held)


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K", "int8"])
def test_several_layers_at_once_compute_what_each_does_alone(kind, two_threads):
    """record_linears (a mixture's experts, each on its own run of rows): five layers of five
    blocks of 8 outputs with rows 2, 0, 5, 1, 3 and 2 (none; more than a pass of 4 rows), so that
    the second thread's share begins inside a layer; each layer's rows as the layer alone makes
    them, bit for bit."""
    import numpy as np

    from shardline.kernels.operands import native_operands
    from tests.test_gguf_loader import _random_blocks

    rng, n, k = np.random.default_rng(5), 40, 512
    if kind == "int8":
        codes = [torch.randint(0, 255, (n, k), dtype=torch.int32) for _ in range(6)]
        layers = [native_operands(c, torch.rand(n, k // 32), torch.rand(n, k // 32), 8)[0] for c in codes]
        alone = native.ops().int8_linear
    else:
        pack = native.ops().q4_k_pack if kind == "Q4_K" else native.ops().q6_k_pack
        layers = [pack(torch.from_numpy(_random_blocks(kind, n, k, rng))) for _ in range(6)]
        alone = native.ops().q4_k_linear if kind == "Q4_K" else native.ops().int6_linear
    offsets = np.cumsum([0, 2, 0, 5, 1, 3, 2]).tolist()
    x = torch.randn(offsets[-1], k)
    together = native.ops().record_linears(x, layers, offsets)
    for e, layer in enumerate(layers):
        rows = slice(offsets[e], offsets[e + 1])
        assert torch.equal(together[rows], alone(x[rows], layer, 1 << 30, False)), e
    with pytest.raises(RuntimeError, match="must be x's rows"):
        native.ops().record_linears(x, layers, offsets[:-1] + [offsets[-1] - 1])


@pytest.mark.parametrize(
    "kernel,bits",
    [("torch", 4), ("torch", 8), ("native", 4), ("native+torch", 4), ("native", 8), ("native", 6), ("native", "4+6")],
)
def test_a_fused_decode_layer_computes_its_block(kernel, bits, monkeypatch, own_machine_choices):
    """Qwen3-like blocks (q/k norms, a qkv bias): the fused layer's output and K/V writes equal the
    block's own, for every kernel and width a layer may be loaded with; prefill and batches above
    the layers' dense-copy crossover run the block itself."""
    from shardline.kernels.operands import Kernel
    from shardline.kernels.quantized import QuantizedLinear
    from shardline.kernels.stacked import StackedLinear
    from shardline.shard.config import ModelConfig
    from shardline.shard.kv_cache import KVPages
    from shardline.shard.model import Transformer
    from shardline.shard.transforms import FusedDecodeBlock, fuse_decode, swap_quantized, use_native_ops

    monkeypatch.setattr("shardline.kernels.quantized.kernel_for", lambda b: Kernel(kernel.removesuffix("+torch")))
    if kernel.startswith("native"):  # not whatever this machine's timing says: torch's int4 kernel measured
        from shardline.kernels import quantized  # faster from 2 rows on (the batch's 3 take it), or never, and our

        measured = quantized.crossover  # direct kernel (int8 activations) for every batch of the test
        pinned = {
            "int4-torch": 1 if kernel == "native+torch" else 1 << 30,
            "int4-direct": 1 << 30,
            "int8-direct": 1 << 30,
            "int6-direct": 1 << 30,
        }

        def crossover(name, *args, **kw):
            rows = next((rows for prefix, rows in pinned.items() if name.startswith(prefix)), None)
            return measured(name, *args, **kw) if rows is None else rows

        monkeypatch.setattr(quantized, "crossover", crossover)
    torch.manual_seed(0)
    cfg = ModelConfig(
        architecture="qwen3",
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        max_position=64,
        tie_word_embeddings=False,
        eos_token_ids=[0],
        qkv_bias=True,
        qk_norm=True,
    )
    model = Transformer(cfg).eval().requires_grad_(False)
    for p in model.parameters():
        p.data = torch.randn_like(p) * 0.2 + (1.0 if p.dim() == 1 else 0.0)

    def q6_k(n, k, bias=None):  # Q6_K's blocks, as a GGUF holds them (kernels/int6_linear.cpp)
        codes, sc = torch.randint(0, 64, (n, k), dtype=torch.uint8), torch.randint(-60, 60, (n, k // 16))
        d = (torch.rand(n, k // 32) / 500).half().float()
        return QuantizedLinear.from_groups(codes, sc.to(torch.int8), d, 6, bias)

    for block in model.layers:
        for name in ("attn.wqkv", "attn.wo", "mlp.w13", "mlp.w2"):
            layer = block.get_submodule(name)
            parent, _, attr = name.rpartition(".")
            layer.quant_bits = 4 if bits == "4+6" else bits
            if bits == 6:
                setattr(block.get_submodule(parent), attr, q6_k(*layer.weight.shape, layer.bias))
            elif bits == "4+6" and attr == "wqkv":  # Q and K 4-bit, V Q6_K's (a Q4_K_M file's, in half its layers)
                qk = torch.nn.Linear(64, 96, bias=False)
                qk.weight.data = layer.weight[:96]
                parts = [QuantizedLinear(qk, 4), q6_k(32, 64)]
                setattr(block.get_submodule(parent), attr, StackedLinear(parts, layer.bias))
    swap_quantized(model)
    use_native_ops(model)  # as prepare does before fusing
    blocks = list(model.layers)
    assert fuse_decode(model) == 2 and all(isinstance(b, FusedDecodeBlock) for b in model.layers)

    kv = KVPages(cfg, 16, 4, torch.float32, torch.device("cpu"))
    lens = torch.tensor([3, 9, 1])
    tables = torch.tensor([[0, 1, 2], [3, 4, 5], [6, 7, 8]])
    batch = AttentionBatch.decode(tables, lens - 1, 4)
    x = torch.randn(3, 64)
    cos_sin = model.rotary.at(lens - 1, torch.float32)
    with torch.inference_mode():
        for fused, block, pages in zip(model.layers, blocks, kv.layers):
            before = [p.clone() for p in pages]
            want = block(x, cos_sin, *pages, batch)
            written = [p.clone() for p in pages]
            for p, b in zip(pages, before):
                p.copy_(b)
            got = fused(x, cos_sin, *pages, batch)
            # Shardline's int4 kernel rounds the activations to int8 (parts in 10^2 of a group's
            # largest); the fused and the block's norms differ in the last fp32 bit, which moves
            # some roundings: parts in 10^4 of the layer's output after four layers of it, and of
            # the K/V it writes after one.
            close = 1e-3 if (kernel, bits) in (("native", 4), ("native", "4+6")) else 1e-4
            if kernel == "native+torch":
                assert all(
                    layer.torch_rows == 1 and layer.torch_operands
                    for layer in (block.attn.wqkv, block.attn.wo, block.mlp.w13, block.mlp.w2)
                )
            torch.testing.assert_close(got, want, rtol=close, atol=close * want.abs().max().item())
            for p, w in zip(pages, written):
                kv_close = close if (kernel, bits) in (("native", 4), ("native", "4+6")) else 1e-5
                torch.testing.assert_close(p, w, rtol=kv_close, atol=kv_close * w.abs().max().item())
        fused = model.layers[0]
        fused.max_rows = 2  # above the crossover: the block itself, bit for bit
        torch.testing.assert_close(
            fused(x, cos_sin, *kv.layers[0], batch), blocks[0](x, cos_sin, *kv.layers[0], batch), rtol=0, atol=0
        )
