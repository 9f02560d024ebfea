"""`shardline` command line: serve (router + shards, or several replicas behind a gateway),
router, shard, gateway, generate, health, certs.

The services' flags are defined in shardline/flags.py; every one can also be set through the
environment as SHARDLINE_<FLAG> (e.g. SHARDLINE_PORT), and numeric ones are range-checked before
anything starts (exit status 2 and a message naming the flag).
"""

from __future__ import annotations

import argparse
import atexit
import faulthandler
import os
import signal
import sys

from shardline.flags import COUNT, SECONDS, SERVICES, SIZE, add_flag, client_tls_flags, number


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shardline", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    helps = {
        "serve": "start the router and its shard(s); print 'ready HOST:PORT'",
        "router": "run the router alone, driving already running shards",
        "shard": "run one shard alone",
        "gateway": "run a gateway in front of running routers (--routers)",
    }
    for command, groups in SERVICES.items():
        service = sub.add_parser(command, help=helps[command])
        for add in groups:
            add(service)

    check = sub.add_parser("health", help="exit 0 when the service at --target reports SERVING")
    check.add_argument("--target", default="127.0.0.1:50051")
    check.add_argument("--timeout", type=SECONDS, default=3.0)
    client_tls_flags(check)

    certs = sub.add_parser("certs", help="make a local CA and router/shard certificates for mutual TLS")
    certs.add_argument("--out", default="certs", help="folder to write them into (kept files stay)")
    certs.add_argument(
        "--names",
        default="localhost",
        help="comma-separated host names the shards and routers are reached by (their certificates name them)",
    )

    gen = sub.add_parser("generate", help="stream a completion from a running server")
    gen.add_argument("prompt")
    add_flag(gen, "target", "127.0.0.1:50051", help="router address")
    gen.add_argument("--max-new-tokens", type=COUNT, default=256)
    gen.add_argument("--temperature", type=number(float, 0), default=0.0)
    gen.add_argument("--top-p", type=number(float, 0, 1, low_open=True), default=None)
    gen.add_argument("--top-k", type=SIZE, default=0)
    gen.add_argument("--seed", type=SIZE, default=None)
    gen.add_argument("--stop", action="append", default=[])
    gen.add_argument("--wait", type=number(float, 0), default=0, help="seconds to wait for the server to come up")
    gen.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    gen.add_argument(
        "--api-key",
        default=os.environ.get("SHARDLINE_API_KEY", ""),
        help="sent as 'authorization: Bearer KEY' (env SHARDLINE_API_KEY)",
    )
    client_tls_flags(gen)
    return parser


def _exit_now(code: int):
    """Ends a service's process without interpreter teardown, after what atexit would run (the
    last spans' export) and with its output flushed. Teardown took most of a second with torch
    loaded, and gRPC's C core has been seen to abort in it (SIGABRT) and hide the real status."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv: list[str] | None = None) -> int:
    from shardline.processes import die_with_parent

    die_with_parent()
    # `kill -USR1 <pid>` writes every thread's Python stack to stderr: where a service hangs.
    faulthandler.register(signal.SIGUSR1, file=sys.__stderr__, all_threads=True)
    parser = build_parser()
    args = parser.parse_args(argv)
    from shardline.common.telemetry import log_with_trace_ids

    log_with_trace_ids(
        f"%(asctime)s {args.command} %(levelname)s %(name)s%(trace_ids)s: %(message)s",
        os.environ.get("SHARDLINE_LOG_LEVEL", "INFO"),
    )
    if args.command == "serve" and args.replicas > 1:
        from shardline.replica_set import serve_replica_set

        _exit_now(serve_replica_set(args))
    if args.command == "serve":
        from shardline.launcher import serve

        _exit_now(serve(args))
    if args.command == "router":
        import asyncio

        from shardline.common.tokenizer_files import convert_soon

        convert_soon(args.model)  # while the router's modules import
        from shardline.router.app import serve_router

        args.shards = [a for a in args.shards.split(",") if a]
        if not args.shards:
            parser.error("router: --shards is required")
        _exit_now(asyncio.run(serve_router(args)))
    if args.command == "gateway":
        import asyncio

        from shardline.gateway.app import serve_gateway

        if not [e for e in args.routers.split(",") if e]:
            parser.error("gateway: --routers is required")
        _exit_now(asyncio.run(serve_gateway(args)))
    if args.command == "shard":
        if args.tp_rank >= args.tp or args.pp_stage >= args.pp:
            parser.error(
                f"shard: --tp-rank {args.tp_rank} / --pp-stage {args.pp_stage} outside --tp {args.tp} / --pp {args.pp}"
            )
        if args.tp * args.pp > 1 and not args.dist_init:
            parser.error("shard: --dist-init tcp://HOST:PORT is required with --tp or --pp above 1")
        from shardline.shard.server import serve_shard

        _exit_now(serve_shard(args))
    if args.command == "certs":
        from pathlib import Path

        from shardline.certs import make_certs

        for path in make_certs(Path(args.out), [n for n in args.names.split(",") if n]):
            print(f"wrote {path}")
        return 0
    if args.command == "health":
        from shardline.common.tls import client_credentials
        from shardline.processes import healthy

        return 0 if healthy(args.target, args.timeout, client_credentials(args)) else 1
    from shardline.client import generate

    return generate(args)


if __name__ == "__main__":
    sys.exit(main())
