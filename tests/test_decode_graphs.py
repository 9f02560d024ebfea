"""Decode graphs (torch.compile on CPU): the same greedy tokens as transformers, with every
decode step of a batch inside a bucket or on its edge replayed as exactly one graph launch, and
intermediate prefill chunks launching none. The CUDA-graph path needs a GPU and is not run here."""

import random

import pytest
import torch

from shardline.common.model_source import resolve_model
from shardline.protos import shard_pb2
from shardline.shard.decode_graphs import buckets_for
from shardline.shard.runner import ModelRunner
from shardline.shard.transforms import use_native_ops
from shardline.shard.weights import build_model
from tests.support import assert_constrained_match, assert_greedy_match, hf_constrained_greedy, hf_greedy, hf_model

PAGE, NEW = 8, 6


def test_buckets_cover_every_batch_size_up_to_the_maximum():
    assert buckets_for(1) == [1]
    assert buckets_for(4) == [1, 2, 4]
    assert buckets_for(12) == [1, 2, 4, 8, 12]


@pytest.fixture(scope="module")
def llama(tiny_models):
    return tiny_models["llama"]


@pytest.fixture(scope="module")
def graph_runner(llama):
    model = build_model(resolve_model(str(llama)), torch.float32, torch.device("cpu"))
    use_native_ops(model)  # as a CPU shard serves it
    runner = ModelRunner(model, PAGE, torch.float32, torch.device("cpu"))
    runner.allocate(64, 4, decode_graphs=True)
    assert sorted(runner.graphs.buckets) == [1, 2, 4]
    return runner


def _generate(runner, prompts, chunk: int):
    """Greedy tokens of `prompts` decoded together; (tokens, graph launches, eager decode steps)
    per step kind."""
    counts = {"chunk": [0, 0], "decode": [0, 0]}
    pages = iter(range(64))
    held = {i: [next(pages) for _ in range(-(-(len(p) + NEW) // PAGE))] for i, p in enumerate(prompts)}
    out = {i: [] for i in range(len(prompts))}
    for i, prompt in enumerate(prompts):  # prefill one by one, in chunks
        for start in range(0, len(prompt), chunk):
            piece = prompt[start : start + chunk]
            emit = start + len(piece) == len(prompt)
            step = shard_pb2.SequenceStep(seq_id=i, token_ids=piece, start_pos=start, emit=emit)
            if start == 0:
                step.first, step.sampling.top_p = True, 1.0
                step.new_pages.extend(held[i])
            result = runner.step(shard_pb2.StepPlan(seqs=[step]))
            if not emit:
                counts["chunk"][0] += result.graph_launches
                counts["chunk"][1] += result.eager_decode_steps
            out[i] += result.tokens
    for n in range(1, NEW):
        plan = shard_pb2.StepPlan(
            seqs=[
                shard_pb2.SequenceStep(seq_id=i, token_ids=out[i][-1:], emit=True, start_pos=len(p) + n - 1)
                for i, p in enumerate(prompts)
            ]
        )
        result = runner.step(plan)
        assert not result.failures, result.failures
        counts["decode"][0] += result.graph_launches
        counts["decode"][1] += result.eager_decode_steps
        for i, token in enumerate(result.tokens):
            out[i].append(token)
    runner.step(shard_pb2.StepPlan(released=list(out)))
    return [out[i] for i in range(len(prompts))], counts


@pytest.mark.processes
@pytest.mark.parametrize("batch", [1, 3, 4], ids=["bucket-1", "inside-bucket-4", "edge-of-bucket-4"])
def test_graph_decode_matches_transformers_with_one_launch_per_step(llama, graph_runner, batch):
    ref = hf_model(llama)
    rng = random.Random(batch)
    prompts = [[rng.randrange(ref.config.vocab_size) for _ in range(rng.randrange(9, 30))] for _ in range(batch)]
    tokens, counts = _generate(graph_runner, prompts, chunk=7)
    for prompt, got in zip(prompts, tokens):
        want, margins = hf_greedy(ref, prompt, NEW)
        assert_greedy_match(got, want, margins)
    assert counts["decode"] == [NEW - 1, 0], "each decode step is one graph launch, none eager"
    assert counts["chunk"] == [0, 0], "intermediate chunks of 7 tokens launch no graph"


@pytest.mark.processes
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)], ids=["TP2", "PP2"])
def test_a_replica_counts_launches_per_rank_and_pipeline_stages_stay_eager(llama, tp, pp):
    """TP2: one graph launch per rank per decode step. PP2: no graphs, one eager decode step per
    stage, and Info says so. Greedy tokens as transformers' either way."""
    from shardline.protos import generation_pb2 as pb
    from tests.support import Server, prompt_chunks

    ref = hf_model(llama)
    # 18 prompt tokens in chunks of 7, 6 and 5 (later chunks hold fewer: router/core/scheduler.py),
    # none of one token, which would decode through a graph like a decode step.
    assert prompt_chunks(18, 7, llama) == [7, 6, 5]
    prompt = [random.Random(5).randrange(ref.config.vocab_size) for _ in range(18)]
    want, margins = hf_greedy(ref, prompt, 8)
    server = Server(
        "--model",
        str(llama),
        "--page-size",
        str(PAGE),
        "--tp",
        str(tp),
        "--pp",
        str(pp),
        "--threads",
        "1",
        "--max-batch",
        "2",
        "--decode-graphs",
        "on",
        "--chunk-size",
        "7",
        timeout=600,
    )
    try:
        info = server.stub.Info(pb.InfoRequest(), timeout=10)
        assert (info.decode_graphs, list(info.decode_graph_buckets)) == ((True, [1, 2]) if pp == 1 else (False, []))
        before = server.stats()
        got, _, _ = server.generate(prompt_token_ids=pb.PromptTokens(ids=prompt), max_new_tokens=8, ignore_eos=True)
        assert_greedy_match(got, want, margins)
        st = server.wait_idle()
        graphs, eager = (
            st.decode_graph_launches - before.decode_graph_launches,
            st.eager_decode_steps - before.eager_decode_steps,
        )
        # 7 decode steps follow the prompt's chunks.
        assert (graphs, eager) == ((7 * tp, 0) if pp == 1 else (0, 7 * pp))
        # A constrained sequence decodes through the same graphs: its mask applies to their logits.
        req = pb.GenerateRequest(
            prompt_token_ids=pb.PromptTokens(ids=prompt),
            max_new_tokens=12,
            json_schema='{"type": "array", "items": {"type": "integer"}, "maxItems": 3}',
        )
        got = server.generate(**{f.name: v for f, v in req.ListFields()})[0]
        assert_constrained_match(got, hf_constrained_greedy(ref, prompt, req, 12))
        assert server.wait_idle().decode_graph_launches > st.decode_graph_launches or pp > 1
    finally:
        assert server.stop() == 0


@pytest.mark.processes
def test_graphs_keep_parity_with_chunking_and_the_prefix_cache(llama):
    """Four prompts at once with --max-batch 4: decode batches of 1 to 4 (inside and on bucket
    edges) run as graphs; every answer is transformers' answer, computed cold in chunks of 7 and
    again from the prefix cache (unchunked prompts decode through graphs in test_native_weights)."""
    from concurrent.futures import ThreadPoolExecutor

    from shardline.protos import generation_pb2 as pb
    from tests.support import Server

    ref = hf_model(llama)
    rng = random.Random(7)
    prompts = [[rng.randrange(ref.config.vocab_size) for _ in range(n)] for n in (5, 37, 90, 131)]
    wants = [hf_greedy(ref, p, 12) for p in prompts]
    server = Server(
        "--model",
        str(llama),
        "--page-size",
        "16",
        "--max-batch",
        "4",
        "--decode-graphs",
        "on",
        "--chunk-size",
        "7",
        timeout=600,
    )
    try:
        for _ in range(2):  # the second round hits the prefix cache
            with ThreadPoolExecutor(len(prompts)) as pool:
                results = list(
                    pool.map(
                        lambda p: server.generate(
                            prompt_token_ids=pb.PromptTokens(ids=p), max_new_tokens=12, ignore_eos=True
                        ),
                        prompts,
                    )
                )
            for (tokens, _, _), (want, margins) in zip(results, wants):
                assert_greedy_match(tokens, want, margins)
        st = server.wait_idle()
        assert st.decode_graph_launches > 0 and st.eager_decode_steps == 0
        assert st.prefix_hit_tokens > 0
        assert st.pages_referenced == 0 and st.pages_free + st.pages_evictable == st.pages_total
    finally:
        assert server.stop() == 0


@pytest.mark.processes
def test_a_one_token_final_chunk_takes_the_decode_graph(llama, graph_runner):
    ref = hf_model(llama)
    prompt = [random.Random(15).randrange(ref.config.vocab_size) for _ in range(15)]
    launches = []
    for start, n in ((0, 7), (7, 7), (14, 1)):  # chunks of 7: the last is one token
        step = shard_pb2.SequenceStep(seq_id=99, token_ids=prompt[start : start + n], start_pos=start, emit=start == 14)
        if start == 0:
            step.first, step.sampling.top_p = True, 1.0
            step.new_pages.extend([60, 61])
        result = graph_runner.step(shard_pb2.StepPlan(seqs=[step]))
        tokens = result.tokens
        launches.append(result.graph_launches)
    graph_runner.step(shard_pb2.StepPlan(released=[99]))
    assert launches == [0, 0, 1]
    want, margins = hf_greedy(ref, prompt, 1)
    assert_greedy_match(tokens, want, margins)
