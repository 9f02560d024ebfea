"""The shard process: loads its weights, answers Info/Warmup, and runs the step stream."""
from __future__ import annotations

import logging
import signal
import threading
import time
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
import torch

from protos import shard_pb2, shard_pb2_grpc
from router.launcher import exit_soon
from shard.kv_cache import bytes_per_page
from shard.parallel import Layout, init_distributed, keep_stage, shard_tensor_parallel
from shard.runner import ModelRunner
from shard.source import resolve_model
from shard.weights import build_model

log = logging.getLogger("shardline.shard")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ShardService(shard_pb2_grpc.ShardServicer):
    def __init__(self, runner: ModelRunner, info: shard_pb2.ShardInfo):
        self.runner, self.info = runner, info
        self._stream_lock = threading.Lock()  # one router drives a shard at a time

    def Info(self, request, context):
        return self.info

    def Warmup(self, request, context):
        if request.num_pages < 1 or request.num_pages > self.info.max_pages:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"num_pages {request.num_pages} outside [1, {self.info.max_pages}]")
        self.runner.allocate(request.num_pages)
        # One prefill and one decode, so first-request latency does not pay for lazy init.
        step = shard_pb2.SequenceStep(seq_id=0, token_ids=[0, 1], start_pos=0, block_table=[0], emit=True)
        self.runner.step([step])
        self.runner.step([shard_pb2.SequenceStep(seq_id=0, token_ids=[1], start_pos=2,
                                                 block_table=[0], emit=True)])
        return shard_pb2.WarmupResponse()

    def Steps(self, request_iterator, context):
        if not self._stream_lock.acquire(blocking=False):
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "another router already drives this shard")
        try:
            if self.runner.kv is None:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, "Warmup must come before Steps")
            for plan in request_iterator:
                t0 = time.perf_counter()
                try:
                    tokens = self.runner.step(plan.seqs)
                except (IndexError, RuntimeError, ValueError) as e:
                    log.exception("step %d failed", plan.step_id)
                    context.abort(grpc.StatusCode.INTERNAL, f"step {plan.step_id} failed: {e}")
                yield shard_pb2.StepResult(step_id=plan.step_id, tokens=tokens,
                                           compute_ms=(time.perf_counter() - t0) * 1e3)
        finally:
            self._stream_lock.release()


def serve_shard(args) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)
    layout = Layout(tp=args.tp, pp=args.pp, tp_rank=args.tp_rank, pp_stage=args.pp_stage)
    if not (0 <= layout.tp_rank < layout.tp and 0 <= layout.pp_stage < layout.pp):
        raise SystemExit(f"--tp-rank {layout.tp_rank} / --pp-stage {layout.pp_stage} outside --tp {layout.tp} "
                         f"--pp {layout.pp}")
    if args.device:
        device = torch.device(args.device)
    elif torch.cuda.is_available():
        device = torch.device("cuda", layout.rank % torch.cuda.device_count())
    else:
        device = torch.device("cpu")
    dtype = DTYPES[args.dtype]
    source = resolve_model(args.model)
    t0 = time.perf_counter()
    model = build_model(source, dtype, device)
    full = model.cfg
    if layout.world > 1:
        if not args.dist_init:
            raise SystemExit("--dist-init tcp://HOST:PORT is required with --tp or --pp above 1")
        group = init_distributed(layout, args.dist_init, device)
        keep_stage(model, layout)
        shard_tensor_parallel(model, layout, group)
    cfg = model.cfg
    log.info("loaded %s (stage %d/%d, TP rank %d/%d, %d layers) in %.1f s", source.name, layout.pp_stage,
             layout.pp, layout.tp_rank, layout.tp, cfg.num_layers, time.perf_counter() - t0)
    per_page = bytes_per_page(cfg, args.page_size, dtype)
    info = shard_pb2.ShardInfo(
        model=full.name or source.name, vocab_size=full.vocab_size, context_length=full.max_position,
        page_size=args.page_size, max_pages=max(0, int(args.kv_memory_gb * 2**30 // per_page) - 1),
        tp_rank=layout.tp_rank, tp_size=layout.tp, pp_stage=layout.pp_stage, pp_size=layout.pp,
        dtype=args.dtype, device=str(device), eos_token_ids=full.eos_token_ids)
    runner = ModelRunner(model, args.page_size, dtype, device, layout)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=[
        ("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)])
    shard_pb2_grpc.add_ShardServicer_to_server(ShardService(runner, info), server)
    health_servicer = health.HealthServicer()  # for orchestrators: SERVING once the weights are in
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if server.add_insecure_port(args.listen) == 0:
        raise SystemExit(f"cannot listen on {args.listen}")
    server.start()
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    print(f"shard listening {args.listen}", flush=True)
    done = threading.Event()
    def on_stop(*_):
        exit_soon()
        done.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_stop)
    done.wait()
    server.stop(grace=1.0).wait()
