"""Two commits of Shardline under the same load, taking turns (bench/turns.py): whether a change
moved decode speed, measured in one sitting. Each commit is checked out in a git worktree (its
gRPC code generated there, as an install does) and served with its own code, SmolLM2 native
weights, speculation off, the two servers up side by side but measured one at a time.

    python -m bench.commits --base <rev> [--head HEAD] [--streams 1,16] [--repeats 5]

Writes bench/out/commits-<time>.json and .png: each commit's tok/s per repeat and median, and
head over base per concurrency.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import machine, save
from bench.kernels import read_gb_s
from bench.turns import plot_turns, take_turns
from harness.serve import ROOT, Server

FLAGS = ("--max-batch", "32", "--speculative", "off")


def checkout(rev: str, into: Path) -> Path:
    """`rev` in a worktree at `into`, with its generated gRPC code."""
    subprocess.run(["git", "worktree", "add", "--detach", "-f", str(into), rev], cwd=ROOT, check=True)
    build = ["build_py", "--build-lib", str(into / "build")]  # which generates the gRPC code in place
    subprocess.run([sys.executable, "setup.py", "-q", *build], cwd=into, check=True, capture_output=True)
    return into


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="the commit to compare against")
    ap.add_argument("--head", default="HEAD")
    ap.add_argument("--streams", default="1,16")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args()
    git = lambda *a: subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    revs = {"base": git("rev-parse", "--short", args.base), "head": git("rev-parse", "--short", args.head)}
    result = {"benchmark": "commits", **machine(), "read_gb_s": read_gb_s(), "commits": revs, "flags": FLAGS}
    result["streams"] = {}
    with tempfile.TemporaryDirectory() as tmp:
        trees = {name: checkout(rev, Path(tmp) / name) for name, rev in revs.items()}
        servers = {}
        try:
            for name, tree in trees.items():
                servers[name] = Server(*FLAGS, cwd=tree)
            for n in (int(s) for s in args.streams.split(",")):
                turns = take_turns(servers, n, args.max_new_tokens, args.repeats)
                turns["head/base"] = turns["head"]["tok_s"] / turns["base"]["tok_s"]
                result["streams"][n] = turns
                print(f"{n} streams: head/base {turns['head/base']:.3f}", flush=True)
        finally:
            for server in servers.values():
                server.stop()
            for tree in trees.values():
                subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, check=False)

    def plot(result: dict, png) -> None:
        last = max(result["streams"])
        plot_turns(result["streams"][last], ["base", "head"], f"{revs['base']} vs {revs['head']}, {last} streams", png)

    save("commits", result, plot)


if __name__ == "__main__":
    main()
