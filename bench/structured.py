"""Structured outputs on the default model: are they valid, and what do they cost?

    python -m bench.structured [--seeds 4] [--streams 16] [--repeats 3] [--weights native]

1. Validity: every schema of harness/schemas.py, and a set of regex, grammar and choice
   constraints, once per seed at temperature 1: of the outputs that finish (not cut by
   max_new_tokens), the share that parse and validate (jsonschema, formats checked). Target 100%.
2. Speed: `--streams` JSON-schema streams against as many unconstrained ones of the same lengths
   (each runs, EOS ignored, as many tokens as its constrained twin did), in turns on one server:
   output tok/s and ITL p50. Target: at most 5% lower throughput and 1 ms more ITL p50.
3. llguidance's own cost, measured in this process as the router spends it: compile time per
   schema, a cached schema's (copy and first mask; target 1 ms), and the mask per token along
   every valid output. Target: a typical schema compiles in 50 ms.

Writes bench/out/structured-<time>.json and .png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import time

import jsonschema

from bench.common import machine, save
from harness.client import concurrently, percentiles
from harness.schemas import SCHEMAS, prompt
from harness.serve import Server
from shardline.common.model_source import resolve_model
from shardline.common.tokenizer import TextCodec
from shardline.common.tokenizer_files import tokenizer_folder
from shardline.protos import generation_pb2 as pb
from shardline.router.requests.constraints import Grammars, grammar_of

OTHERS = [  # (name, constraint fields, what a valid output fullmatches)
    ("regex: a date", dict(regex=r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]"), r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]"),
    ("regex: a phone", dict(regex=r"\+[0-9]{2} [0-9]{3} [0-9]{4}"), r"\+[0-9]{2} [0-9]{3} [0-9]{4}"),
    (
        "grammar: arithmetic",
        dict(grammar='start: NUM | NUM OP NUM | NUM OP NUM OP NUM\nNUM: /[0-9]{1,3}/\nOP: "+" | "*"'),
        r"[0-9]{1,3}([+*][0-9]{1,3})*",
    ),
    (
        "gbnf: a list",
        dict(grammar='root ::= "[" item ("," item){0,3} "]"\nitem ::= [a-z]{1,6}'),
        r"\[[a-z]{1,6}(,[a-z]{1,6}){0,3}\]",
    ),
    (
        "choice: sentiment",
        dict(choice=pb.Choice(options=["positive", "negative", "neutral"])),
        r"positive|negative|neutral",
    ),
]


def chat(what: str) -> pb.ChatMessages:
    return pb.ChatMessages(messages=[pb.ChatMessage(**m) for m in prompt(what)])


def validity(server: Server, seeds: int, max_new: int) -> tuple[dict, list]:
    reqs, checks = [], []
    for seed in range(seeds):
        for what, schema in SCHEMAS:
            reqs.append(
                pb.GenerateRequest(
                    messages=chat(what),
                    max_new_tokens=max_new,
                    json_schema=json.dumps(schema),
                    sampling=pb.SamplingParams(temperature=1.0, seed=seed),
                )
            )
            checks.append(("json_schema", what, schema))
        for name, fields, pattern in OTHERS:
            reqs.append(
                pb.GenerateRequest(
                    prompt=f"Answer with {name.split(': ')[1]}:",
                    max_new_tokens=max_new,
                    sampling=pb.SamplingParams(temperature=1.0, seed=seed),
                    **fields,
                )
            )
            checks.append((name.split(":")[0], name, pattern))
    _, streams = asyncio.run(concurrently(server.target, reqs))
    counts = {}
    valid_outputs = []
    for (kind, name, want), s, req in zip(checks, streams, reqs):
        c = counts.setdefault(kind, {"requests": 0, "finished": 0, "valid": 0, "errors": [], "invalid": []})
        c["requests"] += 1
        if s.error:
            c["errors"].append(s.error)
            continue
        if s.finish_reason not in ("stop", "eos"):
            continue
        c["finished"] += 1
        try:
            if kind == "json_schema":
                jsonschema.validate(json.loads(s.text), want, format_checker=jsonschema.FormatChecker())
            elif not re.fullmatch(want, s.text):
                raise ValueError("no match")
            c["valid"] += 1
            valid_outputs.append((req, s.ids))
        except (ValueError, jsonschema.ValidationError) as e:
            c["invalid"].append({"name": name, "text": s.text, "why": str(e)[:200]})
    for kind, c in counts.items():
        print(
            f"{kind}: {c['valid']}/{c['finished']} finished outputs valid ({c['requests']} requests, "
            f"{len(c['errors'])} errors)",
            flush=True,
        )
    return counts, valid_outputs


def speed(server: Server, streams: int, repeats: int, max_new: int) -> dict:
    constrained = [
        pb.GenerateRequest(
            messages=chat(SCHEMAS[i % len(SCHEMAS)][0]),
            max_new_tokens=max_new,
            json_schema=json.dumps(SCHEMAS[i % len(SCHEMAS)][1]),
            sampling=pb.SamplingParams(temperature=1.0, seed=i),
        )
        for i in range(streams)
    ]
    asyncio.run(concurrently(server.target, constrained))  # warm: compiled, pages cached
    runs = {"constrained": [], "unconstrained": []}
    twins = None
    for rep in range(repeats):
        for kind in ("constrained", "unconstrained") if rep % 2 == 0 else ("unconstrained", "constrained"):
            if kind == "unconstrained" and twins is None:
                continue  # its lengths come from the constrained run
            reqs = constrained if kind == "constrained" else twins
            wall, out = asyncio.run(concurrently(server.target, reqs))
            if kind == "constrained" and twins is None:
                twins = []
                for req, s in zip(constrained, out):
                    twin = pb.GenerateRequest()
                    twin.CopyFrom(req)
                    twin.ClearField("json_schema")
                    twin.max_new_tokens, twin.ignore_eos = max(1, len(s.ids)), True
                    twins.append(twin)
            tokens = sum(len(s.ids) for s in out)
            runs[kind].append(
                {
                    "tok_s": tokens / wall,
                    "tokens": tokens,
                    "wall_s": wall,
                    "itl_ms": percentiles(x for s in out for x in s.itl_ms),
                    "errors": [s.error for s in out if s.error],
                }
            )
            print(
                f"{kind}: {runs[kind][-1]['tok_s']:.1f} tok/s, ITL p50 {runs[kind][-1]['itl_ms']['p50']:.2f} ms",
                flush=True,
            )
    summary = {
        k: {
            "tok_s": statistics.median(r["tok_s"] for r in v),
            "itl_ms_p50": statistics.median(r["itl_ms"]["p50"] for r in v),
            "runs": v,
        }
        for k, v in runs.items()
    }
    c, u = summary["constrained"], summary["unconstrained"]
    summary["throughput_ratio"] = c["tok_s"] / u["tok_s"]
    summary["itl_p50_added_ms"] = c["itl_ms_p50"] - u["itl_ms_p50"]
    print(
        f"constrained/unconstrained tok/s {summary['throughput_ratio']:.3f}, ITL p50 "
        f"{summary['itl_p50_added_ms']:+.2f} ms",
        flush=True,
    )
    return summary


def llguidance_cost(vocab_size: int, valid_outputs: list) -> dict:
    import llguidance as llg

    codec = TextCodec(tokenizer_folder(resolve_model(None)))
    eos = sorted(codec.end_token_ids)
    grammars = Grammars(codec.tokenizer.to_str(), vocab_size, eos, timeout_s=30)
    tokenizer = llg.LLTokenizer(codec.tokenizer.to_str(), n_vocab=vocab_size, eos_token=eos)

    async def cached_ms() -> list[float]:
        out = []
        for _, schema in SCHEMAS:
            req = pb.GenerateRequest(json_schema=json.dumps(schema))
            await grammars.constrained(req)  # compiles and caches
            t0 = time.perf_counter()
            await grammars.constrained(req)
            out.append((time.perf_counter() - t0) * 1e3)
        return out

    compile_ms = {}
    for what, schema in SCHEMAS:
        grammar = grammar_of(pb.GenerateRequest(json_schema=json.dumps(schema)))
        t0 = time.perf_counter()
        llg.LLMatcher(tokenizer, grammar, log_level=0)
        compile_ms[what] = (time.perf_counter() - t0) * 1e3
    mask_us = []
    for req, ids in valid_outputs:
        matcher = llg.LLMatcher(tokenizer, grammar_of(req), log_level=0)
        for token in ids:
            t0 = time.perf_counter()
            matcher.compute_bitmask()
            mask_us.append((time.perf_counter() - t0) * 1e6)
            if not matcher.consume_token(token) or matcher.is_stopped():
                break
    cached = asyncio.run(cached_ms())
    result = {
        "compile_ms": compile_ms,
        "compile_ms_p50": statistics.median(compile_ms.values()),
        "compile_ms_max": max(compile_ms.values()),
        "cached_ms": percentiles(cached),
        "mask_us": percentiles(mask_us),
        "mask_us_mean": statistics.fmean(mask_us) if mask_us else None,
        "masks": len(mask_us),
    }
    print(
        f"compile p50 {result['compile_ms_p50']:.1f} ms (max {result['compile_ms_max']:.1f}), cached "
        f"p50 {result['cached_ms']['p50']:.2f} ms, mask per token p50 {result['mask_us']['p50']:.0f} us "
        f"(mean {result['mask_us_mean']:.0f})",
        flush=True,
    )
    return result


def plot(result: dict, png) -> None:
    import matplotlib.pyplot as plt

    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(14, 4))
    sp = result["speed"]
    kinds = ["unconstrained", "constrained"]
    a1.bar(kinds, [sp[k]["tok_s"] for k in kinds], color=["tab:gray", "tab:blue"])
    a1.set_title(f"{result['streams']} streams: output tok/s (ratio {sp['throughput_ratio']:.3f})")
    a2.bar(kinds, [sp[k]["itl_ms_p50"] for k in kinds], color=["tab:gray", "tab:blue"])
    a2.set_title(f"ITL p50, ms ({sp['itl_p50_added_ms']:+.2f} ms)")
    cost = result["llguidance"]
    a3.hist(list(cost["compile_ms"].values()), bins=20)
    a3.set_title(f"compile ms per schema (cached p50 {cost['cached_ms']['p50']:.2f} ms)")
    valid = ", ".join(f"{k} {c['valid']}/{c['finished']}" for k, c in result["validity"].items())
    fig.suptitle(f"Structured outputs, SmolLM2 {result['weights']}: valid {valid}", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=4)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--weights", default="native", choices=["native", "dequantized"])
    args = ap.parse_args()
    result = {
        "benchmark": "structured",
        **machine(),
        "weights": args.weights,
        "seeds": args.seeds,
        "streams": args.streams,
        "repeats": args.repeats,
        "max_new_tokens": args.max_new_tokens,
    }
    # Every validity request is sent at once: the queue holds them all.
    server = Server("--max-batch", str(max(32, args.streams)), "--weights", args.weights, "--max-waiting", "4096")
    try:
        info = server.stub.Info(pb.InfoRequest(), timeout=30)
        result["validity"], valid_outputs = validity(server, args.seeds, args.max_new_tokens)
        result["speed"] = speed(server, args.streams, args.repeats, args.max_new_tokens)
    finally:
        server.stop()
    result["llguidance"] = llguidance_cost(info.vocab_size, valid_outputs)
    save("structured", result, plot)


if __name__ == "__main__":
    main()
