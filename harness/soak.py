"""The soak workload: many concurrent streams for a long time, with everything clients do wrong
(bench/soak.py runs it long against SmolLM2; tests/test_soak.py briefly against a tiny model).

`streams` client loops (asyncio, one shared channel) run for `duration_s`. Each loop sends
request after request: prompts of mixed lengths, most of them behind one of a few shared
prefixes; random priorities and sampling (greedy, temperature with top-k / top-p, seeds),
sometimes stop strings; and one ending in ten each of: the client cancels after a few tokens, a
short deadline, and a dropped connection (the request goes over a channel of its own that is
closed mid-stream). Every `kill_every_s`, a child process opens a few streams and is SIGKILLed
mid-stream: connections dropped without a goodbye.

The report: requests by final status, TTFT and ITL p50/p99 per time window, router and shard RSS
over time, the pool at the end (after all clients are done), and streams that went silent (no
message for `silent_s`) while open.
"""

from __future__ import annotations

import asyncio
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

import grpc

from harness.client import percentiles
from harness.serve import ROOT, Server, rss_mb
from shardline.protos import generation_pb2 as pb
from shardline.protos import generation_pb2_grpc as pb_grpc


def _arg(default, help: str):
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class SoakArgs:
    streams: int = _arg(200, "client loops, each sending request after request")
    duration_s: float = _arg(600.0, "how long the loops send requests")
    silent_s: float = _arg(60.0, "an open stream with no message for this long counts as silent")
    request_timeout_s: float = _arg(900.0, "deadline of requests not meant to hit theirs: a stuck request ends the run")
    kill_every_s: float = _arg(20.0, "how often a client process with open streams is SIGKILLed")
    seed: int = _arg(0, "of the workload's random choices")


class Soak:
    def __init__(self, target: str, args, rng: random.Random, vocab: int):
        self.target, self.args, self.rng, self.vocab = target, args, rng, vocab
        self.records: list[dict] = []
        # request number -> [last message time, silent already counted, any message yet]
        self.open: dict[int, list] = {}
        self.silent = {"queued": 0, "mid_stream": 0}
        self.prefixes = [[rng.randrange(100, vocab) for _ in range(n)] for n in (64, 200, 450, 900)]
        self.next_id = 0

    def request(self) -> tuple[pb.GenerateRequest, str]:
        rng = self.rng
        roll = rng.random()
        tail = [rng.randrange(100, self.vocab) for _ in range(rng.choice([4, 16, 60, 200]))]
        ids = (rng.choice(self.prefixes) + tail) if roll < 0.7 else tail * rng.choice([1, 3])
        req = pb.GenerateRequest(
            prompt_token_ids=pb.PromptTokens(ids=ids),
            max_new_tokens=rng.choice([4, 16, 32, 64, 128]),
            priority=rng.randint(-2, 2),
            ignore_eos=rng.random() < 0.5,
        )
        kind = rng.random()
        if kind < 0.4:
            req.sampling.temperature = rng.choice([0.3, 0.7, 1.0, 1.5])
            req.sampling.top_p = rng.choice([0.5, 0.9, 1.0])
            req.sampling.top_k = rng.choice([0, 20, 100])
            req.sampling.seed = rng.randrange(2**32)
        if rng.random() < 0.2:
            req.stop.extend(rng.sample([".", "\n", " the", "!", "?"], 2))
        behaviour = rng.choices(["complete", "cancel", "deadline", "drop"], [0.7, 0.1, 0.1, 0.1])[0]
        return req, behaviour

    async def one(self, stub, req: pb.GenerateRequest, behaviour: str, channel=None) -> None:
        n, self.next_id = self.next_id, self.next_id + 1
        rec = {"start": time.monotonic(), "behaviour": behaviour, "stamps": [], "status": "OK"}
        self.open[n] = [rec["start"], False, False]
        timeout = self.rng.uniform(0.5, 5.0) if behaviour == "deadline" else self.args.request_timeout_s
        stop_after = self.rng.randint(1, 6)
        call = stub.Generate(req, timeout=timeout)
        try:
            async for msg in call:
                now = time.monotonic()
                self.open[n][0], self.open[n][2] = now, True
                rec["stamps"] += [now] * max(1, len(msg.token_ids))
                if behaviour in ("cancel", "drop") and len(rec["stamps"]) >= stop_after:
                    if behaviour == "cancel":
                        call.cancel()
                    else:
                        await channel.close(grace=None)
                    rec["status"] = behaviour.upper()
                    break
        except asyncio.CancelledError:
            rec["status"] = rec["status"] if rec["status"] != "OK" else "CANCELLED"
        except grpc.aio.AioRpcError as e:
            rec["status"] = e.code().name
            if e.code() in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL):
                rec["details"] = e.details()
        finally:
            rec["end"] = time.monotonic()
            del self.open[n]
            self.records.append(rec)

    async def client(self, channel, stub, deadline: float) -> None:
        while time.monotonic() < deadline:
            req, behaviour = self.request()
            if behaviour == "drop":
                own = grpc.aio.insecure_channel(self.target)
                try:
                    await self.one(pb_grpc.GenerationStub(own), req, behaviour, own)
                finally:
                    await own.close()
            else:
                await self.one(stub, req, behaviour)

    async def watch_silence(self) -> None:
        while True:
            now = time.monotonic()
            for entry in self.open.values():
                if not entry[1] and now - entry[0] > self.args.silent_s:
                    entry[1] = True
                    self.silent["mid_stream" if entry[2] else "queued"] += 1
            await asyncio.sleep(1)


def _killed_client(target: str, streams: int, seconds: float) -> None:
    """A child process with open streams, SIGKILLed mid-stream by the parent."""
    code = (
        f"import grpc, threading\nfrom protos import generation_pb2 as pb, generation_pb2_grpc as g\n"
        f"s = g.GenerationStub(grpc.insecure_channel({target!r}))\n"
        f"r = pb.GenerateRequest(prompt_token_ids=pb.PromptTokens(ids=list(range(300, 420))), "
        f"max_new_tokens=500, ignore_eos=True)\n"
        f"ts = [threading.Thread(target=lambda: [m for m in s.Generate(r, timeout=600)]) for _ in range({streams})]\n"
        f"[t.start() for t in ts]; [t.join() for t in ts]\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    time.sleep(seconds)
    proc.send_signal(signal.SIGKILL)
    proc.wait()


async def run_soak(target: str, args: SoakArgs, server: Server | None = None) -> dict:
    rng = random.Random(args.seed)
    channel = grpc.aio.insecure_channel(target)
    stub = pb_grpc.GenerationStub(channel)
    info = await stub.Info(pb.InfoRequest(), timeout=30)
    soak = Soak(target, args, rng, info.vocab_size)
    roles = server.roles() if server else {}
    memory: list[tuple[float, dict]] = []
    t0 = time.monotonic()
    deadline = t0 + args.duration_s

    async def sample_memory():
        while True:
            memory.append((time.monotonic() - t0, {r: rss_mb(p) for r, p in roles.items() if r in ("router", "shard")}))
            await asyncio.sleep(5)

    async def kill_clients():
        loop = asyncio.get_running_loop()
        while time.monotonic() + args.kill_every_s < deadline:
            await asyncio.sleep(args.kill_every_s)
            await loop.run_in_executor(None, _killed_client, target, 4, rng.uniform(1, 3))

    watchers = [asyncio.ensure_future(f()) for f in (soak.watch_silence, sample_memory, kill_clients)]
    await asyncio.gather(*(soak.client(channel, stub, deadline) for _ in range(args.streams)))
    finished = time.monotonic()
    for w in watchers:
        w.cancel()
    # The pool once the server has seen every client go.
    for _ in range(600):
        st = await stub.Stats(pb.StatsRequest(), timeout=10)
        if st.requests_running == 0 and st.requests_waiting == 0 and st.pages_referenced == 0:
            break
        await asyncio.sleep(0.1)
    await channel.close()
    return report(soak, memory, st, t0, finished, args)


def report(soak: Soak, memory, st, t0: float, finished: float, args) -> dict:
    windows, width = [], max(5.0, args.duration_s / 20)
    for i in range(int(args.duration_s // width)):
        start = i * width
        recs = [r for r in soak.records if start <= r["start"] - t0 < start + width and r["stamps"]]
        ttft = percentiles(((r["stamps"][0] - r["start"]) * 1e3 for r in recs), (50, 99))
        itl = percentiles(((b - a) * 1e3 for r in recs for a, b in zip(r["stamps"], r["stamps"][1:])), (50, 99))
        windows.append(
            {
                "t": start,
                "requests": len(recs),
                "ttft_p50_ms": ttft.get("p50"),
                "ttft_p99_ms": ttft.get("p99"),
                "itl_p50_ms": itl.get("p50"),
                "itl_p99_ms": itl.get("p99"),
            }
        )
    statuses = Counter(r["status"] for r in soak.records)
    tokens = sum(len(r["stamps"]) for r in soak.records)
    return {
        "streams": args.streams,
        "duration_s": args.duration_s,
        "requests": len(soak.records),
        "tokens": tokens,
        "tokens_per_s": tokens / (finished - t0),
        "statuses": dict(statuses),
        "by_behaviour": {
            b: dict(Counter(r["status"] for r in soak.records if r["behaviour"] == b))
            for b in ("complete", "cancel", "deadline", "drop")
        },
        "unknown_or_internal": [r.get("details", "") for r in soak.records if r["status"] in ("UNKNOWN", "INTERNAL")],
        # Silent for over silent_s: before the first token (still queued: the server is over its
        # capacity), or mid-stream (a stall: what a hang would look like).
        "silent_streams": soak.silent,
        "silent_threshold_s": args.silent_s,
        "end_pool": {
            "pages_total": st.pages_total,
            "pages_free": st.pages_free,
            "pages_evictable": st.pages_evictable,
            "pages_referenced": st.pages_referenced,
            "pages_reserved": st.pages_reserved,
            "requests_running": st.requests_running,
            "requests_waiting": st.requests_waiting,
            "replica_failures": st.replica_failures,
            "requests_failed": st.requests_failed,
        },
        "window_s": width,
        "windows": windows,
        "memory_mb": [(round(t, 1), m) for t, m in memory],
        "drain_s": time.monotonic() - finished,
    }
