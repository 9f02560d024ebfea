"""A mixture's quantized GGUF read straight into the serving layout (shard/gguf_loader.py): each
expert's rows of the 3-D Q4_K and Q6_K tensors become a layer holding exactly their blocks' weights,
a TP rank reads its units of every expert, the native model computes what the dequantized one
does, what a start keeps serves the same, and the footprint counts the experts at their width."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter

from shardline.common.model_source import resolve_model
from shardline.shard import served_cache
from shardline.shard.footprint import describe, shard_footprint
from shardline.shard.gguf_loader import GgufLoader
from shardline.shard.layout import Layout
from shardline.shard.load import weight_bytes
from shardline.shard.model import MLP, MoE
from shardline.shard.weights import build_model
from tests.test_gguf_loader import (  # noqa: F401
    _close,
    _no_cache_left_behind,
    _our_kernel_at_every_row_count,  # noqa: F401  (autouse here too)
    _random_blocks,
    _served,
    prefill_logits,
    written,
)

HIDDEN, EXPERT_UNITS, DENSE_UNITS, EXPERTS, HEADS, KV_HEADS, VOCAB = 256, 512, 256, 4, 4, 2, 320
DENSE_LAYER = 1  # no router in the file: a dense MLP


def _quantized(writer, name: str, kind: str, shape: tuple[int, ...], rng) -> None:
    """Random `kind` blocks of a tensor `shape` (numpy order: experts, rows, columns)."""
    *outer, k = shape
    blocks = _random_blocks(kind, int(np.prod(outer)), k, rng)
    writer.add_tensor(name, blocks.reshape(*outer, -1), raw_dtype=GGMLQuantizationType[kind])


def write_moe_gguf(path, shared: bool = False):
    """A Qwen3-MoE of random blocks, its middle layer dense; `shared`: a Qwen2-MoE's shared expert
    in its sparse layers (and its unnormalized weights)."""
    rng = np.random.default_rng(3)
    hd = HIDDEN // HEADS
    writer = GGUFWriter(str(path), "qwen2moe" if shared else "qwen3moe")
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(DENSE_UNITS)
    writer.add_block_count(3)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_expert_count(EXPERTS)
    writer.add_expert_used_count(2)
    writer.add_expert_feed_forward_length(EXPERT_UNITS)
    if shared:
        writer.add_expert_shared_feed_forward_length(DENSE_UNITS)
    writer.add_token_list([f"t{i}" for i in range(VOCAB)])
    writer.add_tensor("output_norm.weight", rng.uniform(0.5, 1.5, HIDDEN).astype(np.float32))
    _quantized(writer, "token_embd.weight", "Q8_0", (VOCAB, HIDDEN), rng)
    _quantized(writer, "output.weight", "Q6_K", (VOCAB, HIDDEN), rng)
    for i in range(3):
        p = f"blk.{i}."
        for norm, size in (("attn_norm", HIDDEN), ("ffn_norm", HIDDEN), ("attn_q_norm", hd), ("attn_k_norm", hd)):
            writer.add_tensor(p + norm + ".weight", rng.uniform(0.5, 1.5, size).astype(np.float32))
        for part, n in (("attn_q", HEADS * hd), ("attn_k", KV_HEADS * hd), ("attn_v", KV_HEADS * hd)):
            _quantized(writer, p + part + ".weight", "Q8_0", (n, HIDDEN), rng)
        _quantized(writer, p + "attn_output.weight", "Q8_0", (HIDDEN, HEADS * hd), rng)
        if i == DENSE_LAYER:
            _quantized(writer, p + "ffn_gate.weight", "Q4_K", (DENSE_UNITS, HIDDEN), rng)
            _quantized(writer, p + "ffn_up.weight", "Q4_K", (DENSE_UNITS, HIDDEN), rng)
            _quantized(writer, p + "ffn_down.weight", "Q6_K", (HIDDEN, DENSE_UNITS), rng)
            continue
        # small scores: softmax weights far from one-hot, so their renormalization shows
        writer.add_tensor(p + "ffn_gate_inp.weight", (rng.standard_normal((EXPERTS, HIDDEN)) * 0.01).astype(np.float32))
        _quantized(writer, p + "ffn_gate_exps.weight", "Q4_K", (EXPERTS, EXPERT_UNITS, HIDDEN), rng)
        _quantized(writer, p + "ffn_up_exps.weight", "Q4_K", (EXPERTS, EXPERT_UNITS, HIDDEN), rng)
        _quantized(writer, p + "ffn_down_exps.weight", "Q6_K", (EXPERTS, HIDDEN, EXPERT_UNITS), rng)
        if shared:
            _quantized(writer, p + "ffn_gate_shexp.weight", "Q4_K", (DENSE_UNITS, HIDDEN), rng)
            _quantized(writer, p + "ffn_up_shexp.weight", "Q4_K", (DENSE_UNITS, HIDDEN), rng)
            _quantized(writer, p + "ffn_down_shexp.weight", "Q6_K", (HIDDEN, DENSE_UNITS), rng)
            writer.add_tensor(p + "ffn_gate_inp_shexp.weight", rng.standard_normal(HIDDEN).astype(np.float32))
    return written(writer, path)


def _expert_reference(path, name: str, expert: int) -> torch.Tensor:
    """An expert's weights [rows, columns] as the gguf package dequantizes the file's tensor."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    t = next(t for t in GGUFReader(str(path)).tensors if t.name == name)
    w = dequantize(t.data, t.tensor_type).reshape(tuple(int(d) for d in reversed(t.shape)))
    return torch.from_numpy(np.ascontiguousarray(w[expert]))


@pytest.fixture(scope="module")
def moe_gguf(tmp_path_factory):
    return write_moe_gguf(tmp_path_factory.mktemp("moe_gguf") / "moe.gguf")


def _load(path, layout=Layout(), dense_copy=False):
    return GgufLoader(describe(resolve_model(str(path))), layout, torch.float32, dense_copy=dense_copy).load()


def test_each_expert_serves_the_weights_its_blocks_hold_and_a_tp_rank_its_units(moe_gguf):
    model = _load(moe_gguf)
    ranks = [_load(moe_gguf, Layout(tp=2, tp_rank=r)) for r in (0, 1)]
    assert isinstance(model.layers[DENSE_LAYER].mlp, MLP) and model.cfg.dense_layers == [DENSE_LAYER]
    for i in (0, 2):
        moe = model.layers[i].mlp
        assert isinstance(moe, MoE) and moe.top_k == 2 and len(moe.experts) == EXPERTS
        for e, expert in enumerate(moe.experts):
            gate_up = [_expert_reference(moe_gguf, f"blk.{i}.ffn_{k}_exps.weight", e) for k in ("gate", "up")]
            assert _close(_served(expert.w13), torch.cat(gate_up)), (i, e)
            assert _close(_served(expert.w2), _expert_reference(moe_gguf, f"blk.{i}.ffn_down_exps.weight", e))
            halves = [r.layers[i].mlp.experts[e] for r in ranks]
            gate, up = _served(expert.w13).split(EXPERT_UNITS)
            by_rank = [_served(h.w13).split(EXPERT_UNITS // 2) for h in halves]
            assert torch.equal(torch.cat([g for g, _ in by_rank]), gate) and torch.equal(
                torch.cat([u for _, u in by_rank]), up
            )
            assert torch.equal(torch.cat([_served(h.w2) for h in halves], 1), _served(expert.w2))


def test_the_native_mixture_computes_what_the_dequantized_one_does_and_keeps_it(moe_gguf, tmp_path):
    source = resolve_model(str(moe_gguf))
    native = _load(moe_gguf, dense_copy=True)
    served_cache.save(native, tmp_path / "kept.pt")
    kept = served_cache.load(native.cfg, Layout(), torch.float32, tmp_path / "kept.pt")
    dense = build_model(source, torch.float32, torch.device("cpu"))
    tokens = torch.tensor([1, 5, 9, 40, 100, 7, 300, 2])
    outs = [prefill_logits(model, tokens) for model in (native, kept, dense)]
    assert torch.equal(outs[0], outs[1])  # what a later start maps serves the same, to the bit
    cos = torch.nn.functional.cosine_similarity(outs[0].flatten(), outs[2].flatten(), dim=0)
    assert cos > 0.999, cos


def test_the_footprint_counts_experts_at_the_width_they_are_served(moe_gguf):
    description = describe(resolve_model(str(moe_gguf)))
    cfg, tensors = description.cfg, description.tensors
    footprint = shard_footprint(
        cfg,
        tensors,
        tp=1,
        pp=1,
        tp_rank=0,
        pp_stage=0,
        dtype="float32",
        weights="native",
        quantize="none",
        dense_copy=False,
        kv_memory_gb=0.0,
        max_batch=1,
        streamed=True,
    )
    held = weight_bytes(_load(moe_gguf))
    assert 0.8 < footprint.weights / held < 1.25, (footprint.weights, held)


@pytest.mark.parametrize("shared", [False, True])
def test_a_sparse_layer_decodes_as_one_operator_as_its_modules_do(tmp_path, shared):
    """kernels/decode_layer.cpp's mixture (routing, each picked expert once on its rows, the shared
    expert) against the layer's modules, on decode steps of 1 and 6 rows."""
    from shardline.kernels import native
    from shardline.kernels.attention import AttentionBatch
    from shardline.shard.kv_cache import KVPages
    from shardline.shard.transforms import FusedDecodeBlock, finish

    assert native.available(), "Shardline's kernels did not build (the README's setup builds them)"
    model = _load(write_moe_gguf(tmp_path / "moe.gguf", shared=shared))
    finish(model, Layout(), None, torch.device("cpu"), onednn=False)
    layer = model.layers[0]
    assert isinstance(layer, FusedDecodeBlock) and isinstance(layer.block.mlp, MoE)
    assert (layer.block.mlp.shared is not None) == shared and layer.block.mlp.norm_topk_prob == (not shared)
    kv = KVPages(model.cfg, 8, 16, torch.float32, torch.device("cpu"))
    for rows in (1, 6):
        positions = torch.zeros(rows, dtype=torch.long)  # each row its own page, its only token
        batch = AttentionBatch.decode(torch.arange(rows)[:, None], positions, 16)
        x = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(rows))
        with torch.inference_mode():
            cos_sin = model.rotary.at(positions, torch.float32)
            fused = layer(x, cos_sin, *kv.layers[0], batch)
            modules = layer.block(x, cos_sin, *kv.layers[0], batch)
        # the fused norms differ from torch's in the last fp32 bit, which moves some of the int4
        # kernel's roundings of activations (tests/test_native_kernels.py): parts in 10^4
        torch.testing.assert_close(fused, modules, rtol=1e-3, atol=1e-3 * modules.abs().max().item())
