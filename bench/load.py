"""Load benchmark: concurrent streaming Generate against `shardline serve`, with Hugging Face
`generate` on the same weights as the baseline, in the same run (never both at once).

    .venv/bin/python -m bench.load [--concurrency 1,8,16] [--max-new-tokens 128] [--repeats 3]

Writes <out>/load-<timestamp>.json and .png (default out: bench/out/) and prints a summary.
Latencies are taken on the client as each message arrives; tokens/s is completion tokens over
the scenario's wall time (first send to last message), prefill included, as for the baseline.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np
import torch
from google.protobuf.json_format import MessageToDict

from harness.client import PROMPTS, run_scenario, warm_up
from harness.serve import ROOT, CpuMeter, Server
from shardline.protos import generation_pb2 as pb
from shardline.protos import generation_pb2_grpc as pb_grpc


def median_tree(rows: list[dict]) -> dict:
    """Median over repeats of every numeric leaf, nested dicts included."""
    out = {}
    for key in rows[0]:
        vals = [r.get(key) for r in rows]
        if all(isinstance(v, dict) for v in vals):
            out[key] = median_tree(vals)
        elif nums := [v for v in vals if isinstance(v, (int, float)) and not isinstance(v, bool)]:
            out[key] = float(statistics.median(nums))
    return out


# --- Hugging Face baseline ---


def hf_setup(model_spec: str):
    from transformers import AutoTokenizer

    from harness.reference import transformers_model
    from shardline.common.model_source import resolve_model
    from shardline.common.tokenizer_files import tokenizer_folder

    source = resolve_model(model_spec)
    tok = AutoTokenizer.from_pretrained(tokenizer_folder(source))  # the files the router reads
    tok.padding_side = "left"
    tok.pad_token = tok.pad_token or tok.eos_token
    if model_spec == "smollm2":
        with tempfile.TemporaryDirectory(prefix="bench-hf-") as tmp:  # only holds config.json
            model = transformers_model(source, Path(tmp))
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_spec, dtype=torch.float32)
    return model.float().eval(), tok


@torch.no_grad()
def hf_run(model, tok, batch: int, max_new: int) -> dict:
    # add_special_tokens=False: the router encodes `prompt` the same way.
    enc = tok(PROMPTS[:batch], return_tensors="pt", padding=True, add_special_tokens=False)
    t0 = time.perf_counter()
    out = model.generate(
        **enc, max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False, pad_token_id=tok.pad_token_id
    )
    wall = time.perf_counter() - t0
    new = out[:, enc["input_ids"].shape[1] :]
    return {
        "batch": batch,
        "wall_s": wall,
        "tokens": new.numel(),
        "tok_s": new.numel() / wall,
        "ids_req0": new[0].tolist(),
    }


# --- reporting ---


def plot(path: Path, server: dict, hf: dict, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(16, 4.8))
    conc = sorted(server)
    x = np.arange(len(conc))
    med = np.array([server[n]["median"]["tok_s"] for n in conc])
    spread = [
        med - [min(r["tok_s"] for r in server[n]["repeats"]) for n in conc],
        [max(r["tok_s"] for r in server[n]["repeats"]) for n in conc] - med,
    ]
    a1.errorbar(x, med, yerr=spread, marker="o", capsize=4, label="shardline (median, min-max)")
    for (b, h), color in zip(sorted(hf.items()), ["tab:red", "tab:green", "tab:purple"]):
        a1.axhline(h["median"]["tok_s"], ls="--", color=color, label=f"HF generate, batch {b}")
    a1.set(title="output tokens/s", ylabel="tokens/s", ylim=(0, None))
    for ax, key, name in ((a2, "itl_ms", "inter-token latency"), (a3, "ttft_ms", "time to first token")):
        # TTFT min: the first request of a burst is prefilled alone, before the others arrive.
        for j, p in enumerate(["p50", "p90", "p99", "max"] if key == "itl_ms" else ["min", "p50", "p99", "max"]):
            bars = ax.bar(x + (j - 1.5) * 0.2, [server[n]["median"][key].get(p, 0) for n in conc], 0.2, label=p)
            ax.bar_label(bars, fmt="%.0f", fontsize=7)
        ax.set(title=f"{name} (median of repeats)", ylabel="ms")
    for ax in (a1, a2, a3):
        ax.set_xticks(x, [str(n) for n in conc])
        ax.set_xlabel("concurrent streams")
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def summary(res: dict) -> str:
    f = lambda v, fmt="{:.1f}": "-" if v is None else fmt.format(v)
    pair = lambda d, a, b, fmt="{:.1f}": f"{f(d.get(a), fmt)}/{f(d.get(b), fmt)}"
    lines = [
        f"{'streams':>7} {'tok/s':>7} {'TTFT p50/p99 ms':>16} {'ITL p50/p99 ms':>15} "
        f"{'step ms router/shard':>21} {'overhead':>8} {'window':>6} {'other CPU':>9} {'errors':>6}"
    ]
    for n, s in sorted(res["server"].items()):
        m, st = s["median"], s["stats"]
        lines.append(
            f"{n:>7} {m['tok_s']:>7.1f} {pair(m['ttft_ms'], 'p50', 'p99'):>16} "
            f"{pair(m['itl_ms'], 'p50', 'p99'):>15} "
            f"{pair(st, 'decode_step_ms_p50', 'shard_decode_step_ms_p50'):>21} "
            f"{f(st['overhead_pct']) + '%':>8} {st['window_share']:>6.2f} {m['other_cpu_pct']:>8.0f}% "
            f"{sum(len(r['errors']) for r in s['repeats']):>6}"
        )
    for b, h in sorted(res["hf"].items()):
        lines.append(
            f"HF generate batch {b}: {h['median']['tok_s']:.1f} tok/s "
            f"({h['median']['wall_s']:.2f} s for {h['median']['tokens']:.0f} tokens; "
            f"other CPU {h['median']['other_cpu_pct']:.0f}%, server {h['median']['server_cpu_pct']:.0f}%)"
        )
    lines += [f"ratio {k}: {v:.2f}" for k, v in res["ratios"].items()]
    noisy = [
        f"{label} {k} #{i + 1} ({r['other_cpu_pct']:.0f}%)"
        for label, group in (("streams", res["server"]), ("HF batch", res["hf"]))
        for k, g in group.items()
        for i, r in enumerate(g["repeats"])
        if r["other_cpu_pct"] > 20
    ]
    if noisy:  # another process took CPU meanwhile: those numbers (and ratios) are not clean
        lines.append("WARNING other processes used CPU during: " + "; ".join(noisy))
    if "startup_s" in res:
        lines.append(
            f"startup (spawn to ready): {res['startup_s']:.1f} s "
            f"(converted-model cache present before: {res['cache_present']})"
        )
    for role, mem in res.get("memory_after_load", {}).items():
        lines.append(f"{role} RSS after load: {mem['rss_mb']:.0f} MB (peak {mem['peak_rss_mb']:.0f} MB)")
    return "\n".join(lines)


def run(args, res: dict, server: Server | None) -> None:
    target = server.target if server else args.target
    stub = pb_grpc.GenerationStub(grpc.insecure_channel(target))
    res["info"] = MessageToDict(stub.Info(pb.InfoRequest(), timeout=30))
    warm_up(target, 1, 8)
    hf_batches = [int(b) for b in args.hf_batches.split(",") if b]
    hf_runs = {b: [] for b in hf_batches}
    if hf_batches:
        model, tok = hf_setup(args.model)
        for b in hf_batches:
            hf_run(model, tok, b, 4)  # warm-up
    meter = CpuMeter(server)

    def hf_round():  # the server idles meanwhile; meter.pct shows whether it really does
        for b in hf_batches:
            with meter:
                hf_runs[b].append(hf_run(model, tok, b, args.max_new_tokens))
            hf_runs[b][-1].update(meter.pct)
            print(f"HF batch {b}: {hf_runs[b][-1]['tok_s']:.1f} tok/s", flush=True)

    # Repeats of one concurrency run back to back so the Stats window holds its steps;
    # HF rounds go between the groups so drift on a noisy machine hits both sides.
    for n in [int(c) for c in args.concurrency.split(",") if c]:
        if hf_batches and len(hf_runs[hf_batches[0]]) < args.repeats:
            hf_round()
        reps, steps0 = [], stub.Stats(pb.StatsRequest(), timeout=10).steps
        # Untimed: fills the Stats window with this concurrency's steps (and warms its batch shape).
        warm_up(target, n, args.max_new_tokens)
        for _ in range(args.repeats):
            reps.append(r := run_scenario(stub, target, n, args.max_new_tokens, steps0, meter))
            print(
                f"{n} streams: {r['tok_s']:.1f} tok/s, ITL p50 {r['itl_ms'].get('p50', 0):.1f} ms, "
                f"other CPU {r['other_cpu_pct']:.0f}%, errors {len(r['errors'])}",
                flush=True,
            )
        # Stats of the last repeat: its window holds the most steps of this concurrency.
        res["server"][n] = {"repeats": reps, "median": median_tree(reps), "stats": reps[-1]["stats"]}
        del res["server"][n]["median"]["stats"]
    while hf_batches and len(hf_runs[hf_batches[0]]) < args.repeats:
        hf_round()
    res["hf"] = {b: {"repeats": runs, "median": median_tree(runs)} for b, runs in hf_runs.items()}
    if server:
        res["memory_after_load"] = server.memory_mb()
    for s, b in ((1, 1), (16, 8)):
        if s in res["server"] and b in res["hf"]:
            res["ratios"][f"server_{s}_streams/hf_batch_{b}"] = (
                res["server"][s]["median"]["tok_s"] / res["hf"][b]["median"]["tok_s"]
            )
    if 1 in res["server"] and 1 in res["hf"]:  # same prompt, both greedy: tokens until they differ
        a, b = res["server"][1]["repeats"][0]["raw"]["ids_req0"], res["hf"][1]["repeats"][0]["ids_req0"]
        res["greedy_agreeing_tokens_server1_hf1"] = next(
            (i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))
        )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="'smollm2' or a Hugging Face folder")
    p.add_argument("--target", default="", help="host:port of a running server (else start one)")
    p.add_argument("--serve-args", default="", help="extra flags for `serve`, one shell-quoted string")
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--concurrency", default="1,8,16")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--hf-batches", default="1,8", help="HF baseline batch sizes ('' to skip)")
    p.add_argument("--ready-timeout", type=float, default=900, help="a first start converts the GGUF")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "out")
    args = p.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the finally below still runs
    git = lambda *a: subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    cpu = [ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")]
    res = {
        "argv": [sys.executable, "-m", "bench.load", *sys.argv[1:]],
        "args": vars(args) | {"out": str(args.out)},
        "git_commit": git("rev-parse", "HEAD"),
        "git_status": git("status", "--porcelain").splitlines(),
        "started": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": {
            "nproc": os.cpu_count(),
            "affinity_cpus": len(os.sched_getaffinity(0)),
            "cpu": cpu[0] if cpu else "",
            "python": platform.python_version(),
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "loadavg_before": os.getloadavg(),
        },
        "server": {},
        "hf": {},
        "ratios": {},
    }
    server = None
    try:
        if not args.target:
            from shardline.common.model_source import resolve_model

            src = resolve_model(args.model)
            res["cache_present"] = src.kind != "gguf" or src.cache_dir.exists()
            server = Server(
                "--model",
                args.model,
                "--max-batch",
                str(args.max_batch),
                *shlex.split(args.serve_args),
                timeout=args.ready_timeout,
            )
            res["startup_s"] = server.startup_s
        run(args, res, server)
    finally:
        if server:
            server.stop()
            res["server_exit_code"], res["server_log_tail"] = server.proc.returncode, list(server.log)[-30:]
    res["machine"]["loadavg_after"] = os.getloadavg()
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"load-{datetime.datetime.now():%Y%m%d-%H%M%S}"
    plot(
        stem.with_suffix(".png"),
        res["server"],
        res["hf"],
        f"{args.model}, max_new_tokens {args.max_new_tokens}, {args.repeats} repeats, "
        f"{res['machine']['nproc']} CPUs, commit {res['git_commit'][:10]}",
    )
    stem.with_suffix(".json").write_text(json.dumps(res, indent=1, default=float))
    print(summary(res))
    print(f"wrote {stem.with_suffix('.json')} and {stem.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
