"""Child services (the launcher's router and shards, and the servers that tests and benchmarks
start): spawned so that they die with their parent, on free ports, probed for health."""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
from collections import deque

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shardline.common.process import reconnect_options

_PR_SET_PDEATHSIG = 1
_PARENT = "SHARDLINE_PARENT_PID"


def spawn_service(args: list[str], env: dict | None = None, **popen) -> subprocess.Popen:
    """Starts `python -m shardline.cli *args` as a child that dies with this process, so even a
    killed launcher (or test run) leaves no orphans.

    The child arms its parent-death signal itself, first thing (`die_with_parent`), rather than
    in a preexec_fn: no Python may run between fork and exec in a process whose gRPC threads are
    running (gRPC's fork handlers were seen to abort such children). Without a preexec_fn,
    subprocess uses vfork, and no fork handler runs at all."""
    env = {**(os.environ if env is None else env), _PARENT: str(os.getpid())}
    return subprocess.Popen([sys.executable, "-m", "shardline.cli", *args], env=env, **popen)


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


# The ports free_ports returned last, oldest first. Bounded: the launcher calls it at every start
# of its shard group, for the life of the server, and a caller binds its port long before this
# many more have been handed out.
RECENT_PORTS = 4096
_handed_out: deque[int] = deque(maxlen=RECENT_PORTS)
_handing_out = threading.Lock()


def free_ports(n: int) -> list[int]:
    """n distinct free TCP ports on loopback, none of them among the last RECENT_PORTS this
    process returned. A port is free only until someone binds it, and the kernel hands a closed
    one out again: a caller still holding one unbound (a `--metrics-port` for a server that is
    yet to start) got it back from the next call, and two services of one test then raced for it
    (seen in CI: the router's HTTP API and its metrics on the same port)."""
    with _handing_out:
        socks, ports = [], []
        try:
            while len(ports) < n:  # a refused port stays bound meanwhile, so it is not offered again
                socks.append(socket.socket())
                socks[-1].bind(("127.0.0.1", 0))
                port = socks[-1].getsockname()[1]
                if port not in _handed_out:
                    ports.append(port)
            _handed_out.extend(ports)
            return ports
        finally:
            for s in socks:
                s.close()


class HealthProbe:
    """Asks the gRPC health service at `target`, over one channel kept open between probes."""

    def __init__(self, target: str, credentials: grpc.ChannelCredentials | None = None):
        options = reconnect_options(target)
        self.channel = (
            grpc.secure_channel(target, credentials, options=options)
            if credentials
            else grpc.insecure_channel(target, options=options)
        )
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
