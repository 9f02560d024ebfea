"""Routing over replicas: `serve --replicas N` behind its gateway, with round-robin, least-load
and prefix-aware routing, on SmolLM2 (2 replicas) and a tiny random model (4).

The workload is multi-tenant: several tenants, each with its long system prompt, ask many short
questions; requests arrive as a Poisson process at each rate in turn, on a fresh fleet per
policy (cold caches). Each replica's page pool holds about half of all system prompts, so a
policy that scatters a prompt over every replica keeps evicting it. Reported per model, policy
and rate: prompt tokens computed (summed over the routers' Stats), the cache hit rate (cached
over prompt tokens, from usage), TTFT p50/p90, output tok/s and whether every request completed.
"single" is one replica whose pool holds every system prompt: the prefill a fleet with all of
its cache in one place computes, which prefix-aware routing is measured against.

The gateway's own cost, on one SmolLM2 replica directly and through a gateway in front of it,
interleaved: TTFT p50 of one request at a time, and ITL p50 of 16 concurrent streams.

    .venv/bin/python -m bench.fleet [--rates 0.5,1,2] [--requests 40] [--parts smollm2,tiny,cost]
                                    [--policies round-robin,least-load,prefix,single]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import grpc

from bench.common import machine, save
from harness.client import astream, concurrently, percentiles, token_request
from harness.serve import Server, free_port
from harness.tiny_models import make_tiny_model
from shardline.processes import HealthProbe, spawn_service
from shardline.protos import generation_pb2 as pb
from shardline.protos import generation_pb2_grpc as pb_grpc

POLICIES = ["round-robin", "least-load", "prefix"]
PAGE = 64


def make_workload(
    rng: random.Random, tenants: int, system_tokens: int, question_tokens: int, n: int
) -> list[list[int]]:
    systems = [[rng.randrange(1000, 40000) for _ in range(system_tokens)] for _ in range(tenants)]
    return [
        systems[rng.randrange(tenants)] + [rng.randrange(1000, 40000) for _ in range(question_tokens)] for _ in range(n)
    ]


def _routers(stub) -> list[str]:
    return [r.address for r in stub.Stats(pb.StatsRequest(), timeout=10).replicas]


def _computed(addresses: list[str]) -> int:
    total = 0
    for address in addresses:
        with grpc.insecure_channel(address) as channel:
            total += pb_grpc.GenerationStub(channel).Stats(pb.StatsRequest(), timeout=10).prompt_tokens_computed
    return total


async def _poisson(
    target: str, prompts: list[list[int]], rate: float, max_new: int, seed: int, timeout: float
) -> tuple[float, list]:
    rng = random.Random(seed)
    async with grpc.aio.insecure_channel(target) as channel:
        await asyncio.wait_for(channel.channel_ready(), 30)
        stub = pb_grpc.GenerationStub(channel)
        t0, tasks = time.perf_counter(), []
        for ids in prompts:
            tasks.append(asyncio.ensure_future(astream(stub, token_request(ids, max_new), timeout)))
            await asyncio.sleep(rng.expovariate(rate))
        streams = await asyncio.gather(*tasks)
    return max(s.ended for s in streams) - t0, list(streams)


def one_policy(
    flags: list[str],
    policy: str,
    prompts_per_rate: list[list[list[int]]],
    rates: list[float],
    max_new: int,
    timeout: float,
) -> list[dict]:
    server = Server(*flags, *(["--routing", policy] if policy != "single" else []))
    try:
        routers = _routers(server.stub) if policy != "single" else [server.target]
        out = []
        for rate, prompts in zip(rates, prompts_per_rate):
            before = _computed(routers)
            wall, streams = asyncio.run(_poisson(server.target, prompts, rate, max_new, int(rate * 1000), timeout))
            done = [s for s in streams if s.error is None and s.finish_reason]
            prompt = sum(s.last.usage.prompt_tokens for s in done)
            cached = sum(s.last.usage.cached_prompt_tokens for s in done)
            ttft = percentiles([s.ttft_ms for s in done], (50, 90))
            row = {
                "rate": rate,
                "requests": len(streams),
                "completed": len(done) == len(streams),
                "errors": sorted({s.error for s in streams if s.error})[:3],
                "prompt_tokens_computed": _computed(routers) - before,
                "hit_rate": cached / prompt if prompt else 0,
                "ttft_p50_ms": ttft.get("p50"),
                "ttft_p90_ms": ttft.get("p90"),
                "output_tok_s": sum(len(s.ids) for s in done) / wall,
                "wall_s": wall,
            }
            print(
                f"  {policy:>11} @ {rate:4.1f}/s: computed {row['prompt_tokens_computed']:7d}, hit "
                f"{row['hit_rate']:.0%}, TTFT p50 {row['ttft_p50_ms'] or 0:7.0f} "
                f"p90 {row['ttft_p90_ms'] or 0:7.0f} ms, "
                f"{row['output_tok_s']:.1f} tok/s{'' if row['completed'] else ', INCOMPLETE'}",
                flush=True,
            )
            out.append(row)
        return out
    finally:
        server.stop()


def fleet(
    name: str,
    model_flags: list[str],
    replicas: int,
    pages_per_replica: int,
    workload: dict,
    rates: list[float],
    n: int,
    max_new: int,
    timeout: float,
    policies: list[str],
) -> dict:
    rng = random.Random(7)
    # Fresh system prompts per rate, so no rate starts from an earlier one's cache.
    prompts = [make_workload(rng, n=n, **workload) for _ in rates]
    common = [*model_flags, "--page-size", str(PAGE), "--threads", "1", "--http-port", "0"]
    result = {"replicas": replicas, "pages_per_replica": pages_per_replica, "workload": workload, "policies": {}}
    print(f"{name}: {replicas} replicas, {pages_per_replica} pages of {PAGE} each", flush=True)
    for policy in [p for p in POLICIES if p in policies]:
        flags = [*common, "--replicas", str(replicas), "--num-pages", str(pages_per_replica)]
        result["policies"][policy] = one_policy(flags, policy, prompts, rates, max_new, timeout)
    if "single" not in policies:
        return result
    single_pages = pages_per_replica * replicas * 2
    result["policies"]["single"] = one_policy(
        [*common, "--num-pages", str(single_pages)], "single", prompts, rates, max_new, timeout
    )
    single = result["policies"]["single"]
    for policy in [p for p in POLICIES if p in policies]:
        for row, ref in zip(result["policies"][policy], single):
            row["computed_vs_single"] = row["prompt_tokens_computed"] / ref["prompt_tokens_computed"]
    rr = result["policies"].get("round-robin", [])
    completes = [i for i, row in enumerate(rr) if row["completed"]]
    if completes and "prefix" in policies:
        i = completes[-1]
        result["at_highest_completing_rate"] = {
            "rate": rates[i],
            "prefix_ttft_p90_vs_round_robin": result["policies"]["prefix"][i]["ttft_p90_ms"] / rr[i]["ttft_p90_ms"],
            "prefix_computed_vs_single": result["policies"]["prefix"][i]["computed_vs_single"],
        }
        print(
            f"{name} @ {rates[i]}/s: prefix TTFT p90 / round-robin "
            f"{result['at_highest_completing_rate']['prefix_ttft_p90_vs_round_robin']:.2f}, prefix computed / single "
            f"{result['at_highest_completing_rate']['prefix_computed_vs_single']:.2f}",
            flush=True,
        )
    return result


def gateway_cost(streams: int, rounds: int, max_new: int) -> dict:
    """One SmolLM2 replica, directly and through a gateway in front of it, interleaved: TTFT of
    single 4-token requests (nothing else running, so the gateway's hop is all that differs) and ITL at
    `streams` concurrent streams. The shard computes on one thread, leaving the other core to the
    client and the gateway, as a deployment gives the gateway CPU of its own: on two cores with
    both busy computing, any extra process in the path waits for the scheduler (milliseconds)."""
    server = Server("--threads", "1", "--http-port", "0")
    port = free_port()
    gateway = spawn_service(
        ["gateway", "--port", str(port), "--http-port", "0", "--routers", server.target],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    probe = HealthProbe(f"127.0.0.1:{port}")
    try:
        deadline = time.monotonic() + 120
        while not probe.serving() and time.monotonic() < deadline:
            time.sleep(0.2)
        rng = random.Random(3)
        paths = {"direct": server.target, "gateway": f"127.0.0.1:{port}"}
        samples = {k: {"ttft_ms": [], "itl_ms": []} for k in paths}

        def prompts(n, tokens):
            return [token_request([rng.randrange(1000, 40000) for _ in range(tokens)], max_new) for _ in range(n)]

        for r in range(rounds + 1):
            for name, target in paths.items() if r % 2 else reversed(paths.items()):
                # 4-token prompts: the prefill's own noise (milliseconds) would hide the hop
                singles = [asyncio.run(concurrently(target, prompts(1, 4)))[1][0] for _ in range(10)]
                _, together = asyncio.run(concurrently(target, prompts(streams, 32)))
                if r == 0:
                    continue  # warm-up
                samples[name]["ttft_ms"] += [s.ttft_ms for s in singles]
                samples[name]["itl_ms"].append(statistics.median(i for s in together for i in s.itl_ms))
        med = {k: {m: statistics.median(v) for m, v in s.items()} for k, s in samples.items()}
        out = {
            "streams": streams,
            "rounds": rounds,
            "median": med,
            "samples": samples,
            "ttft_p50_added_ms": med["gateway"]["ttft_ms"] - med["direct"]["ttft_ms"],
            "itl_p50_added": med["gateway"]["itl_ms"] / med["direct"]["itl_ms"] - 1,
        }
        print(
            f"gateway cost: TTFT p50 of single requests {med['direct']['ttft_ms']:.2f} -> "
            f"{med['gateway']['ttft_ms']:.2f} ms ({out['ttft_p50_added_ms']:+.2f} ms); ITL p50 at {streams} streams "
            f"{med['direct']['itl_ms']:.2f} -> {med['gateway']['itl_ms']:.2f} ms ({out['itl_p50_added']:+.1%})",
            flush=True,
        )
        return out
    finally:
        probe.close()
        gateway.terminate()
        gateway.wait(30)
        server.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", default="0.5,1,2", help="SmolLM2's arrival rates, requests/s (the tiny model's: x8)")
    ap.add_argument("--requests", type=int, default=40, help="requests per rate")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--parts", default="smollm2,tiny,cost")
    ap.add_argument("--policies", default=",".join([*POLICIES, "single"]))
    args = ap.parse_args()
    rates, parts, policies = [float(r) for r in args.rates.split(",")], args.parts.split(","), args.policies.split(",")
    result = {"benchmark": "fleet", **machine(), "fleets": {}}
    if "smollm2" in parts:  # 6 tenants x 512-token system prompts = 48 pages; each SmolLM2 replica holds 28
        smol = dict(tenants=6, system_tokens=512, question_tokens=24)
        result["fleets"]["smollm2 x2"] = fleet(
            "smollm2 x2", [], 2, 28, smol, rates, args.requests, args.max_new_tokens, 600, policies
        )
    if "tiny" in parts:
        with tempfile.TemporaryDirectory() as tmp:
            tiny = make_tiny_model("llama", Path(tmp) / "llama")
            work = dict(tenants=12, system_tokens=512, question_tokens=24)  # 96 pages; each of 4 replicas holds 28
            result["fleets"]["tiny x4"] = fleet(
                "tiny x4",
                ["--model", str(tiny)],
                4,
                28,
                work,
                [r * 8 for r in rates],
                args.requests * 2,
                args.max_new_tokens,
                600,
                policies,
            )
    if "cost" in parts:
        result["gateway_cost"] = gateway_cost(16, 6, 32)
    save("fleet", result, plot)


def plot(result: dict, png) -> None:
    import matplotlib.pyplot as plt

    fleets = list(result["fleets"])
    if not fleets:  # the gateway's cost alone: its samples
        cost = result["gateway_cost"]["samples"]
        fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
        for ax, metric in zip(axes, ("ttft_ms", "itl_ms")):
            ax.boxplot([cost["direct"][metric], cost["gateway"][metric]], tick_labels=["direct", "gateway"])
            ax.set_title(metric.replace("_ms", " (ms)"), fontsize=9)
        fig.tight_layout()
        fig.savefig(png, dpi=110)
        return
    fig, axes = plt.subplots(len(fleets), 3, figsize=(13, 3.4 * len(fleets)), squeeze=False)
    for row, name in zip(axes, fleets):
        for policy, rows in result["fleets"][name]["policies"].items():
            rates = [r["rate"] for r in rows]
            row[0].plot(rates, [r["prompt_tokens_computed"] for r in rows], "o-", label=policy)
            row[1].plot(rates, [r["ttft_p90_ms"] or float("nan") for r in rows], "o-", label=policy)
            row[2].plot(rates, [r["output_tok_s"] for r in rows], "o-", label=policy)
        for ax, title in zip(row, ("prompt tokens computed", "TTFT p90 (ms)", "output tok/s")):
            ax.set_title(f"{name}: {title}", fontsize=9)
            ax.set_xlabel("arrival rate (requests/s)")
        row[1].set_yscale("log")
        row[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


if __name__ == "__main__":
    main()
