"""A GGUF read straight into the serving layout (shard/gguf_loader.py, kernels/gguf_groups.py):
blocks of each type become the groups the `gguf` package dequantizes them to, a model of mixed
types is served with those weights, wired as the dense loader wires them, and a TP rank or a
pipeline stage reads its own slice."""

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize

from shardline.common.model_source import resolve_model
from shardline.kernels.gguf_groups import dequantized, groups_of
from shardline.kernels.grid import grid_weights
from shardline.kernels.quantized import QuantizedLinear
from shardline.kernels.stacked import StackedLinear
from shardline.shard.footprint import describe
from shardline.shard.gguf_loader import GgufLoader
from shardline.shard.layout import Layout
from shardline.shard.load import weight_formats
from shardline.shard.weights import build_model, unpermute_rope

HIDDEN, INTER, HEADS, KV_HEADS, VOCAB = 256, 512, 4, 2, 320
# (layer, part) -> type: every path the loader takes (int4 from 4-bit blocks, int8 from Q8_0,
# Q4_K's and Q6_K's own blocks, a fused layer of both as parts of each, a fused layer of Q8_0 and
# Q6_K in int8 with its Q6_K part rounded to it, a dense F16 layer)
TYPES = {
    (0, "attn_q"): "Q4_K", (0, "attn_k"): "Q4_K", (0, "attn_v"): "Q6_K", (0, "attn_output"): "Q4_0",
    (0, "ffn_gate"): "Q4_1", (0, "ffn_up"): "Q4_1", (0, "ffn_down"): "Q8_0",
    (1, "attn_q"): "Q8_0", (1, "attn_k"): "Q8_0", (1, "attn_v"): "Q6_K", (1, "attn_output"): "F16",
    (1, "ffn_gate"): "Q4_K", (1, "ffn_up"): "Q4_K", (1, "ffn_down"): "Q6_K",
}  # fmt: skip


_WRITTEN = []  # cache folders of the GGUFs written here: what the loaders keep of them goes after the tests


@pytest.fixture(scope="module", autouse=True)
def _no_cache_left_behind():
    import shutil

    yield
    for folder in _WRITTEN:
        shutil.rmtree(folder, ignore_errors=True)
    _WRITTEN.clear()


@pytest.fixture(autouse=True)
def _our_kernel_at_every_row_count(monkeypatch):
    """Layers keep Shardline's operands whatever torch's int4 kernel measured on this machine (a
    layer where torch's won at every row count keeps only torch's, which computes in bf16): what
    these tests compare is what the loader read, not which kernel the machine chose."""
    from shardline.kernels import quantized
    from shardline.kernels.choice import ALWAYS

    def crossover(key, *args, **kwargs):  # keyed "<record format>-torch-<shape>": int4, q4_k
        return ALWAYS if key.split("-")[1] == "torch" else measured(key, *args, **kwargs)

    measured = quantized.crossover
    monkeypatch.setattr(quantized, "crossover", crossover)


def _random_blocks(kind: str, n: int, k: int, rng) -> np.ndarray:
    """Random bytes of `kind` blocks with finite fp16 scales: any such bytes are valid blocks."""
    weights, size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    blocks = rng.integers(0, 256, size=(n, k // weights, size), dtype=np.uint8)
    scales = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0], "Q6_K": [208]}.get(kind, [0, 2])
    for at in scales:
        d = rng.uniform(0.001, 0.02, size=blocks.shape[:2]).astype(np.float16)
        if kind in ("Q4_K", "Q5_K"):  # powers of two, so that fp16 holds their products with the 6-bit scales
            d = (2.0 ** -rng.integers(6, 10, size=blocks.shape[:2])).astype(np.float16)
        blocks[..., at : at + 2] = d.view(np.uint8).reshape(*blocks.shape[:2], 2)
    if kind == "Q8_0":
        q = blocks[..., 2:34].view(np.int8)
        q[q == -128] = -127
    return blocks.reshape(n, -1)


def _tensor(writer, name: str, kind: str, n: int, k: int, rng) -> None:
    if kind == "F16":
        writer.add_tensor(name, (rng.standard_normal((n, k)) * 0.05).astype(np.float16))
    else:
        writer.add_tensor(name, _random_blocks(kind, n, k, rng), raw_dtype=GGMLQuantizationType[kind])


def write_gguf(
    path,
    tied: bool,
    embed: str = "Q4_K",
    head: str = "Q6_K",
    seed: int = 0,
    shape: tuple[int, int, int, int, int, int] = (HIDDEN, INTER, 2, HEADS, KV_HEADS, VOCAB),
    types=lambda layer, part: TYPES[layer, part],
):
    """A llama GGUF of random blocks: `shape` is (hidden, intermediate, layers, heads, KV heads,
    vocabulary), `types(layer, part)` each linear layer's type."""
    hidden, inter, layers, heads, kv_heads, vocab = shape
    rng = np.random.default_rng(seed)
    hd = hidden // heads
    writer = GGUFWriter(str(path), "llama")
    for add, value in (
        ("add_context_length", 256),
        ("add_embedding_length", hidden),
        ("add_feed_forward_length", inter),
        ("add_block_count", layers),
        ("add_head_count", heads),
        ("add_head_count_kv", kv_heads),
        ("add_layer_norm_rms_eps", 1e-5),
        ("add_rope_freq_base", 10000.0),
    ):
        getattr(writer, add)(value)
    writer.add_token_list([f"t{i}" for i in range(vocab)])
    writer.add_tensor("output_norm.weight", rng.uniform(0.5, 1.5, hidden).astype(np.float32))
    _tensor(writer, "token_embd.weight", embed, vocab, hidden, rng)
    if not tied:
        _tensor(writer, "output.weight", head, vocab, hidden, rng)
    shapes = {
        "attn_q": (heads * hd, hidden),
        "attn_k": (kv_heads * hd, hidden),
        "attn_v": (kv_heads * hd, hidden),
        "attn_output": (hidden, heads * hd),
        "ffn_gate": (inter, hidden),
        "ffn_up": (inter, hidden),
        "ffn_down": (hidden, inter),
    }
    for i in range(layers):
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{norm}.weight", rng.uniform(0.5, 1.5, hidden).astype(np.float32))
        for part, (n, k) in shapes.items():
            _tensor(writer, f"blk.{i}.{part}.weight", types(i, part), n, k, rng)
    return written(writer, path)


def written(writer, path):
    """Writes the file out; what the loaders keep of it goes after this module's tests."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    _WRITTEN.append(resolve_model(str(path)).cache_dir)
    return path


ONE_SCALE = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"]  # the gguf package quantizes to these itself


@pytest.mark.parametrize(
    "kind, written_by",
    [(k, "gguf") for k in [*ONE_SCALE, "MXFP4"]] + [(k, "random") for k in [*ONE_SCALE, "Q4_K", "Q5_K"]],
)
def test_blocks_become_the_groups_the_gguf_package_dequantizes_them_to(kind, written_by):
    rng = np.random.default_rng(1)
    k = 512
    if written_by == "gguf":
        raw = quantize(rng.standard_normal((16, k)).astype(np.float32) * 0.1, GGMLQuantizationType[kind])
    else:
        raw = _random_blocks(kind, 16, k, rng)
    codes, scale, lo = groups_of(kind, raw)
    want = dequantize(raw, GGMLQuantizationType[kind]).reshape(16, k)
    assert torch.equal(grid_weights(codes.double(), scale.double(), lo.double()), torch.from_numpy(want).double())
    assert codes.min() >= 0 and codes.max() <= {"Q4": 15, "Q5": 31, "Q8": 254, "MX": 254}[kind[:2]]


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
def test_blocks_packed_at_once_are_the_weights_the_gguf_package_dequantizes_them_to(kind):
    """Q4_K and Q6_K blocks straight into the 4- and 6-bit kernels' records (no groups between),
    17 rows padded to 24 with zero weights: their rows are the file's weights, to the bit."""
    from shardline.kernels import native

    assert native.available(), "Shardline's kernels did not build (the README's setup builds them)"
    raw = _random_blocks(kind, 17, 512, np.random.default_rng(2))
    want = torch.from_numpy(dequantize(raw, GGMLQuantizationType[kind]).reshape(17, 512))
    records = getattr(native.ops(), kind.lower() + "_pack")(torch.from_numpy(raw))
    rows = native.ops().record_rows(records, torch.arange(24))
    assert torch.equal(rows[:17], want) and not rows[17:].any()


def _served(layer) -> torch.Tensor:
    """The weights a layer holds, [N, K]: its answers to the unit rows through its quantized
    kernel straight from the codes (which of the dense copy, torch's kernel or the GEMM path would
    serve a step of this many rows is measured per machine and shape; their bf16 rounds)."""
    if isinstance(layer, StackedLinear):  # its parts' outputs side by side
        return torch.cat([_served(part) for part in layer.parts])
    eye = torch.eye(layer.in_features)
    with torch.inference_mode():
        if isinstance(layer, QuantizedLinear):  # its own direct kernel at any rows
            layer.max_rows = layer.torch_rows = layer.direct_rows = 1 << 30
            out = layer(eye)
        else:
            out = eye @ layer.weight.float().t()
    return (out - (layer.bias if layer.bias is not None else 0)).t()


def _reference(path, name: str) -> torch.Tensor:
    from gguf import GGUFReader

    t = next(t for t in GGUFReader(str(path)).tensors if t.name == name)
    w = dequantized(t.tensor_type.name, t.data, int(t.shape[0])).numpy()
    if name.endswith("attn_q.weight"):
        w = unpermute_rope(w, HEADS)
    elif name.endswith("attn_k.weight"):
        w = unpermute_rope(w, KV_HEADS)
    return torch.from_numpy(np.ascontiguousarray(w))


def _close(got: torch.Tensor, want: torch.Tensor, rounded: bool = False) -> bool:
    """Equal up to what the served width rounds: nothing where the type is served at its own
    width (the kernels compute in fp32; the Q4_K blocks here have scales whose products fp16
    holds, which the records keep in), or `rounded`: a Q6_K value rounded to an 8-bit grid."""
    tol = (1 / 254 if rounded else 1e-5) * want.abs().max().item()
    return (got - want).abs().max().item() <= tol


@pytest.fixture(scope="module")
def untied(tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp("gguf") / "mixed.gguf", tied=False)


def test_each_layer_serves_the_weights_its_blocks_hold(untied):
    model = GgufLoader(describe(resolve_model(str(untied))), Layout(), torch.float32, dense_copy=False).load()
    for i, block in enumerate(model.layers):
        parts = {
            "attn.wqkv": ["attn_q", "attn_k", "attn_v"],
            "attn.wo": ["attn_output"],
            "mlp.w13": ["ffn_gate", "ffn_up"],
            "mlp.w2": ["ffn_down"],
        }
        for module, names in parts.items():
            served = _served(block.get_submodule(module))
            want = torch.cat([_reference(untied, f"blk.{i}.{n}.weight") for n in names])
            kinds = {TYPES[i, n] for n in names}
            assert _close(served, want, rounded="Q6_K" in kinds and not kinds <= {"Q4_K", "Q6_K"}), (i, module)
    assert isinstance(model.layers[0].attn.wqkv, StackedLinear)  # Q4_K and Q6_K parts, each at its width
    assert _close(_served(model.lm_head), _reference(untied, "output.weight"))
    tokens = torch.tensor([0, 7, VOCAB - 1])
    assert _close(model.embed(tokens), _reference(untied, "token_embd.weight")[tokens])
    # and the shard can say how it holds each (its startup log, Info: the last layer's)
    formats = weight_formats(model)
    assert formats["embed"] == "int8 g32 rows" and formats["w13"].startswith("Q4_K blocks g32 (100% of groups exact)")
    assert formats["w2"].startswith("int6") and formats["lm_head"].startswith("int6 (Q6_K blocks) g32 (100% of groups")


@pytest.mark.parametrize("embed", ["Q8_0", "Q4_K", "Q6_K"])
def test_a_tied_model_serves_its_lm_head_from_the_embeddings_blocks(tmp_path, embed):
    path = write_gguf(tmp_path / "tied.gguf", tied=True, embed=embed)
    model = GgufLoader(describe(resolve_model(str(path))), Layout(), torch.float32, dense_copy=False).load()
    want = _reference(path, "token_embd.weight")
    assert _close(_served(model.lm_head), want)
    tokens = torch.tensor([3, VOCAB - 2])
    assert _close(model.embed(tokens), want[tokens])
    assert model.embed.table is model.lm_head  # the head's records serve the lookups too


def prefill_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    """The model's logits at every position of one sequence of up to 16 tokens, from fresh pages."""
    from shardline.kernels.attention import AttentionBatch
    from shardline.shard.kv_cache import KVPages

    kv = KVPages(model.cfg, 4, 16, torch.float32, torch.device("cpu"))
    batch = AttentionBatch(
        slots=torch.arange(len(tokens)),
        is_decode=False,
        query_lens=[len(tokens)],
        start_positions=[0],
        block_tables_list=[torch.tensor([0])],
    )
    with torch.inference_mode():
        return model.logits(model(tokens, torch.arange(len(tokens)), kv.layers, batch))


def test_the_native_model_computes_what_the_dequantized_one_does(untied):
    """The same file through both loaders: wired alike (unpermuted Q/K, fused order, norms)."""
    source = resolve_model(str(untied))
    native = GgufLoader(describe(source), Layout(), torch.float32, dense_copy=False).load()
    dense = build_model(source, torch.float32, torch.device("cpu"))
    tokens = torch.tensor([1, 5, 9, 40, 100])
    outs = [prefill_logits(model, tokens) for model in (native, dense)]
    cos = torch.nn.functional.cosine_similarity(outs[0].flatten(), outs[1].flatten(), dim=0)
    assert cos > 0.999, cos


def test_a_tp_rank_reads_its_rows_and_columns_and_a_stage_its_layers(untied):
    model = describe(resolve_model(str(untied)))
    whole = GgufLoader(model, Layout(), torch.float32, dense_copy=False).load()
    ranks = [GgufLoader(model, Layout(tp=2, tp_rank=r), torch.float32, dense_copy=False).load() for r in (0, 1)]
    hd = HIDDEN // HEADS
    for i in range(2):
        full = _served(whole.layers[i].attn.wqkv)
        q, k, v = full.split([HEADS * hd, KV_HEADS * hd, KV_HEADS * hd])
        halves = [
            _served(r.layers[i].attn.wqkv).split([HEADS * hd // 2, KV_HEADS * hd // 2, KV_HEADS * hd // 2])
            for r in ranks
        ]
        for whole_part, parts in zip((q, k, v), zip(*halves)):
            assert torch.allclose(torch.cat(parts), whole_part, atol=1e-6)
        assert torch.allclose(
            torch.cat([_served(r.layers[i].mlp.w2) for r in ranks], 1), _served(whole.layers[i].mlp.w2), atol=1e-6
        )
        assert torch.allclose(
            torch.cat([_served(r.layers[i].attn.wo) for r in ranks], 1), _served(whole.layers[i].attn.wo), atol=1e-6
        )
    assert ranks[0].lm_head is not None and ranks[1].lm_head is None  # the head sits with the sampler
    stages = [GgufLoader(model, Layout(pp=2, pp_stage=s), torch.float32, dense_copy=False).load() for s in (0, 1)]
    assert len(stages[0].layers) == len(stages[1].layers) == 1
    assert stages[0].embed is not None and stages[0].lm_head is None and stages[1].embed is None
    assert torch.equal(_served(stages[1].layers[0].mlp.w13), _served(whole.layers[1].mlp.w13))


@pytest.mark.parametrize("tied", [False, True])
def test_kept_weights_serve_what_was_read_without_reading_the_file_again(tmp_path, tied):
    """shard/served_cache.py: what a later start maps is what the first made (records, the
    measured row counts, the embedding the LM head serves), the same to the bit."""
    from shardline.shard import served_cache

    path = write_gguf(tmp_path / "model.gguf", tied=tied, embed="Q8_0" if tied else "Q4_K")
    source = resolve_model(str(path))
    made = GgufLoader(describe(source), Layout(), torch.float32, dense_copy=True).load()
    served_cache.save(made, tmp_path / "kept.pt")
    path.unlink()  # nothing is read from the GGUF any more
    kept = served_cache.load(made.cfg, Layout(), torch.float32, tmp_path / "kept.pt")
    for name, module in made.named_modules():
        if isinstance(module, (QuantizedLinear, torch.nn.Linear)):
            other = kept.get_submodule(name)
            assert type(other) is type(module), name
            if isinstance(module, QuantizedLinear):  # before `_served` sets them
                rows = lambda layer: (layer.max_rows, layer.direct_rows, layer.torch_rows)  # noqa: E731
                assert rows(other) == rows(module) and (other.dense is None) == (module.dense is None), name
            assert torch.equal(_served(other), _served(module)), name
    tokens = torch.tensor([0, 11, VOCAB - 1])
    assert torch.equal(kept.embed(tokens), made.embed(tokens))
    assert (type(kept.embed) is type(made.embed)) and (not tied or kept.embed.table is kept.lm_head)


@pytest.mark.processes
def test_a_first_start_keeps_what_it_serves_for_the_next(tmp_path):
    """A shard serves the weights it made and, once warm, writes them for later starts in the
    background (shard/served_cache.py), finishing before it exits when stopped meanwhile; the
    next start maps them and answers the same."""
    import shutil

    from harness.serve import Server
    from shardline.protos import generation_pb2 as pb

    copy = tmp_path / "SmolLM2.gguf"  # a file of its own: nothing kept of it yet
    shutil.copy(resolve_model(None).path, copy)
    folder = resolve_model(str(copy)).cache_dir
    _WRITTEN.append(folder)
    answers = []
    for start in ("first", "second"):
        server = Server("--model", str(copy))
        try:
            request = dict(prompt="The capital of", max_new_tokens=8, ignore_eos=True)
            answers.append(server.generate(**request, sampling=pb.SamplingParams(temperature=0))[0])
        finally:  # stopped at once: the writer may still be at it
            assert server.stop() == 0
        assert len(list(folder.glob("served-*.pt"))) == 1 and not list(folder.glob(".served-*")), start
    assert answers[0] == answers[1] and len(answers[0]) == 8


def test_the_header_reader_reads_what_the_gguf_package_does(untied):
    """shardline's header reader (common/gguf_header.py) against `gguf`'s GGUFReader: every
    metadata value (a string array as its length), and each tensor's shape, type and offset."""
    from gguf import GGMLQuantizationType, GGUFReader

    from shardline.common.gguf_header import GGML_TYPES, Strings, read_header

    header, reader = read_header(untied), GGUFReader(str(untied))
    fields = {k: f for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert set(header.metadata) == set(fields)
    for key, field in fields.items():
        ours = header.metadata[key]
        if isinstance(ours, Strings):
            assert len(ours) == len(field.data) > 0, key
        elif isinstance(ours, str):
            assert ours == field.contents(), key
        else:  # numbers and arrays of them (floats as float32 holds them: the same either way)
            assert ours == pytest.approx(field.contents(), rel=1e-7), key
    assert [(t.name, list(t.shape), t.ggml_type, t.kind, t.offset) for t in header.tensors] == [
        (t.name, [int(d) for d in t.shape], int(t.tensor_type), t.tensor_type.name, int(t.data_offset))
        for t in reader.tensors
    ]
    assert GGML_TYPES == {t.value: t.name for t in GGMLQuantizationType}  # every type, not just these
    vocabulary = read_header(untied, strings=("tokenizer.ggml.tokens",)).metadata["tokenizer.ggml.tokens"]
    assert vocabulary == fields["tokenizer.ggml.tokens"].contents()  # a string array read in full
