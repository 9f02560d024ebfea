"""Chunked prefill end to end: identical greedy tokens at every chunk size, cancellation in
every phase."""
import random
import time

import grpc
import pytest

from protos import generation_pb2 as pb
from tests.support import Server, assert_greedy_match, assert_serves_like_reference, hf_greedy, hf_model, smollm2_hf_model, smollm2_tokenizer

PAGE = 16


@pytest.fixture(scope="module")
def reference(tiny_models):
    ref = hf_model(tiny_models["qwen3"])
    rng = random.Random(11)
    prompts = [[rng.randrange(ref.config.vocab_size) for _ in range(n)] for n in (5, 70, 720)]
    return ref, prompts, [hf_greedy(ref, p, 10) for p in prompts]


@pytest.mark.parametrize("chunk,cache", [(1, "on"), (7, "on"), (64, "off"), (300, "on")])
def test_tiny_greedy_tokens_do_not_depend_on_chunking(tiny_models, reference, chunk, cache):
    _, prompts, wants = reference
    server = Server("--model", str(tiny_models["qwen3"]), "--page-size", str(PAGE), "--chunk-size", str(chunk),
                    "--prefix-cache", cache, "--max-batch-tokens", "512")
    try:
        assert_serves_like_reference(server, prompts, wants, cache)
        assert server.stub.Info(pb.InfoRequest()).chunk_size == chunk
    finally:
        assert server.stop() == 0


@pytest.mark.smollm2
@pytest.mark.parametrize("chunk", [7, 300])
def test_smollm2_greedy_tokens_do_not_depend_on_chunking(chunk, tmp_path):
    tok = smollm2_tokenizer()
    text = " ".join(f"Step {i}: mix {i} grams of flour with {i + 2} eggs." for i in range(45 if chunk == 300 else 12))
    ids = tok.encode(text, add_special_tokens=False)
    want, margins = hf_greedy(smollm2_hf_model(tmp_path), ids, 12)
    server = Server("--chunk-size", str(chunk), "--weights", "dequantized")
    try:
        got, _, _ = server.generate(prompt_token_ids=pb.PromptTokens(ids=ids), max_new_tokens=12, ignore_eos=True)
        assert_greedy_match(got, want, margins)
    finally:
        assert server.stop() == 0


@pytest.fixture(scope="module")
def one_at_a_time(tiny_models):
    """Chunks of one token: a long prompt stays in the Continue phase for seconds."""
    server = Server("--model", str(tiny_models["llama"]), "--page-size", str(PAGE), "--chunk-size", "1",
                    "--max-batch", "1")
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


def _cancelled(call):
    with pytest.raises(grpc.RpcError) as err:
        for _ in call:
            pass
    return err.value.code() == grpc.StatusCode.CANCELLED


def test_cancel_in_every_phase_returns_every_page(one_at_a_time):
    server = one_at_a_time
    long_prompt = pb.PromptTokens(ids=[(7 * i) % 30000 + 50 for i in range(1500)])
    prefilling = server.stub.Generate(pb.GenerateRequest(prompt_token_ids=long_prompt, max_new_tokens=5), timeout=60)
    _wait_for(server, lambda st: st.requests_prefilling == 1)
    waiting = server.stub.Generate(pb.GenerateRequest(prompt="hello", max_new_tokens=5), timeout=60)
    _wait_for(server, lambda st: st.requests_waiting == 1)
    waiting.cancel()                   # cancelled while waiting
    _wait_for(server, lambda st: st.requests_waiting == 0)
    st = server.stats()
    assert st.requests_prefilling == 1 and st.pages_referenced > 0
    prefilling.cancel()                # cancelled between chunks
    st = server.wait_idle()
    assert st.pages_referenced == 0 and st.pages_free + st.pages_evictable == st.pages_total
    decoding = server.stub.Generate(pb.GenerateRequest(prompt="hi", max_new_tokens=1000, ignore_eos=True), timeout=60)
    next(decoding)
    _wait_for(server, lambda st: st.requests_decoding == 1)
    decoding.cancel()                  # cancelled while decoding
    st = server.wait_idle()
    assert st.pages_referenced == 0 and st.pages_free + st.pages_evictable == st.pages_total
    assert all(_cancelled(c) for c in (waiting, prefilling, decoding))
    tokens, _, last = server.generate(prompt="still alive?", max_new_tokens=3, ignore_eos=True)
    assert len(tokens) == 3
