"""Every flag of the `shardline` services, in groups, and which service has which group.

Every flag can also be set through the environment as SHARDLINE_<FLAG> (e.g. SHARDLINE_PORT).
Numeric flags are range-checked before anything starts: a value out of range exits with status 2
and a message naming the flag.
"""

from __future__ import annotations

import argparse
import math
import os


def number(kind, low=None, high=None, low_open=False):
    """An argparse type: `kind` within [low, high] ((low, high] when low_open), finite."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected {'an integer' if kind is int else 'a number'}, got {text!r}"
            ) from None
        too_low = low is not None and (value <= low if low_open else value < low)
        if (isinstance(value, float) and not math.isfinite(value)) or too_low or (high is not None and value > high):
            bounds = (
                f"{'(' if low_open else '['}{low if low is not None else '-inf'}, "
                f"{high if high is not None else 'inf'}]"
            )
            raise argparse.ArgumentTypeError(f"must lie in {bounds}, got {text!r}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse


COUNT = number(int, 1)  # at least one
SIZE = number(int, 0)  # zero or more
SECONDS = number(float, 0, low_open=True)


def add_flag(p: argparse.ArgumentParser, flag: str, default, kind=str, help: str = "", choices=None):
    env = "SHARDLINE_" + flag.upper().replace("-", "_")
    # The environment's value is a string: argparse runs it through `kind`, so it is checked too.
    p.add_argument(
        f"--{flag}",
        type=kind,
        default=os.environ.get(env, default),
        choices=choices,
        help=f"{help} (env {env}, default {default!r})",
    )


def _model_flags(p):
    add_flag(p, "model", "smollm2", help="'smollm2', a .gguf file or a Hugging Face folder")
    add_flag(p, "page-size", 16, number(int, 1, 1 << 16), "tokens per KV page (and the prefix cache's grain)")
    add_flag(p, "dtype", "float32", help="serving dtype", choices=["float32", "bfloat16", "float16"])


def _parallel_flags(p):
    add_flag(p, "tp", 1, number(int, 1, 256), "tensor-parallel ranks per pipeline stage")
    add_flag(p, "pp", 1, number(int, 1, 256), "pipeline stages")


def _drain_flags(p):
    add_flag(
        p,
        "drain-timeout-s",
        30.0,
        number(float, 0),
        "on SIGTERM, how long in-flight requests may run to completion before the process exits",
    )


def _shard_flags(p):
    add_flag(
        p, "kv-memory-gb", 1.0, number(float, 0, 1 << 16, low_open=True), "memory budget of the KV page pool per shard"
    )
    add_flag(p, "threads", 0, SIZE, "torch threads per shard (0: torch's default)")
    add_flag(p, "device", "", help="cpu | cuda (default: cuda when available)")
    add_flag(
        p,
        "decode-graphs",
        "auto",
        help="capture decode steps as graphs per batch bucket at warmup "
        "(auto: on CUDA only; on CPU torch.compile pays off little and takes minutes to warm up)",
        choices=["auto", "on", "off"],
    )
    add_flag(
        p,
        "weights",
        "native",
        help="native: a GGUF's quantized layers stay quantized (int4 / int8 "
        "kernels; CPU only); dequantized: every weight in --dtype, exact",
        choices=["native", "dequantized"],
    )
    add_flag(
        p,
        "quantize",
        "none",
        help="quantize dense linear layers at load (a Hugging Face folder, or "
        "a dequantized GGUF): int4 (LM head int8) or int8; CPU only",
        choices=["none", "int4", "int8"],
    )
    add_flag(
        p,
        "kv-dtype",
        "auto",
        help="dtype of the KV page pool (auto: float16 where quantized weights are "
        "served, as llama.cpp does, halving attention's memory traffic; else --dtype)",
        choices=["auto", "float32", "bfloat16", "float16"],
    )
    add_flag(
        p,
        "dense-prefill",
        "off",
        help="quantized layers also keep a dense copy for steps of many rows (prefill; bf16, or fp32 "
        "without native bf16) where it measures faster: prefill about 2x faster, 2 or 4 more bytes per weight",
        choices=["on", "off"],
    )


def _router_flags(p):
    add_flag(p, "host", "127.0.0.1", help="address the public API listens on")
    add_flag(p, "port", 50051, number(int, 1, 65535), "port of the public gRPC API")
    add_flag(p, "http-port", 8000, number(int, 0, 65535), "port of the OpenAI-compatible HTTP API (0: none)")
    env = "SHARDLINE_SERVED_MODEL_NAME"
    p.add_argument(
        "--served-model-name",
        nargs="+",
        metavar="NAME",
        default=os.environ.get(env, "").replace(",", " ").split(),
        help="the names HTTP clients may ask for the model by; the first is listed first "
        f"(env {env}, comma- or space-separated; default: the model's own name)",
    )
    add_flag(p, "num-pages", 0, SIZE, "KV pages in the pool (0: what the shards' memory budget holds)")
    add_flag(p, "max-batch", 32, number(int, 1, 4096), "most sequences in one step")
    add_flag(p, "max-batch-tokens", 4096, COUNT, "most prompt tokens in one step")
    add_flag(
        p,
        "chunk-size",
        0,
        SIZE,
        "most prompt tokens of one sequence in one step, fewer late in a "
        "long prompt where each attends to more (0: whole prompts)",
    )
    add_flag(
        p,
        "mixed-steps",
        "off",
        help="every step carries the decode rows beside its prompt chunk "
        "(Sarathi-Serve's stall-free batching) instead of rotating decode, chunk and admission steps",
        choices=["on", "off"],
    )
    add_flag(
        p,
        "layer-groups",
        8,
        COUNT,
        "with --chunk-size, the chunks of a prompt longer than one chunk run "
        "in this many steps of a part of the layers each, so that decode steps and short prompts cut in "
        "between (1: whole chunks; whole on pipeline stages and with --mixed-steps on)",
    )
    add_flag(
        p,
        "speculative",
        "suffix",
        help="speculative decoding: ngram proposes each sequence's next tokens from its own "
        "earlier n-grams and the shards verify them in one step where the measured step costs say "
        "it pays (the output is the same: greedy tokens equal, sampled ones equally distributed); "
        "suffix adds suffix decoding beside it, which proposes also from earlier requests' outputs "
        "(of the same cache namespace), each sequence taking the proposal expected to yield more; "
        "off: a token per sequence per step. A request opts out with speculative: false",
        choices=["off", "ngram", "suffix"],
    )
    add_flag(p, "spec-tokens", 8, number(int, 1, 64), "the most tokens proposed for one sequence in one step")
    add_flag(
        p,
        "reasoning-parser",
        "auto",
        help="how the HTTP APIs read a model's reasoning apart from its answer: auto as its chat "
        "template says (gpt-oss's harmony channels, <think> blocks, or none); think: <think> blocks "
        "whatever the template says; none: the reasoning stays in the answer",
        choices=["auto", "think", "none"],
    )
    add_flag(p, "priority-aging-s", 1.0, SECONDS, "seconds of waiting that raise a request's priority by one")
    add_flag(p, "max-waiting", 256, COUNT, "most queued requests before RESOURCE_EXHAUSTED")
    add_flag(p, "shard-timeout", 300.0, SECONDS, "seconds to wait for the shards to come up")
    add_flag(
        p,
        "step-timeout-s",
        20.0,
        SECONDS,
        "a step running this long makes the router check that every shard still answers; "
        "one that does not within 5 s fails the replica, and so does a step not done after 3 of these",
    )
    add_flag(
        p,
        "constraint-timeout-s",
        5.0,
        SECONDS,
        "longest a request's constraint (JSON schema, regex, grammar) may take to compile; past it "
        "the request is refused INVALID_ARGUMENT",
    )
    add_flag(p, "prefix-cache", "on", help="reuse the KV pages of shared prompt prefixes", choices=["on", "off"])
    add_flag(p, "eviction", "lru", help="which cached pages are reclaimed first", choices=["lru", "slru"])
    add_flag(
        p, "slru-protected-ratio", 0.5, number(float, 0, 1), "SLRU: share of the pool the protected segment may hold"
    )
    add_flag(
        p,
        "api-keys-file",
        "",
        help="Generate, Cancel, Stats and Info require 'authorization: Bearer KEY' "
        "with a key from this file (one per line, optionally 'KEY tenant'); empty: open to all",
    )
    add_flag(p, "tenant-max-requests", 0, SIZE, "a tenant's requests in flight before RESOURCE_EXHAUSTED (0: no limit)")
    add_flag(p, "tenant-max-waiting", 0, SIZE, "a tenant's queued requests before RESOURCE_EXHAUSTED (0: no limit)")
    add_flag(
        p,
        "prefix-cache-sharing",
        "tenant",
        help="tenant: each tenant's cached pages are its own; all: "
        "tenants with identical prompts and salts share pages (a timing side channel between them)",
        choices=["tenant", "all"],
    )

    add_flag(
        p,
        "kv-events-endpoint",
        "",
        help="publish the prefix index's changes as vLLM's KV cache events (ZMQ PUB, msgpack), e.g. "
        "tcp://*:5557 (bound; an address of one host is connected to, as vLLM does); with --replicas N "
        "replica i takes port + i; empty: none",
    )
    add_flag(
        p,
        "kv-events-replay-endpoint",
        "",
        help="where subscribers ask for missed KV event batches by sequence number (ZMQ ROUTER, bound), "
        "e.g. tcp://*:5558; empty: none",
    )
    add_flag(
        p,
        "kv-events-topic",
        "kv@{pod_ip}:{port}@{model}",
        help="the KV events' ZMQ topic, as llm-d's KV-cache indexer parses it (kv@<pod>@<model>): "
        "{pod_ip} is $POD_IP (else --host), {port} the HTTP port, {model} the model's served name",
    )
    add_flag(
        p,
        "kv-events-encoding",
        "map",
        help="each KV event as vLLM encodes it now (map: tagged under 'type') or did before "
        "vllm-project/vllm#42892 (array), which llm-d-kv-cache before v0.9 and older Dynamo relays read",
        choices=["map", "array"],
    )


def _public_tls_flags(p):
    add_flag(
        p,
        "tls-cert-file",
        "",
        help="serve the public API over TLS with this certificate (chain), PEM; re-read when it changes",
    )
    add_flag(p, "tls-key-file", "", help="the private key of --tls-cert-file, PEM")
    add_flag(p, "tls-client-ca-file", "", help="with TLS: accept only clients whose certificate this CA signed")


def _shard_tls_flags(p):
    add_flag(
        p,
        "shard-tls-ca-file",
        "",
        help="mutual TLS between router and shards (TCP only; unix sockets stay "
        "plaintext, owner-only): the CA that signs both sides' certificates, PEM",
    )
    add_flag(p, "shard-tls-cert-file", "", help="this side's certificate for router <-> shard mutual TLS, PEM")
    add_flag(p, "shard-tls-key-file", "", help="its private key, PEM")


def client_tls_flags(p):
    p.add_argument("--tls-ca-file", default="", help="connect over TLS, trusting this CA (PEM)")
    p.add_argument("--tls-cert-file", default="", help="and present this client certificate (mutual TLS)")
    p.add_argument("--tls-key-file", default="", help="the client certificate's private key")


def _metrics_flags(p):
    add_flag(p, "metrics-port", 0, number(int, 0, 65535), "port of the Prometheus endpoint /metrics (0: none)")


def _telemetry_flags(p):
    add_flag(
        p,
        "otlp-endpoint",
        "",
        help="export traces over OTLP/gRPC to this collector (host:port or URL); "
        "the standard OTEL_EXPORTER_OTLP_* variables work too; empty and unset: no tracing",
    )


def _serve_flags(p):
    add_flag(
        p, "shard-restarts", 5, SIZE, "restarts of a failed shard group in a row before `serve` gives up and exits 1"
    )
    add_flag(
        p,
        "replicas",
        1,
        number(int, 1, 64),
        "replicas (a router and its shard group each) on this host; "
        "above 1 a gateway serves --port and the routers take the next free ports",
    )


def _routing_flags(p):
    add_flag(
        p,
        "routing",
        "prefix",
        help="how the gateway picks a replica: prefix (fewest uncached prompt "
        "tokens plus load), least-load, or round-robin",
        choices=["prefix", "least-load", "round-robin"],
    )
    add_flag(
        p,
        "load-weight",
        0.25,
        number(float, 0),
        "prefix routing: what a replica's load (prompt tokens queued, plus 64 per request in flight) "
        "weighs against the prompt tokens it would have to compute",
    )
    add_flag(
        p,
        "balance-abs-threshold",
        8,
        SIZE,
        "imbalance guard: a replica with more than this many requests above the least loaded one ...",
    )
    add_flag(
        p,
        "balance-rel-threshold",
        1.5,
        number(float, 1),
        "... and more than this many times its requests is ranked last, whatever it caches",
    )


def _gateway_only_flags(p):
    add_flag(p, "host", "127.0.0.1", help="address the gateway's gRPC API listens on")
    add_flag(p, "port", 50051, number(int, 1, 65535), "port of the gateway's gRPC API")
    add_flag(
        p,
        "http-port",
        8000,
        number(int, 0, 65535),
        "port of the gateway's OpenAI-compatible HTTP API, passed on to the routers' own (0: none)",
    )
    add_flag(
        p,
        "routers",
        "",
        help="comma-separated router addresses HOST:PORT; each name is resolved "
        "again every --resolve-interval-s and every address it resolves to is a replica "
        "(a Kubernetes headless Service)",
    )
    add_flag(p, "resolve-interval-s", 5.0, SECONDS, "seconds between resolutions of --routers")
    add_flag(
        p,
        "api-keys-file",
        "",
        help="the routers' API keys file: the gateway checks keys too, to know "
        "each request's tenant (whose cache namespace its prompt is hashed in)",
    )
    add_flag(p, "router-tls-ca-file", "", help="connect to the routers over TLS, trusting this CA (PEM)")
    add_flag(p, "router-tls-cert-file", "", help="and present this client certificate (mutual TLS)")
    add_flag(p, "router-tls-key-file", "", help="its private key")


def _router_only_flags(p):
    add_flag(p, "shards", "", help="comma-separated shard addresses (host:port or unix:PATH)")


def _shard_only_flags(p):
    add_flag(p, "listen", "127.0.0.1:50061", help="address the shard listens on")
    add_flag(p, "tp-rank", 0, SIZE, "this shard's tensor-parallel rank")
    add_flag(p, "pp-stage", 0, SIZE, "this shard's pipeline stage")
    add_flag(p, "dist-init", "", help="torch.distributed rendezvous, tcp://HOST:PORT (needed when tp*pp > 1)")


# The flag groups of each service. `serve` passes each of its flags on to the router and to the
# shards whose own command has it (shardline/launcher.py); the `*_only` flags it sets itself.
SERVICES = {
    "serve": (
        _model_flags,
        _shard_flags,
        _router_flags,
        _metrics_flags,
        _parallel_flags,
        _drain_flags,
        _telemetry_flags,
        _serve_flags,
        _routing_flags,
    ),
    "router": (
        _model_flags,
        _router_flags,
        _metrics_flags,
        _drain_flags,
        _telemetry_flags,
        _public_tls_flags,
        _shard_tls_flags,
        _router_only_flags,
    ),
    "shard": (
        _model_flags,
        _shard_flags,
        _drain_flags,
        _telemetry_flags,
        _shard_tls_flags,
        _parallel_flags,
        _shard_only_flags,
    ),
    "gateway": (_model_flags, _metrics_flags, _drain_flags, _public_tls_flags, _routing_flags, _gateway_only_flags),
}


def service_flags(command: str) -> list[str]:
    """The flags (without --) of `router`, `shard` or `serve`, in their order."""
    parser = argparse.ArgumentParser(add_help=False)
    for add in SERVICES[command]:
        add(parser)
    return [a.option_strings[0][2:] for a in parser._actions]
