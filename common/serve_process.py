"""`shardline serve` as a child process of a Python program (tests, benchmarks, scripts): started,
waited for until it prints `ready`, its output kept, and stopped with SIGTERM."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path

from common.process import free_port, spawn_service

ROOT = Path(__file__).resolve().parent.parent


class ServeProcess:
    """startup_s: spawn to the `ready` line. The child dies with this process (PR_SET_PDEATHSIG)."""

    def __init__(self, *args: str, env: dict | None = None, timeout: float = 180, cwd: Path = ROOT,
                 module: str = "common.cli"):
        self.port = free_port()
        self.target = f"127.0.0.1:{self.port}"
        args = ("serve", "--port", str(self.port), *args)
        self.log: deque[str] = deque(maxlen=2000)
        self.startup_s: float | None = None
        self._ready = threading.Event()
        t0 = time.perf_counter()
        env = {**os.environ, **(env or {})}
        output = dict(cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if module == "common.cli":
            self.proc = spawn_service(list(args), env=env, **output)
        else:  # an older checkout being benchmarked; it arms no parent-death signal itself
            self.proc = subprocess.Popen([sys.executable, "-m", module, *args], env=env, **output)

        def pump():  # keeps draining the pipe so the server's logging never blocks on it
            for line in self.proc.stdout:
                self.log.append(line)
                if line.startswith("ready ") and self.startup_s is None:
                    self.startup_s = time.perf_counter() - t0
                    self._ready.set()
            self._ready.set()  # exited: let the waiter see it

        threading.Thread(target=pump, daemon=True).start()
        if not self._ready.wait(timeout) or self.startup_s is None:
            self.stop()
            raise RuntimeError("server never became ready:\n" + "".join(list(self.log)[-60:]))

    def output(self, lines: int = 60) -> str:
        return "".join(list(self.log)[-lines:])

    def stop(self, timeout: float = 60) -> int:
        """SIGTERM (the launcher drains and stops its children), SIGKILL after `timeout`."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode
