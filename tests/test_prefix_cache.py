"""Prefix caching end to end: hits skip recomputation and never change the greedy tokens."""

import random
from concurrent.futures import ThreadPoolExecutor

import pytest

from shardline.protos import generation_pb2 as pb
from tests.support import Server, assert_greedy_match, hf_greedy, hf_model

pytestmark = pytest.mark.processes  # every test here starts processes

PAGE = 16


@pytest.fixture(scope="module")
def tiny(tiny_models):
    server = Server("--model", str(tiny_models["qwen2"]), "--page-size", str(PAGE), "--max-batch", "8")
    yield server, hf_model(tiny_models["qwen2"])
    assert server.stop() == 0


def _gen(server, ids, n=12, **kw):
    return server.generate(prompt_token_ids=pb.PromptTokens(ids=ids), max_new_tokens=n, ignore_eos=True, **kw)


def test_shared_prefixes_hit_and_match_transformers(tiny):
    server, ref = tiny
    rng = random.Random(3)
    system = [rng.randrange(ref.config.vocab_size) for _ in range(5 * PAGE)]  # exactly 5 pages
    questions = [[rng.randrange(ref.config.vocab_size) for _ in range(n)] for n in (1, 7, 16, 40)]
    before = server.stats()
    tokens, _, last = _gen(server, system)
    assert last.usage.cached_prompt_tokens == 0
    # The same prompt again: a full-prompt hit still computes its last token (4 of 5 pages hit).
    again, _, last = _gen(server, system)
    assert again == tokens and last.usage.cached_prompt_tokens == 4 * PAGE
    for q in questions:
        got, _, last = _gen(server, system + q)
        assert last.usage.cached_prompt_tokens == 5 * PAGE
        want, margins = hf_greedy(ref, system + q, 12)
        assert_greedy_match(got, want, margins)
    after = server.stats()
    assert after.prefix_hit_tokens - before.prefix_hit_tokens == (4 + 5 * len(questions)) * PAGE
    st = server.wait_idle()
    assert st.pages_referenced == 0 and st.pages_free + st.pages_evictable == st.pages_total
    assert st.pages_cached >= 5


def test_concurrent_requests_share_a_prefix(tiny):
    server, ref = tiny
    rng = random.Random(4)
    system = [rng.randrange(ref.config.vocab_size) for _ in range(3 * PAGE + 5)]
    _gen(server, system, n=1)  # publish the prefix
    prompts = [system + [rng.randrange(ref.config.vocab_size) for _ in range(9)] for _ in range(4)]
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda p: _gen(server, p), prompts))
    for prompt, (got, _, last) in zip(prompts, results):
        assert last.usage.cached_prompt_tokens == 3 * PAGE
        want, margins = hf_greedy(ref, prompt, 12)
        assert_greedy_match(got, want, margins)
    st = server.wait_idle()
    assert st.pages_referenced == 0 and st.pages_free + st.pages_evictable == st.pages_total


def test_salted_requests_do_not_share(tiny):
    server, _ = tiny
    prompt = list(range(1000, 1000 + 3 * PAGE))
    assert _gen(server, prompt, n=2, cache_salt="alice")[2].usage.cached_prompt_tokens == 0
    assert _gen(server, prompt, n=2, cache_salt="bob")[2].usage.cached_prompt_tokens == 0
    assert _gen(server, prompt, n=2, cache_salt="alice")[2].usage.cached_prompt_tokens == 2 * PAGE


def test_prefix_cache_off_never_hits(tiny_models):
    server = Server("--model", str(tiny_models["llama"]), "--page-size", str(PAGE), "--prefix-cache", "off")
    try:
        prompt = list(range(500, 500 + 4 * PAGE))
        first, _, _ = _gen(server, prompt)
        second, _, last = _gen(server, prompt)
        assert first == second and last.usage.cached_prompt_tokens == 0
        st = server.wait_idle()
        assert st.pages_cached == 0 and st.pages_free == st.pages_total
        assert server.stub.Info(pb.InfoRequest()).prefix_cache is False
    finally:
        assert server.stop() == 0


def test_a_small_pool_reclaims_cached_pages_for_new_requests(tiny_models):
    """8 pages: every new prompt must reclaim what earlier ones left cached."""
    server = Server(
        "--model", str(tiny_models["llama"]), "--page-size", str(PAGE), "--num-pages", "8", "--eviction", "slru"
    )
    try:
        for i in range(6):
            prompt = [2000 + i] * (5 * PAGE)
            _gen(server, prompt, n=4)
            st = server.wait_idle()
            assert st.pages_referenced == 0 and st.pages_free + st.pages_evictable == 8
            assert st.pages_protected <= 4
        assert server.stub.Info(pb.InfoRequest()).eviction_policy == "slru"
    finally:
        assert server.stop() == 0


@pytest.mark.smollm2
def test_smollm2_same_long_prompt_twice(smollm2_server):
    text = " ".join(f"Rule {i}: always answer politely and cite source {i}." for i in range(50))
    first, _, last1 = smollm2_server.generate(prompt=text, max_new_tokens=16, ignore_eos=True)
    second, _, last2 = smollm2_server.generate(prompt=text, max_new_tokens=16, ignore_eos=True)
    n = last1.usage.prompt_tokens
    assert n > 512 and last1.usage.cached_prompt_tokens == 0
    page = smollm2_server.stub.Info(pb.InfoRequest(), timeout=10).page_size  # the default's
    assert last2.usage.cached_prompt_tokens == (n - 1) // page * page
    assert second == first
