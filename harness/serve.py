"""`shardline serve` as a child process of a test or a benchmark: started, waited for until it
prints `ready`, its output kept, driven over gRPC, measured (psutil), and stopped with SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path

import grpc
import psutil

from shardline.processes import free_ports, spawn_service
from shardline.protos import generation_pb2 as pb
from shardline.protos import generation_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    return free_ports(1)[0]


def _cli_module(cwd: Path) -> str:
    """The command line's module in a checkout (an older one may be benchmarked as a baseline)."""
    for module in ("shardline.cli", "common.cli"):
        if (cwd / module.replace(".", "/")).with_suffix(".py").is_file():
            return module
    return "router.cli"


def _has_http(cwd: Path) -> bool:
    """Whether a checkout serves the HTTP API (an older one may be benchmarked as a baseline)."""
    flags = cwd / "shardline" / "flags.py"
    return flags.is_file() and "http-port" in flags.read_text()


class Server:
    """startup_s: spawn to the `ready` line (a first start converts the GGUF: minutes on two
    cores). The child dies with this process (PR_SET_PDEATHSIG)."""

    def __init__(self, *args: str, env: dict | None = None, timeout: float = 600, cwd: Path = ROOT):
        self.port, self.http_port = free_ports(2)
        self.target = f"127.0.0.1:{self.port}"
        self.http_url = f"http://127.0.0.1:{self.http_port}/v1"  # the OpenAI-compatible API
        http = ["--http-port", str(self.http_port)] if _has_http(cwd) and "--http-port" not in args else []
        args = ("serve", "--port", str(self.port), *http, *args)
        self.log: deque[str] = deque(maxlen=2000)
        self.startup_s: float | None = None
        self._ready = threading.Event()
        t0 = time.perf_counter()
        env = {**os.environ, **(env or {})}
        output = dict(cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        module = _cli_module(cwd)
        if module == "shardline.cli":
            self.proc = spawn_service(list(args), env=env, **output)
        else:  # an older checkout being benchmarked; it arms no parent-death signal itself
            self.proc = subprocess.Popen([sys.executable, "-m", module, *args], env=env, **output)

        def pump():  # keeps draining the pipe so the server's logging never blocks on it
            for line in self.proc.stdout:
                self.log.append(line)
                # `serve --replicas N` passes on its replicas' own ready lines: the one on our port counts.
                if line.startswith("ready ") and line.rstrip().endswith(f":{self.port}") and self.startup_s is None:
                    self.startup_s = time.perf_counter() - t0
                    self._ready.set()
            self._ready.set()  # exited: let the waiter see it

        threading.Thread(target=pump, daemon=True).start()
        if not self._ready.wait(timeout) or self.startup_s is None:
            self.stop()
            raise RuntimeError("server never became ready:\n" + "".join(list(self.log)[-60:]))
        self.channel = grpc.insecure_channel(self.target)
        self.stub = pb_grpc.GenerationStub(self.channel)
        self.metadata = None  # what `stats` sends (an API key, where the server wants one)

    def output(self, lines: int = 60) -> str:
        return "".join(list(self.log)[-lines:])

    # -- over gRPC ----------------------------------------------------------------------------------
    def generate(self, **kwargs) -> tuple[list[int], str, pb.GenerateResponse]:
        tokens, text, last = [], "", None
        for msg in self.stub.Generate(pb.GenerateRequest(**kwargs), timeout=300):
            tokens += msg.token_ids
            text += msg.text
            last = msg
        return tokens, text, last

    def stats(self) -> pb.StatsResponse:
        return self.stub.Stats(pb.StatsRequest(), metadata=self.metadata, timeout=10)

    def wait_idle(self, timeout: float = 60) -> pb.StatsResponse:
        """Waits until no request holds a page; returns the stats seen then."""
        deadline = time.monotonic() + timeout
        while True:
            st = self.stats()
            if (
                st.pages_referenced == 0 and st.requests_running == 0 and st.requests_waiting == 0
            ) or time.monotonic() > deadline:
                return st
            time.sleep(0.05)

    # -- its processes --------------------------------------------------------------------------------
    def children(self) -> list[psutil.Process]:
        return psutil.Process(self.proc.pid).children()

    def shard_pids(self) -> list[int]:
        """The launcher's shard processes, in (stage, rank) order."""

        def place(proc):
            args = proc.cmdline()
            return int(args[args.index("--pp-stage") + 1]), int(args[args.index("--tp-rank") + 1])

        return [p.pid for p in sorted((p for p in self.children() if "shard" in p.cmdline()), key=place)]

    def router_pid(self) -> int:
        return next(p.pid for p in self.children() if "router" in p.cmdline())

    def roles(self) -> dict[str, int]:
        """launcher, router and shard pids (the last shard when there are several)."""
        return {"launcher": self.proc.pid, "router": self.router_pid(), "shard": self.shard_pids()[-1]}

    def memory_mb(self) -> dict:
        return {role: {"rss_mb": rss_mb(pid), "peak_rss_mb": peak_rss_mb(pid)} for role, pid in self.roles().items()}

    def cpu_s(self) -> float:
        return tree_cpu_s([self.proc.pid])

    def stop(self, timeout: float = 60) -> int:
        """SIGTERM (the launcher drains and stops its children), SIGKILL after `timeout`. A
        nonzero exit prints the server's last output (shown by pytest when the test fails)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if hasattr(self, "channel"):  # not when the server never came up
            self.channel.close()
        code = self.proc.returncode
        if code != 0:
            print(f"server exited with {code}; its last output:\n" + self.output())
        return code


def rss_mb(pid: int) -> float:
    return psutil.Process(pid).memory_info().rss / 2**20


def peak_rss_mb(pid: int) -> float:
    """The most the process was resident (psutil reports no peak on Linux: /proc says it)."""
    line = next(ln for ln in Path(f"/proc/{pid}/status").read_text().splitlines() if ln.startswith("VmHWM:"))
    return int(line.split()[1]) / 1024


def tree_cpu_s(pids: list[int]) -> float:
    """User + system CPU seconds of these processes and all their descendants."""
    total = 0.0
    for pid in pids:
        try:
            root = psutil.Process(pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
        for proc in procs:
            try:
                t = proc.cpu_times()
                total += t.user + t.system
            except psutil.NoSuchProcess:  # exited meanwhile
                pass
    return total


class CpuMeter:
    """CPU use during a measurement, in % of one core: this client, the server's process tree,
    and everything else on the machine (the noise of a shared box; with no server, the server too)."""

    def __init__(self, server: Server | None):
        self.server = server

    def _read(self) -> tuple[float, float, float]:
        busy = psutil.cpu_times()
        return (
            time.process_time(),
            self.server.cpu_s() if self.server else 0.0,
            busy.user + busy.nice + busy.system + busy.irq + busy.softirq + busy.steal,
        )

    def __enter__(self):
        self.r0, self.t0, self.pct = self._read(), time.perf_counter(), {}
        return self

    def __exit__(self, *exc):
        wall, (c, s, b) = time.perf_counter() - self.t0, [b - a for a, b in zip(self.r0, self._read())]
        self.pct.update(
            client_cpu_pct=100 * c / wall, server_cpu_pct=100 * s / wall, other_cpu_pct=100 * (b - c - s) / wall
        )
