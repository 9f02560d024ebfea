"""Log-probabilities in the API: the sampled tokens' and the prompt's (teacher-forced), with the
best alternatives, equal to transformers' log-softmax over the same weights, whether the prompt
runs whole or in chunks over two pipeline stages, or a second time where the prefix cache holds it."""

import random

import grpc
import pytest
import torch

from shardline.protos import generation_pb2 as pb
from tests.support import Server, hf_model, smollm2_hf_model, smollm2_tokenizer

pytestmark = pytest.mark.processes  # every test here starts processes

TOP = 5
TOL = 2e-3  # fp32 on both sides; different kernels and reduction orders


@torch.no_grad()
def reference_logprobs(model, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab]: row i is log p(. | ids[:i + 1])."""
    return model(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def assert_matches(got: pb.TokenLogprob, row: torch.Tensor, token: int):
    assert got.token_id == token
    assert abs(got.logprob - row[token].item()) < TOL, (got.logprob, row[token].item())
    best = row.topk(TOP).values.tolist()
    assert len(got.top) == TOP
    assert [t.logprob for t in got.top] == sorted((t.logprob for t in got.top), reverse=True)
    for alt, want in zip(got.top, best):
        assert abs(alt.logprob - want) < TOL  # the same best values, in order
        assert abs(alt.logprob - row[alt.token_id].item()) < TOL  # and each is its token's


def check_request(server: Server, ref, prompt: list[int], new_tokens: int = 6, cached: bool = False):
    responses = list(
        server.stub.Generate(
            pb.GenerateRequest(
                prompt_token_ids=pb.PromptTokens(ids=prompt),
                max_new_tokens=new_tokens,
                ignore_eos=True,
                logprobs=TOP,
                prompt_logprobs=TOP,
            ),
            timeout=120,
        )
    )
    tokens = [t for r in responses for t in r.token_ids]
    assert len(tokens) == new_tokens
    assert all(len(r.logprobs) == len(r.token_ids) for r in responses)
    assert all(not r.prompt_logprobs for r in responses[1:])
    rows = reference_logprobs(ref, prompt + tokens)
    scored = responses[0].prompt_logprobs
    assert len(scored) == len(prompt) - 1
    for i, got in enumerate(scored):
        assert_matches(got, rows[i], prompt[i + 1])
    sampled = [lp for r in responses for lp in r.logprobs]
    for i, got in enumerate(sampled):
        assert_matches(got, rows[len(prompt) - 1 + i], tokens[i])
    assert responses[-1].usage.cached_prompt_tokens == 0  # scored prompts are never served from cache
    return tokens


@pytest.mark.parametrize("layout", [[], ["--pp", "2", "--chunk-size", "7"]], ids=["whole", "pp2-chunks-of-7"])
def test_logprobs_equal_transformers_log_softmax(tiny_models, layout):
    ref = hf_model(tiny_models["llama"])
    rng = random.Random(5)
    # Whole, 1100 tokens take two pieces of a step (PREFILL_PIECE_TOKENS); in chunks, 200 cross
    # dozens of chunk ends, which the chunk cost cap makes 2-7 tokens apart on this tiny model.
    lengths = (2, 40, 200) if layout else (2, 40, 1100)
    prompts = [[rng.randrange(ref.config.vocab_size) for _ in range(n)] for n in lengths]
    server = Server("--model", str(tiny_models["llama"]), "--page-size", "16", "--max-batch-tokens", "512", *layout)
    try:
        for prompt in prompts:
            check_request(server, ref, prompt)
        # Again: the prefix cache now holds these prompts, and scoring must not skip them.
        check_request(server, ref, prompts[2])
        plain = server.generate(prompt_token_ids=pb.PromptTokens(ids=prompts[2]), max_new_tokens=2, ignore_eos=True)
        assert plain[2].usage.cached_prompt_tokens > 0 and not plain[2].logprobs
        st = server.wait_idle()
        assert st.pages_referenced == 0
    finally:
        assert server.stop() == 0


def test_logprobs_zero_reports_the_sampled_token_only_and_too_many_is_invalid(tiny_models):
    server = Server("--model", str(tiny_models["llama"]), "--page-size", "16")
    try:
        _, _, last = server.generate(prompt="Hello there", max_new_tokens=3, logprobs=0)
        assert len(last.logprobs) == 1 and not last.logprobs[0].top and last.logprobs[0].logprob <= 0
        for field in ("logprobs", "prompt_logprobs"):
            with pytest.raises(grpc.RpcError) as e:
                server.generate(prompt="Hello there", max_new_tokens=3, **{field: 21})
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in e.value.details()
    finally:
        assert server.stop() == 0


@pytest.mark.smollm2
def test_smollm2_logprobs_equal_transformers_on_the_dequantized_weights(smollm2_server):
    ids = smollm2_tokenizer().encode("The quick brown fox jumps over the lazy dog. Then it", add_special_tokens=False)
    check_request(smollm2_server, smollm2_hf_model(), ids, new_tokens=4)


@pytest.mark.smollm2
def test_smollm2_native_weights_pass_the_quality_gate(smollm2_server):
    """The quantized-weights gate of bench.quality (harness/quality.py) on its text's first 1024
    tokens: perplexity within +0.5% of the dequantized weights', the same top-1 token at >= 96.5%
    of positions. Where a machine measured the int8 kernels faster than the LM head's GEMM path
    at every row count, the 1024 scored rows take int8 activations as a decode step does, a
    little further from the dequantized weights than the GEMM path's float activations."""
    from harness.quality import compare, prompt_scores, reference_text
    from tests.support import smollm2_codec

    ids = smollm2_codec().encode(reference_text())[:1024]
    native = Server("--weights", "native")
    try:
        formats = native.stub.Info(pb.InfoRequest()).weight_formats
        assert formats["w13"].startswith("int4") and formats["lm_head"].startswith("int8"), formats
        result = compare(prompt_scores(smollm2_server, ids), prompt_scores(native, ids))
    finally:
        assert native.stop() == 0
    print(result)
    assert result["perplexity_ratio"] <= 1.005 and result["same_top1"] >= 0.965, result
