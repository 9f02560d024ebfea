"""`shardline serve` as a user runs it: ready line, clean shutdown, no orphans. (Failing shards
and drains: test_recovery.py.)"""

import os
import signal
import time

import psutil
import pytest

from tests.support import Server, alive, children, cmdline


def mapped(pid: int, *libraries: str) -> bool:
    """Whether the process has any of these shared libraries mapped."""
    return any(lib in m.path for m in psutil.Process(pid).memory_maps() for lib in libraries)


@pytest.fixture
def server(tiny_models):
    server = Server("--model", str(tiny_models["llama"]), "--page-size", "16")
    yield server
    server.stop()  # whatever the test did, leave no process behind


@pytest.mark.processes
def test_sigterm_stops_router_and_shard(server):
    kids = children(server.proc.pid)
    assert sorted(" shard " in cmdline(k) for k in kids) == [False, True]
    assert server.generate(prompt="hi", max_new_tokens=2)[2].finish_reason in ("length", "eos")
    assert not mapped(server.router_pid(), "libtorch", "libc10"), "the router process must not load torch"
    assert mapped(server.shard_pids()[0], "libtorch")  # the check can see it
    assert server.stop() == 0
    deadline = time.monotonic() + 10
    while any(alive(k) for k in kids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(k) for k in kids)


@pytest.mark.processes
def test_killed_launcher_takes_its_children_along(server):
    kids = children(server.proc.pid)
    server.proc.kill()  # no chance to clean up: PR_SET_PDEATHSIG must do it
    server.proc.wait()
    deadline = time.monotonic() + 30
    while any(alive(k) for k in kids) and time.monotonic() < deadline:
        time.sleep(0.05)
    survivors = {k: psutil.Process(k).as_dict(["name", "status", "cmdline"]) for k in kids if alive(k)}
    for k in survivors:  # their stacks, for the message (shardline/cli.py)
        os.kill(k, signal.SIGUSR1)
    time.sleep(1 if survivors else 0)
    assert not survivors, f"{survivors}\n{server.output(300)}"


def test_free_ports_never_hands_out_a_port_twice():
    """A test picks a port for a flag, then starts a server that picks its own: the kernel reuses
    closed ephemeral ports, and the two once collided (a router's HTTP API and metrics)."""
    from shardline.processes import RECENT_PORTS, _handed_out, free_ports

    ports = [p for _ in range(1500) for p in free_ports(1)] + free_ports(3)
    assert len(set(ports)) == len(ports)
    # and it remembers a bounded number: the launcher calls it at every restart of its group
    for _ in range(RECENT_PORTS // 2):
        free_ports(2)
    assert len(_handed_out) == RECENT_PORTS
