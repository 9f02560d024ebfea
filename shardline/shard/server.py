"""The shard process: serves what it loaded (shard/load.py): answers Info/Warmup, and runs the
step stream.

Failures: an invalid plan entry or a failed sampling fails that sequence alone (reported in the
step result). An exception inside the forward pass leaves the shard's state unknown: the stream
ends with INTERNAL. A shard of a multi-rank group then exits, as it does when the router abandons
its stream, because a torch.distributed group cannot take back one restarted rank: the group is
restarted as a whole by its supervisor (`shardline serve`, or compose's restart policy).

SIGTERM drains: health turns NOT_SERVING and the shard keeps serving its step stream until the
router closes it, for up to `--drain-timeout-s`.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import queue
import signal
import sys
import threading
import time
from concurrent import futures

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from opentelemetry import propagate, trace

from shardline.common.process import exit_soon, parent_gone, trim_heap
from shardline.common.telemetry import setup_tracing
from shardline.common.tls import ShardTls
from shardline.protos import shard_pb2, shard_pb2_grpc
from shardline.shard.footprint import REFUSED, Unservable
from shardline.shard.load import load_shard
from shardline.shard.runner import ModelRunner, StepOutput

log = logging.getLogger("shardline.shard")
MAX_SEQUENCES = 4096  # sequences a shard holds at once: the top of the router's --max-batch range
WEDGED_S = 15.0  # the main loop not turning this long, outside a call: exit (MainThreadWork)


class MainThreadWork:
    """Runs the model's work on the process's main thread, for the gRPC handlers that ask. Torch
    ops called from another thread ran much slower here: a SmolLM2 decode step (fp32, 2 cores)
    took 51 ms on the main thread and 70-95 ms on any other, also on a single dedicated one."""

    def __init__(self):
        # Not a SimpleQueue: CPython 3.11's SimpleQueue.get(timeout) waits forever once a signal
        # handler has run past the timeout (it then waits with a negative one, which means none).
        # The SIGTERM handler that a dead launcher's parent-death signal runs here took the 50 ms
        # once in a while, and its shard then stayed, its loop never turning again.
        self._queue: queue.Queue = queue.Queue()

    def call(self, fn, *args):
        future = futures.Future()
        self._queue.put((fn, args, future))
        return future.result()

    def serve_until(self, done) -> None:
        """Runs queued calls on this (the main) thread until `done()`.

        While it waits, the loop turns every 50 ms. If it stops turning for WEDGED_S seconds
        outside a call, the process is wedged: faulthandler's own thread, which needs no GIL,
        writes every thread's stack to stderr and exits (code 1).

        The timer is armed by a turn that found nothing to run, re-armed a tenth of WEDGED_S
        apart, and disarmed when a call comes: arming starts a thread (arming and disarming
        took 55 us), which steps that follow each other within a turn never pay."""
        armed_at = None  # when an idle turn last armed the timer; None while it is off
        try:
            while not done():
                try:
                    fn, args, future = self._queue.get(timeout=0.05)
                except queue.Empty:
                    if armed_at is None or time.monotonic() - armed_at > WEDGED_S / 10:
                        faulthandler.dump_traceback_later(WEDGED_S, exit=True)
                        armed_at = time.monotonic()
                    continue
                if armed_at is not None:  # a call (a step) may run long
                    faulthandler.cancel_dump_traceback_later()
                    armed_at = None
                try:
                    future.set_result(fn(*args))
                except BaseException as e:  # the handler that asked re-raises it
                    future.set_exception(e)
        finally:
            faulthandler.cancel_dump_traceback_later()


class ShardService(shard_pb2_grpc.ShardServicer):
    def __init__(
        self,
        runner: ModelRunner,
        info: shard_pb2.ShardInfo,
        grouped: bool,
        decode_graphs: bool,
        work: MainThreadWork,
        tracer=None,
        keep: threading.Thread | None = None,
    ):
        self.runner, self.info, self.grouped, self.decode_graphs = runner, info, grouped, decode_graphs
        self.work, self.tracer = work, tracer
        self.keep = keep  # the served weights' writer (shard/served_cache.py), started after the first warm-up
        self.keeping: threading.Thread | None = None  # that writer, once started
        self._stream_lock = threading.Lock()  # one router drives a shard at a time
        self.streaming = threading.Event()  # a step stream is open
        self.leaving: str | None = None  # why this shard is leaving its broken group

    def _refuse_if_leaving(self, context) -> None:
        """A shard that is about to exit (its group is broken) takes no new work: a router that
        reconnects must wait for the restarted group, not warm up a dying process."""
        if self.leaving is not None:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"this shard is leaving its group: {self.leaving}")

    def Info(self, request, context):
        self._refuse_if_leaving(context)
        return self.info

    def Warmup(self, request, context):
        self._refuse_if_leaving(context)
        info, pages, window_pages = self.info, request.num_pages, request.window_pages
        if pages < 1:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"num_pages {pages}: at least one page")
        if window_pages and not info.window:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a window pool for a model without sliding-window layers")
        # the pools and their padding pages (without a window pool, every layer's pages in one)
        per_page, windowed = info.kv_bytes_per_page, info.window_kv_bytes_per_page if window_pages else 0
        pool_bytes = (pages + 1) * (per_page - windowed) + (window_pages + 1) * windowed
        if pool_bytes > info.kv_budget_bytes:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{pages} pages and {window_pages} window pages take {pool_bytes} bytes, "
                f"past the KV budget of {info.kv_budget_bytes}",
            )
        if self.streaming.is_set():
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "a step stream is still open")
        if not 1 <= request.max_batch <= MAX_SEQUENCES:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"max_batch {request.max_batch} outside [1, {MAX_SEQUENCES}]"
            )
        try:  # allocating can fail (memory) and be retried; the group stays as it is
            self.work.call(self.runner.allocate, pages, request.max_batch, window_pages)
        except Exception as e:
            log.exception("allocating the KV pool failed")
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"allocating {pages} pages failed: {e!r}")
        try:
            prefill_ms_per_token = self.work.call(self._warm_up, request.max_batch)
        except Exception as e:  # inside the forward pass, as a failed step: the state is unknown
            log.exception("warmup failed")
            self._leave_group_soon("the warmup failed")
            context.abort(grpc.StatusCode.INTERNAL, f"warmup failed: {e!r}")
        graphs = self.runner.graphs
        if self.keep is not None:
            self.keep.start()
            self.keeping, self.keep = self.keep, None
        return shard_pb2.WarmupResponse(
            decode_graph_buckets=sorted(graphs.buckets) if graphs else [],
            capture_s=graphs.capture_s if graphs else 0.0,
            kv_pool_bytes=self.runner.kv.bytes,
            prefill_ms_per_token=prefill_ms_per_token,
        )

    def _warm_up(self, max_batch: int) -> float:
        """The decode graphs when asked for, then one prefill and one decode, so first-request
        latency does not pay for lazy init. Returns the prefill's ms per token."""
        if self.decode_graphs:
            self.runner.capture_decode_graphs(max_batch)
        seq = dict(seq_id=0, emit=True)
        t0 = time.perf_counter()
        self.runner.step(
            shard_pb2.StepPlan(
                seqs=[
                    shard_pb2.SequenceStep(
                        **seq,
                        first=True,
                        token_ids=[0, 1],
                        start_pos=0,
                        new_pages=[0],
                        sampling=shard_pb2.Sampling(top_p=1.0),
                    )
                ]
            )
        )
        prefill_ms = (time.perf_counter() - t0) * 1e3
        self.runner.step(shard_pb2.StepPlan(seqs=[shard_pb2.SequenceStep(**seq, token_ids=[1], start_pos=2)]))
        self.runner.table.release_all()
        trim_heap()
        return prefill_ms / 2

    def Steps(self, request_iterator, context):
        self._refuse_if_leaving(context)
        if not self._stream_lock.acquire(blocking=False):
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "another router already drives this shard")
        self.streaming.set()
        try:
            if self.runner.kv is None:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, "Warmup must come before Steps")
            closed = False
            for plan in request_iterator:
                if plan.close:  # the stream ends cleanly next
                    closed = True
                    continue
                with self._step_span(plan) as span:
                    t0 = time.perf_counter()
                    try:
                        out = self.work.call(self.runner.step, plan)
                    except Exception as e:  # the step's effects are unknown
                        log.exception("step %d failed", plan.step_id)
                        self._leave_group_soon(f"step {plan.step_id} failed")
                        context.abort(grpc.StatusCode.INTERNAL, f"step {plan.step_id} failed: {e!r}")
                    result = step_result(plan.step_id, out, (time.perf_counter() - t0) * 1e3)
                    span.set_attributes(
                        {
                            "shardline.step.compute_ms": result.compute_ms,
                            "shardline.step.decode_graph_launches": result.graph_launches,
                            "shardline.step.eager_decode_steps": result.eager_decode_steps,
                            "shardline.step.failed_sequences": len(result.failures),
                        }
                    )
                yield result
            if not closed:  # cancelled, or the router went away
                self._leave_group_soon("the router abandoned the step stream")
        except grpc.RpcError:  # cancelled by the router, or the router went away
            self._leave_group_soon("the router abandoned the step stream")
        finally:
            self.streaming.clear()
            self._stream_lock.release()

    def _step_span(self, plan):
        """The shard's span of a step, a child of the router's (a non-recording one when either
        side does not trace); current while the step runs, so log lines carry its ids."""
        if self.tracer is None or not plan.trace_context:
            return trace.use_span(trace.INVALID_SPAN)
        info = self.info
        return self.tracer.start_as_current_span(
            "shard step",
            context=propagate.extract(dict(plan.trace_context)),
            kind=trace.SpanKind.SERVER,
            attributes={
                "shardline.step.id": plan.step_id,
                "shardline.tp_rank": info.tp_rank,
                "shardline.pp_stage": info.pp_stage,
                "shardline.step.sequences": len(plan.seqs),
            },
        )

    def _leave_group_soon(self, why: str) -> None:
        if self.grouped:
            self.leaving = why
            log.error("%s; exiting so that the shard group restarts as a whole", why)
            exit_soon(0.5)  # time for the abort to reach the router


def step_result(step_id: int, out: StepOutput, compute_ms: float) -> shard_pb2.StepResult:
    """A step's output in shard.proto's form: the sequences' tokens one after the other in the
    plan's order, counted where any sequence has other than one, and their log-probabilities."""
    emitted = [seq.tokens for seq in out.sequences.values() if seq.tokens]
    return shard_pb2.StepResult(
        step_id=step_id,
        tokens=out.tokens,
        token_counts=[len(tokens) for tokens in emitted] if any(len(tokens) != 1 for tokens in emitted) else [],
        compute_ms=compute_ms,
        graph_launches=out.graph_launches,
        eager_decode_steps=out.eager_decode_steps,
        failures=[shard_pb2.SequenceFailure(seq_id=k, message=v) for k, v in out.failures.items()],
        logprobs=[
            shard_pb2.SequenceLogprobs(seq_id=seq_id, prompt=seq.prompt_logprobs, sampled=seq.sampled_logprobs)
            for seq_id, seq in out.sequences.items()
            if seq.prompt_logprobs or seq.sampled_logprobs
        ],
    )


def serve_shard(args) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        shard = load_shard(args)
    except Unservable as e:  # refused once, with status 2: nothing restarts it (shardline/launcher.py)
        print(f"shardline shard: {e}", file=sys.stderr, flush=True)
        return REFUSED
    trim_heap()
    layout, info = shard.layout, shard.info
    runner = ModelRunner(
        shard.model,
        args.page_size,
        shard.dtype,
        shard.device,
        layout,
        info.vocab_size,
        info.context_length,
        kv_dtype=shard.kv_dtype,
    )
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=4),
        options=[("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)],
    )
    work = MainThreadWork()
    tracer = setup_tracing(
        args.otlp_endpoint,
        "shard",
        f"pp{layout.pp_stage}-tp{layout.tp_rank}",
        {"shardline.tp_rank": layout.tp_rank, "shardline.pp_stage": layout.pp_stage},
    )
    service = ShardService(
        runner,
        info,
        grouped=layout.world > 1,
        decode_graphs=shard.decode_graphs,
        work=work,
        tracer=tracer,
        keep=shard.keep,
    )
    shard_pb2_grpc.add_ShardServicer_to_server(service, server)
    health_servicer = health.HealthServicer()  # for orchestrators: SERVING once the weights are in
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    tls = ShardTls.from_args(args)
    secure = tls is not None and not args.listen.startswith("unix:")
    if (server.add_secure_port(args.listen, tls.server()) if secure else server.add_insecure_port(args.listen)) == 0:
        raise SystemExit(f"cannot listen on {args.listen}")
    if args.listen.startswith("unix:"):  # the step stream writes KV: only this user may drive it
        os.chmod(args.listen[len("unix:") :], 0o600)
    server.start()
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    print(f"shard listening {args.listen}", flush=True)
    stop = threading.Event()

    def on_stop(*_):
        exit_soon(args.drain_timeout_s + 10)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_stop)
    work.serve_until(lambda: stop.is_set() or parent_gone())
    if not stop.is_set():  # the launcher died and its SIGTERM never came: leave as if it had
        on_stop()
    health_servicer.enter_graceful_shutdown()  # NOT_SERVING from now on
    deadline = time.monotonic() + args.drain_timeout_s
    work.serve_until(lambda: not service.streaming.is_set() or time.monotonic() > deadline)
    server.stop(grace=1.0).wait()
    if service.keeping is not None and service.keeping.is_alive():  # the process ends with os._exit
        log.info("finishing writing the served weights for later starts")
        service.keeping.join()  # within the deadline on_stop set
    return 0
