"""`shardline serve` as a user runs it: ready line, clean shutdown, no orphans. (Failing shards
and drains: test_recovery.py.)"""
import time
from pathlib import Path

import pytest

from tests.support import Server, alive, children, cmdline, router_pid, shard_pids


@pytest.fixture
def server(tiny_models):
    server = Server("--model", str(tiny_models["llama"]), "--page-size", "16")
    yield server
    server.stop()  # whatever the test did, leave no process behind


def test_sigterm_stops_router_and_shard(server):
    kids = children(server.proc.pid)
    assert sorted(" shard " in cmdline(k) for k in kids) == [False, True]
    assert server.generate(prompt="hi", max_new_tokens=2)[2].finish_reason in ("length", "eos")
    maps = Path(f"/proc/{router_pid(server)}/maps").read_text()
    assert "libtorch" not in maps and "libc10" not in maps, "the router process must not load torch"
    assert "libtorch" in Path(f"/proc/{shard_pids(server)[0]}/maps").read_text()  # the check can see it
    assert server.stop() == 0
    deadline = time.monotonic() + 10
    while any(alive(k) for k in kids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(k) for k in kids)


def test_killed_launcher_takes_its_children_along(server):
    kids = children(server.proc.pid)
    server.proc.kill()  # no chance to clean up: PR_SET_PDEATHSIG must do it
    server.proc.wait()
    deadline = time.monotonic() + 30
    while any(alive(k) for k in kids) and time.monotonic() < deadline:
        time.sleep(0.05)
    survivors = {k: Path(f"/proc/{k}/status").read_text().splitlines()[:3] + [cmdline(k)]
                 for k in kids if alive(k)}
    assert not survivors, survivors
