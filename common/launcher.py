"""`shardline serve`: the router and its shards as child processes of one command.

Children die with the launcher (PR_SET_PDEATHSIG), so even a killed launcher leaves no orphans.
Ctrl-C / SIGTERM stops them all; if a child exits on its own, the launcher says which and
exits non-zero.
"""
from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:  # not Linux: the launcher's own cleanup still applies
        pass


def _flags(args, names: list[str]) -> list[str]:
    out = []
    for name in names:
        out += [f"--{name}", str(getattr(args, name.replace("-", "_")))]
    return out


def exit_soon(seconds: float = 10.0) -> None:
    """Called when a service is told to stop: if a graceful shutdown hangs (a peer that vanished
    mid-call, a stuck thread), the process still ends after `seconds`."""
    timer = threading.Timer(seconds, os._exit, args=(1,))
    timer.daemon = True
    timer.start()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthy(target: str, timeout: float = 1.0) -> bool:
    """Whether the gRPC health service at `target` answers SERVING."""
    try:
        with grpc.insecure_channel(target) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
            return reply.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


def _stop(children: dict[str, subprocess.Popen]) -> None:
    for proc in children.values():
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + 10
    for proc in children.values():
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def serve(args) -> int:
    sockets = Path(tempfile.mkdtemp(prefix="shardline-"))
    base = [sys.executable, "-m", "router.cli"]
    model = _flags(args, ["model", "page-size", "dtype"])
    children: dict[str, subprocess.Popen] = {}
    stopping = False

    def on_signal(signum, _frame):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    addresses = []
    dist_port = _free_port()
    while dist_port == args.port:  # the router binds its port only later
        dist_port = _free_port()
    dist_init = f"tcp://127.0.0.1:{dist_port}"
    for stage in range(args.pp):
        for rank in range(args.tp):
            name = f"shard {stage * args.tp + rank}"
            address = f"unix:{sockets / f'shard-{stage}-{rank}.sock'}"
            addresses.append(address)
            children[name] = subprocess.Popen(
                base + ["shard", *model, *_flags(args, ["kv-memory-gb", "threads", "device", "tp", "pp"]),
                        "--tp-rank", str(rank), "--pp-stage", str(stage), "--dist-init", dist_init,
                        "--listen", address], preexec_fn=die_with_parent)
    children["router"] = subprocess.Popen(
        base + ["router", *model, "--shards", ",".join(addresses),
                *_flags(args, ["host", "port", "num-pages", "max-batch", "max-batch-tokens",
                               "max-waiting", "shard-timeout", "prefix-cache", "eviction",
                               "slru-protected-ratio", "chunk-size", "priority-aging-s"])],
        preexec_fn=die_with_parent)
    target = f"{args.host}:{args.port}"
    ready = False
    try:
        while not stopping:
            for name, proc in children.items():
                if proc.poll() is not None:
                    print(f"shardline: {name} (pid {proc.pid}) exited with code {proc.returncode}",
                          file=sys.stderr, flush=True)
                    return 1
            if not ready and healthy(target):
                ready = True
                print(f"ready {target}", flush=True)
            time.sleep(0.2)
        return 0
    finally:
        _stop(children)
        for sock in sockets.glob("*"):
            sock.unlink(missing_ok=True)
        sockets.rmdir()
