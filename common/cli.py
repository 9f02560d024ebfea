"""`shardline` command line: serve (router + shards), router, shard, generate.

Every flag can also be set through the environment as SHARDLINE_<FLAG> (e.g. SHARDLINE_PORT).
"""
from __future__ import annotations

import argparse
import logging
import os
import sys


def _env(name: str, default, kind=str):
    value = os.environ.get("SHARDLINE_" + name.upper().replace("-", "_"))
    return default if value is None else kind(value)


def _add(p: argparse.ArgumentParser, flag: str, default, kind=str, help: str = "", choices=None):
    p.add_argument(f"--{flag}", type=kind, default=_env(flag, default, kind), choices=choices,
                   help=f"{help} (env SHARDLINE_{flag.upper().replace('-', '_')}, default {default!r})")


def _model_flags(p):
    _add(p, "model", "smollm2", help="'smollm2', a .gguf file or a Hugging Face folder")
    _add(p, "page-size", 64, int, "tokens per KV page")
    _add(p, "dtype", "float32", help="serving dtype", choices=["float32", "bfloat16", "float16"])


def _parallel_flags(p):
    _add(p, "tp", 1, int, "tensor-parallel ranks per pipeline stage")
    _add(p, "pp", 1, int, "pipeline stages")


def _shard_flags(p):
    _add(p, "kv-memory-gb", 1.0, float, "memory budget of the KV page pool per shard")
    _add(p, "threads", 0, int, "torch threads per shard (0: torch's default)")
    _add(p, "device", "", help="cpu | cuda (default: cuda when available)")


def _router_flags(p):
    _add(p, "host", "127.0.0.1", help="address the public API listens on")
    _add(p, "port", 50051, int, "port of the public API")
    _add(p, "num-pages", 0, int, "KV pages in the pool (0: what the shards' memory budget holds)")
    _add(p, "max-batch", 32, int, "most sequences in one step")
    _add(p, "max-batch-tokens", 4096, int, "most prompt tokens in one step")
    _add(p, "chunk-size", 0, int, "most prompt tokens of one sequence in one step (0: whole prompts)")
    _add(p, "priority-aging-s", 1.0, float, "seconds of waiting that raise a request's priority by one")
    _add(p, "max-waiting", 256, int, "most queued requests before RESOURCE_EXHAUSTED")
    _add(p, "shard-timeout", 300.0, float, "seconds to wait for the shards to come up")
    _add(p, "prefix-cache", "on", help="reuse the KV pages of shared prompt prefixes",
         choices=["on", "off"])
    _add(p, "eviction", "lru", help="which cached pages are reclaimed first", choices=["lru", "slru"])
    _add(p, "slru-protected-ratio", 0.5, float, "SLRU: share of the pool the protected segment may hold")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shardline", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="start the router and its shard(s); print 'ready HOST:PORT'")
    for add in (_model_flags, _shard_flags, _router_flags, _parallel_flags):
        add(serve)

    router = sub.add_parser("router", help="run the router alone, driving already running shards")
    _model_flags(router)
    _router_flags(router)
    _add(router, "shards", "", help="comma-separated shard addresses (host:port or unix:PATH)")

    shard = sub.add_parser("shard", help="run one shard alone")
    _model_flags(shard)
    _shard_flags(shard)
    _add(shard, "listen", "127.0.0.1:50061", help="address the shard listens on")
    _parallel_flags(shard)
    _add(shard, "tp-rank", 0, int, "this shard's tensor-parallel rank")
    _add(shard, "pp-stage", 0, int, "this shard's pipeline stage")
    _add(shard, "dist-init", "", help="torch.distributed rendezvous, tcp://HOST:PORT (needed when tp*pp > 1)")

    check = sub.add_parser("health", help="exit 0 when the service at --target reports SERVING")
    check.add_argument("--target", default="127.0.0.1:50051")
    check.add_argument("--timeout", type=float, default=3.0)

    gen = sub.add_parser("generate", help="stream a completion from a running server")
    gen.add_argument("prompt")
    _add(gen, "target", "127.0.0.1:50051", help="router address")
    gen.add_argument("--max-new-tokens", type=int, default=256)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=None)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[])
    gen.add_argument("--wait", type=float, default=0, help="seconds to wait for the server to come up")
    gen.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=os.environ.get("SHARDLINE_LOG_LEVEL", "INFO"),
                        format=f"%(asctime)s {args.command} %(levelname)s %(name)s: %(message)s")
    if args.command == "serve":
        from router.launcher import serve
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
            raise SystemExit("--shards is required")
        asyncio.run(serve_router(args))
        return 0
    if args.command == "shard":
        from shard.server import serve_shard
        serve_shard(args)
        return 0
    if args.command == "health":
        from router.launcher import healthy
        return 0 if healthy(args.target, args.timeout) else 1
    from router.client import generate
    return generate(args)


if __name__ == "__main__":
    sys.exit(main())
