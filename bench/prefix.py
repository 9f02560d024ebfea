"""Prefix-cache workloads on the real model (SmolLM2), each run against a fresh server.

shared: 64 requests with one common 512-token system prompt and distinct 64-token questions,
        8 in flight at a time; prefill tokens computed and TTFT, prefix cache on vs off.
scan:   a 48-page pool; two hot 10-page prefixes, used twice up front, then reused between
        one-use 26-page prompts; token hit rate and prefill tokens, LRU vs SLRU.

    .venv/bin/python -m bench.prefix [--only shared|scan]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

from bench.common import machine, save
from harness.client import percentiles, stream, token_request
from harness.serve import Server

VOCAB_LO, VOCAB_HI = 1000, 40000  # ordinary tokens, no special ones


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(n)]


def shared_prefix(prefix_cache: str, args) -> dict:
    rng = random.Random(0)
    system = _tokens(rng, 512)
    prompts = [system + _tokens(rng, 64) for _ in range(args.requests)]
    server = Server("--prefix-cache", prefix_cache, "--max-batch", "16")
    try:
        before = server.stats()
        t0 = time.perf_counter()
        with ThreadPoolExecutor(args.in_flight) as pool:
            results = list(pool.map(lambda p: stream(server.stub, token_request(p, args.new_tokens), 600), prompts))
        wall = time.perf_counter() - t0
        after = server.stats()
    finally:
        server.stop()
    ttfts = [r.ttft_ms for r in results]
    return {
        "prefix_cache": prefix_cache,
        "requests": len(prompts),
        "wall_s": wall,
        "prefill_tokens_computed": after.prompt_tokens_computed - before.prompt_tokens_computed,
        "cached_prompt_tokens": sum(r.last.usage.cached_prompt_tokens for r in results),
        "ttft_ms_p50": statistics.median(ttfts),
        "ttft_ms_p90": percentiles(ttfts)["p90"],
        "ttft_ms": ttfts,
    }


def scan_pollution(policy: str, args) -> dict:
    rng = random.Random(1)
    page = 16
    hot = [_tokens(rng, 10 * page + 1) for _ in range(2)]  # 10 full pages each
    workload = [hot[0], hot[1], hot[0], hot[1]]  # each used twice: the second use hits
    for i in range(args.scan_rounds):
        # One-use prompts of 26 pages: between two uses of a hot prefix, more new pages than
        # the pool holds beside the hot ones, so recency alone (LRU) evicts the hot prefix.
        workload += [_tokens(rng, 26 * page), hot[i % 2]]
    server = Server(
        "--page-size",
        str(page),
        "--num-pages",
        "48",
        "--eviction",
        policy,
        "--slru-protected-ratio",
        "0.5",
        "--max-batch",
        "1",
    )
    try:
        before = server.stats()
        hot_hits = []
        for ids in workload:
            last = stream(server.stub, token_request(ids, 1), 600).last
            if any(ids is h for h in hot):
                hot_hits.append(last.usage.cached_prompt_tokens)
        after = server.stats()
    finally:
        server.stop()
    hit = after.prefix_hit_tokens - before.prefix_hit_tokens
    query = after.prefix_query_tokens - before.prefix_query_tokens
    return {
        "policy": policy,
        "requests": len(workload),
        "token_hit_rate": hit / query,
        "hit_tokens": hit,
        "query_tokens": query,
        "prefill_tokens_computed": after.prompt_tokens_computed - before.prompt_tokens_computed,
        "hot_prompt_cached_tokens": hot_hits,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=["shared", "scan"])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--in-flight", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--scan-rounds", type=int, default=12)
    args = ap.parse_args()
    result = {"benchmark": "prefix", **machine()}
    if args.only in (None, "shared"):
        result["shared"] = [shared_prefix(mode, args) for mode in ("off", "on")]
        for r in result["shared"]:
            print(
                f"shared prefix, cache {r['prefix_cache']:>3}: {r['prefill_tokens_computed']:6d} prefill tokens, "
                f"TTFT p50 {r['ttft_ms_p50']:7.0f} ms p90 {r['ttft_ms_p90']:7.0f} ms, wall {r['wall_s']:.1f} s"
            )
    if args.only in (None, "scan"):
        result["scan"] = [scan_pollution(policy, args) for policy in ("lru", "slru")]
        for r in result["scan"]:
            print(
                f"scan pollution, {r['policy']:>4}: hit rate {r['token_hit_rate']:.1%}, "
                f"{r['prefill_tokens_computed']} prefill tokens, hot prompt hits {r['hot_prompt_cached_tokens']}"
            )
    save("prefix", result, plot)


def plot(result: dict, png) -> None:
    import matplotlib.pyplot as plt

    panels = [k for k in ("shared", "scan") if k in result]
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
    for ax, key in zip(axes[0], panels):
        rows = result[key]
        if key == "shared":
            ax.boxplot([r["ttft_ms"] for r in rows], showfliers=True)
            ax.set_xticks(
                range(1, len(rows) + 1),
                [f"cache {r['prefix_cache']}\n{r['prefill_tokens_computed']} prefill tok" for r in rows],
            )
            ax.set_ylabel("TTFT (ms)")
            ax.set_title("64 requests, shared 512-token system prompt")
        else:
            ax.bar([r["policy"] for r in rows], [100 * r["token_hit_rate"] for r in rows])
            for i, r in enumerate(rows):
                ax.text(
                    i,
                    100 * r["token_hit_rate"],
                    f"{r['prefill_tokens_computed']} prefill tok",
                    ha="center",
                    va="bottom",
                )
            ax.set_ylabel("prompt tokens served from cache (%)")
            ax.set_title("hot prefixes between one-use scans, 48-page pool")
    fig.tight_layout()
    fig.savefig(png, dpi=110)


if __name__ == "__main__":
    main()
