"""The OpenAI-compatible HTTP API against the gRPC API, streaming the same workload from the same
server in turns (so that both meet the same drift of the machine): output tokens/s and
inter-token latency p50/p99 at each concurrency. Target: HTTP within 3% of gRPC's throughput,
ITL p50 within 0.5 ms.

    python -m bench.http [--streams 1,16] [--max-new-tokens 128] [--repeats 3]
    python -m bench.http --base-url http://127.0.0.1:8080/v1 [--model NAME]   # any OpenAI-compatible server
    python -m bench.http --llama-server PATH [--streams 1,16,32]

With --base-url it drives that server over HTTP alone (a peer such as llama.cpp's `llama-server`),
with the same client and workload. With --llama-server, Shardline (default flags) and
`llama-server` (started per concurrency with that many slots) are both up and driven in turns
over HTTP, so that a ratio compares runs minutes apart at most on a machine whose speed drifts.
Writes bench/out/http-<time>.json and .png.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import subprocess
import time
from pathlib import Path

import httpx

from bench.common import PLAIN_DECODE, machine, save
from harness.client import decode_tok_s, http_concurrently, http_workload, percentiles, run_scenario, warm_up
from harness.serve import CpuMeter, Server, free_port
from shardline.protos import generation_pb2 as pb


def http_scenario(base_url: str, model: str, n: int, max_new: int, meter) -> dict:
    with meter:
        wall, streams = asyncio.run(http_concurrently(base_url, http_workload(model, n, max_new)))
    tokens = sum(s.completion_tokens for s in streams)
    return {
        "concurrency": n,
        "wall_s": wall,
        "completion_tokens": tokens,
        "tok_s": tokens / wall,
        "decode_tok_s": decode_tok_s(streams),
        "ttft_ms": percentiles(s.ttft_ms for s in streams),
        "itl_ms": percentiles(x for s in streams for x in s.itl_ms),
        "errors": [s.error for s in streams if s.error],
        **meter.pct,
    }


def summary(runs: list[dict]) -> dict:
    decode = [r["decode_tok_s"] for r in runs if r.get("decode_tok_s")]
    return {
        "tok_s": statistics.median(r["tok_s"] for r in runs),
        "decode_tok_s": statistics.median(decode) if decode else None,
        "itl_ms_p50": statistics.median(r["itl_ms"].get("p50", 0) for r in runs),
        "itl_ms_p99": statistics.median(r["itl_ms"].get("p99", 0) for r in runs),
        "errors": sum(len(r["errors"]) for r in runs),
        "runs": runs,
    }


def against_grpc(args, streams: list[int]) -> dict:
    server = Server("--max-batch", str(max(streams)), *PLAIN_DECODE)
    try:
        model = server.stub.Info(pb.InfoRequest(), timeout=30).model
        meter, out = CpuMeter(server), {}
        for n in streams:
            warm_up(server.target, n, 8)
            asyncio.run(http_concurrently(server.http_url, http_workload(model, n, 8)))
            runs = {"grpc": [], "http": []}
            for rep in range(args.repeats):
                for api in ("grpc", "http") if rep % 2 == 0 else ("http", "grpc"):  # neither always first
                    runs[api].append(
                        run_scenario(server.stub, server.target, n, args.max_new_tokens, server.stats().steps, meter)
                        if api == "grpc"
                        else http_scenario(server.http_url, model, n, args.max_new_tokens, meter)
                    )
                print(
                    f"{n} streams: gRPC {runs['grpc'][-1]['tok_s']:.1f} tok/s, HTTP {runs['http'][-1]['tok_s']:.1f}",
                    flush=True,
                )
            grpc_, http_ = summary(runs["grpc"]), summary(runs["http"])
            out[n] = {
                "grpc": grpc_,
                "http": http_,
                "http_vs_grpc_tok_s": http_["tok_s"] / grpc_["tok_s"],
                "http_minus_grpc_itl_p50_ms": http_["itl_ms_p50"] - grpc_["itl_ms_p50"],
            }
            print(
                f"{n} streams: HTTP/gRPC tok/s {out[n]['http_vs_grpc_tok_s']:.3f}, "
                f"ITL p50 {out[n]['http_minus_grpc_itl_p50_ms']:+.2f} ms",
                flush=True,
            )
        return out
    finally:
        server.stop()


@contextlib.contextmanager
def llama_server(path: str, slots: int, model: str | None = None, context: int | None = None, extra=()):
    """llama.cpp's `llama-server` on a GGUF (SmolLM2's by default) with `slots` (`-np`, continuous
    batching) sharing `context` tokens of KV cache (2048 a slot by default), on every core, with
    `extra` flags; yields its base URL (".../v1") once healthy."""
    from shardline.common.model_source import resolve_model

    port = free_port()
    proc = subprocess.Popen(
        [
            path,
            "-m",
            str(resolve_model(model).path),
            "-np",
            str(slots),
            "-c",
            str(context or 2048 * slots),
            "-t",
            str(os.cpu_count()),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            *extra,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        for _ in range(6000):
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {proc.returncode}")
            time.sleep(0.1)
        else:
            raise RuntimeError("llama-server did not become healthy within 10 minutes")
        yield base + "/v1"
    finally:
        proc.terminate()
        proc.wait(30)


def against_llama_server(args, streams: list[int]) -> dict:
    if not Path(args.llama_server).is_file():
        raise SystemExit(f"no llama-server at {args.llama_server}")
    server = Server("--max-batch", str(max(streams)), *PLAIN_DECODE)
    try:
        ours = server.http_url
        model = server.stub.Info(pb.InfoRequest(), timeout=30).model
        out = {}
        for n in streams:
            with llama_server(args.llama_server, n) as theirs:
                urls = {"shardline": (ours, model), "llama-server": (theirs, "smollm2")}
                for url, name in urls.values():  # untimed: warms this batch shape
                    asyncio.run(http_concurrently(url, http_workload(name, n, 8)))
                runs = {name: [] for name in urls}
                for rep in range(args.repeats):
                    for name in urls if rep % 2 == 0 else reversed(urls):  # neither always first
                        url, served = urls[name]
                        runs[name].append(http_scenario(url, served, n, args.max_new_tokens, CpuMeter(None)))
                    print(
                        f"{n} streams: " + ", ".join(f"{k} {v[-1]['tok_s']:.1f} tok/s" for k, v in runs.items()),
                        flush=True,
                    )
            ours_, theirs_ = summary(runs["shardline"]), summary(runs["llama-server"])
            out[n] = {
                "shardline": ours_,
                "llama-server": theirs_,
                "tok_s_ratio": ours_["tok_s"] / theirs_["tok_s"],
                "decode_tok_s_ratio": ours_["decode_tok_s"] / theirs_["decode_tok_s"],
            }
            print(
                f"{n} streams: Shardline/llama-server tok/s {out[n]['tok_s_ratio']:.2f}x, "
                f"decode {out[n]['decode_tok_s_ratio']:.2f}x",
                flush=True,
            )
        return out
    finally:
        server.stop()


def peer(args, streams: list[int]) -> dict:
    model = args.model or httpx.get(args.base_url + "/models", timeout=30).json()["data"][0]["id"]
    meter, out = CpuMeter(None), {}
    for n in streams:
        asyncio.run(http_concurrently(args.base_url, http_workload(model, n, 8)))
        out[n] = {
            "http": summary(
                [http_scenario(args.base_url, model, n, args.max_new_tokens, meter) for _ in range(args.repeats)]
            )
        }
        print(f"{n} streams: {out[n]['http']['tok_s']:.1f} tok/s", flush=True)
    return out


def plot(result: dict, png) -> None:
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    ns = sorted(result["streams"], key=int)
    apis = [a for a, v in result["streams"][ns[0]].items() if isinstance(v, dict)]
    width = 0.8 / len(apis)
    for j, api in enumerate(apis):
        xs = [i + (j - (len(apis) - 1) / 2) * width for i in range(len(ns))]
        a1.bar(xs, [result["streams"][n][api]["tok_s"] for n in ns], width, label=api)
        a2.bar(xs, [result["streams"][n][api]["itl_ms_p50"] for n in ns], width, label=f"{api} p50")
    for ax, title in ((a1, "output tokens/s"), (a2, "inter-token latency p50, ms")):
        ax.set_xticks(range(len(ns)), [f"{n} streams" for n in ns])
        ax.set_title(title)
        ax.legend()
    fig.suptitle(
        result.get("base_url")
        or (
            "Shardline against llama-server over HTTP, in turns"
            if "shardline" in apis
            else "Shardline: HTTP against gRPC, same server, in turns"
        ),
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(png, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", default="1,16")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--base-url", default="", help="an OpenAI-compatible server to drive instead (.../v1)")
    ap.add_argument("--model", default="", help="with --base-url: the model to ask for (default: its first)")
    ap.add_argument(
        "--llama-server", default="", help="llama.cpp's llama-server binary, driven in turns with Shardline"
    )
    args = ap.parse_args()
    streams = [int(s) for s in args.streams.split(",")]
    result = {
        "benchmark": "http",
        **machine(),
        "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats,
        "base_url": args.base_url,
    }
    result["streams"] = (
        peer(args, streams)
        if args.base_url
        else against_llama_server(args, streams)
        if args.llama_server
        else against_grpc(args, streams)
    )
    save("http", result, plot)


if __name__ == "__main__":
    main()
