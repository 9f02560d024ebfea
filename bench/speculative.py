"""Speculative decoding: Shardline with prompt lookup (`ngram`) and with suffix decoding beside it
(`suffix`) against itself without speculation, and against llama.cpp's `llama-server` with each
of its n-gram speculation kinds, on the same GGUF (SmolLM2's default) and the same chat prompts,
through the same OpenAI client (bench/http.py).

    python -m bench.speculative [--llama-server PATH] [--streams 1,8] [--repeats 3] [--max-new-tokens 160]
        [--modes off,ngram,suffix]

Workloads, each a few chat prompts that cycle over the streams: the copy-heavy ones, `quote`
(repeat a paragraph), `rename` (rewrite code with one name changed) and `json` (extract fields
from a text), whose answers copy from their prompts (reported each and together); `edit`, one
file renamed twice in two requests (an agent's loop: the second answer rewrites the first's);
and `free` (nothing to copy). Every run starts its server afresh (`shardline`: why). Greedy,
each answer ends at EOS or `--max-new-tokens`. Per run: tok/s (completion tokens over the wall
time from the first request to the last token, prefill included) and decode tok/s
(bench/http.py); medians over repeats. The host's read bandwidth is measured first
(bench/kernels.py); Shardline's acceptance per workload comes from its Stats (proposed and
accepted tokens). llama-server runs with `--spec-type none` and each n-gram kind at its
defaults; its best kind per workload and concurrency is the peer. Writes
bench/out/speculative-<time>.json and .png.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil

from bench.common import machine, save
from bench.http import llama_server, summary
from bench.kernels import read_gb_s
from harness.client import http_concurrently
from harness.serve import Server
from shardline.protos import generation_pb2 as pb

PARAGRAPHS = [
    "The old lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a brass lantern "
    "and a notebook in which he wrote the colour of the sea, the direction of the wind and the names of the "
    "ships that passed the rocky point before the fog rolled in from the north.",
    "Our library opens at nine on weekdays and at ten on Saturdays. Members may borrow up to six books "
    "for three weeks, renew them twice online, and reserve titles that are on loan. Late returns cost ten "
    "cents a day, and lost books are replaced at the price printed on the cover.",
]
CODE = [
    "def total_price(items, tax_rate):\n    subtotal = 0\n    for item in items:\n"
    "        subtotal += item.price * item.quantity\n    tax = subtotal * tax_rate\n"
    "    return subtotal + tax\n",
    "def count_words(text):\n    counts = {}\n    for word in text.lower().split():\n"
    "        word = word.strip('.,!?')\n        counts[word] = counts.get(word, 0) + 1\n    return counts\n",
]
RENAMES = [("subtotal", "net_amount"), ("counts", "frequencies")]
# An agent's edit loop: one file, renamed twice, each a new request (run() at one stream asks them
# in turn), so that the second answer rewrites most of what the first wrote.
FILE = (
    "import json\n\n\nclass Inventory:\n    def __init__(self, path):\n        self.path = path\n"
    "        self.items = {}\n\n    def load(self):\n        with open(self.path) as f:\n"
    "            self.items = json.load(f)\n\n    def add(self, name, count):\n"
    "        self.items[name] = self.items.get(name, 0) + count\n\n    def remove(self, name, count):\n"
    "        if self.items.get(name, 0) < count:\n            raise ValueError(name)\n"
    "        self.items[name] -= count\n\n    def save(self):\n        with open(self.path, 'w') as f:\n"
    "            json.dump(self.items, f)\n"
)
EDITS = [("items", "stock"), ("count", "amount")]
RECORDS = [
    "Order 4471 was placed by Maria Gonzalez of 12 Harbour Road, Lisbon, on 3 March 2025 for two "
    "ceramic vases and one linen tablecloth, paid by credit card, to be delivered by express courier.",
    "Ticket 9082: the customer Daniel Okafor, email daniel.okafor@example.com, reports that the "
    "printer model LX-300 in room 214 jams on every second page since the firmware update of Monday.",
]
FREE = [
    "Write a short story about a dragon who learns to bake bread.",
    "What are some good ways to stay focused while studying? Give advice in your own words.",
    "Describe an imaginary city on the moon and the people who live there.",
    "Explain why the sky looks blue to a ten-year-old.",
]


def copy_workloads() -> dict[str, list[str]]:
    """Prompts whose answers copy from them, phrased as SmolLM2-135M follows them best (asked to
    output only the renamed code it writes other code; asked for named fields it copies them)."""
    return {
        "quote": [f"Repeat the following paragraph exactly, word for word:\n\n{text}" for text in PARAGRAPHS],
        "rename": [
            f"Here is a Python function:\n\n```python\n{code}```\n\nRewrite it with `{old}` renamed to "
            f"`{new}`. Keep everything else the same."
            for code, (old, new) in zip(CODE, RENAMES)
        ],
        "json": [
            f"Return a JSON object with the fields id, customer, place, date and subject for this text:\n\n{record}"
            for record in RECORDS
        ],
    }


def edit_workload() -> list[str]:
    return [
        f"Here is a Python file:\n\n```python\n{FILE}```\n\nRewrite the whole file with `{old}` renamed to "
        f"`{new}`. Keep everything else the same."
        for old, new in EDITS
    ]


COPY = ("quote", "rename", "json")  # together: the copy-heavy workload
WORKLOADS = {**copy_workloads(), "edit": edit_workload(), "free": FREE}
MODES = ("off", "ngram", "suffix")


def body(model: str, prompt: str, max_new: int) -> dict:
    return {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_new,
        "temperature": 0.0,
        "stream_options": {"include_usage": True},
    }


def run(base_url: str, model: str, prompts: list[str], n: int, max_new: int) -> dict:
    """One stream: every prompt of the workload in turn. n streams: n requests at once, cycling
    over the prompts."""
    from harness.client import decode_tok_s, percentiles

    if n == 1:
        wall, streams = 0.0, []
        for prompt in prompts:
            w, s = asyncio.run(http_concurrently(base_url, [body(model, prompt, max_new)]))
            wall, streams = wall + w, streams + s
        timed = [s for s in streams if len(s.times) > 1]  # each stream's own decode window
        decode = sum(len(s.times) - 1 for s in timed) / sum(s.times[-1] - s.times[0] for s in timed)
    else:
        wall, streams = asyncio.run(
            http_concurrently(base_url, [body(model, prompts[i % len(prompts)], max_new) for i in range(n)])
        )
        decode = decode_tok_s(streams)
    tokens = sum(s.completion_tokens for s in streams)
    return {
        "wall_s": wall,
        "completion_tokens": tokens,
        "tok_s": tokens / wall,
        "decode_tok_s": decode,
        "itl_ms": percentiles(x for s in streams for x in s.itl_ms),
        "errors": [s.error for s in streams if s.error],
    }


def _report(who: str, key: str, entry: dict) -> None:
    spec = entry.get("spec") or {}
    print(
        f"  {who} {key}: {entry['tok_s']:.1f} tok/s (decode {entry['decode_tok_s'] or 0:.1f}), "
        f"{sum(r['completion_tokens'] for r in entry['runs']) / len(entry['runs']):.0f} tokens"
        + (f", acceptance {spec['acceptance']:.2f}" if spec.get("acceptance") is not None else ""),
        flush=True,
    )


def _spec_counts(runs: list[tuple]) -> dict:
    """Proposed and accepted tokens over runs, each as (stats before, stats after)."""
    proposed = sum(b.spec_proposed_tokens - a.spec_proposed_tokens for a, b in runs)
    accepted = sum(b.spec_accepted_tokens - a.spec_accepted_tokens for a, b in runs)
    generated = sum(b.tokens_generated - a.tokens_generated for a, b in runs)
    return {
        "proposed": proposed,
        "accepted": accepted,
        "verifications": sum(b.spec_verifications - a.spec_verifications for a, b in runs),
        "acceptance": accepted / proposed if proposed else None,
        "accepted_share_of_output": accepted / generated if generated else None,
    }


def _start(mode: str, streams: list[int]) -> Server:
    return Server("--speculative", mode, "--max-batch", str(max(streams)))


def shardline(streams: list[int], max_new: int, repeats: int, modes: list[str]) -> dict:
    """Each mode's server driven in turns (the order alternating), so that ratios compare runs
    seconds apart on a machine whose speed drifts. Every run starts each server afresh and caches
    its prompts' pages first (answers of two tokens, too short for a suffix cache to keep): the
    suffix cache then holds only what that run writes (the earlier turn of `edit`), never the same
    prompt's answer from a repeat before; and every mode computes the same prompt KV, so that
    greedy answers agree (a prompt computed whole takes the prefill path's attention, the rest of
    a cached one decode rows', and on int8 activations that moves near-ties)."""
    out = {mode: {} for mode in modes}
    for name, prompts in WORKLOADS.items():
        for n in streams:
            key, runs, counts = f"{name}/{n}", {m: [] for m in modes}, {m: [] for m in modes}
            for rep in range(repeats):
                for mode in modes if rep % 2 == 0 else modes[::-1]:
                    server = _start(mode, streams)
                    try:
                        model = server.stub.Info(pb.InfoRequest(), timeout=30).model
                        run(server.http_url, model, prompts, n, 2)  # untimed: warms this shape
                        before = server.stats()
                        runs[mode].append(run(server.http_url, model, prompts, n, max_new))
                        counts[mode].append((before, server.stats()))
                    finally:
                        server.stop()
            for mode in modes:
                out[mode][key] = summary(runs[mode])
                if mode != "off":
                    out[mode][key]["spec"] = _spec_counts(counts[mode])
                _report(f"shardline {mode}", key, out[mode][key])
            answers = {mode: [r["completion_tokens"] for r in runs[mode]] for mode in modes}
            if len({tuple(a) for a in answers.values()}) > 1:
                print(f"  {key}: the modes' answers differ in length: {answers}", flush=True)
    return out


SPEC_TYPES = ["none", "ngram-simple", "ngram-map-k", "ngram-mod", "ngram-cache"]


def llama(path: str, spec: str, streams: list[int], max_new: int, repeats: int) -> dict:
    out = {}
    for n in streams:
        with llama_server(path, n, extra=["--spec-type", spec]) as base_url:
            for name, prompts in WORKLOADS.items():
                key = f"{name}/{n}"
                run(base_url, "smollm2", prompts[:1], n, 16)  # untimed: warms this shape
                out[key] = summary([run(base_url, "smollm2", prompts, n, max_new) for _ in range(repeats)])
                _report(f"llama-server {spec}", key, out[key])
    return out


def copy_heavy(runs: dict, n: int) -> float:
    """The copy-heavy workloads at `n` streams together: their completion tokens over their wall
    time, each workload's median run."""
    medians = [
        sorted(runs[f"{name}/{n}"]["runs"], key=lambda r: r["tok_s"])[len(runs[f"{name}/{n}"]["runs"]) // 2]
        for name in COPY
    ]
    return sum(r["completion_tokens"] for r in medians) / sum(r["wall_s"] for r in medians)


def ratios(result: dict, streams: list[int]) -> dict:
    ours = result["shardline"]
    off, peers = ours["off"], result.get("llama_server", {})
    rate = {**{f"shardline {m}": r for m, r in ours.items()}, **{f"llama-server {s}": r for s, r in peers.items()}}
    out = {}
    for n in streams:
        copy = {who: copy_heavy(runs, n) for who, runs in rate.items()}
        out[f"copy-heavy/{n}: tok/s"] = copy
        peer_kinds = [w for w in copy if w.startswith("llama-server") and w != "llama-server none"]
        best = max(peer_kinds, key=copy.get, default=None)
        for mode in ours:
            if mode != "off":
                out[f"copy-heavy/{n}: {mode}/off"] = copy[f"shardline {mode}"] / copy["shardline off"]
                if best:
                    out[f"copy-heavy/{n}: {mode}/{best}"] = copy[f"shardline {mode}"] / copy[best]
    for mode, runs in ours.items():
        if mode == "off":
            continue
        for key in runs:
            out[f"{key}: {mode}/off"] = runs[key]["tok_s"] / off[key]["tok_s"]
            if peers:
                best = max((s for s in peers if s != "none"), key=lambda s: peers[s][key]["tok_s"])
                out[f"{key}: {mode}/llama-server {best}"] = runs[key]["tok_s"] / peers[best][key]["tok_s"]
    return out


def plot(result: dict, png) -> None:
    import matplotlib.pyplot as plt

    keys = list(result["shardline"]["off"])
    series = {f"Shardline {m}": runs for m, runs in result["shardline"].items()}
    series.update({f"llama-server {s}": r for s, r in result.get("llama_server", {}).items()})
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / len(series)
    for i, (label, runs) in enumerate(series.items()):
        ax.bar([k + i * width for k in range(len(keys))], [runs[k]["tok_s"] for k in keys], width, label=label)
    ax.set_xticks([k + 0.4 - width / 2 for k in range(len(keys))], [k.replace("/", " x") for k in keys])
    ax.set_ylabel("tokens/s (prefill included)")
    ax.set_title("Speculative decoding, SmolLM2-135M Q4_1 GGUF, " + result["cpu"][:40])
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", default="1,8")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER") or shutil.which("llama-server"))
    parser.add_argument("--spec-types", default=",".join(SPEC_TYPES), help="llama-server's, 'none' among them")
    parser.add_argument("--modes", default=",".join(MODES), help="Shardline's --speculative, 'off' first")
    args = parser.parse_args()
    streams = [int(s) for s in args.streams.split(",")]
    result = {"benchmark": "speculative", **machine(), "max_new_tokens": args.max_new_tokens, "repeats": args.repeats}
    result["read_gb_s"] = read_gb_s()  # what a decode step's weights are read at
    print(f"read bandwidth {result['read_gb_s']:.1f} GB/s", flush=True)
    result["shardline"] = shardline(streams, args.max_new_tokens, args.repeats, args.modes.split(","))
    if args.llama_server:
        result["llama_server"] = {
            spec: llama(args.llama_server, spec, streams, args.max_new_tokens, args.repeats)
            for spec in args.spec_types.split(",")
        }
    result["ratios"] = ratios(result, streams)
    for key, value in result["ratios"].items():
        print(f"{key}: {value:.2f}" if isinstance(value, float) else f"{key}: {value}")
    save("speculative", result, plot)


if __name__ == "__main__":
    main()
