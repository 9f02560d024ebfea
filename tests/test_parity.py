"""Greedy output of the real gRPC server equals Hugging Face `generate` for the same weights."""

import random
from concurrent.futures import ThreadPoolExecutor

import pytest

from shardline.protos import generation_pb2 as pb
from tests.support import Server, assert_greedy_match, hf_greedy, hf_model, smollm2_hf_model, smollm2_tokenizer

pytestmark = pytest.mark.processes  # every test here starts processes

PROMPT_LENGTHS = [5, 37, 300, 720]  # with 16-token pages: 1 to 46 pages
NEW_TOKENS = 24


def _prompts(vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in PROMPT_LENGTHS]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_models_match_transformers(arch, tiny_models):
    path = tiny_models[arch]
    ref = hf_model(path)
    prompts = _prompts(ref.config.vocab_size, seed=len(arch))
    server = Server("--model", str(path), "--page-size", "16", "--max-batch", "8")
    try:
        # All at once: the server batches them; each must still match its solo reference.
        with ThreadPoolExecutor(len(prompts)) as pool:
            results = list(
                pool.map(
                    lambda p: server.generate(
                        prompt_token_ids=pb.PromptTokens(ids=p), max_new_tokens=NEW_TOKENS, ignore_eos=True
                    ),
                    prompts,
                )
            )
        for prompt, (tokens, _, last) in zip(prompts, results):
            want, margins = hf_greedy(ref, prompt, NEW_TOKENS)
            assert_greedy_match(tokens, want, margins)
            assert last.finish_reason == "length"
            assert last.usage.prompt_tokens == len(prompt)
            assert last.usage.completion_tokens == NEW_TOKENS
        st = server.wait_idle()
        assert st.pages_free + st.pages_evictable == st.pages_total
    finally:
        assert server.stop() == 0


@pytest.mark.smollm2
def test_smollm2_matches_transformers(smollm2_server):
    tok = smollm2_tokenizer()
    ref = smollm2_hf_model()
    long_text = " ".join(
        f"Item {i}: the {['red', 'green', 'blue'][i % 3]} box holds {i * 7 % 13} stones." for i in range(60)
    )
    cases = [
        dict(prompt="The capital of France is"),
        dict(messages=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="Name three colors.")])),
        dict(prompt=long_text + " Which box holds the most stones?"),
    ]
    for case in cases:
        if "prompt" in case:
            ids = tok.encode(case["prompt"], add_special_tokens=False)
        else:
            ids = list(
                tok.apply_chat_template(
                    [{"role": "user", "content": "Name three colors."}],
                    tokenize=True,
                    add_generation_prompt=True,
                    return_dict=False,
                )
            )
        tokens, text, last = smollm2_server.generate(max_new_tokens=NEW_TOKENS, ignore_eos=True, **case)
        assert last.usage.prompt_tokens == len(ids)
        want, margins = hf_greedy(ref, ids, NEW_TOKENS)
        assert_greedy_match(tokens, want, margins)
        assert text == tok.decode(tokens, skip_special_tokens=True)
    assert len(ids) > 700


@pytest.mark.smollm2
def test_smollm2_knows_paris(smollm2_server):
    """Catches wrongly loaded weights (e.g. a Q/K permutation left in): both our model and the
    reference would agree on garbage, but garbage does not know capitals."""
    _, text, last = smollm2_server.generate(prompt="The capital of France is", max_new_tokens=4)
    assert "Paris" in text
