"""Decode graphs on against off, in one run: 1-stream inter-token latency, 8/16/32-stream
throughput, start-to-ready time (graphs on: with a cold and a warm compile cache), the shard's
memory, and the launch counters.

    .venv/bin/python -m bench.decode_graphs [--concurrency 1,8,16,32] [--repeats 3] [--max-new-tokens 64]

Both servers run side by side (the idle one costs nothing); scenarios alternate between them so
the machine's noise hits both. Writes bench/out/decode_graphs-<timestamp>.json and .png.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

from bench.common import machine, save
from harness.client import run_scenario
from harness.serve import CpuMeter, Server
from shardline.protos import generation_pb2 as pb


def start(name: str, graphs: str, max_batch: int, env: dict) -> tuple[Server, float]:
    os.environ.update(env)
    t0 = time.perf_counter()
    server = Server("--decode-graphs", graphs, "--max-batch", str(max_batch), "--prefix-cache", "off", timeout=1800)
    ready_s = time.perf_counter() - t0
    print(f"{name}: ready in {ready_s:.1f} s", flush=True)
    return server, ready_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", default="1,8,16,32")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args()
    levels = [int(n) for n in args.concurrency.split(",")]
    max_batch = max(levels)
    cache = tempfile.mkdtemp(prefix="bench-inductor-")  # a cold compile cache, then the same one warm
    env = {"TORCHINDUCTOR_CACHE_DIR": cache}
    result = {
        "benchmark": "decode_graphs",
        **machine(),
        "levels": levels,
        "max_new_tokens": args.max_new_tokens,
        "start_s": {},
        "runs": {"off": {n: [] for n in levels}, "on": {n: [] for n in levels}},
    }
    servers = {}
    try:
        servers["off"], result["start_s"]["off"] = start("graphs off", "off", max_batch, env)
        cold, result["start_s"]["on, cold cache"] = start("graphs on (cold cache)", "on", max_batch, env)
        cold.stop()
        servers["on"], result["start_s"]["on, warm cache"] = start("graphs on (warm cache)", "on", max_batch, env)
        info = servers["on"].stub.Info(pb.InfoRequest(), timeout=10)
        result["buckets"], result["capture_s"] = list(info.decode_graph_buckets), info.decode_graph_capture_s
        result["memory_mb"] = {name: s.memory_mb()["shard"] for name, s in servers.items()}
        for _ in range(args.repeats):
            for n in levels:
                for name, server in servers.items():
                    r = run_scenario(server.stub, server.target, n, args.max_new_tokens, 0, CpuMeter(server))
                    assert not r["errors"], r["errors"]
                    result["runs"][name][n].append({"tok_s": r["tok_s"], "itl_p50_ms": r["itl_ms"]["p50"]})
                    print(name, n, round(r["tok_s"], 1), "tok/s, ITL p50", round(r["itl_ms"]["p50"], 1), flush=True)
        result["counters"] = {
            name: {k: getattr(s.stats(), k) for k in ("decode_graph_launches", "eager_decode_steps")}
            for name, s in servers.items()
        }
        result["memory_mb_after"] = {name: s.memory_mb()["shard"] for name, s in servers.items()}
    finally:
        for server in servers.values():
            server.stop()
        shutil.rmtree(cache, ignore_errors=True)
    med = {
        name: {n: {k: statistics.median(r[k] for r in runs[n]) for k in ("tok_s", "itl_p50_ms")} for n in levels}
        for name, runs in result["runs"].items()
    }
    result["median"] = med
    result["on_over_off_tok_s"] = {n: med["on"][n]["tok_s"] / med["off"][n]["tok_s"] for n in levels}
    for n in levels:
        print(
            f"{n:3d} streams: off {med['off'][n]['tok_s']:.1f} tok/s (ITL p50 {med['off'][n]['itl_p50_ms']:.1f} ms), "
            f"on {med['on'][n]['tok_s']:.1f} tok/s (ITL p50 {med['on'][n]['itl_p50_ms']:.1f} ms): "
            f"{result['on_over_off_tok_s'][n]:.2f}x"
        )
    print("start:", result["start_s"], "memory:", result["memory_mb"], "counters:", result["counters"])
    save("decode_graphs", result, plot)


def plot(result: dict, png) -> None:
    import matplotlib.pyplot as plt

    levels = result["levels"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for name, m in result["median"].items():
        a.plot(levels, [m[n]["tok_s"] for n in levels], marker="o", label=f"graphs {name}")
        b.plot(levels, [m[n]["itl_p50_ms"] for n in levels], marker="o", label=f"graphs {name}")
    a.set(xlabel="concurrent streams", ylabel="generated tok/s (median)", title="Throughput")
    b.set(xlabel="concurrent streams", ylabel="ITL p50 (ms, median)", title="Inter-token latency")
    a.legend()
    fig.suptitle(f"Decode graphs on/off ({result['commit']})")
    fig.tight_layout()
    fig.savefig(png, dpi=110)


if __name__ == "__main__":
    main()
