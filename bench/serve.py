"""The benchmarked server as a child process, and what /proc says about it (psutil is not
installed): its process tree, memory and CPU time, and the CPU everything else on the machine uses."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path

from router.launcher import die_with_parent
from tests.support import free_port

ROOT = Path(__file__).resolve().parent.parent


def _proc(pid: int, name: str) -> str:
    with open(f"/proc/{pid}/{name}", "rb") as f:
        return f.read().replace(b"\0", b" ").decode(errors="replace")


def _stat(pid: int) -> list[str]:  # fields after "(comm)", which may itself contain spaces
    return _proc(pid, "stat").rsplit(")", 1)[1].split()


def _descendants(pid: int) -> list[int]:
    kids = []
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            kids += [int(d)] if int(_stat(int(d))[1]) == pid else []
        except (OSError, IndexError):  # exited meanwhile
            pass
    return kids + [g for k in kids for g in _descendants(k)]


def _status_mb(pid: int, key: str) -> float:
    line = next(l for l in _proc(pid, "status").splitlines() if l.startswith(key + ":"))
    return int(line.split()[1]) / 1024


class Serve:
    """`shardline serve` as a child process; startup_s is spawn to its `ready` line."""

    def __init__(self, args: list[str], timeout: float):
        self.target = f"127.0.0.1:{free_port()}"
        cmd = [sys.executable, "-m", "router.cli", "serve", "--port", self.target.split(":")[1], *args]
        self.log: deque[str] = deque(maxlen=200)
        self.startup_s, ready, t0 = None, threading.Event(), time.perf_counter()
        # PR_SET_PDEATHSIG: a SIGKILLed benchmark still takes the launcher (and so its children) down.
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     preexec_fn=die_with_parent)

        def pump():  # keeps draining the pipe so the server's logging never blocks on it
            for line in self.proc.stdout:
                self.log.append(line)
                if line.startswith("ready ") and self.startup_s is None:
                    self.startup_s = time.perf_counter() - t0
                    ready.set()
            ready.set()
        threading.Thread(target=pump, daemon=True).start()
        if not ready.wait(timeout) or self.startup_s is None:
            self.stop()
            raise RuntimeError("server never became ready:\n" + "".join(self.log))

    def roles(self) -> dict[str, int]:
        out = {"launcher": self.proc.pid}
        for pid in _descendants(self.proc.pid):
            cmd = " " + _proc(pid, "cmdline")
            out.update({role: pid for role in ("shard", "router") if f" {role} " in cmd})
        return out

    def memory_mb(self) -> dict:
        return {role: {"rss_mb": _status_mb(pid, "VmRSS"), "peak_rss_mb": _status_mb(pid, "VmHWM")}
                for role, pid in self.roles().items()}

    def cpu_s(self) -> float:  # utime + stime of the whole tree
        ticks = 0
        for pid in [self.proc.pid, *_descendants(self.proc.pid)]:
            try:
                fields = _stat(pid)
                ticks += int(fields[11]) + int(fields[12])
            except OSError:
                pass
        return ticks / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # the launcher stops router and shard itself
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class CpuMeter:
    """CPU use during a measurement, in % of one core: this client, the server's process tree,
    and everything else on the machine (the noise of a shared box; with --target, the server too)."""

    def __init__(self, server: Serve | None):
        self.server = server

    def _read(self) -> tuple[float, float, float]:
        busy = [int(v) for v in open("/proc/stat").readline().split()[1:9]]  # skip idle, iowait
        return (time.process_time(), self.server.cpu_s() if self.server else 0.0,
                (sum(busy) - busy[3] - busy[4]) / os.sysconf("SC_CLK_TCK"))

    def __enter__(self):
        self.r0, self.t0, self.pct = self._read(), time.perf_counter(), {}
        return self

    def __exit__(self, *exc):
        wall, (c, s, b) = time.perf_counter() - self.t0, [b - a for a, b in zip(self.r0, self._read())]
        self.pct.update(client_cpu_pct=100 * c / wall, server_cpu_pct=100 * s / wall,
                        other_cpu_pct=100 * (b - c - s) / wall)
