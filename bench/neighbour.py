"""Decode beside a noisy neighbour: Shardline and llama-server on one GGUF, each alone on the host
and then with another process keeping one core busy (a Python busy loop, unpinned, as a
co-tenant's job would be), at 1 and 16 streams.

    python -m bench.neighbour --model /work/models/llama-3.2-1b-Q4_K_M.gguf [--llama-server PATH]
        [--rounds 3] [--max-new-tokens 128]

Each round runs both servers quiet and loud in turns (quiet, loud, for one server, then the
other), so that a ratio compares runs a minute apart on a machine whose read bandwidth drifts;
medians over rounds of each stream count's decode tok/s (bench/sizes.py's `decode`). Reported:
each server's loud over quiet (the issue asks >= 0.5 for Shardline) and Shardline over
llama-server, quiet and loud. Writes bench/out/neighbour-<time>.json and .png.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import shutil
import statistics
from pathlib import Path

from bench.common import PLAIN_DECODE, machine, save
from bench.http import llama_server
from bench.kernels import read_gb_s
from bench.sizes import KV_TOKENS, SLOTS, decode, kv_bytes_per_token, served_name
from harness.serve import Server

STREAMS = (1, SLOTS)


def _busy() -> None:
    while True:
        pass


@contextlib.contextmanager
def neighbour(on: bool):
    """One process spinning on whichever core the scheduler gives it, while the block runs."""
    if not on:
        yield
        return
    proc = multiprocessing.get_context("spawn").Process(target=_busy, daemon=True)
    proc.start()
    try:
        yield
    finally:
        proc.kill()
        proc.join()


@contextlib.contextmanager
def started(side: str, gguf: Path, llama: str | None):
    if side == "llama-server":
        with llama_server(llama, SLOTS, str(gguf), KV_TOKENS) as url:
            yield url
        return
    kv_gb = KV_TOKENS * kv_bytes_per_token(gguf) / 2**30
    flags = ["--model", str(gguf), "--kv-memory-gb", f"{kv_gb:.4f}", "--max-batch", str(SLOTS), *PLAIN_DECODE]
    server = Server(*flags, timeout=1800)
    try:
        yield server.http_url
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER") or shutil.which("llama-server"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    sides = ["shardline"] + (["llama-server"] if args.llama_server else [])
    result = {"benchmark": "neighbour", **machine(), "model": str(args.model), "read_gb_s": read_gb_s()}
    print(f"read bandwidth {result['read_gb_s']:.1f} GB/s", flush=True)
    runs = {side: {loud: {n: [] for n in STREAMS} for loud in ("quiet", "loud")} for side in sides}
    for rnd in range(args.rounds):
        for side in sides if rnd % 2 == 0 else sides[::-1]:
            with started(side, args.model, args.llama_server) as url:
                model = served_name(url)
                for n in STREAMS:
                    decode(url, model, n, 8)  # untimed: warms this batch shape
                for loud in ("quiet", "loud"):
                    with neighbour(loud == "loud"):
                        for n in STREAMS:
                            tok_s = decode(url, model, n, args.max_new_tokens)["decode_tok_s"]
                            runs[side][loud][n].append(tok_s)
                            print(f"round {rnd} {side} {loud} {n} streams: {tok_s:.1f} tok/s", flush=True)
    medians = {
        side: {loud: {n: statistics.median(r) for n, r in by_n.items()} for loud, by_n in by_loud.items()}
        for side, by_loud in runs.items()
    }
    result |= {"runs": runs, "medians": medians, "ratios": {}}
    for n in STREAMS:
        for side in sides:
            result["ratios"][f"{side} {n} streams: loud/quiet"] = medians[side]["loud"][n] / medians[side]["quiet"][n]
        if "llama-server" in medians:
            for loud in ("quiet", "loud"):
                ours, theirs = medians["shardline"][loud][n], medians["llama-server"][loud][n]
                result["ratios"][f"{n} streams {loud}: shardline/llama-server"] = ours / theirs
    for key, value in result["ratios"].items():
        print(f"{key}: {value:.2f}")
    save("neighbour", result, plot)


def plot(result: dict, png) -> None:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(STREAMS), figsize=(9, 4))
    for ax, n in zip(axes, STREAMS):
        sides = list(result["medians"])
        for i, loud in enumerate(("quiet", "loud")):
            values = [result["medians"][side][loud][n] for side in sides]
            ax.bar([x + 0.4 * i for x in range(len(sides))], values, 0.4, label=loud)
        ax.set_xticks([x + 0.2 for x in range(len(sides))], sides)
        ax.set_title(f"{n} stream{'s' if n > 1 else ''}")
        ax.set_ylabel("decode tok/s")
        ax.legend(fontsize=8)
    fig.suptitle(f"Decode beside a busy-looping neighbour, {Path(result['model']).name}, {result['cpu'][:40]}")
    fig.tight_layout()
    fig.savefig(png, dpi=100)


if __name__ == "__main__":
    main()
