"""Two (or more) configurations of the server under the same load, taking turns: the A/B shape
of bench.tracing and bench.tls. Each configuration is an object with `target`, `stub` and
`cpu_s()` (a `harness.serve.Server`, or any pair of processes that offers the same)."""

from __future__ import annotations

import statistics

from harness.client import run_scenario, warm_up
from harness.serve import CpuMeter
from shardline.protos import generation_pb2 as pb


def take_turns(configs: dict, streams: int, max_new: int, repeats: int) -> dict:
    """{name: {"runs": [tok/s per repeat], "tok_s": median}} for each configuration, warmed up
    once, then measured in turns so that every configuration sees the same drift of the machine."""
    for config in configs.values():
        warm_up(config.target, streams, 8)
    runs = {name: [] for name in configs}
    for _ in range(repeats):
        for name, config in configs.items():
            steps0 = config.stub.Stats(pb.StatsRequest(), timeout=10).steps
            runs[name].append(
                run_scenario(config.stub, config.target, streams, max_new, steps0, CpuMeter(config))["tok_s"]
            )
            print(f"{name}: {runs[name][-1]:.1f} tok/s", flush=True)
    return {name: {"runs": r, "tok_s": statistics.median(r)} for name, r in runs.items()}


def plot_turns(result: dict, names: list[str], title: str, png) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, color in zip(names, ("tab:gray", "tab:blue", "tab:orange")):
        runs = result[name]["runs"]
        ax.plot(range(1, len(runs) + 1), runs, "o-", color=color, label=name)
    ax.set_xlabel("repeat")
    ax.set_ylabel("tokens/s")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=100)
