"""`shardline serve` as a user runs it: ready line, clean shutdown, no orphans, failing children."""
import os
import signal
import time
from pathlib import Path

import pytest

from tests.support import Server


def _children(pid: int) -> list[int]:
    # The launcher starts its children from its main thread, whose task id is its pid.
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in status


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")


@pytest.fixture
def server(tiny_models):
    server = Server("--model", str(tiny_models["llama"]), "--page-size", "16")
    yield server
    server.stop()  # whatever the test did, leave no process behind


def test_sigterm_stops_router_and_shard(server):
    kids = _children(server.proc.pid)
    assert sorted(" shard " in _cmdline(k) for k in kids) == [False, True]
    assert server.generate(prompt="hi", max_new_tokens=2)[2].finish_reason in ("length", "eos")
    assert server.stop() == 0
    deadline = time.monotonic() + 10
    while any(_alive(k) for k in kids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(k) for k in kids)


def test_a_dying_shard_is_named_and_the_launcher_exits_nonzero(server):
    kids = _children(server.proc.pid)
    shard = next(k for k in kids if " shard " in _cmdline(k))
    os.kill(shard, signal.SIGKILL)
    assert server.proc.wait(30) == 1
    time.sleep(0.5)
    assert any("shard 0" in line and "exited" in line for line in server.log), server.log[-5:]
    assert not any(_alive(k) for k in kids)


def test_killed_launcher_takes_its_children_along(server):
    kids = _children(server.proc.pid)
    server.proc.kill()  # no chance to clean up: PR_SET_PDEATHSIG must do it
    server.proc.wait()
    deadline = time.monotonic() + 30
    while any(_alive(k) for k in kids) and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = {k: Path(f"/proc/{k}/status").read_text().splitlines()[:3] + [_cmdline(k)]
             for k in kids if _alive(k)}
    assert not alive, alive
