"""What the tests share: tiny random models, Hugging Face references, and real server processes."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import torch

from protos import generation_pb2 as pb, generation_pb2_grpc as pb_grpc
from router.launcher import die_with_parent

ROOT = Path(__file__).resolve().parent.parent

TINY_CONFIGS = {
    # Large enough init that random logits are not near-uniform (greedy ties would be noise).
    "llama": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, tie_word_embeddings=False),
    "qwen2": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, tie_word_embeddings=True),
    "qwen3": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=1, head_dim=32, tie_word_embeddings=False),
}


def smollm2_tokenizer():
    from router.tokenizer import load_tokenizer
    from shard.source import resolve_model
    return load_tokenizer(resolve_model(None))


def make_tiny_model(arch: str, path: Path, seed: int = 0) -> Path:
    """A random Hugging Face checkpoint (config, safetensors, SmolLM2's tokenizer) in `path`."""
    import transformers

    cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
           "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
           "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)}[arch]
    tok = smollm2_tokenizer()
    config = cls[0](vocab_size=len(tok), max_position_embeddings=2048, rms_norm_eps=1e-6,
                    initializer_range=0.3, eos_token_id=tok.eos_token_id, bos_token_id=1,
                    rope_theta=10000.0, **TINY_CONFIGS[arch])
    torch.manual_seed(seed)
    model = cls[1](config).eval()
    with torch.no_grad():  # biases start at 0 and norms at 1; make them matter
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(torch.randn_like(param) * 0.3)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path


def hf_model(path: Path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def smollm2_hf_model(tmp: Path):
    """transformers' Llama over exactly the weights Shardline serves (the dequantized GGUF)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from shard.source import resolve_model
    from shard.weights import load_state_dict, write_hf_config

    cfg, sd = load_state_dict(resolve_model(None))
    write_hf_config(cfg, tmp / "config.json")
    model = LlamaForCausalLM(LlamaConfig.from_pretrained(tmp))
    model.load_state_dict(sd, strict=False)
    model.tie_weights()
    return model.eval()


@torch.no_grad()
def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy tokens from `generate`, and at each step the gap between the two best logits."""
    out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                         output_scores=True, return_dict_in_generate=True, eos_token_id=None,
                         pad_token_id=0)
    margins = [float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in out.scores]
    return out.sequences[0, len(prompt_ids):].tolist(), margins


def assert_greedy_match(got: list[int], want: list[int], margins: list[float], tie: float = 1e-3):
    """Token-for-token equality; a divergence is accepted only where the reference's top two
    logits were a near-tie (float reduction order may flip those), and only there."""
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            print(f"near-tie divergence at token {i} (margin {margins[i]:.3g})")
            assert margins[i] < tie, (f"diverged at token {i}: got {a}, reference {b} "
                                      f"(top-2 margin {margins[i]:.4g})\n got {got}\nwant {want}")
            return
    assert len(got) == len(want), f"got {len(got)} tokens, reference {len(want)}"


def assert_serves_like_reference(server: "Server", prompts, wants, cache: str, new_tokens: int = 10):
    """Runs every prompt twice (the second round hits the prefix cache when it is on): each time
    the greedy tokens match the reference; afterwards no page is held and every page is usable."""
    for _ in range(2):
        for prompt, (want, margins) in zip(prompts, wants):
            got, _, last = server.generate(prompt_token_ids=pb.PromptTokens(ids=prompt),
                                           max_new_tokens=new_tokens, ignore_eos=True)
            assert_greedy_match(got, want, margins)
    assert (last.usage.cached_prompt_tokens > 0) == (cache == "on")
    st = server.wait_idle()
    assert st.pages_referenced == 0 and st.pages_free + st.pages_evictable == st.pages_total


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """n distinct free ports: all held open together, so the kernel cannot hand one out twice."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class Server:
    """`shardline serve` as a real child process; `stub` talks to it over gRPC."""

    def __init__(self, *args: str, env: dict | None = None, timeout: float = 180):
        self.port = free_port()
        self.target = f"127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "router.cli", "serve", "--port", str(self.port), *args]
        self.log: list[str] = []
        # preexec: the server dies with the test process, even a killed one.
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env={**os.environ, **(env or {})},
                                     preexec_fn=die_with_parent)
        self._ready = threading.Event()
        threading.Thread(target=self._pump, daemon=True).start()
        if not self._ready.wait(timeout):
            self.stop()
            raise RuntimeError("server never became ready:\n" + "".join(self.log[-40:]))
        self.channel = grpc.insecure_channel(self.target)
        self.stub = pb_grpc.GenerationStub(self.channel)

    def _pump(self):
        for line in self.proc.stdout:
            self.log.append(line)
            if line.startswith("ready "):
                self._ready.set()
        self._ready.set()  # exited: let the waiter see it

    def generate(self, **kwargs) -> tuple[list[int], str, pb.GenerateResponse]:
        tokens, text, last = [], "", None
        for msg in self.stub.Generate(pb.GenerateRequest(**kwargs), timeout=300):
            tokens += msg.token_ids
            text += msg.text
            last = msg
        return tokens, text, last

    def stats(self) -> pb.StatsResponse:
        return self.stub.Stats(pb.StatsRequest(), timeout=10)

    def wait_idle(self, timeout: float = 60) -> pb.StatsResponse:
        """Waits until no request holds a page; returns the stats seen then."""
        deadline = time.monotonic() + timeout
        while True:
            st = self.stats()
            if (st.pages_referenced == 0 and st.requests_running == 0 and st.requests_waiting == 0) \
                    or time.monotonic() > deadline:
                return st
            time.sleep(0.05)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if hasattr(self, "channel"):
            self.channel.close()
        if self.proc.returncode != 0:  # shown by pytest when the test fails
            print(f"server exited with {self.proc.returncode}; its last output:\n" + "".join(self.log[-60:]))
        return self.proc.returncode
