"""Quantized weights through every serving path: chunked prefill, the prefix cache, TP2 and PP2.

A tiny random llama served with `--quantize int4` (int4 block layers, int8 LM head). Its
configurations compute in different orders (TP2 sums partial products across ranks; a chunk of
at most a few rows takes the LM head's quantized kernel where a longer one takes its dense copy), so each
is compared with the whole-prompt single-shard run by the quality measure of `bench.quality`,
with one allowance for this random model: its next-token distributions are nearly flat, and the
quantized kernels return bf16 logits (steps of 1/16 at this model's logit sizes), so exact top-2
ties are common. Hence: perplexity within 1%, and the same top-1 token at every position where
the whole-prompt run's best token leads its second by more than 0.25 (four bf16 steps); a path
that computes something else disagrees far beyond that. A repeat on a prefix-cache hit must
give exactly the same tokens as the first run of the same server.
"""

import random

import pytest

from harness.quality import compare, prompt_scores
from shardline.protos import generation_pb2 as pb
from tests.support import Server

pytestmark = pytest.mark.processes  # every test here starts processes

QUANT = ["--quantize", "int4", "--page-size", "16", "--max-batch-tokens", "512"]


def serve_and_score(model, prompts, *flags):
    server = Server("--model", str(model), *QUANT, *flags)
    try:
        info = server.stub.Info(pb.InfoRequest())
        formats = info.weight_formats
        assert formats["w13"].startswith("int4") and formats["lm_head"].startswith("int8"), formats
        assert info.kv_dtype == "float16"  # auto: quantized weights keep their KV pages in fp16
        scores, tokens = [], []
        for prompt in prompts:
            responses = list(
                server.stub.Generate(
                    pb.GenerateRequest(
                        prompt_token_ids=pb.PromptTokens(ids=prompt),
                        max_new_tokens=8,
                        ignore_eos=True,
                        prompt_logprobs=20,
                    ),
                    timeout=120,
                )
            )
            scores += list(responses[0].prompt_logprobs)
            tokens.append([t for r in responses for t in r.token_ids])
        for prompt, first in zip(prompts, tokens):  # again, now from the prefix cache
            again, _, last = server.generate(
                prompt_token_ids=pb.PromptTokens(ids=prompt), max_new_tokens=8, ignore_eos=True
            )
            assert again == first
        assert last.usage.cached_prompt_tokens > 0
        assert server.wait_idle().pages_referenced == 0
        return scores, tokens
    finally:
        assert server.stop() == 0


@pytest.fixture(scope="module")
def whole(tiny_models):
    rng = random.Random(3)
    prompts = [[rng.randrange(1000, 40000) for _ in range(n)] for n in (40, 300)]
    return prompts, serve_and_score(tiny_models["llama"], prompts)


@pytest.mark.parametrize(
    "flags",
    [["--chunk-size", "7"], ["--tp", "2"], ["--pp", "2", "--chunk-size", "64"]],
    ids=["chunks-of-7", "tp2", "pp2-chunks-of-64"],
)
def test_quantized_serving_paths_agree_with_the_whole_prompt_run(tiny_models, whole, flags):
    prompts, (want, _) = whole
    got, _ = serve_and_score(tiny_models["llama"], prompts, *flags)
    result = compare(want, got)
    print(result)
    assert result["perplexity_ratio"] <= 1.01, result
    # Clear-cut: a top-2 gap wider than what the paths' roundings move (TP2 quantizes and sums its
    # halves apart; the activations' int8 rounding turns an fp32 difference into a step of 1/254).
    clear = [
        (w.top[0].token_id, g.top[0].token_id) for w, g in zip(want, got) if w.top[0].logprob - w.top[1].logprob > 0.5
    ]
    assert len(clear) > len(want) / 3  # many positions are clear-cut, so this checks something
    assert all(a == b for a, b in clear), [i for i, (a, b) in enumerate(clear) if a != b]


def test_int8_quantized_layers_serve_what_the_dense_weights_say(tiny_models):
    """`--quantize int8` end to end: every linear layer int8, scored against the same model served
    dense (fp32, exact) by the same measure."""
    rng = random.Random(5)
    ids = [rng.randrange(1000, 40000) for _ in range(200)]
    dense = Server("--model", str(tiny_models["llama"]), "--page-size", "16")
    int8 = Server("--model", str(tiny_models["llama"]), "--page-size", "16", "--quantize", "int8")
    try:
        formats = int8.stub.Info(pb.InfoRequest()).weight_formats
        assert all(formats[k].startswith("int8") for k in ("wqkv", "wo", "w13", "w2", "lm_head")), formats
        want, got = prompt_scores(dense, ids), prompt_scores(int8, ids)
    finally:
        assert dense.stop() == 0 and int8.stop() == 0
    result = compare(want, got)
    print(result)
    # This random model's flat distributions let rounding reorder even some clear-cut top-2 pairs
    # (5 of 139 in one run), so the gate is the distance between the distributions: a layer
    # computing something else puts KL near 1, rounding here about 0.003.
    assert result["perplexity_ratio"] <= 1.01 and result["mean_kl"] <= 0.01, result


def test_quantized_decode_graphs_agree_with_eager_decode(tiny_models):
    """Decode graphs over int4 layers (`--decode-graphs on`, buckets 1 and 2): two concurrent
    streams decode as graph launches only, with the eager server's tokens up to any bf16 near-tie
    (eager top-2 gap at most 0.25, as above), after which continuations may part."""
    from concurrent.futures import ThreadPoolExecutor

    rng = random.Random(9)
    prompts = [[rng.randrange(1000, 40000) for _ in range(n)] for n in (12, 45)]

    def run(*flags):
        server = Server("--model", str(tiny_models["llama"]), *QUANT, "--max-batch", "2", *flags, timeout=600)
        try:
            with ThreadPoolExecutor(2) as pool:
                out = list(
                    pool.map(
                        lambda p: list(
                            server.stub.Generate(
                                pb.GenerateRequest(
                                    prompt_token_ids=pb.PromptTokens(ids=p),
                                    max_new_tokens=10,
                                    ignore_eos=True,
                                    logprobs=5,
                                ),
                                timeout=120,
                            )
                        ),
                        prompts,
                    )
                )
            return [[lp for r in responses for lp in r.logprobs] for responses in out], server.wait_idle()
        finally:
            assert server.stop() == 0

    eager, _ = run("--decode-graphs", "off")
    graphs, st = run("--decode-graphs", "on")
    assert st.decode_graph_launches > 0 and st.eager_decode_steps == 0
    for want, got in zip(eager, graphs):
        for w, g in zip(want, got):
            if w.token_id != g.token_id:  # eager's distribution must rate the graph's token near-best
                theirs = {t.token_id: t.logprob for t in w.top}
                assert g.token_id in theirs and w.top[0].logprob - theirs[g.token_id] <= 0.25, (w, g)
                break
