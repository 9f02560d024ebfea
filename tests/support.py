"""What the tests share: tiny random models, Hugging Face references, and real server processes
(harness/serve.py's `Server`, which the benchmarks use too)."""

from __future__ import annotations

import functools
import json
import time
from pathlib import Path

import psutil
import torch

from harness import serve
from harness.serve import ROOT, free_port  # noqa: F401  (re-exported for the tests)
from harness.tiny_models import TINY_CONFIGS, make_tiny_model, smollm2_codec, smollm2_tokenizer  # noqa: F401
from shardline.common.model_source import resolve_model
from shardline.processes import free_ports  # noqa: F401
from shardline.protos import generation_pb2 as pb


class Server(serve.Server):
    """The harness's server (harness/serve.py), with a tiny model's KV pool cut to 50 MB unless a
    test sizes it: a tiny model's page is a few KB, so the default 1 GB budget is some 100,000
    pages, and zeroing them cost every start a third of a second."""

    def __init__(self, *args: str, **kwargs):
        model = Path(args[args.index("--model") + 1]) if "--model" in args else None
        if model is not None and "--kv-memory-gb" not in args and _is_tiny(model):
            args = (*args, "--kv-memory-gb", "0.05")
        super().__init__(*args, **kwargs)


def _is_tiny(model: Path) -> bool:
    config = model / "config.json"
    return config.is_file() and json.loads(config.read_text())["hidden_size"] < 512


def prompt_chunks(prompt: int, size: int, model) -> list[int]:
    """The chunks the router should cut a prompt into: each the most tokens whose weight and
    attention multiply-adds (the model's, counted here by brute force) are at most those of
    `size` tokens at position 0."""
    cfg = json.loads((model / "config.json").read_text())
    hidden, heads, inter = cfg["hidden_size"], cfg["num_attention_heads"], cfg["intermediate_size"]
    head_dim = cfg.get("head_dim") or hidden // heads
    q, kv = heads * head_dim, cfg["num_key_value_heads"] * head_dim
    token, pair = hidden * (q + 2 * kv) + q * hidden + 3 * hidden * inter, 2 * q

    def cost(n, start):
        return n * token + pair * sum(start + i for i in range(n))

    chunks, start = [], 0
    while start < prompt:
        n = 1
        while n < min(size, prompt - start) and cost(n + 1, start) <= cost(size, 0):
            n += 1
        chunks.append(n)
        start += n
    return chunks


def hf_model(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@functools.cache
def smollm2_hf_model():
    """transformers' Llama over exactly the weights Shardline serves (the dequantized GGUF), built
    once per test session (every test only runs it)."""
    import tempfile

    from harness.reference import transformers_model

    with tempfile.TemporaryDirectory(prefix="smollm2-hf-") as folder:  # only holds config.json
        return transformers_model(resolve_model(None), Path(folder))


@torch.no_grad()
def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy tokens from `generate`, and at each step the gap between the two best logits."""
    out = model.generate(
        torch.tensor([prompt_ids]),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        output_scores=True,
        return_dict_in_generate=True,
        eos_token_id=None,
        pad_token_id=0,
    )
    margins = [float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in out.scores]
    return out.sequences[0, len(prompt_ids) :].tolist(), margins


class _Masked:
    """A logits processor: transformers' logits with llguidance's mask for the tokens so far."""

    def __init__(self, matcher, prompt_len: int):
        self.matcher, self.prompt_len = matcher, prompt_len
        self.margins: list[float] = []  # per step, the gap between the two best allowed logits

    def __call__(self, input_ids, scores):
        if input_ids.shape[1] > self.prompt_len:
            assert self.matcher.consume_token(int(input_ids[0, -1]))
        bits = torch.frombuffer(bytearray(self.matcher.compute_bitmask()), dtype=torch.uint8)
        allowed = ((bits.unsqueeze(1) >> torch.arange(8, dtype=torch.uint8)) & 1).flatten()[: scores.shape[1]].bool()
        scores = scores.masked_fill(~allowed, float("-inf"))
        best = scores[0].topk(2).values
        self.margins.append(float(best[0] - best[1]))
        return scores


@functools.cache
def _llg_tokenizer(vocab_size: int, eos_token_id: int):
    """llguidance's view of SmolLM2's tokenizer (a third of a second to build)."""
    import llguidance as llg

    return llg.LLTokenizer(smollm2_codec().tokenizer.to_str(), n_vocab=vocab_size, eos_token=[eos_token_id])


@torch.no_grad()
def hf_constrained_greedy(
    model, prompt_ids: list[int], req: pb.GenerateRequest, max_new_tokens: int
) -> tuple[list[int], list[float]]:
    """The reference of constrained decoding: transformers' greedy tokens with the llguidance
    mask of the request's constraint applied to its logits (SmolLM2's tokenizer, as the tiny
    models and SmolLM2 have), and at each step the gap between the two best allowed logits."""
    import llguidance as llg
    from transformers import LogitsProcessorList

    from shardline.router.requests.constraints import grammar_of

    tokenizer = _llg_tokenizer(model.config.vocab_size, model.config.eos_token_id)
    masked = _Masked(llg.LLMatcher(tokenizer, grammar_of(req)), len(prompt_ids))
    out = model.generate(
        torch.tensor([prompt_ids]),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=0,
        logits_processor=LogitsProcessorList([masked]),
    )
    return out[0, len(prompt_ids) :].tolist(), masked.margins


def assert_constrained_match(got: list[int], want: tuple[list[int], list[float]]):
    """As assert_greedy_match, for a constrained answer that may end before the reference's
    (which goes on to EOS once the constraint is complete)."""
    tokens, margins = want
    assert_greedy_match(got, tokens[: len(got)], margins)


def assert_greedy_match(got: list[int], want: list[int], margins: list[float], tie: float = 1e-3):
    """Token-for-token equality; a divergence is accepted only where the reference's top two
    logits were a near-tie (float reduction order may flip those), and only there."""
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            print(f"near-tie divergence at token {i} (margin {margins[i]:.3g})")
            assert margins[i] < tie, (
                f"diverged at token {i}: got {a}, reference {b} "
                f"(top-2 margin {margins[i]:.4g})\n got {got}\nwant {want}"
            )
            return
    assert len(got) == len(want), f"got {len(got)} tokens, reference {len(want)}"


def assert_serves_like_reference(server: Server, prompts, wants, cache: str, new_tokens: int = 10):
    """Runs every prompt twice (the second round hits the prefix cache when it is on): each time
    the greedy tokens match the reference; afterwards no page is held and every page is usable."""
    for _ in range(2):
        for prompt, (want, margins) in zip(prompts, wants):
            got, _, last = server.generate(
                prompt_token_ids=pb.PromptTokens(ids=prompt), max_new_tokens=new_tokens, ignore_eos=True
            )
            assert_greedy_match(got, want, margins)
    assert (last.usage.cached_prompt_tokens > 0) == (cache == "on")
    st = server.wait_idle()
    assert st.pages_referenced == 0 and st.pages_free + st.pages_evictable == st.pages_total


# -- processes ----------------------------------------------------------------------------------
def children(pid: int) -> list[int]:
    return [c.pid for c in psutil.Process(pid).children()]


def cmdline(pid: int) -> str:
    return " ".join(psutil.Process(pid).cmdline())


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def health_status(channel, timeout: float = 5) -> int:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout).status


def wait_for(predicate, timeout: float, what: str, every: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def replica_config(**overrides):
    """The replica's configuration as the router's flags give it by default (flags.py is the one
    home of each default), with `overrides`."""
    import dataclasses

    from shardline.cli import build_parser
    from shardline.router.core.config import ReplicaConfig

    return dataclasses.replace(ReplicaConfig.from_flags(build_parser().parse_args(["router"])), **overrides)
