"""Load benchmark: concurrent streaming Generate against `shardline serve`, with Hugging Face
`generate` on the same weights as the baseline, in the same run.

    .venv/bin/python -m bench.load [--concurrency 1,8,16] [--max-new-tokens 128] [--repeats 3]

Writes <out>/load-<timestamp>.json and .png (default out: bench/out/) and prints a summary.
Latencies are taken on the client when each message arrives; tokens/s is completion tokens over
the scenario's wall time (first send to last message), prefill included, like the HF baseline.
"""
from __future__ import annotations

import argparse, asyncio, ctypes, datetime, json, os, platform, shlex, signal, statistics
import subprocess, sys, tempfile, threading, time
from collections import deque
from pathlib import Path

import grpc
import numpy as np
import torch
from google.protobuf.json_format import MessageToDict

from protos import generation_pb2 as pb, generation_pb2_grpc as pb_grpc
from tests.support import free_port

ROOT = Path(__file__).resolve().parent.parent
STATS_WINDOW = 512  # the router's Stats medians cover this many recent decode steps
TOPICS = ["a lighthouse keeper", "a lost robot", "a dragon who cannot fly", "a time-travelling baker",
          "a haunted library", "a city under the sea", "a chess champion", "a talking cat",
          "the last tree on Earth", "a space station cook", "a forgotten violin", "a desert caravan",
          "a clockmaker apprentice", "a mountain rescue dog", "a secret garden", "a retired pirate"]
# 52-56 SmolLM2 tokens each: below one 64-token KV page, so repeats cannot hit the prefix cache.
PROMPTS = [f"Write a short story about {t}. Give the main character a name, a clear goal and a "
           "problem that stands in the way. Describe the setting with vivid details, include some "
           "dialogue, and end with a twist that the reader does not see coming." for t in TOPICS]


def pct(xs) -> dict:
    a = np.asarray(xs, dtype=float)
    if a.size == 0:
        return {}
    return {"min": float(a.min()), **{f"p{q}": float(np.percentile(a, q)) for q in (50, 90, 99)},
            "max": float(a.max())}


def median_tree(rows: list[dict]) -> dict:
    """Median over repeats of every numeric leaf (nested dicts alike)."""
    out = {}
    for key, value in rows[0].items():
        vals = [r.get(key) for r in rows]
        if isinstance(value, dict):
            out[key] = median_tree([v for v in vals if isinstance(v, dict)])
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            nums = [v for v in vals if isinstance(v, (int, float))]
            out[key] = statistics.median(nums) if nums else None
    return out


# --- the server process and its children, read through /proc (psutil is not installed) ---

def _die_with_parent() -> None:
    # So a SIGKILLed benchmark still takes the launcher (and through it, router and shard) down.
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _proc(pid: int, name: str) -> str:
    with open(f"/proc/{pid}/{name}", "rb") as f:
        return f.read().replace(b"\0", b" ").decode(errors="replace")


def _descendants(pid: int) -> list[int]:
    kids = []
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            if int(_proc(int(d), "stat").rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(d))
        except (OSError, IndexError):
            continue
    return kids + [g for k in kids for g in _descendants(k)]


def _status_mb(pid: int, key: str) -> float | None:
    for line in _proc(pid, "status").splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    return None


def _cpu_s(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        try:  # utime + stime, fields 14 and 15 of stat (indices 11, 12 after the comm field)
            f = _proc(pid, "stat").rsplit(")", 1)[1].split()
            total += (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
        except OSError:
            pass
    return total


class Serve:
    """`shardline serve` as a child process; startup_s is spawn to the `ready` line."""

    def __init__(self, args: list[str], timeout: float):
        self.target = f"127.0.0.1:{free_port()}"
        cmd = [sys.executable, "-m", "router.cli", "serve", "--port", self.target.split(":")[1], *args]
        self.log: deque[str] = deque(maxlen=200)
        self.startup_s = None
        ready = threading.Event()
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, preexec_fn=_die_with_parent)

        def pump():  # keeps draining the pipe so the server's logging never blocks on it
            for line in self.proc.stdout:
                self.log.append(line)
                if line.startswith("ready ") and self.startup_s is None:
                    self.startup_s = time.perf_counter() - t0
                    ready.set()
            ready.set()
        threading.Thread(target=pump, daemon=True).start()
        if not ready.wait(timeout) or self.startup_s is None:
            self.stop()
            raise RuntimeError("server never became ready:\n" + "".join(self.log))

    def roles(self) -> dict[str, int]:
        out = {"launcher": self.proc.pid}
        for pid in _descendants(self.proc.pid):
            cmd = " " + _proc(pid, "cmdline")
            out.update({role: pid for role in ("shard", "router") if f" {role} " in cmd})
        return out

    def memory_mb(self) -> dict:
        return {role: {"rss_mb": _status_mb(pid, "VmRSS"), "peak_rss_mb": _status_mb(pid, "VmHWM")}
                for role, pid in self.roles().items()}

    def cpu_s(self) -> float:
        return _cpu_s([self.proc.pid, *_descendants(self.proc.pid)])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # the launcher stops router and shard itself
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# --- load scenarios ---

async def _stream(stub, prompt: str, max_new: int) -> dict:
    req = pb.GenerateRequest(prompt=prompt, max_new_tokens=max_new, ignore_eos=True,
                             sampling=pb.SamplingParams(temperature=0.0))
    t_send, arrivals, ids, last, error = time.perf_counter(), [], [], None, None
    try:
        async for msg in stub.Generate(req, timeout=900):
            now = time.perf_counter()  # first thing: before any client-side work
            if msg.token_ids:
                arrivals.append((now, len(msg.token_ids)))
                ids += msg.token_ids
            last = msg
    except grpc.aio.AioRpcError as e:
        error = f"{e.code().name}: {e.details()}"
    times = [t for t, _ in arrivals]
    return {"t_send": t_send, "t_end": time.perf_counter(), "error": error, "ids": ids,
            "ttft_ms": (times[0] - t_send) * 1e3 if times else None,
            "itl_ms": [(b - a) * 1e3 for a, b in zip(times, times[1:])],
            "multi_token_msgs": sum(n > 1 for _, n in arrivals),
            "completion_tokens": last.usage.completion_tokens if last and last.finish_reason else len(ids),
            "cached_prompt_tokens": last.usage.cached_prompt_tokens if last else 0,
            "finish_reason": last.finish_reason if last else ""}


async def _scenario(target: str, n: int, max_new: int) -> tuple[float, float, list[dict]]:
    async with grpc.aio.insecure_channel(target) as channel:
        await asyncio.wait_for(channel.channel_ready(), 30)  # connection setup is not TTFT
        stub = pb_grpc.GenerationStub(channel)
        cpu0, t0 = time.process_time(), time.perf_counter()
        reqs = await asyncio.gather(*(_stream(stub, PROMPTS[i % len(PROMPTS)], max_new) for i in range(n)))
        return max(r["t_end"] for r in reqs) - t0, time.process_time() - cpu0, reqs


def run_scenario(stub, target: str, n: int, max_new: int, group_steps0: int) -> dict:
    before = stub.Stats(pb.StatsRequest(), timeout=10)
    wall, client_cpu, reqs = asyncio.run(_scenario(target, n, max_new))
    st = stub.Stats(pb.StatsRequest(), timeout=10)  # right away: the medians are a sliding window
    tokens = sum(r["completion_tokens"] for r in reqs)
    itl = [x for r in reqs for x in r["itl_ms"]]
    router_ms, shard_ms = st.decode_step_ms_p50, st.shard_decode_step_ms_p50
    return {
        "concurrency": n, "wall_s": wall, "completion_tokens": tokens, "tok_s": tokens / wall,
        "ttft_ms": pct([r["ttft_ms"] for r in reqs if r["ttft_ms"] is not None]), "itl_ms": pct(itl),
        "errors": [r["error"] for r in reqs if r["error"]],
        "finish_reasons": sorted({r["finish_reason"] for r in reqs}),
        "multi_token_msgs": sum(r["multi_token_msgs"] for r in reqs),
        "cached_prompt_tokens": sum(r["cached_prompt_tokens"] for r in reqs),
        "client_cpu_pct": 100 * client_cpu / wall,  # of one core; near 100 would mean we bottleneck
        "stats": {"decode_step_ms_p50": router_ms, "shard_decode_step_ms_p50": shard_ms,
                  "overhead_pct": (router_ms - shard_ms) / shard_ms * 100 if shard_ms else None,
                  "steps": st.steps - before.steps,
                  # ~share of the medians' window holding this concurrency's steps (steps count
                  # prefills too, so this is approximate); below ~0.5 the medians mostly describe
                  # the previous scenario
                  "window_share": min(1.0, (st.steps - group_steps0) / min(STATS_WINDOW, st.steps))},
        "raw": {"ttft_ms": [r["ttft_ms"] for r in reqs],
                "itl_ms": [[round(x, 3) for x in r["itl_ms"]] for r in reqs]},
        "_first_ids": reqs[0]["ids"],
    }


# --- Hugging Face baseline ---

def hf_setup(model_spec: str, tmp: Path):
    from router.tokenizer import load_tokenizer
    from shard.source import resolve_model
    tok = load_tokenizer(resolve_model(model_spec))  # the tokenizer the router uses
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    if model_spec == "smollm2":
        from tests.support import smollm2_hf_model
        model = smollm2_hf_model(tmp)
    else:
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained(model_spec, dtype=torch.float32)
    return model.float().eval(), tok


@torch.no_grad()
def hf_run(model, tok, batch: int, max_new: int) -> dict:
    # add_special_tokens=False: the router encodes `prompt` the same way.
    enc = tok(PROMPTS[:batch], return_tensors="pt", padding=True, add_special_tokens=False)
    t0 = time.perf_counter()
    out = model.generate(**enc, max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False,
                         pad_token_id=tok.pad_token_id)
    wall = time.perf_counter() - t0
    new = out[:, enc["input_ids"].shape[1]:]
    return {"batch": batch, "wall_s": wall, "tokens": new.numel(), "tok_s": new.numel() / wall,
            "_first_ids": new[0].tolist()}


# --- reporting ---

def plot(path: Path, server: dict, hf: dict, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    conc = sorted(server)
    x = np.arange(len(conc))
    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(16, 4.8))
    med = [server[n]["median"]["tok_s"] for n in conc]
    lo = [med[i] - min(r["tok_s"] for r in server[n]["repeats"]) for i, n in enumerate(conc)]
    hi = [max(r["tok_s"] for r in server[n]["repeats"]) - med[i] for i, n in enumerate(conc)]
    a1.errorbar(x, med, yerr=[lo, hi], marker="o", capsize=4, label="shardline (median, min-max)")
    for (b, h), color in zip(sorted(hf.items()), ["tab:red", "tab:green", "tab:purple"]):
        a1.axhline(h["median"]["tok_s"], ls="--", color=color, label=f"HF generate batch {b}")
    a1.set(title="output tokens/s", xlabel="concurrent streams", ylabel="tokens/s", ylim=(0, None))
    for ax, key, name in ((a2, "itl_ms", "inter-token latency"), (a3, "ttft_ms", "time to first token")):
        for j, p in enumerate(["p50", "p90", "p99", "max"]):
            vals = [server[n]["median"][key].get(p, 0) for n in conc]
            bars = ax.bar(x + (j - 1.5) * 0.2, vals, 0.2, label=p)
            ax.bar_label(bars, fmt="%.0f", fontsize=7)
        ax.set(title=f"{name} (median of repeats)", xlabel="concurrent streams", ylabel="ms")
    for ax in (a1, a2, a3):
        ax.set_xticks(x, [str(n) for n in conc])
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def summary(res: dict) -> str:
    f = lambda v, fmt="{:.1f}": "-" if v is None else fmt.format(v)
    lines = [f"{'streams':>7} {'tok/s':>7} {'TTFT p50/p99 ms':>16} {'ITL p50/p99 ms':>15} "
             f"{'step ms router/shard':>21} {'overhead':>8} {'window':>6} {'errors':>6}"]
    for n, s in sorted(res["server"].items()):
        m, st = s["median"], s["stats"]
        lines.append(f"{n:>7} {m['tok_s']:>7.1f} {f(m['ttft_ms']['p50']) + '/' + f(m['ttft_ms']['p99']):>16} "
                     f"{f(m['itl_ms'].get('p50')) + '/' + f(m['itl_ms'].get('p99')):>15} "
                     f"{f(st['decode_step_ms_p50'], '{:.2f}') + '/' + f(st['shard_decode_step_ms_p50'], '{:.2f}'):>21} "
                     f"{f(st['overhead_pct']) + '%':>8} {f(st['window_share'], '{:.2f}'):>6} "
                     f"{sum(len(r['errors']) for r in s['repeats']):>6}")
    for b, h in sorted(res["hf"].items()):
        lines.append(f"HF generate batch {b}: {h['median']['tok_s']:.1f} tok/s "
                     f"({h['median']['wall_s']:.2f} s for {h['median']['tokens']} tokens)")
    for k, v in res["ratios"].items():
        lines.append(f"ratio {k}: {f(v, '{:.2f}')}")
    if res.get("startup_s") is not None:
        lines.append(f"startup (spawn to ready): {res['startup_s']:.1f} s "
                     f"(converted-model cache present before: {res['cache_present']})")
    for role, mem in (res.get("memory_after_load") or {}).items():
        lines.append(f"{role} RSS after load: {f(mem['rss_mb'], '{:.0f}')} MB (peak {f(mem['peak_rss_mb'], '{:.0f}')} MB)")
    return "\n".join(lines)


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
    p.add_argument("--ready-timeout", type=float, default=900, help="first start converts the GGUF")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "out")
    args = p.parse_args()
    conc = [int(c) for c in args.concurrency.split(",") if c]
    hf_batches = [int(b) for b in args.hf_batches.split(",") if b]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the finally below still runs
    git = lambda *a: subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    res = {"argv": [sys.executable, "-m", "bench.load", *sys.argv[1:]], "args": {k: str(v) for k, v in vars(args).items()},
           "git_commit": git("rev-parse", "HEAD"), "git_dirty": git("status", "--porcelain").splitlines(),
           "started": datetime.datetime.now().isoformat(timespec="seconds"),
           "machine": {"nproc": os.cpu_count(), "affinity": len(os.sched_getaffinity(0)),
                       "cpu": next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), ""),
                       "python": platform.python_version(), "torch": torch.__version__,
                       "torch_threads": torch.get_num_threads(), "loadavg_before": os.getloadavg()},
           "server": {}, "hf": {}, "ratios": {}}
    server = None
    try:
        if args.target:
            target = args.target
        else:
            from shard.source import resolve_model
            src = resolve_model(args.model)
            res["cache_present"] = src.kind != "gguf" or src.cache_dir.exists()
            server = Serve(["--model", args.model, "--max-batch", str(args.max_batch),
                            *shlex.split(args.serve_args)], args.ready_timeout)
            target, res["startup_s"] = server.target, server.startup_s
        channel = grpc.insecure_channel(target)
        stub = pb_grpc.GenerationStub(channel)
        res["info"] = MessageToDict(stub.Info(pb.InfoRequest(), timeout=30))
        asyncio.run(_scenario(target, 1, 8))  # warm-up
        model = tok = None
        if hf_batches:
            model, tok = hf_setup(args.model, Path(tempfile.mkdtemp(prefix="bench-hf-")))
            for b in hf_batches:
                hf_run(model, tok, b, 4)  # warm-up
        hf_runs = {b: [] for b in hf_batches}
        server_cpu_during_hf = 0.0

        def hf_round():  # the server idles meanwhile; its CPU use then is recorded as interference
            nonlocal server_cpu_during_hf
            cpu0 = server.cpu_s() if server else 0.0
            for b in hf_batches:
                hf_runs[b].append(hf_run(model, tok, b, args.max_new_tokens))
                print(f"HF batch {b}: {hf_runs[b][-1]['tok_s']:.1f} tok/s", flush=True)
            server_cpu_during_hf += (server.cpu_s() - cpu0) if server else 0.0

        # Repeats of one concurrency run back to back so the Stats window mostly holds its own
        # steps; HF rounds are spread between the groups so machine drift hits both sides.
        for n in conc:
            if hf_batches and len(hf_runs[hf_batches[0]]) < args.repeats:
                hf_round()
            reps, steps0 = [], stub.Stats(pb.StatsRequest(), timeout=10).steps
            for _ in range(args.repeats):
                reps.append(run_scenario(stub, target, n, args.max_new_tokens, steps0))
                r = reps[-1]
                print(f"{n} streams: {r['tok_s']:.1f} tok/s, ITL p50 {r['itl_ms'].get('p50', 0):.1f} ms, "
                      f"errors {len(r['errors'])}", flush=True)
            # Stats from the last repeat: its window holds the most steps of this concurrency.
            res["server"][n] = {"repeats": reps, "median": median_tree(reps), "stats": reps[-1]["stats"]}
            res["server"][n]["median"].pop("stats")
        while hf_batches and len(hf_runs[hf_batches[0]]) < args.repeats:
            hf_round()
        res["hf"] = {b: {"repeats": runs, "median": median_tree(runs)} for b, runs in hf_runs.items()}
        res["server_cpu_s_during_hf"] = server_cpu_during_hf
        if server:
            res["memory_after_load"] = server.memory_mb()
        tps = lambda d, k: d[k]["median"]["tok_s"] if k in d else None
        for s, b in ((1, 1), (16, 8)):
            if tps(res["server"], s) and tps(res["hf"], b):
                res["ratios"][f"server_{s}_streams/hf_batch_{b}"] = tps(res["server"], s) / tps(res["hf"], b)
        if 1 in res["server"] and 1 in hf_runs:  # same prompt, greedy: how long do they agree?
            a, b = res["server"][1]["repeats"][0]["_first_ids"], hf_runs[1][0]["_first_ids"]
            res["greedy_agree_tokens_server1_vs_hf1"] = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    finally:
        if server:
            server.stop()
            res["server_exit_code"] = server.proc.returncode
            res["server_log_tail"] = list(server.log)[-30:]
    res["machine"]["loadavg_after"] = os.getloadavg()
    for group in (res["server"], res["hf"]):
        for g in group.values():
            for r in g["repeats"]:
                r.pop("_first_ids", None)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"load-{datetime.datetime.now():%Y%m%d-%H%M%S}"
    res["png"] = str(stem.with_suffix(".png"))
    plot(stem.with_suffix(".png"), res["server"], res["hf"],
         f"{args.model}, max_new_tokens {args.max_new_tokens}, {args.repeats} repeats, "
         f"{res['machine']['nproc']} CPUs, commit {res['git_commit'][:10]}")
    stem.with_suffix(".json").write_text(json.dumps(res, indent=1))
    print(summary(res))
    print(f"wrote {stem.with_suffix('.json')} and {stem.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
