"""Prefill benchmark: time to first token of long prompts on `shardline serve`, whole and chunked,
against a `transformers` forward over the same prompt with the same weights, and llama.cpp's
prompt evaluation of the same GGUF (`llama-cpp-python`, where installed), in one run.

    .venv/bin/python -m bench.prefill [--lengths 512,1024,2048,8191] [--repeats 3] [--long-repeats 1]

SmolLM2's context is 8192 tokens including the first generated one, hence 8191.
Each repeat uses a fresh random prompt, so the prefix cache never helps; the three contenders take
turns (server whole, server chunked, transformers) so the machine's noise hits all of them.
Writes bench/out/prefill-<timestamp>.json and .png.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from bench.common import llama_cpp_model, machine, save
from bench.load import hf_setup
from harness.client import stream, token_request
from harness.serve import Server


def server_ttft_s(server: Server, ids: list[int]) -> float:
    s = stream(server.stub, token_request(ids, 1), timeout=3600)
    return s.ended - s.sent


@torch.inference_mode()
def hf_ttft_s(model, ids: list[int]) -> float:
    """One forward over the prompt and the first token from its last position: what `generate`
    does before its first token (without its per-call setup)."""
    t0 = time.perf_counter()
    logits = model(torch.tensor([ids]), logits_to_keep=1).logits
    int(logits[0, -1].argmax())
    return time.perf_counter() - t0


def llama_cpp_eval_s(llm, ids: list[int]) -> float:
    llm.reset()  # from position 0: eval drops the cached positions from there on
    t0 = time.perf_counter()
    llm.eval(ids)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--lengths", default="512,1024,2048,8191")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--long-repeats", type=int, default=1, help="repeats of prompts over 4096 tokens")
    ap.add_argument("--chunk-size", type=int, default=256)
    ap.add_argument("--serve-args", default="", help="extra flags for both servers")
    args = ap.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    model, _ = hf_setup(args.model)
    vocab = model.config.vocab_size
    extra = args.serve_args.split()
    servers = {
        "whole": Server("--model", args.model, *extra),
        f"chunked {args.chunk_size}": Server("--model", args.model, "--chunk-size", str(args.chunk_size), *extra),
    }
    rng = random.Random(0)
    llm = llama_cpp_model(args.model, max(lengths) + 8, n_batch=512)
    runs = {name: {n: [] for n in lengths} for name in [*servers, "transformers", *(["llama.cpp"] if llm else [])]}
    try:
        for server in servers.values():
            server_ttft_s(server, [1, 2, 3])
        hf_ttft_s(model, [1, 2, 3])
        if llm:
            llama_cpp_eval_s(llm, [1, 2, 3])
        for n in lengths:
            for _ in range(args.long_repeats if n > 4096 else args.repeats):
                for name, server in servers.items():
                    runs[name][n].append(server_ttft_s(server, [rng.randrange(vocab) for _ in range(n)]))
                runs["transformers"][n].append(hf_ttft_s(model, [rng.randrange(vocab) for _ in range(n)]))
                if llm:
                    runs["llama.cpp"][n].append(llama_cpp_eval_s(llm, [rng.randrange(vocab) for _ in range(n)]))
                print(n, {name: round(r[n][-1], 2) for name, r in runs.items()}, flush=True)
    finally:
        for server in servers.values():
            server.stop()
    medians = {name: {n: statistics.median(ts) for n, ts in r.items()} for name, r in runs.items()}
    hf = medians["transformers"]
    result = {
        "benchmark": "prefill",
        **machine(),
        "model": args.model,
        "lengths": lengths,
        "threads": torch.get_num_threads(),
        "runs_s": runs,
        "median_s": medians,
        "speedup_vs_transformers": {
            name: {n: hf[n] / m[n] for n in lengths} for name, m in medians.items() if name != "transformers"
        },
        "speedup_vs_llama_cpp": {
            name: {n: medians["llama.cpp"][n] / m[n] for n in lengths}
            for name, m in medians.items()
            if name != "llama.cpp"
        }
        if llm
        else {},
        "chunked_over_whole": {n: medians[f"chunked {args.chunk_size}"][n] / medians["whole"][n] for n in lengths},
    }
    for n in lengths:
        print(
            f"{n:5d} tokens: "
            + ", ".join(f"{name} {m[n]:.2f} s" for name, m in medians.items())
            + f"; whole/transformers {result['speedup_vs_transformers']['whole'][n]:.2f}x, "
            f"chunked/whole {result['chunked_over_whole'][n]:.2f}"
        )
    save("prefill", result, plot)


def plot(result: dict, png) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, m in result["median_s"].items():
        ax.plot(result["lengths"], [m[n] for n in result["lengths"]], marker="o", label=name)
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="prompt tokens",
        ylabel="time to first token (s, median)",
        title=f"Prefill, {result['model']} ({result['commit']})",
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)


if __name__ == "__main__":
    main()
