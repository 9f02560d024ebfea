"""Mixtures of experts (Qwen3-MoE, Mixtral, Qwen2-MoE): tiny random ones made with `transformers`,
served from their Hugging Face folders and from GGUFs written as llama.cpp's converter writes them
(F32: the exact weights), give `transformers`' greedy tokens under tensor parallelism, chunked
prefill and prefix-cache hits; and its constrained tokens, and its log-probabilities through the
OpenAI API."""

import random

import openai
import pytest
import torch

from harness.gguf_of import write_gguf_of
from shardline.protos import generation_pb2 as pb
from shardline.shard.model import MoE
from tests.support import (
    Server,
    assert_constrained_match,
    assert_serves_like_reference,
    hf_constrained_greedy,
    hf_greedy,
    hf_model,
    make_tiny_model,
)

PAGE = 16


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory):
    """arch -> (Hugging Face folder, its GGUF)."""
    root = tmp_path_factory.mktemp("moe")
    made = {}
    for arch in ("qwen3_moe", "mixtral", "qwen2_moe"):
        folder = make_tiny_model(arch, root / arch)
        made[arch] = folder, write_gguf_of(folder, root / f"{arch}.gguf")
    return made


@pytest.mark.processes
@pytest.mark.parametrize(
    "arch, source, tp, chunk",
    [
        ("qwen3_moe", "hf", 1, 0),
        ("qwen3_moe", "gguf", 2, 7),  # a dense layer among sparse ones, experts split over two ranks
        ("mixtral", "hf", 2, 7),
        ("mixtral", "gguf", 1, 0),  # llama's permuted Q/K rows, experts from 3-D tensors
        ("qwen2_moe", "hf", 1, 7),
        ("qwen2_moe", "gguf", 2, 0),  # the shared expert and its gate (a vector in the file)
    ],
)
def test_tiny_mixtures_match_transformers(moe_models, arch, source, tp, chunk):
    folder, gguf = moe_models[arch]
    ref = hf_model(folder)
    rng = random.Random(len(arch) * 10 + tp)
    prompts = [[rng.randrange(ref.config.vocab_size) for _ in range(n)] for n in (5, 70, 300)]
    wants = [hf_greedy(ref, p, 10) for p in prompts]
    model = str(folder if source == "hf" else gguf)
    server = Server(
        *("--model", model, "--page-size", str(PAGE), "--tp", str(tp), "--threads", "1"),
        *("--chunk-size", str(chunk), "--weights", "native", "--kv-memory-gb", "0.05"),
    )
    try:
        info = server.stub.Info(pb.InfoRequest())
        assert info.tensor_parallel == tp and info.kv_dtype == "float32"  # F32 weights served dense: exact
        assert_serves_like_reference(server, prompts, wants, "on")
        if source == "gguf" and tp == 2:  # above the model, once: a constraint's mask, the HTTP API's logprobs
            req = pb.GenerateRequest(
                prompt_token_ids=pb.PromptTokens(ids=prompts[1]), max_new_tokens=12, regex="[a-z]{3}-[0-9]{2,9}"
            )
            got = server.generate(**{f.name: v for f, v in req.ListFields()})[0]
            assert_constrained_match(got, hf_constrained_greedy(ref, prompts[1], req, 12))
            _logprobs_match_transformers(server, ref, prompts[0], wants[0][0][:6])
    finally:
        assert server.stop() == 0


def _logprobs_match_transformers(server, ref, prompt: list[int], want: list[int]):
    """A greedy completion's log-probabilities through the OpenAI API against transformers' of
    the same tokens."""
    client = openai.OpenAI(base_url=server.http_url, api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    answer = client.completions.create(
        model=model, prompt=prompt, max_tokens=len(want), temperature=0, logprobs=2, extra_body={"ignore_eos": True}
    )
    with torch.inference_mode():
        logits = ref(torch.tensor([prompt + want])).logits[0, len(prompt) - 1 : -1]
    theirs = torch.log_softmax(logits.double(), -1).gather(1, torch.tensor(want)[:, None])[:, 0]
    ours = torch.tensor(answer.choices[0].logprobs.token_logprobs, dtype=torch.float64)
    torch.testing.assert_close(ours, theirs, atol=1e-3, rtol=0)


def test_experts_group_their_rows_and_weigh_them_as_the_reference(moe_models):
    """One `MoE` against transformers' sparse block of the same weights, on 40 tokens (many
    experts with several rows each), and each token's routing on its own."""
    from shardline.common.model_source import resolve_model
    from shardline.shard.weights import build_model

    for arch in ("qwen3_moe", "mixtral", "qwen2_moe"):
        folder, _ = moe_models[arch]
        ours = build_model(resolve_model(str(folder)), torch.float32, torch.device("cpu")).layers[0].mlp
        theirs = hf_model(folder).model.layers[0].mlp
        assert isinstance(ours, MoE)
        x = torch.randn(40, 64, generator=torch.Generator().manual_seed(0))
        with torch.inference_mode():
            want = theirs(x[None])[0]
            assert torch.allclose(ours(x), want, atol=1e-5, rtol=1e-4), arch
            one_by_one = torch.cat([ours(x[i : i + 1]) for i in range(len(x))])
            assert torch.allclose(one_by_one, want, atol=1e-4, rtol=1e-4), arch  # GEMV rounds as GEMM does not


def test_a_decode_batch_runs_each_expert_once(moe_models, monkeypatch):
    """A step's rows are grouped by expert: every expert picked by any row runs once, on all of
    its rows (not once per row)."""
    from shardline.common.model_source import resolve_model
    from shardline.shard.weights import build_model

    moe = build_model(resolve_model(str(moe_models["qwen3_moe"][0])), torch.float32, torch.device("cpu")).layers[0].mlp
    calls = []
    for e, expert in enumerate(moe.experts):
        expert.register_forward_hook(lambda _m, inputs, _out, e=e: calls.append((e, inputs[0].shape[0])))
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        picked, _ = moe.route(x)
        moe(x)
    counts = torch.bincount(picked.flatten(), minlength=len(moe.experts))
    assert calls == [(e, int(n)) for e, n in enumerate(counts) if n]
    assert len(calls) < 16 * moe.top_k  # a batch shares experts
