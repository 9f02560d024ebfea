"""Process plumbing that router, shard and launcher share: a bounded exit, how long a silent
shard is waited for, how fast a lost peer is reconnected to, and whether the parent is gone."""

from __future__ import annotations

import ctypes
import os
import threading


def exit_soon(seconds: float = 10.0, code: int = 1) -> None:
    """Called when a service is told to stop: if a graceful shutdown hangs (a peer that vanished
    mid-call, a stuck thread), the process still ends after `seconds`."""
    timer = threading.Timer(seconds, os._exit, args=(code,))
    timer.daemon = True
    timer.start()


_FIRST_PARENT = os.getppid()  # at import, which a service does before it serves


def parent_gone() -> bool:
    """Whether the process that started this one has died (this one was reparented). A service's
    serving loop checks it as well as relying on the parent-death SIGTERM, which a process may
    block or miss. A service started by init or a container runtime keeps its parent and is
    unaffected."""
    return os.getppid() != _FIRST_PARENT


def hang_detection_s(step_timeout_s: float) -> tuple[float, float]:
    """(probe timeout, launcher's silence limit) for a --step-timeout-s. The router, which sees a
    step overrun, probes the shards for at most the probe timeout after the step deadline; the
    launcher's own health silence limit is longer, so a hang during a step is reported by the
    router with its cause, and the launcher is the backstop for a shard that hangs while idle."""
    probe = min(5.0, step_timeout_s)
    return probe, step_timeout_s + probe + 1.0


# A peer that is still starting or restarts (a shard group, say) is reconnected to within a
# quarter second of its listening, rather than after gRPC's default backoff, which grows to two
# minutes while the peer is away; even a 1 s cap added a visible part of a small model's start to
# a router that started before its shards listened. A connection attempt every 250 ms to a local
# or in-cluster peer costs nothing.
FAST_RECONNECT = [
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 250),
]
# A peer on this machine (a unix socket, a loopback port) takes a connection at once: tried every
# 100 ms, a start's router notices its shards, and the launcher its router, sooner. (The minimum
# backoff is also gRPC's connect timeout, which a remote TLS peer on a busy network should keep
# at 200 ms.)
LOCAL_RECONNECT = [(name, 100) for name, _ in FAST_RECONNECT]
LOCAL_HOSTS = ("unix:", "127.", "localhost:", "0.0.0.0:", "[::1]:", "[::]:")


def reconnect_options(target: str) -> list[tuple[str, int]]:
    """How often a channel to `target` tries to connect while its peer is away."""
    return LOCAL_RECONNECT if target.startswith(LOCAL_HOSTS) else FAST_RECONNECT


def trim_heap() -> None:
    """Hands the heap's free memory back to the system: what loading the weights (and a previous
    KV pool) left behind would otherwise stay resident."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
