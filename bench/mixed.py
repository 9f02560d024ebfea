"""The workload chunked prefill exists for, on SmolLM2: one stream decoding; after its 8th token a
2048-token prompt arrives, and 20 ms later a 128-token prompt.

Reports, per configuration (chunking off; --chunk-size 256 and 512 with whole chunks, each also
with --mixed-steps on; 256 with the long prompt's chunks in 8 layer groups, the default, and in
4), the medians over runs of: the active stream's maximum and p95 inter-token latency, the short
late request's TTFT, the long request's TTFT, and the output rate in the window (from the long
prompt's arrival until both new requests have their first token). Writes JSON and a PNG timeline
of tokens over time.

    .venv/bin/python -m bench.mixed [--runs 3] [--configs off 'chunk 256' ...]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

import grpc

from bench.common import machine, save
from harness.client import Stream, astream, percentiles, token_request
from harness.serve import Server
from shardline.protos import generation_pb2_grpc as pb_grpc

CONFIGS = {
    "off": [],
    "chunk 256": ["--chunk-size", "256", "--layer-groups", "1"],
    "chunk 512": ["--chunk-size", "512", "--layer-groups", "1"],
    "groups 256": ["--chunk-size", "256", "--layer-groups", "8"],
    "groups4 256": ["--chunk-size", "256", "--layer-groups", "4"],
    "mixed 256": ["--chunk-size", "256", "--mixed-steps", "on"],
    "mixed 512": ["--chunk-size", "512", "--mixed-steps", "on"],
}


async def _arrivals(target: str, rng: random.Random) -> tuple[Stream, Stream, Stream]:
    def prompt(n):
        return [rng.randrange(1000, 40000) for _ in range(n)]

    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.GenerationStub(channel)

        def start(ids: list[int], new: int) -> tuple[Stream, asyncio.Future]:
            s = Stream(time.perf_counter())
            return s, asyncio.ensure_future(astream(stub, token_request(ids, new), 600, into=s))

        active, t_active = start(prompt(16), 160)
        while len(active.times) < 8 and not t_active.done():
            await asyncio.sleep(0.0005)
        long_, t_long = start(prompt(2048), 8)
        await asyncio.sleep(0.020)
        short, t_short = start(prompt(128), 8)
        await asyncio.gather(t_active, t_long, t_short)
    return active, long_, short


def one_run(server: Server, rng: random.Random) -> dict:
    active, long_, short = asyncio.run(_arrivals(server.target, rng))
    t0 = active.sent
    window = (long_.sent, max(long_.times[0], short.times[0]))
    itl = active.itl_ms
    in_window = sum(window[0] <= t <= window[1] for s in (active, long_, short) for t in s.times)
    return {
        "active_itl_max_ms": max(itl),
        "active_itl_p95_ms": percentiles(itl, (95,))["p95"],
        "short_ttft_ms": short.ttft_ms,
        "long_ttft_ms": long_.ttft_ms,
        "window_s": window[1] - window[0],
        "window_tokens_per_s": in_window / (window[1] - window[0]),
        "timeline": {
            name: [t - t0 for t in s.times] for name, s in (("active", active), ("long", long_), ("short", short))
        },
        "arrivals": {name: s.sent - t0 for name, s in (("active", active), ("long", long_), ("short", short))},
    }


METRICS = ["active_itl_max_ms", "active_itl_p95_ms", "short_ttft_ms", "long_ttft_ms", "window_tokens_per_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument(
        "--configs",
        nargs="+",
        choices=CONFIGS,
        default=list(CONFIGS),
        help="configurations to run ('off' is always run: the others are compared with it)",
    )
    args = ap.parse_args()
    configs = {name: flags for name, flags in CONFIGS.items() if name == "off" or name in args.configs}
    result = {"benchmark": "mixed", **machine(), "runs": args.runs, "configs": {}}
    rng = random.Random(0)  # fresh prompts every run, so no run hits an earlier one's prefix
    for name, flags in configs.items():
        server = Server(*flags)
        try:
            one_run(server, rng)  # warm-up, not counted
            runs = [one_run(server, rng) for _ in range(args.runs)]
        finally:
            server.stop()
        med = {m: statistics.median(r[m] for r in runs) for m in METRICS}
        result["configs"][name] = {"median": med, "runs": runs}
        print(
            f"{name:>9}: active ITL max {med['active_itl_max_ms']:6.0f} ms, p95 {med['active_itl_p95_ms']:5.0f} ms; "
            f"short TTFT {med['short_ttft_ms']:6.0f} ms; long TTFT {med['long_ttft_ms']:6.0f} ms; "
            f"window {med['window_tokens_per_s']:.1f} tok/s",
            flush=True,
        )
    off = result["configs"]["off"]["median"]
    for name in configs.keys() - {"off"}:
        on = result["configs"][name]["median"]
        result["configs"][name]["vs_off"] = {m: on[m] / off[m] - 1 for m in METRICS}
        v = result["configs"][name]["vs_off"]
        print(
            f"{name} vs off: max ITL {v['active_itl_max_ms']:+.0%}, short TTFT {v['short_ttft_ms']:+.0%}, "
            f"long TTFT {v['long_ttft_ms']:+.0%}"
        )
    save("mixed", result, plot)


def plot(result: dict, png) -> None:
    import matplotlib.pyplot as plt

    names = list(result["configs"])
    fig, axes = plt.subplots(len(names), 1, figsize=(9, 2.6 * len(names)), sharex=True)
    for ax, name in zip(axes, names):
        run = result["configs"][name]["runs"][0]
        for i, (stream, color) in enumerate((("active", "tab:blue"), ("long", "tab:red"), ("short", "tab:green"))):
            stamps = run["timeline"][stream]
            ax.scatter(stamps, [i] * len(stamps), s=8, color=color, label=f"{stream} tokens")
            ax.axvline(run["arrivals"][stream], color=color, lw=0.8, ls="--")
        ax.set_yticks([0, 1, 2], ["active", "2048-tok", "128-tok"])
        med = result["configs"][name]["median"]
        ax.set_title(
            f"{name}: active max ITL {med['active_itl_max_ms']:.0f} ms, "
            f"short TTFT {med['short_ttft_ms']:.0f} ms, long TTFT {med['long_ttft_ms']:.0f} ms",
            fontsize=9,
        )
    axes[-1].set_xlabel("seconds since the active stream started (dashed: arrivals)")
    fig.tight_layout()
    fig.savefig(png, dpi=110)


if __name__ == "__main__":
    main()
