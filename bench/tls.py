"""The throughput cost of mutual TLS on the router <-> shard step stream: a router and a shard
(SmolLM2, TP1) over loopback TCP in plaintext, and the same pair with `--shard-tls-*` (a local CA
and certificates made by `shardline certs` for the run), taking turns under the same load.

    python -m bench.tls [--streams 16] [--max-new-tokens 64] [--repeats 3]

tok/s is completion tokens over the scenario's wall time (as in bench.load). Both pairs are up
together; only one is under load at a time. Writes bench/out/tls-<time>.json and .png.
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
import time
from pathlib import Path

import grpc

from bench.common import machine, save
from bench.turns import plot_turns, take_turns
from harness.serve import ROOT, free_port, tree_cpu_s
from shardline.certs import make_certs
from shardline.processes import healthy, spawn_service
from shardline.protos import generation_pb2_grpc as pb_grpc


class Pair:
    """A shard and its router as separate processes; `stub` talks to the router."""

    def __init__(self, streams: int, certs: Path | None):
        shard_port, port = free_port(), free_port()
        flags = {"shard": [], "router": []}
        if certs:
            for side in flags:
                flags[side] = [
                    "--shard-tls-ca-file",
                    str(certs / "ca.crt"),
                    "--shard-tls-cert-file",
                    str(certs / f"{side}.crt"),
                    "--shard-tls-key-file",
                    str(certs / f"{side}.key"),
                ]
        out = dict(cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.procs = [
            spawn_service(["shard", "--listen", f"127.0.0.1:{shard_port}", *flags["shard"]], **out),
            spawn_service(
                [
                    "router",
                    "--shards",
                    f"127.0.0.1:{shard_port}",
                    "--port",
                    str(port),
                    "--max-batch",
                    str(streams),
                    *flags["router"],
                ],
                **out,
            ),
        ]
        self.target = f"127.0.0.1:{port}"
        deadline = time.monotonic() + 600
        while not healthy(self.target):
            if time.monotonic() > deadline or any(p.poll() is not None for p in self.procs):
                self.stop()
                raise RuntimeError("the router and shard did not come up")
            time.sleep(0.5)
        self.channel = grpc.insecure_channel(self.target)
        self.stub = pb_grpc.GenerationStub(self.channel)

    def cpu_s(self) -> float:
        return tree_cpu_s([p.pid for p in self.procs])

    def stop(self) -> None:
        for p in self.procs:
            p.kill()
            p.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    result = {"benchmark": "tls", **machine(), "streams": args.streams, "max_new_tokens": args.max_new_tokens}
    with tempfile.TemporaryDirectory() as tmp:
        make_certs(Path(tmp), ["localhost"])
        pairs = {"plaintext": Pair(args.streams, None), "mtls": Pair(args.streams, Path(tmp))}
        try:
            result.update(take_turns(pairs, args.streams, args.max_new_tokens, args.repeats))
        finally:
            for pair in pairs.values():
                pair.stop()
    result["mtls_over_plaintext"] = result["mtls"]["tok_s"] / result["plaintext"]["tok_s"]
    print(f"mtls/plaintext {result['mtls_over_plaintext']:.3f}")
    save(
        "tls",
        result,
        lambda r, png: plot_turns(
            r,
            ["plaintext", "mtls"],
            f"router<->shard TLS, {r['streams']} streams: mtls/plaintext = {r['mtls_over_plaintext']:.3f}",
            png,
        ),
    )


if __name__ == "__main__":
    main()
