"""The benchmarked server as a child process, and what /proc says about it (psutil is not
installed): its process tree, memory and CPU time, and the CPU everything else on the machine uses."""
from __future__ import annotations

import os
import time
from pathlib import Path

import grpc

from common.serve_process import ROOT, ServeProcess
from protos import generation_pb2 as pb, generation_pb2_grpc as pb_grpc


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


class Serve(ServeProcess):
    """`shardline serve` as a child process, with a client stub and what /proc says about it."""

    def __init__(self, *args: str, timeout: float = 600, cwd: Path = ROOT, env: dict | None = None):
        # A checkout from before the command line moved to common/ (a baseline being compared).
        module = "common.cli" if (cwd / "common" / "cli.py").is_file() else "router.cli"
        super().__init__(*args, timeout=timeout, cwd=cwd, module=module, env=env)
        self.channel = grpc.insecure_channel(self.target)
        self.stub = pb_grpc.GenerationStub(self.channel)

    def stats(self) -> pb.StatsResponse:
        return self.stub.Stats(pb.StatsRequest(), timeout=10)

    def roles(self) -> dict[str, int]:
        """launcher, router and shard pids (the last shard when there are several)."""
        out = {"launcher": self.proc.pid}
        for pid in _descendants(self.proc.pid):
            cmd = " " + _proc(pid, "cmdline")
            out.update({role: pid for role in ("shard", "router") if f" {role} " in cmd})
        return out

    def memory_mb(self) -> dict:
        return {role: {"rss_mb": _status_mb(pid, "VmRSS"), "peak_rss_mb": _status_mb(pid, "VmHWM")}
                for role, pid in self.roles().items()}

    def cpu_s(self) -> float:  # utime + stime of the whole tree
        return tree_cpu_s([self.proc.pid])

    def stop(self, timeout: float = 60) -> int:
        code = super().stop(timeout)
        self.channel.close()
        return code


def tree_cpu_s(pids: list[int]) -> float:
    """utime + stime of these processes and all their descendants, in seconds."""
    ticks = 0
    for pid in [*pids, *(d for p in pids for d in _descendants(p))]:
        try:
            fields = _stat(pid)
            ticks += int(fields[11]) + int(fields[12])
        except OSError:
            pass
    return ticks / os.sysconf("SC_CLK_TCK")


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
