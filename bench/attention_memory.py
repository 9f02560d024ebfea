"""Decode attention's temporary memory: shard peak RSS at batch 32 with one sequence at the full
context and 31 short ones, and short-context decode speed, for this checkout and a baseline
revision side by side (the baseline runs from a git worktree of that revision).

Per version, against a fresh `shardline serve --max-batch 32` on SmolLM2:
1. short context: one stream (ITL p50 over 128 tokens), then 32 streams at once (tokens/s),
   `--short-repeats` times, the versions interleaved so that both meet the same noise (medians);
2. long context: 32 short streams first (the pool and heap in use), then a prompt of
   `--long-tokens` random tokens; once its first token is out, 31 short streams join it; the
   shard's RSS is sampled throughout and its peak (VmHWM) read at the end. The budget is weights
   + the whole KV pool + 400 MB.

    .venv/bin/python -m bench.attention_memory [--baseline-rev REV] [--weights native|dequantized]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc

from bench.common import machine, save
from harness.client import Stream, astream, concurrently, stream, token_request
from harness.serve import ROOT, Server, peak_rss_mb, rss_mb
from shardline.protos import generation_pb2 as pb
from shardline.protos import generation_pb2_grpc as pb_grpc

BUDGET_EXTRA_MB = 400


def _serve(cwd: Path, args) -> Server:
    weights = ["--weights", args.weights] if cwd == ROOT else []  # a baseline may predate the flag
    return Server("--max-batch", "32", "--prefix-cache", "off", *weights, cwd=cwd)


def measure_short(cwd: Path, args, rng: random.Random) -> dict:
    """Short-context decode on a fresh server: one stream, then 32 at once."""
    server = _serve(cwd, args)
    try:
        prompt = lambda n: [rng.randrange(1000, 40000) for _ in range(n)]
        stream(server.stub, token_request(prompt(32), 8))  # warm-up
        one = stream(server.stub, token_request(prompt(32), 128))
        wall, many = asyncio.run(concurrently(server.target, [token_request(prompt(32), 64) for _ in range(32)]))
        return {
            "itl_p50_ms_1_stream": statistics.median(one.itl_ms),
            "tok_s_32_streams": sum(len(s.ids) for s in many) / wall,
        }
    finally:
        server.stop()


async def _long_joined_by_short(target: str, long_req: pb.GenerateRequest, short_reqs: list[pb.GenerateRequest]):
    """The long request; once its first token is out, the short ones at once. Returns (the long
    stream, when the short ones were sent, the short streams)."""
    async with grpc.aio.insecure_channel(target) as channel:
        long_ = Stream(time.perf_counter())
        task = asyncio.ensure_future(astream(pb_grpc.GenerationStub(channel), long_req, 1800, into=long_))
        while not long_.times and not task.done():
            await asyncio.sleep(0.05)
        joined = time.perf_counter()
        _, shorts = await concurrently(target, short_reqs, 1800)
        await task
    return long_, joined, shorts


def measure_long(cwd: Path, args, rng: random.Random) -> dict:
    """A long sequence, joined by 31 short ones once its first token is out; the shard's RSS."""
    server = _serve(cwd, args)
    try:
        shard = server.roles()["shard"]
        prompt = lambda n: [rng.randrange(1000, 40000) for _ in range(n)]
        # the pool and heap in use first
        asyncio.run(concurrently(server.target, [token_request(prompt(32), 16) for _ in range(32)]))
        rss, stop = [], threading.Event()

        def sample():
            while not stop.is_set():
                rss.append((time.perf_counter(), rss_mb(shard)))
                time.sleep(0.2)

        sampler = threading.Thread(target=sample)
        sampler.start()
        t0 = time.perf_counter()
        long_, joined, shorts = asyncio.run(
            _long_joined_by_short(
                server.target,
                token_request(prompt(args.long_tokens), args.long_new_tokens),
                [token_request(prompt(32), args.short_new_tokens) for _ in range(31)],
            )
        )
        stop.set()
        sampler.join()
        info = server.stub.Info(pb.InfoRequest())  # an older checkout leaves the memory fields 0
        return {
            "prefill_s": joined - t0,
            "peak_rss_mb": peak_rss_mb(shard),
            "rss_mb": [(round(t - t0, 2), round(m, 1)) for t, m in rss],
            "batch_32_from_s": joined - t0,
            "short_tokens": sum(len(s.ids) for s in shorts),
            "long_tokens": len(long_.ids),
            "info": {
                "weight_mb": info.shard_weight_bytes / 2**20,
                "kv_pool_mb": info.shard_kv_pool_bytes / 2**20,
                "num_pages": info.num_pages,
            },
        }
    finally:
        server.stop()


def _worktree(rev: str) -> Path:
    """A checkout of `rev` with its gRPC code generated, in a temporary folder."""
    path = Path(tempfile.mkdtemp(prefix="shardline-baseline-")) / "tree"
    subprocess.run(["git", "worktree", "add", "--detach", str(path), rev], cwd=ROOT, check=True, capture_output=True)
    import grpc_tools
    from grpc_tools import protoc

    include = Path(grpc_tools.__file__).parent / "_proto"
    for proto in sorted((path / "protos").glob("*.proto")):
        protoc.main(
            [
                "protoc",
                f"-I{path}",
                f"-I{include}",
                f"--python_out={path}",
                f"--grpc_python_out={path}",
                str(proto.relative_to(path)),
            ]
        )
    return path


def plot(result: dict, png: Path) -> None:
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(13, 4.8))
    for name, r in result["versions"].items():
        t, m = zip(*r["long"]["rss_mb"]) if r["long"]["rss_mb"] else ((), ())
        a1.plot(t, m, label=f"{name} (peak {r['long']['peak_rss_mb']:.0f} MB)")
        a1.axvline(r["long"]["batch_32_from_s"], ls=":", color=a1.lines[-1].get_color())
    a1.axhline(result["budget_mb"], ls="--", color="red", label=f"budget {result['budget_mb']:.0f} MB")
    a1.set(title=f"shard RSS: {result['long_tokens']}-token sequence, then +31 short (dotted)", xlabel="s", ylabel="MB")
    a1.legend(fontsize=8)
    names = list(result["versions"])
    for j, key in enumerate(["itl_p50_ms_1_stream", "tok_s_32_streams"]):
        bars = a2.bar(
            [i + 0.4 * j for i in range(len(names))],
            [result["versions"][n]["short_context"][key] for n in names],
            0.4,
            label=key,
        )
        a2.bar_label(bars, fmt="%.1f")
    a2.set_xticks([i + 0.2 for i in range(len(names))], names)
    a2.set(title="short-context decode")
    a2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline-rev", default="", help="git revision to compare with (e.g. the parent commit)")
    ap.add_argument("--long-tokens", type=int, default=8000)
    ap.add_argument("--long-new-tokens", type=int, default=190)
    ap.add_argument("--short-new-tokens", type=int, default=64)
    ap.add_argument("--short-repeats", type=int, default=3)
    ap.add_argument("--weights", default="native", help="this checkout's --weights (native | dequantized)")
    args = ap.parse_args()
    trees = {"this checkout": ROOT}
    if args.baseline_rev:
        trees = {f"baseline {args.baseline_rev}": _worktree(args.baseline_rev), **trees}
    result = {
        "benchmark": "attention_memory",
        **machine(),
        "long_tokens": args.long_tokens,
        "weights": args.weights,
        "short_repeats": args.short_repeats,
        "versions": {n: {"short_runs": []} for n in trees},
    }
    rng = random.Random(0)
    try:
        for _ in range(args.short_repeats):  # interleaved, so that both see the same noise
            for name, cwd in trees.items():
                result["versions"][name]["short_runs"].append(measure_short(cwd, args, rng))
        for name, cwd in trees.items():
            result["versions"][name]["long"] = measure_long(cwd, args, random.Random(1))
    finally:
        for cwd in trees.values():
            if cwd != ROOT:
                subprocess.run(["git", "worktree", "remove", "--force", str(cwd)], cwd=ROOT, capture_output=True)
    for r in result["versions"].values():
        r["short_context"] = {k: statistics.median(run[k] for run in r["short_runs"]) for k in r["short_runs"][0]}
    info = result["versions"]["this checkout"]["long"]["info"]
    result["budget_mb"] = info["weight_mb"] + info["kv_pool_mb"] + BUDGET_EXTRA_MB
    for name, r in result["versions"].items():
        r["within_budget"] = r["long"]["peak_rss_mb"] <= result["budget_mb"]
        print(name, "short context (median of repeats):", r["short_context"], "peak RSS MB", r["long"]["peak_rss_mb"])
    save("attention_memory", result, plot)
    print(
        f"budget {result['budget_mb']:.0f} MB:",
        {n: round(r["long"]["peak_rss_mb"]) for n, r in result["versions"].items()},
    )


if __name__ == "__main__":
    sys.exit(main())
