"""The router process: tokenizer, shard group, page pool and the public gRPC server."""
from __future__ import annotations

import asyncio
import logging
import signal

import grpc
from grpc_health.v1 import health, health_pb2

from protos import generation_pb2 as pb
from router.engine import Engine
from router.launcher import exit_soon
from router.page_manager import PageManager
from router.scheduler import Scheduler
from router.server import SERVICE, GenerationService, add_services
from router.shard_client import ShardGroup
from router.tokenizer import load_tokenizer
from shard.source import resolve_model

log = logging.getLogger("shardline.router")


async def serve_router(args) -> None:
    source = resolve_model(args.model)
    shards = ShardGroup(args.shards)
    tokenizer_task = asyncio.get_running_loop().run_in_executor(None, load_tokenizer, source)
    infos = await shards.info(timeout=args.shard_timeout)
    tokenizer = await tokenizer_task
    capacity = min(i.max_pages for i in infos)
    num_pages = min(args.num_pages, capacity) if args.num_pages else capacity
    if num_pages < 1:
        raise SystemExit(f"the shards have room for {capacity} pages; raise --kv-memory-gb")
    await shards.warmup(num_pages, args.max_batch)
    head = infos[shards.sampler]
    info = pb.InfoResponse(
        model=head.model, page_size=head.page_size, num_pages=num_pages,
        tensor_parallel=head.tp_size, pipeline_parallel=head.pp_size, max_batch=args.max_batch,
        context_length=head.context_length, vocab_size=head.vocab_size, dtype=head.dtype,
        device=head.device, prefix_cache=args.prefix_cache == "on", eviction_policy=args.eviction,
        slru_protected_ratio=args.slru_protected_ratio, chunk_size=args.chunk_size,
        max_batch_tokens=args.max_batch_tokens)
    eos = set(head.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    pages = PageManager(num_pages, head.page_size, policy=args.eviction,
                        prefix_cache=args.prefix_cache == "on",
                        protected_ratio=args.slru_protected_ratio, model_key=f"{head.model}/{head.dtype}")
    scheduler = Scheduler(pages, args.max_batch, args.max_batch_tokens, chunk_size=args.chunk_size,
                          aging_s=args.priority_aging_s)
    engine = Engine(scheduler, shards, tokenizer, head.context_length)

    server = grpc.aio.server()
    health_servicer = health.aio.HealthServicer()
    add_services(server, GenerationService(engine, info, frozenset(eos), args.max_waiting), health_servicer)
    address = f"{args.host}:{args.port}"
    if server.add_insecure_port(address) == 0:
        raise SystemExit(f"cannot listen on {address}")
    await server.start()
    for name in ("", SERVICE):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("router serving %s on %s with %d pages of %d tokens", info.model, address, num_pages,
             info.page_size)
    print(f"router listening {address}", flush=True)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    def on_stop():
        exit_soon()
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_stop)
    engine_task = asyncio.create_task(engine.run())
    stop_task = asyncio.create_task(stop.wait())
    await asyncio.wait([engine_task, stop_task], return_when=asyncio.FIRST_COMPLETED)
    if engine.error:
        # A shard is gone: stay up so clients get UNAVAILABLE and health says NOT_SERVING.
        for name in ("", SERVICE):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        await stop.wait()
    engine_task.cancel()
    await server.stop(grace=1.0)
    await shards.close()

