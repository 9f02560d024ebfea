"""Tensor and pipeline parallel replicas: real shard processes joined by torch.distributed (gloo)."""

import random

import pytest
import torch

from shardline.protos import generation_pb2 as pb
from tests.support import (
    Server,
    assert_constrained_match,
    assert_greedy_match,
    assert_serves_like_reference,
    hf_constrained_greedy,
    hf_greedy,
    hf_model,
    smollm2_hf_model,
    smollm2_tokenizer,
)

PAGE = 16


# With the cache on, every prompt's first round is computed cold and its second from cached
# pages: both paths. One layout runs with the cache off as well.
@pytest.mark.processes
@pytest.mark.parametrize(
    "arch,tp,pp,chunk,cache",
    [
        ("qwen3", 2, 1, 7, "on"),  # one KV head, two ranks: the KV head is replicated
        ("qwen3", 2, 1, 7, "off"),
        ("llama", 1, 2, 0, "on"),
        ("qwen2", 2, 2, 64, "on"),
    ],
)
def test_tiny_parallel_layouts_match_transformers(tiny_models, arch, tp, pp, chunk, cache):
    ref = hf_model(tiny_models[arch])
    rng = random.Random(tp * 10 + pp)
    prompts = [[rng.randrange(ref.config.vocab_size) for _ in range(n)] for n in (5, 70, 300)]
    wants = [hf_greedy(ref, p, 10) for p in prompts]
    server = Server(
        "--model",
        str(tiny_models[arch]),
        "--page-size",
        str(PAGE),
        "--tp",
        str(tp),
        "--pp",
        str(pp),
        "--threads",
        "1",
        "--chunk-size",
        str(chunk),
        "--prefix-cache",
        cache,
    )
    try:
        info = server.stub.Info(pb.InfoRequest())
        assert (info.tensor_parallel, info.pipeline_parallel) == (tp, pp)
        assert info.kv_dtype == "float32"  # auto: dense weights keep the serving dtype, exact
        assert_serves_like_reference(server, prompts, wants, cache)
        # Constrained decoding: the mask reaches the sampling rank of the last stage.
        req = pb.GenerateRequest(
            prompt_token_ids=pb.PromptTokens(ids=prompts[1]), max_new_tokens=16, regex="[a-z]{3}-[0-9]{2,9}"
        )
        got = server.generate(**{f.name: v for f, v in req.ListFields()})[0]
        assert_constrained_match(got, hf_constrained_greedy(ref, prompts[1], req, 16))
    finally:
        assert server.stop() == 0


@pytest.fixture(scope="module")
def smollm2_reference():
    ids = smollm2_tokenizer().encode(
        " ".join(f"Fact {i}: water boils at {90 + i} degrees on mountain {i}." for i in range(20)),
        add_special_tokens=False,
    )
    return ids, hf_greedy(smollm2_hf_model(), ids, 12)


@pytest.mark.processes
@pytest.mark.smollm2
# SmolLM2's 3 KV heads split 2 + 1 over two ranks (TP with PP runs on the tiny models above, which
# split evenly; four SmolLM2 processes on two cores cost the suite 25 s). Its answer continues the
# facts' pattern, so speculation proposes and verifies across ranks and stages (the random tiny
# models copy nothing: no proposal of theirs is ever made).
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_smollm2_parallel_layouts_match_transformers(tp, pp, smollm2_reference):
    ids, (want, margins) = smollm2_reference
    server = Server(
        "--tp", str(tp), "--pp", str(pp), "--threads", "1", "--chunk-size", "64", "--weights", "dequantized"
    )
    try:
        for _ in range(2):
            got, _, last = server.generate(
                prompt_token_ids=pb.PromptTokens(ids=ids), max_new_tokens=12, ignore_eos=True
            )
            assert_greedy_match(got, want, margins)
        assert last.usage.cached_prompt_tokens > 0
        assert server.stats().spec_verifications > 0  # the facts' pattern is proposed and verified
    finally:
        assert server.stop() == 0


@pytest.mark.parametrize("stage", [0, 1])
def test_kv_writes_land_only_in_scheduled_slots_on_each_stage(tiny_models, stage):
    from shardline.common.model_source import resolve_model
    from shardline.kernels.attention import AttentionBatch
    from shardline.shard.kv_cache import KVPages
    from shardline.shard.layout import Layout
    from shardline.shard.parallel import keep_stage
    from shardline.shard.transforms import use_native_ops
    from shardline.shard.weights import build_model

    model = build_model(resolve_model(str(tiny_models["qwen2"])), torch.float32, torch.device("cpu"))
    use_native_ops(model)  # as a CPU shard serves it
    keep_stage(model, Layout(pp=2, pp_stage=stage))
    kv = KVPages(model.cfg, num_pages=8, page_size=4, dtype=torch.float32, device=torch.device("cpu"))
    for k, v in kv.layers:
        k.fill_(float("nan"))
        v.fill_(float("nan"))
    table = torch.tensor([5, 2])
    positions = torch.arange(0, 6)
    slots = table[positions // 4] * 4 + positions % 4
    batch = AttentionBatch(slots=slots, is_decode=False, query_lens=[6], start_positions=[0], block_tables_list=[table])
    hidden = None if stage == 0 else torch.randn(6, model.cfg.hidden_size)
    with torch.inference_mode():
        model(torch.arange(6), positions, kv.layers, batch, hidden)
    written = torch.zeros(9 * 4, dtype=torch.bool)
    written[slots] = True
    assert len(kv.layers) == len(model.layers) > 0
    for k, v in kv.layers:
        for pages in (k, v):
            flat = pages.view(-1, *pages.shape[2:])
            assert not torch.isnan(flat[written]).any()
            assert torch.isnan(flat[~written]).all()
