"""The load client that benchmarks and tests share: one streamed request with the arrival time
of every token, many at once over one channel, the standard workload's scenario, and the one
percentile definition every report uses (linear interpolation, numpy's default), so that a p99
from one benchmark compares with a p99 from another."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import grpc
import numpy as np

from shardline.protos import generation_pb2 as pb
from shardline.protos import generation_pb2_grpc as pb_grpc

# 52-56 SmolLM2 tokens each: under one 64-token KV page, so repeats cannot hit the prefix cache.
TOPICS = [
    "a lighthouse keeper",
    "a lost robot",
    "a dragon who cannot fly",
    "a time-travelling baker",
    "a haunted library",
    "a city under the sea",
    "a chess champion",
    "a talking cat",
    "the last tree on Earth",
    "a space station cook",
    "a forgotten violin",
    "a desert caravan",
    "a clockmaker apprentice",
    "a mountain rescue dog",
    "a secret garden",
    "a retired pirate",
]
PROMPTS = [
    f"Write a short story about {t}. Give the main character a name, a clear goal and a "
    "problem that stands in the way. Describe the setting with vivid details, include some "
    "dialogue, and end with a twist that the reader does not see coming."
    for t in TOPICS
]
STATS_WINDOW = 512  # the router's Stats medians cover this many recent decode steps


def percentiles(values, qs=(50, 90, 99)) -> dict:
    """{"min", "p50", ..., "max"} of `values` ({} for none)."""
    a = np.asarray([v for v in values if v is not None], dtype=float)
    if a.size == 0:
        return {}
    return {"min": float(a.min()), **{f"p{q}": float(np.percentile(a, q)) for q in qs}, "max": float(a.max())}


def token_request(ids: list[int], max_new_tokens: int, **fields) -> pb.GenerateRequest:
    """Greedy, always `max_new_tokens` long (EOS ignored), from token ids."""
    return pb.GenerateRequest(
        prompt_token_ids=pb.PromptTokens(ids=ids), max_new_tokens=max_new_tokens, ignore_eos=True, **fields
    )


def text_request(prompt: str, max_new_tokens: int, **fields) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        prompt=prompt,
        max_new_tokens=max_new_tokens,
        ignore_eos=True,
        sampling=pb.SamplingParams(temperature=0.0),
        **fields,
    )


@dataclass
class Stream:
    """One streamed request as its client saw it."""

    sent: float  # time.perf_counter() when it was sent
    times: list[float] = field(default_factory=list)  # when each token arrived
    ids: list[int] = field(default_factory=list)
    text: str = ""
    last: pb.GenerateResponse | None = None
    error: str | None = None
    multi_token_msgs: int = 0  # messages carrying more than one token (those arrive at one time)
    ended: float = 0.0

    def _take(self, msg: pb.GenerateResponse) -> None:
        now = time.perf_counter()  # first thing, before any client-side work
        self.times += [now] * len(msg.token_ids)
        self.ids += msg.token_ids
        self.text += msg.text
        self.multi_token_msgs += len(msg.token_ids) > 1
        self.last = msg

    @property
    def ttft_ms(self) -> float | None:
        return (self.times[0] - self.sent) * 1e3 if self.times else None

    @property
    def itl_ms(self) -> list[float]:
        return [(b - a) * 1e3 for a, b in zip(self.times, self.times[1:])]

    @property
    def finish_reason(self) -> str:
        return self.last.finish_reason if self.last else ""

    @property
    def completion_tokens(self) -> int:
        return self.last.usage.completion_tokens if self.last and self.last.finish_reason else len(self.ids)


def stream(stub, req: pb.GenerateRequest, timeout: float = 900) -> Stream:
    """One request on a blocking stub, to its end (an error is raised)."""
    s = Stream(time.perf_counter())
    for msg in stub.Generate(req, timeout=timeout):
        s._take(msg)
    s.ended = time.perf_counter()
    return s


async def astream(stub, req: pb.GenerateRequest, timeout: float = 900, into: Stream | None = None) -> Stream:
    """One request on an asyncio stub, to its end; an error is kept in `error`. `into`: the
    Stream to fill as tokens arrive (a caller may watch it meanwhile)."""
    s = into or Stream(time.perf_counter())
    try:
        async for msg in stub.Generate(req, timeout=timeout):
            s._take(msg)
    except grpc.aio.AioRpcError as e:
        s.error = f"{e.code().name}: {e.details()}"
    s.ended = time.perf_counter()
    return s


async def concurrently(target: str, reqs: list[pb.GenerateRequest], timeout: float = 900) -> tuple[float, list[Stream]]:
    """All of `reqs` at once over one channel: (wall seconds from the first send to the last
    message, the streams)."""
    async with grpc.aio.insecure_channel(target) as channel:
        await asyncio.wait_for(channel.channel_ready(), 30)  # connection setup is not TTFT
        stub = pb_grpc.GenerationStub(channel)
        t0 = time.perf_counter()
        streams = await asyncio.gather(*(astream(stub, r, timeout) for r in reqs))
        return max(s.ended for s in streams) - t0, list(streams)


def workload(n: int, max_new: int) -> list[pb.GenerateRequest]:
    """The standard workload: `n` greedy streams over PROMPTS, `max_new` tokens each."""
    return [text_request(PROMPTS[i % len(PROMPTS)], max_new) for i in range(n)]


def decode_tok_s(streams: list[Stream]) -> float | None:
    """Tokens after each stream's first, over the window from the earliest first token to the
    latest last one: the decode rate that ITL measures, without prefill."""
    timed = [s for s in streams if len(s.times) > 1]
    if not timed:
        return None
    window = max(s.times[-1] for s in timed) - min(s.times[0] for s in timed)
    return sum(len(s.times) - 1 for s in timed) / window if window > 0 else None


def run_scenario(stub, target: str, n: int, max_new: int, group_steps0: int, meter) -> dict:
    """`n` streams of the standard workload, measured: tok/s (completion tokens over the wall
    time from the first send to the last message, prefill included), TTFT and ITL percentiles,
    the CPU `meter`'s shares, and the router's step times from Stats."""
    before = stub.Stats(pb.StatsRequest(), timeout=10)
    with meter:
        wall, streams = asyncio.run(concurrently(target, workload(n, max_new)))
    st = stub.Stats(pb.StatsRequest(), timeout=10)  # right away: the medians are a sliding window
    tokens = sum(s.completion_tokens for s in streams)
    router_ms, shard_ms = st.decode_step_ms_p50, st.shard_decode_step_ms_p50
    return {
        "concurrency": n,
        "wall_s": wall,
        "completion_tokens": tokens,
        "tok_s": tokens / wall,
        "decode_tok_s": decode_tok_s(streams),
        "ttft_ms": percentiles(s.ttft_ms for s in streams),
        "itl_ms": percentiles(x for s in streams for x in s.itl_ms),
        "errors": [s.error for s in streams if s.error],
        "finish_reasons": sorted({s.finish_reason for s in streams}),
        "multi_token_msgs": sum(s.multi_token_msgs for s in streams),
        "cached_prompt_tokens": sum(s.last.usage.cached_prompt_tokens if s.last else 0 for s in streams),
        **meter.pct,  # client_cpu_pct near 100 would mean the client is the bottleneck
        "stats": {
            "decode_step_ms_p50": router_ms,
            "shard_decode_step_ms_p50": shard_ms,
            "overhead_pct": (router_ms - shard_ms) / shard_ms * 100 if shard_ms else None,
            "steps": st.steps - before.steps,  # prefills included
            # ~share of the medians' window holding this concurrency's steps (steps count
            # prefills too, so approximate); under ~0.5 they mostly describe earlier scenarios
            "window_share": min(1.0, (st.steps - group_steps0) / min(STATS_WINDOW, st.steps)),
        },
        "raw": {
            "ttft_ms": [s.ttft_ms for s in streams],
            "itl_ms": [[round(x, 3) for x in s.itl_ms] for s in streams],
            "ids_req0": streams[0].ids,
        },
    }


def warm_up(target: str, n: int, max_new: int) -> None:
    """Untimed: the standard workload once (warms this batch shape)."""
    asyncio.run(concurrently(target, workload(n, max_new)))


# -- the OpenAI-compatible HTTP API ---------------------------------------------------------------
async def http_stream(client, base_url: str, body: dict, headers: dict | None = None, timeout: float = 900) -> Stream:
    """One streamed completion (`/completions`, or `/chat/completions` when the body has
    messages) from any OpenAI-compatible server at `base_url` (".../v1"), on an httpx.AsyncClient:
    the arrival time of every chunk that carries text, the text, and `last` as a GenerateResponse
    holding the finish reason and usage (the body should ask for `stream_options.include_usage`).
    An error status or error event is kept in `error`."""
    import json

    path = "/chat/completions" if "messages" in body else "/completions"
    s, usage, finish = Stream(time.perf_counter()), None, ""
    try:
        async with client.stream(
            "POST", base_url + path, json={**body, "stream": True}, headers=headers, timeout=timeout
        ) as response:
            if response.status_code != 200:
                s.error = f"HTTP {response.status_code}: {(await response.aread()).decode()[:300]}"
            else:
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    now = time.perf_counter()
                    chunk = json.loads(line[len("data: ") :])
                    if "error" in chunk:
                        s.error = chunk["error"].get("message", str(chunk["error"]))
                        continue
                    usage = chunk.get("usage") or usage
                    for choice in chunk.get("choices", []):
                        text = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
                        if text:
                            s.times.append(now)
                            s.text += text
                        finish = choice.get("finish_reason") or finish
    except Exception as e:  # noqa: BLE001 - a load client reports, it does not stop
        s.error = f"{type(e).__name__}: {e}"
    s.ended = time.perf_counter()
    s.last = pb.GenerateResponse(finish_reason=finish)
    if usage:
        s.last.usage.prompt_tokens = usage.get("prompt_tokens", 0)
        s.last.usage.completion_tokens = usage.get("completion_tokens", 0)
        s.last.usage.cached_prompt_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return s


async def http_concurrently(
    base_url: str, bodies: list[dict], headers: dict | None = None, timeout: float = 900
) -> tuple[float, list[Stream]]:
    """All of `bodies` at once over one connection pool: (wall seconds from the first send to the
    last message, the streams)."""
    import httpx

    limits = httpx.Limits(max_connections=len(bodies) + 4, max_keepalive_connections=len(bodies) + 4)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        t0 = time.perf_counter()
        streams = await asyncio.gather(*(http_stream(client, base_url, b, headers, timeout) for b in bodies))
        return max(s.ended for s in streams) - t0, list(streams)


def http_workload(model: str, n: int, max_new: int) -> list[dict]:
    """The standard workload as completions bodies: greedy, `max_new` tokens each, EOS ignored
    (`ignore_eos`: vLLM's name, which llama.cpp's server reads too)."""
    return [
        {
            "model": model,
            "prompt": PROMPTS[i % len(PROMPTS)],
            "max_tokens": max_new,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
        }
        for i in range(n)
    ]
