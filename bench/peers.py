"""Shardline against its peers on the same prompts, one after the other (never two at once):
`transformers` generate (fp32, batch 1 and 8), llama.cpp through `llama-cpp-python` on the same
GGUF (one stream: its high-level API decodes one sequence), llama.cpp's own `llama-server`
(continuous batching, `-np` slots) at 1, 16 and 32 streams, and Shardline with native and with
dequantized weights at 1, 8, 16 and 32 concurrent streams.

    python -m bench.peers [--max-new-tokens 128] [--repeats 2] [--llama-server PATH]

llama.cpp is the optional `peers` extra (`pip install -e .[peers]`: builds from source, about ten
minutes on two cores); without it that peer is reported as missing. `llama-server` is built with
cmake from the llama.cpp source that the `llama-cpp-python` sdist vendors (the README says how);
give its path with --llama-server or $LLAMA_SERVER. Shardline native and `llama-server` are
driven through the same OpenAI-API client (bench/http.py) at the same concurrencies.

Two rates per run: tok/s, completion tokens over wall time from the first request to the last
token, prefill included; and decode tok/s, the tokens after each stream's first over the window
from the first token to the last (what ITL measures). ITL is the gap between streamed tokens.
Writes bench/out/peers-<time>.json and .png.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import time
from pathlib import Path

import grpc

from bench.common import PLAIN_DECODE, llama_cpp_model, machine, save
from bench.http import http_scenario, llama_server, summary
from bench.load import hf_run, hf_setup
from harness.client import PROMPTS, http_concurrently, http_workload, run_scenario, warm_up
from harness.serve import CpuMeter, Server
from shardline.protos import generation_pb2 as pb
from shardline.protos import generation_pb2_grpc as pb_grpc


def median(values: list[float]) -> float:
    return float(statistics.median(values))


def llama_cpp_peer(max_new: int, repeats: int) -> dict:
    llm = llama_cpp_model()
    if llm is None:
        return {"missing": "llama-cpp-python is not installed (pip install -e .[peers])"}
    import llama_cpp
    from transformers import AutoTokenizer

    from shardline.common.model_source import resolve_model
    from shardline.common.tokenizer_files import tokenizer_folder

    tok = AutoTokenizer.from_pretrained(tokenizer_folder(resolve_model("smollm2")))
    no_eos = {llm.token_eos(): -1e9}  # always max_new tokens, as the other peers generate

    def one(prompt_ids: list[int], n: int) -> dict:
        llm.reset()
        t0, times = time.perf_counter(), []
        for _ in llm.create_completion(
            prompt_ids, max_tokens=n, temperature=0.0, repeat_penalty=1.0, top_k=1, stream=True, logit_bias=no_eos
        ):
            times.append(time.perf_counter())
        times = times[:n]  # the stream ends with a chunk that only says why it finished
        wall = times[-1] - t0
        itl = [(b - a) * 1e3 for a, b in zip(times, times[1:])]
        return {
            "tok_s": len(times) / wall,
            "ttft_ms": (times[0] - t0) * 1e3,
            "itl_ms_p50": median(itl) if itl else None,
            "tokens": len(times),
        }

    ids = tok(PROMPTS[0], add_special_tokens=False)["input_ids"]
    one(ids, 8)  # warm-up
    runs = [one(tok(PROMPTS[i % len(PROMPTS)], add_special_tokens=False)["input_ids"], max_new) for i in range(repeats)]
    return {
        "version": llama_cpp.__version__,
        "runs": runs,
        "tok_s": median([r["tok_s"] for r in runs]),
        "itl_ms_p50": median([r["itl_ms_p50"] for r in runs]),
    }


def http_runs(base_url: str, model: str, n: int, max_new: int, repeats: int, meter) -> dict:
    """`n` streams through the OpenAI API at `base_url`, after an untimed warm-up of that shape."""
    asyncio.run(http_concurrently(base_url, http_workload(model, n, 8)))
    return summary([http_scenario(base_url, model, n, max_new, meter) for _ in range(repeats)])


def llama_server_peer(path: str | None, streams: list[int], max_new: int, repeats: int) -> dict:
    """llama.cpp's `llama-server` on the same GGUF, started per concurrency with that many slots
    (`-np n`, continuous batching) and 2048 tokens of context per slot."""
    if not path or not Path(path).is_file():
        return {"missing": "no llama-server (build it from the llama-cpp-python sdist; --llama-server PATH)"}
    out = {"path": path, "streams": {}}
    for n in streams:
        with llama_server(path, n) as base_url:
            out["streams"][n] = http_runs(base_url, "smollm2", n, max_new, repeats, CpuMeter(None))
            print(
                f"llama-server {n} streams: {out['streams'][n]['tok_s']:.1f} tok/s, "
                f"decode {out['streams'][n]['decode_tok_s']:.1f}, ITL p50 {out['streams'][n]['itl_ms_p50']:.1f} ms",
                flush=True,
            )
    return out


def transformers_peer(max_new: int, repeats: int) -> dict:
    model, tok = hf_setup("smollm2")
    out = {}
    for batch in (1, 8):
        hf_run(model, tok, batch, 4)  # warm-up
        runs = [hf_run(model, tok, batch, max_new) for _ in range(repeats)]
        out[batch] = {"tok_s": median([r["tok_s"] for r in runs]), "runs": [r["tok_s"] for r in runs]}
    del model
    return out


def shardline_peer(weights: str, streams: list[int], max_new: int, repeats: int, http: list[int]) -> dict:
    """Over gRPC at each of `streams`, and over the OpenAI API at each of `http`."""
    server = Server("--weights", weights, "--max-batch", str(max(streams)), *PLAIN_DECODE)
    try:
        stub = pb_grpc.GenerationStub(grpc.insecure_channel(server.target))
        info = stub.Info(pb.InfoRequest(), timeout=30)
        warm_up(server.target, 1, 8)
        meter, out = (
            CpuMeter(server),
            {
                "startup_s": server.startup_s,
                "weight_formats": dict(info.weight_formats),
                "shard_weight_mb": info.shard_weight_bytes / 2**20,
                "kv_pool_mb": info.shard_kv_pool_bytes / 2**20,
                "streams": {},
            },
        )
        for n in streams:
            warm_up(server.target, n, max_new)  # untimed: warms this batch shape
            runs = []
            for _ in range(repeats):
                steps0 = stub.Stats(pb.StatsRequest(), timeout=10).steps
                runs.append(run_scenario(stub, server.target, n, max_new, steps0, meter))
            out["streams"][n] = {
                "tok_s": median([r["tok_s"] for r in runs]),
                "decode_tok_s": median([r["decode_tok_s"] for r in runs]),
                "itl_ms_p50": median([r["itl_ms"]["p50"] for r in runs]),
                "shard_decode_step_ms_p50": runs[-1]["stats"]["shard_decode_step_ms_p50"],
                "router_decode_step_ms_p50": runs[-1]["stats"]["decode_step_ms_p50"],
                "other_cpu_pct": median([r["other_cpu_pct"] for r in runs]),
                "ttft_ms_p50": median([r["ttft_ms"]["p50"] for r in runs]),
                "errors": sum(len(r["errors"]) for r in runs),
                "runs": [r["tok_s"] for r in runs],
            }
            print(
                f"shardline {weights} {n} streams: {out['streams'][n]['tok_s']:.1f} tok/s, "
                f"ITL p50 {out['streams'][n]['itl_ms_p50']:.1f} ms",
                flush=True,
            )
        model = info.model
        out["http"] = {n: http_runs(server.http_url, model, n, max_new, repeats, meter) for n in http}
        for n, r in out["http"].items():
            print(
                f"shardline {weights} over HTTP, {n} streams: {r['tok_s']:.1f} tok/s, decode {r['decode_tok_s']:.1f}, "
                f"ITL p50 {r['itl_ms_p50']:.1f} ms",
                flush=True,
            )
        out["memory_after_load"] = server.memory_mb()
        return out
    finally:
        server.stop()


def plot(result: dict, png) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for weights, color in (("native", "tab:blue"), ("dequantized", "tab:gray")):
        streams = result["shardline"][weights]["streams"]
        xs = sorted(int(n) for n in streams)
        ax.plot(xs, [streams[n]["tok_s"] for n in xs], "o-", color=color, label=f"Shardline {weights}")
    for batch, style in ((1, ":"), (8, "--")):
        ax.axhline(
            result["transformers"][batch]["tok_s"],
            ls=style,
            color="tab:orange",
            label=f"transformers fp32 batch {batch}",
        )
    if "tok_s" in result["llama_cpp"]:
        ax.axhline(result["llama_cpp"]["tok_s"], ls="-.", color="tab:green", label="llama.cpp, 1 stream")
    if "streams" in result["llama_server"]:
        ls = result["llama_server"]["streams"]
        xs = sorted(int(n) for n in ls)
        ax.plot(xs, [ls[n]["tok_s"] for n in xs], "s--", color="tab:green", label="llama-server (HTTP)")
        sl = result["shardline"]["native"]["http"]
        ax.plot(xs, [sl[n]["tok_s"] for n in xs if n in sl], "s--", color="tab:cyan", label="Shardline native (HTTP)")
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("tokens/s")
    ax.set_xscale("log", base=2)
    ax.set_title("SmolLM2-135M Q4_1 GGUF, " + result["platform"][:40])
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=100)


def ratios(result: dict) -> dict:
    native = result["shardline"]["native"]["streams"]
    hf = result["transformers"]
    out = {
        "native_1_stream/transformers_batch_1": native[1]["tok_s"] / hf[1]["tok_s"],
        "native_16_streams/transformers_batch_8": native[16]["tok_s"] / hf[8]["tok_s"],
    }
    if "tok_s" in result["llama_cpp"]:
        out["native_1_stream/llama_cpp_1_stream"] = native[1]["tok_s"] / result["llama_cpp"]["tok_s"]
    if "streams" in result["llama_server"]:
        ours = result["shardline"]["native"]["http"]
        for n, theirs in result["llama_server"]["streams"].items():
            if n in ours:
                out[f"native_http_{n}/llama_server_{n}"] = ours[n]["tok_s"] / theirs["tok_s"]
                out[f"native_http_{n}/llama_server_{n}_decode"] = ours[n]["decode_tok_s"] / theirs["decode_tok_s"]
    rss = {w: result["shardline"][w]["memory_after_load"]["shard"]["rss_mb"] for w in ("native", "dequantized")}
    out["shard_rss_mb_saved_native_vs_dequantized"] = rss["dequantized"] - rss["native"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--streams", default="1,8,16,32")
    parser.add_argument("--server-streams", default="1,16,32", help="concurrencies against llama-server")
    parser.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER") or shutil.which("llama-server"))
    args = parser.parse_args()
    streams = [int(s) for s in args.streams.split(",")]
    server_streams = [int(s) for s in args.server_streams.split(",")]
    result = {"benchmark": "peers", **machine(), "max_new_tokens": args.max_new_tokens, "repeats": args.repeats}
    # Shardline first: the peers that run inside this process (transformers' OpenMP team,
    # llama.cpp's thread pool) may leave threads behind that compete with a server started later.
    result["shardline"] = {
        w: shardline_peer(w, streams, args.max_new_tokens, args.repeats, server_streams if w == "native" else [])
        for w in ("native", "dequantized")
    }
    result["llama_server"] = llama_server_peer(args.llama_server, server_streams, args.max_new_tokens, args.repeats)
    result["transformers"] = transformers_peer(args.max_new_tokens, args.repeats)
    print("transformers:", {b: round(r["tok_s"], 1) for b, r in result["transformers"].items()}, flush=True)
    result["llama_cpp"] = llama_cpp_peer(args.max_new_tokens, max(3, args.repeats))
    print("llama.cpp:", result["llama_cpp"].get("tok_s", result["llama_cpp"].get("missing")), flush=True)
    if {1, 16} <= set(streams):
        result["ratios"] = ratios(result)
        print(result["ratios"])
    save("peers", result, plot)


if __name__ == "__main__":
    main()
