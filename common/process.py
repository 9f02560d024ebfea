"""Process plumbing both services and the launcher use: dying with the parent, a bounded exit,
free ports and health probes."""
from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

_PR_SET_PDEATHSIG = 1
_PARENT = "SHARDLINE_PARENT_PID"


def spawn_service(args: list[str], env: dict | None = None, **popen) -> subprocess.Popen:
    """Starts `python -m common.cli *args` as a child that dies with this process, so even a
    killed launcher (or test run) leaves no orphans.

    The child arms its parent-death signal itself, first thing (`die_with_parent`), rather than
    in a preexec_fn: no Python may run between fork and exec in a process whose gRPC threads are
    running (gRPC's fork handlers were seen to abort such children). Without a preexec_fn,
    subprocess uses vfork, and no fork handler runs at all."""
    env = {**(os.environ if env is None else env), _PARENT: str(os.getpid())}
    return subprocess.Popen([sys.executable, "-m", "common.cli", *args], env=env, **popen)


def die_with_parent() -> None:
    """In a child started by `spawn_service`: get SIGTERM when the parent dies."""
    parent = os.environ.pop(_PARENT, None)
    if parent is None:
        return
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:  # not Linux: the parent's own cleanup still applies
        return
    if os.getppid() != int(parent):  # the parent died before the signal was armed
        os._exit(1)


def exit_soon(seconds: float = 10.0, code: int = 1) -> None:
    """Called when a service is told to stop: if a graceful shutdown hangs (a peer that vanished
    mid-call, a stuck thread), the process still ends after `seconds`."""
    timer = threading.Timer(seconds, os._exit, args=(code,))
    timer.daemon = True
    timer.start()


def free_ports(n: int) -> list[int]:
    """n distinct free TCP ports on loopback, all held open together so none is handed out twice."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port() -> int:
    return free_ports(1)[0]


def hang_detection_s(step_timeout_s: float) -> tuple[float, float]:
    """(probe timeout, launcher's silence limit) for a --step-timeout-s. The router, which sees a
    step overrun, probes the shards for at most the probe timeout after the step deadline; the
    launcher's own health silence limit is longer, so a hang during a step is reported by the
    router with its cause, and the launcher is the backstop for a shard that hangs while idle."""
    probe = min(5.0, step_timeout_s)
    return probe, step_timeout_s + probe + 1.0


# A peer that restarts (a shard group, say) is reconnected to within a second, rather than after
# gRPC's default backoff, which grows to two minutes while the peer is away.
FAST_RECONNECT = [("grpc.initial_reconnect_backoff_ms", 200), ("grpc.min_reconnect_backoff_ms", 200),
                  ("grpc.max_reconnect_backoff_ms", 1000)]


class HealthProbe:
    """Asks the gRPC health service at `target`, over one channel kept open between probes."""

    def __init__(self, target: str, credentials: grpc.ChannelCredentials | None = None):
        self.channel = (grpc.secure_channel(target, credentials, options=FAST_RECONNECT) if credentials
                        else grpc.insecure_channel(target, options=FAST_RECONNECT))
        self.stub = health_pb2_grpc.HealthStub(self.channel)

    def serving(self, timeout: float = 1.0) -> bool:
        try:
            reply = self.stub.Check(health_pb2.HealthCheckRequest(), timeout=timeout)
        except grpc.RpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    def close(self) -> None:
        self.channel.close()


def healthy(target: str, timeout: float = 1.0, credentials: grpc.ChannelCredentials | None = None) -> bool:
    """Whether the gRPC health service at `target` answers SERVING within `timeout`."""
    probe = HealthProbe(target, credentials)
    try:
        return probe.serving(timeout)
    finally:
        probe.close()
