"""Tracing overhead: the same load against a server with tracing off and one that traces every
request (sampler always_on) into a local OTLP/gRPC receiver, in one run, taking turns.

    python -m bench.tracing [--streams 16] [--max-new-tokens 64] [--repeats 3]

tok/s is completion tokens over the scenario's wall time (as in bench.load); the two servers are
up together but only one is under load at a time. Writes bench/out/tracing-<time>.json and .png.
"""

from __future__ import annotations

import argparse

from bench.common import machine, save
from bench.turns import plot_turns, take_turns
from harness.otlp_receiver import OtlpReceiver
from harness.serve import Server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--serve-args", default="", help="extra `shardline serve` arguments for both servers")
    args = parser.parse_args()
    extra = args.serve_args.split()
    result = {"benchmark": "tracing", **machine(), "streams": args.streams, "max_new_tokens": args.max_new_tokens}
    with OtlpReceiver() as receiver:
        servers = {
            "off": Server("--max-batch", str(args.streams), *extra),
            "on": Server(
                "--max-batch",
                str(args.streams),
                "--otlp-endpoint",
                receiver.endpoint,
                *extra,
                env={"OTEL_TRACES_SAMPLER": "always_on"},
            ),
        }
        try:
            result.update(take_turns(servers, args.streams, args.max_new_tokens, args.repeats))
        finally:
            for s in servers.values():
                s.stop()
        spans = receiver.spans()
    result["on_over_off"] = result["on"]["tok_s"] / result["off"]["tok_s"]
    result["spans_received"] = {name: sum(1 for s in spans if s.name == name) for name in {s.name for s in spans}}
    print(f"on/off {result['on_over_off']:.3f}; spans received: {result['spans_received']}")
    save(
        "tracing",
        result,
        lambda r, png: plot_turns(
            r, ["off", "on"], f"tracing, {r['streams']} streams: on/off = {r['on_over_off']:.3f}", png
        ),
    )


if __name__ == "__main__":
    main()
