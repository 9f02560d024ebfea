"""TP1 vs TP2 vs PP2 on this machine: single-stream and 8-stream decode tokens/s and the time to
prefill a 2048-token prompt, with the cost of the collectives measured on their own (gloo on
loopback: an all-reduce of one decode step's activations, and a stage-to-stage send/recv).

    .venv/bin/python -m bench.parallel
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.common import machine, save
from harness.client import concurrently, stream, token_request
from harness.serve import Server, free_port

LAYOUTS = {"TP1": (1, 1, 2), "TP2": (2, 1, 1), "PP2": (1, 2, 2)}  # tp, pp, torch threads per shard
HIDDEN = 576  # SmolLM2


def measure(layout: str, args, rng: random.Random) -> dict:
    tp, pp, threads = LAYOUTS[layout]
    server = Server("--tp", str(tp), "--pp", str(pp), "--threads", str(threads), "--prefix-cache", "off")
    try:

        def prompt(n):
            return [rng.randrange(1000, 40000) for _ in range(n)]

        stream(server.stub, token_request(prompt(32), 8))  # warm-up
        one = stream(server.stub, token_request(prompt(32), args.new_tokens))
        itl = one.itl_ms[1:]  # from the second gap on, as decode runs
        wall, many = asyncio.run(
            concurrently(server.target, [token_request(prompt(32), args.new_tokens) for _ in range(8)])
        )
        prefill = [stream(server.stub, token_request(prompt(2048), 1)) for _ in range(args.prefill_runs)]
        stats = server.stats()
    finally:
        server.stop()
    return {
        "layout": layout,
        "tp": tp,
        "pp": pp,
        "threads_per_shard": threads,
        "one_stream_tok_s": 1e3 / statistics.median(itl),
        "eight_streams_tok_s": sum(len(s.ids) for s in many) / wall,
        "prefill_2048_s": statistics.median(p.times[0] - p.sent for p in prefill),
        "router_decode_step_ms_p50": stats.decode_step_ms_p50,
        "shard_decode_step_ms_p50": stats.shard_decode_step_ms_p50,
    }


def _comm_worker(rank: int, port: int, reps: int, out):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    result = {}
    for rows in (1, 8):
        x = torch.randn(rows, HIDDEN)
        for _ in range(20):
            dist.all_reduce(x)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            dist.all_reduce(x)
            times.append(time.perf_counter() - t0)
        result[f"all_reduce_{rows}x{HIDDEN}_ms"] = statistics.median(times) * 1e3
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(x, 1)
                dist.recv(x, 1)
            else:
                dist.recv(x, 0)
                dist.send(x, 0)
            times.append((time.perf_counter() - t0) / 2)
        result[f"send_recv_{rows}x{HIDDEN}_ms"] = statistics.median(times) * 1e3
    if rank == 0:
        out.update(result)
    dist.destroy_process_group()


def comm_costs(reps: int) -> dict:
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_comm_worker, args=(free_port(), reps, out), nprocs=2)
        return dict(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--prefill-runs", type=int, default=2)
    ap.add_argument("--reps", type=int, default=500)
    args = ap.parse_args()
    result = {"benchmark": "parallel", **machine(), "comm": comm_costs(args.reps), "layouts": []}
    rng = random.Random(0)
    for layout in LAYOUTS:
        r = measure(layout, args, rng)
        result["layouts"].append(r)
        print(
            f"{layout}: 1 stream {r['one_stream_tok_s']:.1f} tok/s, 8 streams {r['eight_streams_tok_s']:.1f} tok/s, "
            f"2048-token prefill {r['prefill_2048_s']:.2f} s, decode step {r['shard_decode_step_ms_p50']:.1f} ms",
            flush=True,
        )
    c = result["comm"]
    per_step = 2 * 30 * c[f"all_reduce_1x{HIDDEN}_ms"]
    result["tp2_allreduce_ms_per_decode_step"] = per_step
    print(
        f"gloo all-reduce 1x{HIDDEN}: {c[f'all_reduce_1x{HIDDEN}_ms']:.3f} ms, 8x{HIDDEN}: "
        f"{c[f'all_reduce_8x{HIDDEN}_ms']:.3f} ms; send/recv 1x{HIDDEN}: {c[f'send_recv_1x{HIDDEN}_ms']:.3f} ms"
    )
    print(f"TP2 runs 2 all-reduces per layer x 30 layers: ~{per_step:.0f} ms of every decode step")
    save("parallel", result, plot)


def plot(result: dict, png) -> None:
    import matplotlib.pyplot as plt

    rows = result["layouts"]
    names = [r["layout"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    for ax, key, label in zip(
        axes,
        ["one_stream_tok_s", "eight_streams_tok_s", "prefill_2048_s"],
        ["1 stream (tok/s)", "8 streams (tok/s)", "2048-token prefill (s)"],
    ):
        ax.bar(names, [r[key] for r in rows], color=["tab:blue", "tab:orange", "tab:green"])
        ax.set_title(label)
    fig.suptitle("SmolLM2 fp32 on 2 CPU cores, gloo on loopback")
    fig.tight_layout()
    fig.savefig(png, dpi=110)


if __name__ == "__main__":
    main()
