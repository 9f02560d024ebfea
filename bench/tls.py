"""The throughput cost of mutual TLS on the router <-> shard step stream: a router and a shard
(SmolLM2, TP1) over loopback TCP in plaintext, and the same pair with `--shard-tls-*` (a CA and
certificates made by trustme for the run), taking turns under the same load.

    python -m bench.tls [--streams 16] [--max-new-tokens 64] [--repeats 3]

tok/s is completion tokens over the scenario's wall time (as in bench.load). Both pairs are up
together; only one is under load at a time. Writes bench/out/tls-<time>.json and .png.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import grpc

from bench.common import machine, save
from bench.load import _scenario, run_scenario
from bench.serve import ROOT, CpuMeter, _descendants, _stat
from common.process import free_port, healthy, spawn_service
from protos import generation_pb2 as pb, generation_pb2_grpc as pb_grpc


class Pair:
    """A shard and its router as separate processes; `stub` talks to the router."""

    def __init__(self, streams: int, tls: dict[str, str] | None):
        shard_port, self.port = free_port(), free_port()
        flags = {"shard": [], "router": []}
        if tls:
            for side in flags:
                flags[side] = ["--shard-tls-ca-file", tls["ca"], "--shard-tls-cert-file", tls[f"{side}_cert"],
                               "--shard-tls-key-file", tls[f"{side}_key"]]
        out = dict(cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.procs = [spawn_service(["shard", "--listen", f"127.0.0.1:{shard_port}", *flags["shard"]], **out),
                      spawn_service(["router", "--shards", f"127.0.0.1:{shard_port}", "--port", str(self.port),
                                     "--max-batch", str(streams), *flags["router"]], **out)]
        self.target = f"127.0.0.1:{self.port}"
        deadline = time.monotonic() + 600
        while not healthy(self.target):
            if time.monotonic() > deadline or any(p.poll() is not None for p in self.procs):
                self.stop()
                raise RuntimeError("the router and shard did not come up")
            time.sleep(0.5)
        self.channel = grpc.insecure_channel(self.target)
        self.stub = pb_grpc.GenerationStub(self.channel)

    def cpu_s(self) -> float:  # for CpuMeter: both processes and their children
        ticks = 0
        for pid in [p.pid for p in self.procs] + [d for p in self.procs for d in _descendants(p.pid)]:
            try:
                fields = _stat(pid)
                ticks += int(fields[11]) + int(fields[12])
            except OSError:
                pass
        return ticks / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        for p in self.procs:
            p.kill()
            p.wait()


def certificates(folder: Path) -> dict[str, str]:
    import trustme
    ca = trustme.CA()
    files = {"ca": folder / "ca.crt"}
    ca.cert_pem.write_to_path(files["ca"])
    for side, names in (("shard", ("127.0.0.1", "localhost")), ("router", ("shardline-router",))):
        cert = ca.issue_cert(*names)
        files[f"{side}_cert"], files[f"{side}_key"] = folder / f"{side}.crt", folder / f"{side}.key"
        cert.cert_chain_pems[0].write_to_path(files[f"{side}_cert"])
        cert.private_key_pem.write_to_path(files[f"{side}_key"])
    return {k: str(v) for k, v in files.items()}


def plot(result: dict, png) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for mode, color in (("plaintext", "tab:gray"), ("mtls", "tab:blue")):
        runs = result[mode]["runs"]
        ax.plot(range(1, len(runs) + 1), runs, "o-", color=color, label=mode)
    ax.set_xlabel("repeat")
    ax.set_ylabel("tokens/s")
    ax.set_title(f"router<->shard TLS, {result['streams']} streams: mtls/plaintext = {result['mtls_over_plaintext']:.3f}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    result = {"benchmark": "tls", **machine(), "streams": args.streams, "max_new_tokens": args.max_new_tokens}
    with tempfile.TemporaryDirectory() as tmp:
        pairs = {"plaintext": Pair(args.streams, None), "mtls": Pair(args.streams, certificates(Path(tmp)))}
        try:
            runs = {mode: [] for mode in pairs}
            for pair in pairs.values():
                asyncio.run(_scenario(pair.target, args.streams, 8))  # warm-up
            for _ in range(args.repeats):
                for mode, pair in pairs.items():
                    steps0 = pair.stub.Stats(pb.StatsRequest(), timeout=10).steps
                    runs[mode].append(run_scenario(pair.stub, pair.target, args.streams, args.max_new_tokens, steps0,
                                                   CpuMeter(pair))["tok_s"])
                    print(f"{mode}: {runs[mode][-1]:.1f} tok/s", flush=True)
        finally:
            for pair in pairs.values():
                pair.stop()
    for mode in runs:
        result[mode] = {"runs": runs[mode], "tok_s": statistics.median(runs[mode])}
    result["mtls_over_plaintext"] = result["mtls"]["tok_s"] / result["plaintext"]["tok_s"]
    print(f"mtls/plaintext {result['mtls_over_plaintext']:.3f}")
    save("tls", result, plot)


if __name__ == "__main__":
    main()
