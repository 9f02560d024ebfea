"""The router process: tokenizer, the replica's shard group, and the public servers: gRPC and
the OpenAI-compatible HTTP API, two front ends of one admission.

The gRPC server starts listening once the shard group is first connected (so a client's
wait_for_ready waits for a usable server), the HTTP one at once (its /health answers 503 and
its requests UNAVAILABLE until then); both turn NOT_SERVING whenever the group fails, and
SERVING again when it is back. SIGTERM drains: NOT_SERVING at once, new
requests UNAVAILABLE (HTTP 503), accepted ones of either API run to completion for up to
`--drain-timeout-s`, then the process exits 0.
"""

from __future__ import annotations

import asyncio
import logging
import signal

import grpc
from grpc_health.v1 import health, health_pb2

from shardline.common.auth import ApiKeys
from shardline.common.generation_service import SERVICE, add_generation_service
from shardline.common.http_server import HttpServer
from shardline.common.model_source import resolve_model
from shardline.common.process import exit_soon
from shardline.common.telemetry import setup_tracing
from shardline.common.tls import ShardTls, http_ssl_context, listen
from shardline.common.tokenizer import TextCodec
from shardline.common.tokenizer_files import tokenizer_folder
from shardline.router.api.fleet import FLEET_SERVICE, CacheWatchers, add_fleet_service
from shardline.router.api.generation import GenerationService
from shardline.router.api.http_app import HttpApi
from shardline.router.api.kv_events import KvEventPublisher, topic_of
from shardline.router.core.config import ReplicaConfig
from shardline.router.core.replica import Replica
from shardline.router.observers.metrics import Metrics
from shardline.router.observers.stats import StatsCounters
from shardline.router.observers.tracing import Tracing
from shardline.router.requests.admission import Admission
from shardline.router.shards.group import ShardGroup
from shardline.router.shards.link import ShardLink

log = logging.getLogger("shardline.router")


async def serve_router(args) -> int:
    source = resolve_model(args.model)
    loop = asyncio.get_running_loop()
    codec = await loop.run_in_executor(None, lambda: TextCodec(tokenizer_folder(source)))
    health_servicer = health.aio.HealthServicer()
    server = grpc.aio.server()
    address = f"{args.host}:{args.port}"
    http: HttpServer | None = None
    listening = False

    async def on_serving(serving: bool) -> None:
        nonlocal listening
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE):
            await health_servicer.set(name, status)
        if serving and not listening:
            await server.start()
            listening = True
            print(f"router listening {address}", flush=True)

    shard_tls = ShardTls.from_args(args)
    credentials = shard_tls.channel() if shard_tls else None
    shards = ShardLink(ShardGroup(args.shards, step_timeout_s=args.step_timeout_s, credentials=credentials))
    tracer = setup_tracing(args.otlp_endpoint, "router", f"router:{args.port}")
    tracing = Tracing(tracer, source.name) if tracer is not None else None
    stats = StatsCounters()
    metrics = Metrics()  # served on the HTTP API's /metrics, and on --metrics-port where one is set
    replica = Replica(
        ReplicaConfig.from_flags(args),
        source.name,
        shards,
        codec,
        on_serving,
        [o for o in (stats, metrics, tracing) if o],
    )
    metrics.watch(replica)
    if args.metrics_port:
        metrics.serve(args.metrics_port, args.host)
        print(f"router metrics http://{args.host}:{args.metrics_port}/metrics", flush=True)
    try:
        keys = ApiKeys.load(args.api_keys_file) if args.api_keys_file else None
    except (OSError, ValueError) as e:
        raise SystemExit(f"--api-keys-file: {e}") from None
    admission = Admission(
        replica,
        args.max_waiting,
        args.tenant_max_requests,
        args.tenant_max_waiting,
        share_cache=args.prefix_cache_sharing == "all",
        constraint_timeout_s=args.constraint_timeout_s,
    )
    add_generation_service(
        server,
        GenerationService(replica, admission, stats, tracing, keys),
        health_servicer,
        other_services=(FLEET_SERVICE,),
    )
    watchers = CacheWatchers(replica, tenants_share_cache=args.prefix_cache_sharing == "all", http_port=args.http_port)
    add_fleet_service(server, watchers)
    publisher = asyncio.ensure_future(watchers.run())
    kv_events = _kv_events(args, replica, source.name)
    kv_publisher = asyncio.ensure_future(kv_events.run()) if kv_events else None
    listen(server, address, args)
    if args.http_port:
        tls = (
            http_ssl_context(args.tls_cert_file, args.tls_key_file, args.tls_client_ca_file)
            if args.tls_cert_file
            else None
        )
        api = HttpApi(
            replica, admission, tracing, keys, args.served_model_name, metrics.registry, args.reasoning_parser
        )
        http = HttpServer(api.app, args.host, args.http_port, tls)
        await http.start()  # at once: /health answers 503 until the shard group serves
        print(f"router HTTP API {http.address}/v1", flush=True)

    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await replica.run(stop)  # returns once a stop was asked for and the drain is over
    watchers.tick()  # the watchers hear that the replica stopped serving
    publisher.cancel()
    if kv_events is not None:
        kv_events.tick()
        kv_publisher.cancel()
        kv_events.close()
    exit_soon(15)  # whatever hangs from here on, the process ends
    if http is not None:
        await http.stop()
    if listening:
        await server.stop(grace=2.0)
    await shards.close()
    return 0


def _kv_events(args, replica: Replica, model: str) -> KvEventPublisher | None:
    """The KV event publisher the flags ask for (router/api/kv_events.py), its sockets bound."""
    if not args.kv_events_endpoint:
        if args.kv_events_replay_endpoint:
            raise SystemExit("--kv-events-replay-endpoint replays what --kv-events-endpoint publishes: set both")
        return None
    served = args.served_model_name[0] if args.served_model_name else model
    topic = topic_of(args.kv_events_topic, args.host, args.http_port, served)
    events = KvEventPublisher(
        replica, args.kv_events_endpoint, args.kv_events_replay_endpoint, topic, args.kv_events_encoding
    )
    print(f"router KV events {args.kv_events_endpoint} topic {topic}", flush=True)
    return events
