"""Soak: many concurrent streams for a long time, with everything clients do wrong (the
workload: harness/soak.py), against a fresh `shardline serve`.

Written to bench/out/soak-*.json and .png: requests by final status, TTFT and ITL p50/p99 per
time window, router and shard RSS over time, the pool at the end (after all clients are done),
and streams that went silent (no message for `--silent-s`, default 60) while open.

    .venv/bin/python -m bench.soak [--streams 200] [--duration-s 600] [--model smollm2]
"""

from __future__ import annotations

import argparse
import asyncio
from dataclasses import fields

from bench.common import machine, save
from harness.serve import Server
from harness.soak import SoakArgs, run_soak


def plot(result: dict, png) -> None:
    import matplotlib.pyplot as plt

    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(17, 4.8))
    statuses = sorted(result["statuses"].items(), key=lambda kv: -kv[1])
    bars = a1.bar([k for k, _ in statuses], [v for _, v in statuses])
    a1.bar_label(bars)
    a1.set(title=f"{result['requests']} requests by final status", yscale="log")
    a1.tick_params(axis="x", rotation=30)
    w = result["windows"]
    t = [x["t"] for x in w]
    for key, style in (("ttft_p50_ms", "-"), ("ttft_p99_ms", "--"), ("itl_p50_ms", "-"), ("itl_p99_ms", "--")):
        a2.plot(t, [x[key] or 0 for x in w], style, marker="o", label=key)
    a2.set(title=f"latency by request start, {result['window_s']:.0f} s windows", xlabel="s", ylabel="ms", yscale="log")
    a2.legend(fontsize=8)
    for role in ("router", "shard"):
        a3.plot([m[0] for m in result["memory_mb"]], [m[1].get(role, 0) for m in result["memory_mb"]], label=role)
    pool = result["end_pool"]
    silent = result["silent_streams"]
    a3.set(
        title=f"RSS (end: {pool['pages_referenced']} pages referenced; silent > {result['silent_threshold_s']:.0f} s: "
        f"{silent['queued']} queued, {silent['mid_stream']} mid-stream)",
        xlabel="s",
        ylabel="MB",
    )
    a3.legend()
    fig.suptitle(
        f"soak: {result['streams']} streams, {result['duration_s']:.0f} s, {result['tokens_per_s']:.0f} tok/s",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument(
        "--serve-args",
        default="--max-batch 64 --max-waiting 512 --chunk-size 256",
        help="extra flags for shardline serve",
    )
    for f in fields(SoakArgs):  # --streams, --duration-s, ...
        ap.add_argument(
            "--" + f.name.replace("_", "-"), type=type(f.default), default=f.default, help=f.metadata["help"]
        )
    args = ap.parse_args()
    soak = SoakArgs(**{f.name: getattr(args, f.name) for f in fields(SoakArgs)})
    server = Server("--model", args.model, *args.serve_args.split())
    try:
        result = asyncio.run(run_soak(server.target, soak, server))
    finally:
        code = server.stop()
    result.update(
        {"benchmark": "soak", **machine(), "model": args.model, "serve_args": args.serve_args, "server_exit_code": code}
    )
    save("soak", result, plot)
    print(
        {
            k: result[k]
            for k in ("requests", "tokens_per_s", "statuses", "silent_streams", "end_pool", "unknown_or_internal")
        }
    )


if __name__ == "__main__":
    main()
