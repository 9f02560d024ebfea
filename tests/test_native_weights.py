"""Quantized weights through every serving path: chunked prefill, the prefix cache, TP2 and PP2.

A tiny random llama served with `--quantize int4` (int4 block layers, int8 LM head). Its
configurations compute in different orders (TP2 sums partial products across ranks; a chunk of
at most a few rows takes the LM head's quantized kernel where a longer one takes its dense copy), so each
is compared with the whole-prompt single-shard run by the quality measure of `bench.quality`,
with one allowance for this random model: its next-token distributions are nearly flat, and the
quantized kernels return bf16 logits (steps of 1/16 at this model's logit sizes), so exact top-2
ties are common; and the kernel each layer's shape takes is measured per machine
(kernels/choice.py), so TP2's half-width layers may compute on other kernels than the whole
model's, rounding differently (int8 activations or none). Hence the gate is the distance between
the distributions, a mean KL from the whole-prompt run's within 0.01 (as the int8 test's: a path
that computes something else puts it far beyond), and the same top-1 token wherever the
whole-prompt run's best leads its second by more than `CLEAR`. (Each position's own KL tells
little here: this model's distributions at two unrelated positions are often as close as TP2's
rounding moves one. The exact path's tests catch a position computed wrong token for token.)

A repeat on a prefix-cache hit computes only the prompt's tail, in a step of a few rows, which
the kernel choices measured on the machine (kernels/choice.py) may give to another kernel than
the whole prompt's step: its tokens' distributions must be the first run's by the same gate (most
alternatives shared, a mean KL within 0.01), for as long as the two runs choose the same tokens;
they may part only at a near-tie.
"""

import random

import pytest

from harness.quality import compare, prompt_scores
from shardline.protos import generation_pb2 as pb
from tests.support import Server

pytestmark = pytest.mark.processes  # every test here starts processes

QUANT = ["--quantize", "int4", "--page-size", "16", "--max-batch-tokens", "512"]
# a top-2 gap, in log-probability, wider than the paths' roundings move one (by how much they
# were seen to: the commit that set it)
CLEAR = 1.5
MEAN_KL = 0.01  # the int8 test's gate too: a path that computes something else puts it far beyond


def generate(server, prompt, **extra):
    """The sampled tokens' log-probabilities (with their 20 best alternatives) and the responses."""
    responses = list(
        server.stub.Generate(
            pb.GenerateRequest(
                prompt_token_ids=pb.PromptTokens(ids=prompt), max_new_tokens=8, ignore_eos=True, logprobs=20, **extra
            ),
            timeout=120,
        )
    )
    return [lp for r in responses for lp in r.logprobs], responses


def same_run(first, again) -> int:
    """Asserts that `again` chose what `first` chose, from the same distributions (most of each
    position's alternatives shared, a mean KL within the gate), up to a near-tie where they may
    part; returns how many positions it compared."""
    compared = len(first)
    for i, (a, b) in enumerate(zip(first, again)):
        theirs = {t.token_id for t in b.top}
        assert sum(t.token_id in theirs for t in a.top) >= len(a.top) // 2, (i, a, b)
        if b.token_id != a.token_id:
            assert a.top[0].logprob - a.top[1].logprob <= CLEAR, (i, a, b)
            compared = i + 1
            break
    result = compare(first[:compared], again[:compared])
    assert result["mean_kl"] <= MEAN_KL, result
    return compared


def serve_and_score(model, prompts, *flags):
    server = Server("--model", str(model), *QUANT, *flags)
    try:
        info = server.stub.Info(pb.InfoRequest())
        formats = info.weight_formats
        assert formats["w13"].startswith("int4") and formats["lm_head"].startswith("int8"), formats
        assert info.kv_dtype == "float16"  # auto: quantized weights keep their KV pages in fp16
        scores, runs = [], []
        for prompt in prompts:
            run, responses = generate(server, prompt, prompt_logprobs=20)
            scores += list(responses[0].prompt_logprobs)
            runs.append(run)
        for prompt, first in zip(prompts, runs):  # again, now from the prefix cache
            again, responses = generate(server, prompt)
            assert same_run(first, again) > 0
            last = responses[-1]
        assert last.usage.cached_prompt_tokens > 0
        assert server.wait_idle().pages_referenced == 0
        return scores
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
    prompts, want = whole
    got = serve_and_score(tiny_models["llama"], prompts, *flags)
    result = compare(want, got)
    print(result)
    assert result["mean_kl"] <= MEAN_KL, result
    clear = [
        (w.top[0].token_id, g.top[0].token_id) for w, g in zip(want, got) if w.top[0].logprob - w.top[1].logprob > CLEAR
    ]
    assert len(clear) >= 10  # positions are clear-cut, so this checks something
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
    assert result["perplexity_ratio"] <= 1.01 and result["mean_kl"] <= MEAN_KL, result


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
