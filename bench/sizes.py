"""Real model sizes against llama.cpp: random-weight GGUFs of the Llama-3.2-1B, Llama-3.2-3B and
Llama-3.1-8B shapes and of OLMoE-1B-7B's mixture of experts (bench/gguf_shapes.py), served by
Shardline and by llama.cpp's `llama-server`, one after the other in one sitting, through the same
OpenAI client (harness/client.py):

- start to first answer, spawn to a one-token completion's end: first start (the OS page cache
  dropped where this runs as root, and Shardline's cache of the file emptied) and second start,
  in turns, medians over the repeats; and one stream's
  decode right after each first start (Shardline keeps what it converted meanwhile), beside the
  second start's;
- resident memory of the process tree, sampled every 0.1 s: its peak while starting and over the
  whole run, and steady (idle after the workloads), with the same KV capacity in tokens on both
  sides (`-c` against `--kv-memory-gb` for as many fp16 tokens);
- decode tok/s at 1 and 16 streams, and at 1 stream the GB/s of weights read a token, against the
  host's read bandwidth measured here;
- prefill: the latency of a 512- and a 2048-token prompt with one token out (random token ids,
  new on every run, so that no prefix cache helps), and `llama-bench`'s pp512 and tg128 as a
  second peer figure.

    python -m bench.sizes --llama-server PATH [--shapes llama-3.2-1b,llama-3.1-8b] [--type Q4_K_M]
        [--models DIR] [--max-new-tokens 128] [--repeats 3] [--keep] [--shardline-flags "..."]

`llama-quantize` and `llama-bench` are taken from beside `llama-server`. A GGUF made here is
deleted after its shape, with Shardline's cache of it, unless --keep (an 8B is some 5 GB).
Writes bench/out/sizes-<time>.json and .png.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shlex
import shutil
import statistics
import subprocess
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import psutil

from bench.common import PLAIN_DECODE, machine, save
from bench.gguf_shapes import SHAPES, make
from bench.http import llama_server
from bench.kernels import read_gb_s
from harness.client import http_concurrently, http_workload
from harness.serve import Server
from shardline.common.model_source import resolve_model

SLOTS = 16  # streams at once, llama-server's -np
KV_TOKENS = SLOTS * 2560  # room for the 2,048-token prompt in any one slot
PREFILL = (512, 2048)


class TreeMemory:
    """The resident bytes of this process's descendants (the server under test and its
    children), sampled every 0.1 s from `mark()` on: `peak` since then, `now()`."""

    def __init__(self):
        self.me, self.peak, self._stop = psutil.Process(), 0, threading.Event()
        threading.Thread(target=self._sample, daemon=True).start()

    def now(self) -> int:
        total = 0
        for p in self.me.children(recursive=True):
            try:
                total += p.memory_info().rss
            except psutil.Error:  # gone between listing and reading
                pass
        return total

    def mark(self) -> None:
        self.peak = 0

    def _sample(self) -> None:
        while not self._stop.wait(0.1):
            self.peak = max(self.peak, self.now())

    def close(self) -> None:
        self._stop.set()


def served_name(base_url: str) -> str:
    return httpx.get(base_url + "/models", timeout=30).json()["data"][0]["id"]


def one_token(base_url: str, model: str, prompt, timeout: float = 900) -> float:
    """Seconds for a completion of one token: all prefill, for a long prompt."""
    t0 = time.perf_counter()
    r = httpx.post(
        base_url + "/completions",
        json={"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0.0},
        timeout=timeout,
    )
    r.raise_for_status()
    return time.perf_counter() - t0


def decode(base_url: str, model: str, n: int, max_new: int) -> dict:
    """`n` streams at once: output tokens a second after each stream's first (usage's count, since
    a random model's token need not end a character), and over the wall time."""
    wall, streams = asyncio.run(http_concurrently(base_url, http_workload(model, n, max_new)))
    errors = [s.error for s in streams if s.error]
    if errors:
        raise RuntimeError(f"{n} streams: {errors[0]}")
    tokens = [s.last.usage.completion_tokens for s in streams]
    window = max(s.ended for s in streams) - min(s.times[0] if s.times else s.ended for s in streams)
    return {"decode_tok_s": sum(t - 1 for t in tokens) / window, "tok_s": sum(tokens) / wall}


def measure(base_url: str, args, memory: TreeMemory, rng) -> dict:
    """The workloads on a started server, and its memory after them."""
    model = served_name(base_url)
    out = {"decode": {}, "prefill_s": {}}
    for n in (1, SLOTS):
        decode(base_url, model, n, 8)  # untimed: warms this batch shape
        runs = [decode(base_url, model, n, args.max_new_tokens) for _ in range(args.repeats)]
        out["decode"][n] = {k: statistics.median(r[k] for r in runs) for k in runs[0]} | {"runs": runs}
        print(f"  {n} streams: {out['decode'][n]['decode_tok_s']:.1f} tok/s decode", flush=True)
    for length in PREFILL:
        runs = [one_token(base_url, model, rng.integers(100, 49000, length).tolist()) for _ in range(args.repeats)]
        out["prefill_s"][length] = {"median": statistics.median(runs), "runs": runs}
        print(f"  prefill {length}: {statistics.median(runs):.2f} s", flush=True)
    time.sleep(2)
    out["steady_bytes"] = memory.now()
    return out


def drop_page_cache() -> bool:
    """Empties the OS page cache (root on Linux), as a first start after a reboot or on a fresh node
    finds it: the GGUF, the Python and torch libraries, llama.cpp's binary read from disk. False
    where it cannot (the first start then reads them from memory)."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def run_server(name: str, start, args, memory: TreeMemory, rng, forget=lambda: None) -> dict:
    """`args.repeats` rounds of a first and a second start of a server, each from spawn to its first
    answer (`start(stack)` spawns it, stopped when `stack` closes, and gives its base URL once it
    is up; before a first start `forget()` empties what the server keeps between starts, and the
    page cache is dropped): their medians; one stream's decode after each first start; and the
    workloads on the last second start."""
    out, runs = {}, {"first": [], "second": []}
    for repeat in range(args.repeats):
        for which in runs:
            with contextlib.ExitStack() as stack:
                if which == "first":
                    forget()
                    out["page_cache_dropped"] = drop_page_cache()
                memory.mark()
                t0 = time.perf_counter()
                url = start(stack)
                one_token(url, served_name(url), "Hello")
                run = {"s": time.perf_counter() - t0, "peak_bytes": memory.peak}
                print(f"  {name} {which} start: {run['s']:.1f} s, peak {run['peak_bytes'] / 1e9:.2f} GB", flush=True)
                if which == "first":  # while a first start may still be keeping what it converted
                    decode(url, served_name(url), 1, 8)
                    run["decode_1"] = decode(url, served_name(url), 1, args.max_new_tokens)["decode_tok_s"]
                    print(f"  {name} first start's decode: {run['decode_1']:.1f} tok/s", flush=True)
                runs[which].append(run)
                if which == "second" and repeat == args.repeats - 1:
                    memory.mark()
                    out |= measure(url, args, memory, rng)
                    out["run_peak_bytes"] = memory.peak
    for which, rows in runs.items():
        out[f"{which}_start_s"] = statistics.median(r["s"] for r in rows)
        out[f"{which}_start_peak_bytes"] = max(r["peak_bytes"] for r in rows)
        out[f"{which}_start_runs"] = rows
    out["first_start_decode_1"] = statistics.median(r["decode_1"] for r in runs["first"])
    return out


def run_shardline(gguf: Path, args, memory: TreeMemory, rng) -> dict:
    kv_gb = KV_TOKENS * kv_bytes_per_token(gguf) / 2**30
    flags = ["--model", str(gguf), "--kv-memory-gb", f"{kv_gb:.4f}", "--max-batch", str(SLOTS), *PLAIN_DECODE]
    flags += shlex.split(args.shardline_flags)

    def start(stack):
        server = Server(*flags, timeout=1800)
        stack.callback(server.stop)
        return server.http_url

    def forget():
        shutil.rmtree(resolve_model(str(gguf)).cache_dir, ignore_errors=True)

    return {"flags": flags, **run_server("Shardline", start, args, memory, rng, forget)}


def run_llama_server(gguf: Path, args, memory: TreeMemory, rng) -> dict:
    def start(stack):  # it keeps nothing between starts
        return stack.enter_context(llama_server(args.llama_server, SLOTS, str(gguf), KV_TOKENS))

    return {"flags": ["-np", str(SLOTS), "-c", str(KV_TOKENS)], **run_server("llama-server", start, args, memory, rng)}


def llama_bench(gguf: Path, args) -> dict:
    binary = Path(args.llama_server).with_name("llama-bench")
    done = subprocess.run(
        [str(binary), "-m", str(gguf), "-p", "512", "-n", "128", "-t", str(os.cpu_count()), "-r", str(args.repeats)]
        + ["-o", "json"],
        capture_output=True,
        text=True,
        check=True,
    )
    return {("pp512" if r["n_prompt"] else "tg128"): r["avg_ts"] for r in json.loads(done.stdout)}


def kv_bytes_per_token(gguf: Path) -> int:
    """fp16 K and V of every layer, as both servers keep them for quantized weights."""
    shape = SHAPES[gguf.stem.rsplit("-", 1)[0]]
    return 2 * shape.layers * shape.kv_heads * shape.head_dim * 2


def weight_bytes_read(gguf: Path) -> int:
    """Bytes of weights a one-stream decode step reads: every tensor but an untied embedding (a
    row a token), and of a mixture's 3-D expert tensors only the share of the experts it picks."""
    from gguf import GGUFReader

    tensors = GGUFReader(str(gguf)).tensors
    tied = not any(t.name == "output.weight" for t in tensors)
    shape = SHAPES[gguf.stem.rsplit("-", 1)[0]]
    share = shape.experts_used / shape.experts if shape.experts else 1.0
    return int(
        sum(
            int(t.n_bytes) * (share if t.name.endswith("_exps.weight") else 1)
            for t in tensors
            if t.name != "token_embd.weight" or tied
        )
    )


def ratios(ours: dict, theirs: dict) -> dict:
    """Shardline over llama-server, each way round so that above 1 is Shardline's better."""
    out = {
        f"decode_{n}": ours["decode"][n]["decode_tok_s"] / theirs["decode"][n]["decode_tok_s"] for n in ours["decode"]
    }
    out |= {f"prefill_{n}": theirs["prefill_s"][n]["median"] / ours["prefill_s"][n]["median"] for n in PREFILL}
    out |= {f"{w}_start": ours[f"{w}_start_s"] / theirs[f"{w}_start_s"] for w in ("first", "second")}
    out["steady_memory"] = ours["steady_bytes"] / theirs["steady_bytes"]
    # Shardline's own: one stream's decode on its first start over that on its second (1: no slower)
    out["own_first_over_second_start_decode"] = ours["first_start_decode_1"] / ours["decode"][1]["decode_tok_s"]
    out["peak_memory_vs_their_steady"] = (
        max(ours["first_start_peak_bytes"], ours["run_peak_bytes"]) / (theirs["steady_bytes"])
    )
    return out  # times and memory: Shardline over llama-server (below 1 is Shardline's better)


def plot(result: dict, png) -> None:
    import matplotlib.pyplot as plt

    shapes = list(result["shapes"])
    panels = {
        "start to first answer, s (first / second)": lambda r: [r["first_start_s"], r["second_start_s"]],
        "memory, GB (peak / steady)": lambda r: [
            max(r["first_start_peak_bytes"], r["run_peak_bytes"]) / 1e9,
            r["steady_bytes"] / 1e9,
        ],
        "decode tok/s (1 / 16 streams)": lambda r: [r["decode"][n]["decode_tok_s"] for n in r["decode"]],
        "prefill tok/s (512 / 2048)": lambda r: [n / r["prefill_s"][n]["median"] for n in PREFILL],
    }
    fig, axes = plt.subplots(1, len(panels), figsize=(16, 4))
    for ax, (title, values) in zip(axes, panels.items()):
        for j, server in enumerate(("shardline", "llama-server")):
            for i, shape in enumerate(shapes):
                pair = values(result["shapes"][shape][server])
                xs = [i * 3 + k + j * 0.4 for k in range(len(pair))]
                ax.bar(xs, pair, 0.4, color=f"C{j}", label=server if i == 0 else None)
        ax.set_xticks([i * 3 + 0.7 for i in range(len(shapes))], shapes, fontsize=8)
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=8)
    fig.suptitle(f"{result['type']} GGUFs of real shapes, random weights: Shardline and llama-server", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-server", required=True, help="llama.cpp's llama-server (llama-bench beside it)")
    ap.add_argument("--shapes", default="llama-3.2-1b,llama-3.1-8b")
    ap.add_argument("--type", default="Q4_K_M")
    ap.add_argument("--models", type=Path, default=Path("/tmp/shardline-shapes"))
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--keep", action="store_true", help="keep the GGUFs made (and Shardline's caches of them)")
    ap.add_argument("--shardline-flags", default="", help="more flags for shardline serve")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    result = {
        "benchmark": "sizes",
        **machine(),
        "type": args.type,
        "llama_server": args.llama_server,
        "kv_tokens": KV_TOKENS,
        "read_gb_s": read_gb_s(mb=1024, runs=7),
        "shapes": {},
    }
    print(f"read bandwidth {result['read_gb_s']:.1f} GB/s", flush=True)
    memory = TreeMemory()
    for shape in args.shapes.split(","):
        made = not (args.models / f"{shape}-{args.type}.gguf").is_file()
        gguf = make(shape, args.type, args.models, str(Path(args.llama_server).with_name("llama-quantize")))
        print(f"{shape}: {gguf} ({gguf.stat().st_size / 1e9:.2f} GB)", flush=True)
        try:
            per = {"gguf_bytes": gguf.stat().st_size, "weight_bytes_read": weight_bytes_read(gguf)}
            per["shardline"] = run_shardline(gguf, args, memory, rng)
            per["llama-server"] = run_llama_server(gguf, args, memory, rng)
            per["llama-bench"] = llama_bench(gguf, args)
            per["ratios"] = ratios(per["shardline"], per["llama-server"])
            for server in ("shardline", "llama-server"):
                one = per[server]["decode"][1]["decode_tok_s"]
                per[server]["read_share_1_stream"] = one * per["weight_bytes_read"] / 1e9 / result["read_gb_s"]
            print(f"  ratios {json.dumps({k: round(v, 2) for k, v in per['ratios'].items()})}", flush=True)
            result["shapes"][shape] = per
        except Exception as e:  # noqa: BLE001 - a shape that fails is a result too; the others still run
            result.setdefault("failed", {})[shape] = f"{type(e).__name__}: {e}"
            print(f"  {shape} failed: {e}", flush=True)
        finally:
            if made and not args.keep:
                shutil.rmtree(resolve_model(str(gguf)).cache_dir, ignore_errors=True)
                gguf.unlink()
    memory.close()
    save("sizes", result, plot)


if __name__ == "__main__":
    main()
