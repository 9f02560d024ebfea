"""`shardline` command line: serve (router + shards), router, shard, generate, health.

Every flag can also be set through the environment as SHARDLINE_<FLAG> (e.g. SHARDLINE_PORT).
Numeric flags are range-checked before anything starts: a value out of range exits with status 2
and a message naming the flag.
"""
from __future__ import annotations

import argparse
import logging
import math
import os
import sys


def _number(kind, low=None, high=None, low_open=False):
    """An argparse type: `kind` within [low, high] ((low, high] when low_open), finite."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, "
                                             f"got {text!r}") from None
        too_low = low is not None and (value <= low if low_open else value < low)
        if (isinstance(value, float) and not math.isfinite(value)) or too_low \
                or (high is not None and value > high):
            bounds = f"{'(' if low_open else '['}{low if low is not None else '-inf'}, " \
                     f"{high if high is not None else 'inf'}]"
            raise argparse.ArgumentTypeError(f"must lie in {bounds}, got {text!r}")
        return value
    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse


COUNT = _number(int, 1)             # at least one
SIZE = _number(int, 0)              # zero or more
SECONDS = _number(float, 0, low_open=True)


def _add(p: argparse.ArgumentParser, flag: str, default, kind=str, help: str = "", choices=None):
    env = "SHARDLINE_" + flag.upper().replace("-", "_")
    # The environment's value is a string: argparse runs it through `kind`, so it is checked too.
    p.add_argument(f"--{flag}", type=kind, default=os.environ.get(env, default), choices=choices,
                   help=f"{help} (env {env}, default {default!r})")


def _model_flags(p):
    _add(p, "model", "smollm2", help="'smollm2', a .gguf file or a Hugging Face folder")
    _add(p, "page-size", 64, _number(int, 1, 1 << 16), "tokens per KV page")
    _add(p, "dtype", "float32", help="serving dtype", choices=["float32", "bfloat16", "float16"])


def _parallel_flags(p):
    _add(p, "tp", 1, _number(int, 1, 256), "tensor-parallel ranks per pipeline stage")
    _add(p, "pp", 1, _number(int, 1, 256), "pipeline stages")


def _drain_flags(p):
    _add(p, "drain-timeout-s", 30.0, _number(float, 0),
         "on SIGTERM, how long in-flight requests may run to completion before the process exits")


def _shard_flags(p):
    _add(p, "kv-memory-gb", 1.0, _number(float, 0, 1 << 16, low_open=True), "memory budget of the KV page pool per shard")
    _add(p, "threads", 0, SIZE, "torch threads per shard (0: torch's default)")
    _add(p, "device", "", help="cpu | cuda (default: cuda when available)")
    _add(p, "decode-graphs", "auto", help="capture decode steps as graphs per batch bucket at warmup "
         "(auto: on CUDA only; on CPU torch.compile pays off little and takes minutes to warm up)",
         choices=["auto", "on", "off"])
    _add(p, "weights", "native", help="native: a GGUF's quantized layers stay quantized (int4 / int8 "
         "kernels; CPU only); dequantized: every weight in --dtype, exact",
         choices=["native", "dequantized"])
    _add(p, "quantize", "none", help="quantize dense linear layers at load (a Hugging Face folder, or "
         "a dequantized GGUF): int4 (LM head int8) or int8; CPU only", choices=["none", "int4", "int8"])
    _add(p, "kv-dtype", "auto", help="dtype of the KV page pool (auto: float16 where quantized weights are "
         "served, as llama.cpp does, halving attention's memory traffic; else --dtype)",
         choices=["auto", "float32", "bfloat16", "float16"])
    _add(p, "dense-prefill", "off", help="int4 layers also keep a dense copy for steps of many rows (prefill; "
         "bf16, or fp32 without native bf16): prefill about 2x faster, 2 or 4 more bytes per weight",
         choices=["on", "off"])


def _router_flags(p):
    _add(p, "host", "127.0.0.1", help="address the public API listens on")
    _add(p, "port", 50051, _number(int, 1, 65535), "port of the public API")
    _add(p, "num-pages", 0, SIZE, "KV pages in the pool (0: what the shards' memory budget holds)")
    _add(p, "max-batch", 32, _number(int, 1, 4096), "most sequences in one step")
    _add(p, "max-batch-tokens", 4096, COUNT, "most prompt tokens in one step")
    _add(p, "chunk-size", 0, SIZE, "most prompt tokens of one sequence in one step (0: whole prompts)")
    _add(p, "priority-aging-s", 1.0, SECONDS, "seconds of waiting that raise a request's priority by one")
    _add(p, "max-waiting", 256, COUNT, "most queued requests before RESOURCE_EXHAUSTED")
    _add(p, "shard-timeout", 300.0, SECONDS, "seconds to wait for the shards to come up")
    _add(p, "step-timeout-s", 20.0, SECONDS,
         "a step running this long makes the router check that every shard still answers; "
         "one that does not within 5 s fails the replica")
    _add(p, "prefix-cache", "on", help="reuse the KV pages of shared prompt prefixes",
         choices=["on", "off"])
    _add(p, "eviction", "lru", help="which cached pages are reclaimed first", choices=["lru", "slru"])
    _add(p, "slru-protected-ratio", 0.5, _number(float, 0, 1),
         "SLRU: share of the pool the protected segment may hold")
    _add(p, "metrics-port", 0, _number(int, 0, 65535), "port of the Prometheus endpoint /metrics (0: none)")
    _add(p, "api-keys-file", "", help="Generate, Cancel, Stats and Info require 'authorization: Bearer KEY' "
         "with a key from this file (one per line, optionally 'KEY tenant'); empty: open to all")
    _add(p, "tenant-max-requests", 0, SIZE, "a tenant's requests in flight before RESOURCE_EXHAUSTED (0: no limit)")
    _add(p, "tenant-max-waiting", 0, SIZE, "a tenant's queued requests before RESOURCE_EXHAUSTED (0: no limit)")
    _add(p, "prefix-cache-sharing", "tenant", help="tenant: each tenant's cached pages are its own; all: "
         "tenants with identical prompts and salts share pages (a timing side channel between them)",
         choices=["tenant", "all"])


def _public_tls_flags(p):
    _add(p, "tls-cert-file", "", help="serve the public API over TLS with this certificate (chain), PEM; "
         "re-read when it changes")
    _add(p, "tls-key-file", "", help="the private key of --tls-cert-file, PEM")
    _add(p, "tls-client-ca-file", "", help="with TLS: accept only clients whose certificate this CA signed")


def _shard_tls_flags(p):
    _add(p, "shard-tls-ca-file", "", help="mutual TLS between router and shards (TCP only; unix sockets stay "
         "plaintext, owner-only): the CA that signs both sides' certificates, PEM")
    _add(p, "shard-tls-cert-file", "", help="this side's certificate for router <-> shard mutual TLS, PEM")
    _add(p, "shard-tls-key-file", "", help="its private key, PEM")


def _client_tls_flags(p):
    p.add_argument("--tls-ca-file", default="", help="connect over TLS, trusting this CA (PEM)")
    p.add_argument("--tls-cert-file", default="", help="and present this client certificate (mutual TLS)")
    p.add_argument("--tls-key-file", default="", help="the client certificate's private key")


def _telemetry_flags(p):
    _add(p, "otlp-endpoint", "", help="export traces over OTLP/gRPC to this collector (host:port or URL); "
         "the standard OTEL_EXPORTER_OTLP_* variables work too; empty and unset: no tracing")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shardline", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="start the router and its shard(s); print 'ready HOST:PORT'")
    for add in (_model_flags, _shard_flags, _router_flags, _parallel_flags, _drain_flags, _telemetry_flags):
        add(serve)
    _add(serve, "shard-restarts", 5, SIZE,
         "restarts of a failed shard group in a row before `serve` gives up and exits 1")

    router = sub.add_parser("router", help="run the router alone, driving already running shards")
    _model_flags(router)
    _router_flags(router)
    _drain_flags(router)
    _telemetry_flags(router)
    _public_tls_flags(router)
    _shard_tls_flags(router)
    _add(router, "shards", "", help="comma-separated shard addresses (host:port or unix:PATH)")

    shard = sub.add_parser("shard", help="run one shard alone")
    _model_flags(shard)
    _shard_flags(shard)
    _drain_flags(shard)
    _telemetry_flags(shard)
    _shard_tls_flags(shard)
    _add(shard, "listen", "127.0.0.1:50061", help="address the shard listens on")
    _parallel_flags(shard)
    _add(shard, "tp-rank", 0, SIZE, "this shard's tensor-parallel rank")
    _add(shard, "pp-stage", 0, SIZE, "this shard's pipeline stage")
    _add(shard, "dist-init", "", help="torch.distributed rendezvous, tcp://HOST:PORT (needed when tp*pp > 1)")

    check = sub.add_parser("health", help="exit 0 when the service at --target reports SERVING")
    check.add_argument("--target", default="127.0.0.1:50051")
    check.add_argument("--timeout", type=SECONDS, default=3.0)
    _client_tls_flags(check)

    certs = sub.add_parser("certs", help="make a local CA and router/shard certificates for mutual TLS")
    certs.add_argument("--out", default="certs", help="folder to write them into (kept files stay)")
    certs.add_argument("--names", default="localhost",
                       help="comma-separated host names the shards are reached by (their certificate names them)")

    gen = sub.add_parser("generate", help="stream a completion from a running server")
    gen.add_argument("prompt")
    _add(gen, "target", "127.0.0.1:50051", help="router address")
    gen.add_argument("--max-new-tokens", type=COUNT, default=256)
    gen.add_argument("--temperature", type=_number(float, 0), default=0.0)
    gen.add_argument("--top-p", type=_number(float, 0, 1, low_open=True), default=None)
    gen.add_argument("--top-k", type=SIZE, default=0)
    gen.add_argument("--seed", type=SIZE, default=None)
    gen.add_argument("--stop", action="append", default=[])
    gen.add_argument("--wait", type=_number(float, 0), default=0,
                     help="seconds to wait for the server to come up")
    gen.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    gen.add_argument("--api-key", default=os.environ.get("SHARDLINE_API_KEY", ""),
                     help="sent as 'authorization: Bearer KEY' (env SHARDLINE_API_KEY)")
    _client_tls_flags(gen)
    return parser


def main(argv: list[str] | None = None) -> int:
    from common.process import die_with_parent
    die_with_parent()
    parser = build_parser()
    args = parser.parse_args(argv)
    from common.telemetry import log_with_trace_ids
    log_with_trace_ids(f"%(asctime)s {args.command} %(levelname)s %(name)s%(trace_ids)s: %(message)s",
                       os.environ.get("SHARDLINE_LOG_LEVEL", "INFO"))
    if args.command == "serve":
        from common.launcher import serve
        code = serve(args)
        # The children are stopped; skip interpreter teardown, where gRPC's C core has been seen
        # to abort (SIGABRT) and hide the launcher's real exit status.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    if args.command == "router":
        import asyncio
        from router.app import serve_router
        args.shards = [a for a in args.shards.split(",") if a]
        if not args.shards:
            parser.error("router: --shards is required")
        return asyncio.run(serve_router(args))
    if args.command == "shard":
        if args.tp_rank >= args.tp or args.pp_stage >= args.pp:
            parser.error(f"shard: --tp-rank {args.tp_rank} / --pp-stage {args.pp_stage} outside "
                         f"--tp {args.tp} / --pp {args.pp}")
        if args.tp * args.pp > 1 and not args.dist_init:
            parser.error("shard: --dist-init tcp://HOST:PORT is required with --tp or --pp above 1")
        from shard.server import serve_shard
        return serve_shard(args)
    if args.command == "certs":
        from pathlib import Path
        from common.certs import make_certs
        for path in make_certs(Path(args.out), [n for n in args.names.split(",") if n]):
            print(f"wrote {path}")
        return 0
    if args.command == "health":
        from common.process import healthy
        from common.tls import client_credentials
        return 0 if healthy(args.target, args.timeout, client_credentials(args)) else 1
    from router.client import generate
    return generate(args)


if __name__ == "__main__":
    sys.exit(main())
