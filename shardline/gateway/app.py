"""The gateway process: `shardline.v1.Generation` (with health and reflection) on --host/--port
and the OpenAI-compatible HTTP API on --http-port, in front of the routers that `--routers` names.

It listens at once. Its health is SERVING while at least one replica is routable and it is not
draining. SIGTERM drains as a router does: NOT_SERVING at once, new requests UNAVAILABLE, the
streams it has open run to completion for up to `--drain-timeout-s`, then the process exits 0.
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
from shardline.common.tls import channel_credentials, http_ssl_context, listen
from shardline.common.tokenizer import TextCodec
from shardline.common.tokenizer_files import tokenizer_folder
from shardline.gateway.choice import Weights
from shardline.gateway.http_proxy import HttpProxy
from shardline.gateway.metrics import serve_metrics
from shardline.gateway.replicas import Replicas
from shardline.gateway.service import GatewayService

log = logging.getLogger("shardline.gateway")


async def serve_gateway(args) -> int:
    loop = asyncio.get_running_loop()
    source = resolve_model(args.model)
    codec = await loop.run_in_executor(None, lambda: TextCodec(tokenizer_folder(source)))
    try:
        keys = ApiKeys.load(args.api_keys_file) if args.api_keys_file else None
    except (OSError, ValueError) as e:
        raise SystemExit(f"--api-keys-file: {e}") from None
    health_servicer = health.aio.HealthServicer()
    serving_now = None

    def on_change() -> None:
        nonlocal serving_now
        if service.serving != serving_now:
            serving_now = service.serving
            status = (
                health_pb2.HealthCheckResponse.SERVING if serving_now else health_pb2.HealthCheckResponse.NOT_SERVING
            )
            for name in ("", SERVICE):
                asyncio.ensure_future(health_servicer.set(name, status))
            log.info("gateway %s", "SERVING" if serving_now else "NOT_SERVING")

    router_tls = (
        channel_credentials(args.router_tls_ca_file, args.router_tls_cert_file, args.router_tls_key_file)
        if args.router_tls_ca_file
        else None
    )
    entries = [e for e in args.routers.split(",") if e]
    replicas = Replicas(entries, args.resolve_interval_s, lambda: on_change(), router_tls)
    weights = Weights(args.load_weight, args.balance_abs_threshold, args.balance_rel_threshold)
    service = GatewayService(replicas, codec, keys, weights, args.routing)
    on_change()

    server = grpc.aio.server()
    add_generation_service(server, service, health_servicer, serialized_responses=True)
    address = f"{args.host}:{args.port}"
    listen(server, address, args)
    await server.start()
    resolver = asyncio.ensure_future(replicas.run())
    print(f"gateway listening {address} over {', '.join(entries)}", flush=True)
    if args.metrics_port:
        serve_metrics(service, args.metrics_port, args.host)
        print(f"gateway metrics http://{args.host}:{args.metrics_port}/metrics", flush=True)
    http = proxy = None
    if args.http_port:
        tls = (
            http_ssl_context(args.tls_cert_file, args.tls_key_file, args.tls_client_ca_file)
            if args.tls_cert_file
            else None
        )
        proxy = HttpProxy(
            service,
            (args.router_tls_ca_file, args.router_tls_cert_file, args.router_tls_key_file)
            if args.router_tls_ca_file
            else None,
        )
        http = HttpServer(proxy.app, args.host, args.http_port, tls)
        await http.start()
        print(f"gateway HTTP API {http.address}/v1", flush=True)

    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    service.accepting = False
    on_change()
    try:  # drain: the streams already open run to completion, for a while
        async with asyncio.timeout(args.drain_timeout_s):
            while service.in_flight:
                await asyncio.sleep(0.05)
    except TimeoutError:
        log.warning("drain timed out after %.0f s with %d streams open", args.drain_timeout_s, service.in_flight)
    exit_soon(15)
    resolver.cancel()
    if http is not None:
        await http.stop()
        await proxy.close()
    await server.stop(grace=2.0)
    await replicas.close()
    return 0
