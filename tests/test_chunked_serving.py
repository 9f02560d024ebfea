"""Chunked prefill end to end: identical greedy tokens at every chunk size, cancellation in
every phase."""

import random
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from shardline.protos import generation_pb2 as pb
from tests.support import (
    Server,
    assert_greedy_match,
    assert_serves_like_reference,
    hf_greedy,
    hf_model,
    prompt_chunks,
    smollm2_hf_model,
    smollm2_tokenizer,
)

pytestmark = pytest.mark.processes  # every test here starts processes

PAGE = 16


@pytest.fixture(scope="module")
def reference(tiny_models):
    ref = hf_model(tiny_models["qwen3"])
    rng = random.Random(11)
    # 330 tokens: two chunks of 300, five of 64; every prompt runs twice, so with the cache on
    # the second round starts from cached pages at every chunk size.
    prompts = [[rng.randrange(ref.config.vocab_size) for _ in range(n)] for n in (5, 70, 330)]
    return ref, prompts, [hf_greedy(ref, p, 10) for p in prompts]


# With the cache on, every prompt's first round is computed cold and its second from cached
# pages: both paths. One chunk size runs with the cache off as well (the router never looks).
@pytest.mark.parametrize("chunk,cache", [(1, "on"), (7, "on"), (64, "on"), (300, "on"), (7, "off")])
def test_tiny_greedy_tokens_do_not_depend_on_chunking(tiny_models, reference, chunk, cache):
    _, prompts, wants = reference
    server = Server(
        "--model",
        str(tiny_models["qwen3"]),
        "--page-size",
        str(PAGE),
        "--chunk-size",
        str(chunk),
        "--prefix-cache",
        cache,
        "--max-batch-tokens",
        "512",
    )
    try:
        assert_serves_like_reference(server, prompts, wants, cache)
        assert server.stub.Info(pb.InfoRequest()).chunk_size == chunk
        if chunk > 1:  # a fresh prompt runs in the chunks its attention's cost cuts it to
            prompt = random.Random(chunk).choices(range(1000), k=330)
            steps = server.wait_idle().steps
            server.generate(prompt_token_ids=pb.PromptTokens(ids=prompt), max_new_tokens=1, ignore_eos=True)
            assert server.wait_idle().steps - steps == len(prompt_chunks(330, chunk, tiny_models["qwen3"]))
    finally:
        assert server.stop() == 0


@pytest.mark.parametrize("flags", [("--mixed-steps", "on"), ("--layer-groups", "3")])
def test_decodes_beside_or_between_chunks_give_the_same_greedy_tokens(tiny_models, reference, flags):
    """Every prompt at once, twice: decode rows ride in the steps that compute the others' chunks
    (mixed steps), or run between the layer groups of a long prompt's chunks."""
    _, prompts, wants = reference
    server = Server(
        "--model",
        str(tiny_models["qwen3"]),
        "--page-size",
        str(PAGE),
        "--chunk-size",
        "7",
        "--max-batch-tokens",
        "512",
        *flags,
    )
    try:
        info = server.stub.Info(pb.InfoRequest())
        assert (info.mixed_steps, info.layer_groups) == ((True, 1) if "--mixed-steps" in flags else (False, 3))
        for _ in range(2):
            with ThreadPoolExecutor(len(prompts)) as pool:
                runs = list(
                    pool.map(
                        lambda p: server.generate(
                            prompt_token_ids=pb.PromptTokens(ids=p), max_new_tokens=10, ignore_eos=True
                        ),
                        prompts,
                    )
                )
            for (got, _, _), (want, margins) in zip(runs, wants):
                assert_greedy_match(got, want, margins)
        st = server.wait_idle()
        assert (st.mixed_steps > 0) == info.mixed_steps and (st.layer_group_steps > 0) == (info.layer_groups > 1)
        assert st.pages_referenced == 0 and st.pages_free + st.pages_evictable == st.pages_total
    finally:
        assert server.stop() == 0


@pytest.fixture(scope="module")
def smollm2_reference():
    """A prompt of about 380 tokens (two chunks of 300, dozens of 7) and transformers' greedy tokens."""
    tok = smollm2_tokenizer()
    ids = tok.encode(
        " ".join(f"Step {i}: mix {i} grams of flour with {i + 2} eggs." for i in range(24)), add_special_tokens=False
    )
    assert 300 < len(ids) < 450
    return ids, hf_greedy(smollm2_hf_model(), ids, 12)


@pytest.mark.smollm2
@pytest.mark.parametrize("chunk", [7, 300])
def test_smollm2_greedy_tokens_do_not_depend_on_chunking(smollm2_reference, chunk):
    """Computed cold, then from the first run's cached pages. With chunks of 300 another request
    decodes meanwhile, so the prompt's two chunks run in layer groups (8, the default)."""
    ids, (want, margins) = smollm2_reference
    server = Server("--chunk-size", str(chunk), "--weights", "dequantized")
    try:
        with ThreadPoolExecutor(1) as pool:
            if chunk == 300:
                side = pool.submit(
                    server.generate, prompt_token_ids=pb.PromptTokens(ids=ids[:20]), max_new_tokens=40, ignore_eos=True
                )
                _wait_for(server, lambda st: st.requests_decoding == 1)
            for _ in range(2):
                got, _, last = server.generate(
                    prompt_token_ids=pb.PromptTokens(ids=ids), max_new_tokens=12, ignore_eos=True
                )
                assert_greedy_match(got, want, margins)
            if chunk == 300:
                assert len(side.result()[0]) == 40
        assert last.usage.cached_prompt_tokens > 0
        st = server.stats()
        assert (st.layer_group_steps >= 8) == (chunk == 300)
        assert st.spec_verifications > 0  # the recipe's next step is proposed from its pattern
        plain, _, _ = server.generate(
            prompt_token_ids=pb.PromptTokens(ids=ids), max_new_tokens=12, ignore_eos=True, speculative=False
        )
        assert plain == got
    finally:
        assert server.stop() == 0


@pytest.fixture(scope="module")
def one_at_a_time(tiny_models):
    """Chunks of one token: a long prompt stays in the Continue phase for seconds."""
    server = Server(
        "--model", str(tiny_models["llama"]), "--page-size", str(PAGE), "--chunk-size", "1", "--max-batch", "1"
    )
    yield server
    assert server.stop() == 0


def _wait_for(server, predicate, timeout=30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = server.stats()
        if predicate(st):
            return st
        time.sleep(0.005)
    raise AssertionError(f"never reached: {server.stats()}")


def _ended_by_cancel(call) -> list[pb.GenerateResponse]:
    """The rest of a stream that a Cancel ends: status OK, exactly one last message that says
    cancelled, whose usage counts every token the stream carried."""
    replies = list(call)  # raises unless the stream ends OK
    assert [r.finish_reason for r in replies].count("cancelled") == 1 and replies[-1].finish_reason == "cancelled"
    assert all(not r.finish_reason for r in replies[:-1])
    return replies


def test_cancel_in_every_phase_ends_the_stream_once_and_returns_every_page(one_at_a_time):
    server, stub = one_at_a_time, one_at_a_time.stub
    long_prompt = pb.PromptTokens(ids=[(7 * i) % 30000 + 50 for i in range(1500)])
    prefilling = stub.Generate(
        pb.GenerateRequest(request_id="prefilling", prompt_token_ids=long_prompt, max_new_tokens=5), timeout=60
    )
    _wait_for(server, lambda st: st.requests_prefilling == 1)
    waiting = stub.Generate(pb.GenerateRequest(request_id="waiting", prompt="hello", max_new_tokens=5), timeout=60)
    _wait_for(server, lambda st: st.requests_waiting == 1)
    with pytest.raises(grpc.RpcError) as err:  # ids name one running request
        next(stub.Generate(pb.GenerateRequest(request_id="waiting", prompt="again", max_new_tokens=5), timeout=60))
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS

    stub.Cancel(pb.CancelRequest(request_id="waiting"), timeout=10)  # while waiting
    (last,) = _ended_by_cancel(waiting)
    assert last.usage.prompt_tokens > 0 and last.usage.completion_tokens == 0 and not last.token_ids
    st = server.stats()
    assert st.requests_waiting == 0 and st.requests_prefilling == 1 and st.pages_referenced > 0
    stub.Cancel(pb.CancelRequest(request_id="prefilling"), timeout=10)  # between chunks
    (last,) = _ended_by_cancel(prefilling)
    assert last.usage.prompt_tokens == 1500 and last.usage.completion_tokens == 0
    st = server.wait_idle()
    assert st.pages_referenced == 0 and st.pages_free + st.pages_evictable == st.pages_total

    decoding = stub.Generate(
        pb.GenerateRequest(request_id="decoding", prompt="hi", max_new_tokens=1000, ignore_eos=True), timeout=60
    )
    first = next(decoding)
    _wait_for(server, lambda st: st.requests_decoding == 1)
    stub.Cancel(pb.CancelRequest(request_id="decoding"), timeout=10)  # while decoding
    replies = [first, *_ended_by_cancel(decoding)]
    assert replies[-1].usage.completion_tokens == sum(len(r.token_ids) for r in replies) < 1000
    st = server.wait_idle()
    assert st.pages_referenced == 0 and st.pages_free + st.pages_evictable == st.pages_total
    with pytest.raises(grpc.RpcError) as err:  # its stream has ended: nothing runs under that id
        stub.Cancel(pb.CancelRequest(request_id="decoding"), timeout=10)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    tokens, _, last = server.generate(prompt="still alive?", max_new_tokens=3, ignore_eos=True)
    assert len(tokens) == 3
