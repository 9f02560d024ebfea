"""KV memory of a sliding-window model at a long context: what Gemma 3's local layers hold next to
what a full-attention model of the same shape would.

A random Gemma 3 of the 4B's attention shape (34 layers, five local of a 1024-token window to
each global one, 4 KV heads of 256; narrow elsewhere, as KV memory turns on nothing else) is
served with `--page-size 16`. A prompt of `--context` random tokens decodes 32 tokens; half way
through, the router's /metrics give the pages it holds in each pool (a window pool's reserved
pages counted as held: they are promised to it), and the shard's RSS its growth since warmup.
The full-attention figure is every layer's pages for the same positions.

    .venv/bin/python -m bench.window_kv [--context 16384]
"""

from __future__ import annotations

import argparse
import tempfile
import time
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from bench.common import machine, save
from harness.serve import Server, free_port, rss_mb
from harness.tiny_models import smollm2_tokenizer
from shardline.protos import generation_pb2 as pb

PAGE = 16
SHAPE = dict(  # Gemma-3-4B's attention; its hidden size 2560 and MLP 10240 narrowed
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=34,
    num_attention_heads=4,  # the 4B's 8 halved: KV memory is the KV heads'
    num_key_value_heads=4,
    head_dim=256,
    sliding_window=1024,
    query_pre_attn_scalar=256,
    rope_parameters=dict(
        full_attention=dict(rope_type="linear", factor=8.0, rope_theta=1e6),
        sliding_attention=dict(rope_type="default", rope_theta=1e4),
    ),
    tie_word_embeddings=True,
    pad_token_id=None,
)


def make_model(folder: Path, context: int) -> Path:
    import torch
    import transformers

    tok = smollm2_tokenizer()
    config = transformers.Gemma3TextConfig(
        vocab_size=len(tok), max_position_embeddings=2 * context, eos_token_id=tok.eos_token_id, bos_token_id=1, **SHAPE
    )
    torch.manual_seed(0)
    transformers.Gemma3ForCausalLM(config).eval().save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    return folder


def pages(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    want = {"shardline:kv_window_pages": "window", "shardline:kv_cache_pages": "page"}
    return {
        f"{want[f.name]}_{s.labels['state']}": s.value
        for f in text_string_to_metric_families(text)
        if f.name in want
        for s in f.samples
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--context", type=int, default=16384)
    p.add_argument("--new-tokens", type=int, default=32)
    args = p.parse_args()
    layers, kv_heads, head_dim = SHAPE["num_hidden_layers"], SHAPE["num_key_value_heads"], SHAPE["head_dim"]
    local = sum(1 for i in range(layers) if (i + 1) % 6)
    layer_page = 2 * PAGE * kv_heads * head_dim * 4  # K and V of one layer's page, float32
    with tempfile.TemporaryDirectory(prefix="window-kv-") as folder:
        model = make_model(Path(folder), args.context)
        port = free_port()
        budget = layers * layer_page * (args.context // PAGE + 64) / 2**30  # room for full attention
        server = Server(
            "--model", str(model), "--page-size", str(PAGE), "--metrics-port", str(port), "--speculative", "off",
            "--max-batch", "1", "--kv-memory-gb", f"{budget:.3f}", timeout=1200,
        )  # fmt: skip
        try:
            shard = server.shard_pids()[0]
            rss_warm = rss_mb(shard)
            prompt = [1 + (i * 7919) % 40000 for i in range(args.context)]
            request = pb.GenerateRequest(
                prompt_token_ids=pb.PromptTokens(ids=prompt), max_new_tokens=args.new_tokens, ignore_eos=True
            )
            t0, got, held, rss_mid = time.perf_counter(), 0, None, None
            for reply in server.stub.Generate(request, timeout=3600):
                got += len(reply.token_ids)
                if held is None and got >= args.new_tokens // 2:
                    held, rss_mid = pages(port), rss_mb(shard)
            wall = time.perf_counter() - t0
        finally:
            server.stop()
    positions = args.context + args.new_tokens // 2
    full_attention = -(-positions // PAGE) * layers * layer_page
    page_pool = held["page_referenced"] * (layers - local) * layer_page
    window_pool = (held["window_referenced"] + held["window_reserved"]) * local * layer_page
    result = {
        "machine": machine(),
        "shape": {**SHAPE, "local_layers": local, "page_size": PAGE, "kv_dtype": "float32"},
        "context": args.context,
        "positions_held": positions,
        "pages": held,
        "full_attention_kv_mb": full_attention / 2**20,
        "page_pool_kv_mb": page_pool / 2**20,
        "window_pool_kv_mb": window_pool / 2**20,
        "held_over_full_attention": (page_pool + window_pool) / full_attention,
        "shard_rss_growth_mb": rss_mid - rss_warm,
        "rss_growth_over_full_attention": (rss_mid - rss_warm) * 2**20 / full_attention,
        "request_wall_s": wall,
    }
    print({k: v for k, v in result.items() if k not in ("machine", "shape")})
    save("window_kv", result, plot)


def plot(result: dict, png: Path) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    bars = {
        "full attention\n(every layer's pages)": result["full_attention_kv_mb"],
        "Shardline: global layers\n+ local layers' windows": result["page_pool_kv_mb"] + result["window_pool_kv_mb"],
        "Shardline shard\nRSS growth": result["shard_rss_growth_mb"],
    }
    ax.bar(list(bars), list(bars.values()), color=["grey", "tab:blue", "tab:cyan"])
    ax.set_ylabel(f"MB of KV at {result['positions_held']} positions")
    ratio = result["held_over_full_attention"]
    ax.set_title(
        f"Gemma-3-4B attention shape, {result['context']}-token prompt:\n{ratio:.2f}x of full attention's KV held"
    )
    fig.tight_layout()
    fig.savefig(png)


if __name__ == "__main__":
    main()
