"""`shardline serve`: the router and one replica's shards as child processes of one command.

- Children die with the launcher (PR_SET_PDEATHSIG), so even a killed launcher leaves no orphans.
- The shard group is supervised as a whole: when a shard exits, or stops answering its health
  check for `--step-timeout-s` after it once answered (a hung or SIGSTOPped process), every shard
  of the group is killed and the group is started again, after a backoff that doubles from 1 s
  to 30 s. A torch.distributed group cannot take back one restarted rank, hence all of them.
  The router notices on its own, fails what was in flight, and reconnects when the group is back.
  After `--shard-restarts` restarts in a row (a group that stays up for a minute resets the
  count) the launcher gives up and exits 1.
- A model the shards cannot serve (an architecture without model code, or more than this host's
  memory: shard/footprint.py) is refused before anything starts, with exit status 2 and why;
  a shard that refuses it all the same (exit status 2) is not started again either.
- SIGTERM / Ctrl-C: the router drains (up to `--drain-timeout-s`) and exits, then the shards stop.
  The launcher exits with 0 when that went cleanly. If the router dies, the launcher names it,
  stops the shards and exits 1.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from shardline.common.model_source import resolve_model
from shardline.common.process import hang_detection_s
from shardline.flags import service_flags
from shardline.processes import HealthProbe, free_ports, spawn_service
from shardline.shard.footprint import REFUSED, Unservable, check_layout

log = logging.getLogger("shardline.launcher")
BACKOFF_S = (1, 2, 4, 8, 16, 30)
STABLE_S = 60.0  # a group up this long resets the restart count


def passed_on(args, command: str) -> list[str]:
    """`serve`'s flags that the `command` service has too, with their values, as its command line."""
    serve = set(service_flags("serve"))
    out = []
    for name in service_flags(command):
        if name in serve:
            value = getattr(args, name.replace("-", "_"))
            if isinstance(value, list):  # a flag of several values: none at all where the list is empty
                out += [f"--{name}", *value] if value else []
            else:
                out += [f"--{name}", str(value)]
    return out


def shard_command(args, address: str, stage: int, rank: int, dist_port: int) -> list[str]:
    return [
        "shard",
        *passed_on(args, "shard"),
        "--tp-rank",
        str(rank),
        "--pp-stage",
        str(stage),
        "--dist-init",
        f"tcp://127.0.0.1:{dist_port}",
        "--listen",
        address,
    ]


def router_command(args, shard_addresses: list[str]) -> list[str]:
    return ["router", *passed_on(args, "router"), "--shards", ",".join(shard_addresses)]


def _stop(procs: list[subprocess.Popen], timeout: float, kill_first: bool = False) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill() if kill_first else proc.terminate()
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class ShardProcesses:
    """The shard processes of one replica, started, checked and killed together."""

    def __init__(self, args, sockets: Path):
        self.args = args
        self.addresses = [
            f"unix:{sockets / f'shard-{stage}-{rank}.sock'}" for stage in range(args.pp) for rank in range(args.tp)
        ]
        self.procs: list[subprocess.Popen] = []
        self.probes: list[HealthProbe] = []
        self.started = 0.0
        self.answered: list[bool] = []
        self.silent_since: list[float | None] = []

    def start(self) -> None:
        args = self.args
        dist_port = next(p for p in free_ports(2) if p != args.port)  # the router binds its port later
        self.procs = []
        for address in self.addresses:
            Path(address[len("unix:") :]).unlink(missing_ok=True)
        for n, address in enumerate(self.addresses):
            stage, rank = divmod(n, args.tp)
            self.procs.append(spawn_service(shard_command(args, address, stage, rank, dist_port)))
        self.probes = [HealthProbe(a) for a in self.addresses]
        self.started = time.monotonic()
        self.answered = [False] * len(self.procs)
        self.silent_since = [None] * len(self.procs)

    def serving(self) -> None:
        """The router serves from this group: every shard has answered it (and is past loading)."""
        self.answered = [True] * len(self.procs)

    def shards(self) -> list[tuple[int, int]]:
        """(pipeline stage, TP rank) of each shard."""
        return [divmod(n, self.args.tp) for n in range(len(self.addresses))]

    def refused(self) -> bool:
        """A shard refused the model (exit status 2): starting it again changes nothing."""
        return any(proc.poll() == REFUSED for proc in self.procs)

    def failure(self) -> str | None:
        """Why the group must be restarted, or None while it is fine (or still loading)."""
        now = time.monotonic()
        for n, proc in enumerate(self.procs):
            if proc.poll() is not None:
                return f"shard {n} (pid {proc.pid}) exited with code {proc.returncode}"
        for n, probe in enumerate(self.probes):
            if probe.serving(timeout=1.0):
                self.answered[n], self.silent_since[n] = True, None
            elif self.answered[n]:  # loading weights is not a hang; silence after serving is
                self.silent_since[n] = self.silent_since[n] or now
                if now - self.silent_since[n] > hang_detection_s(self.args.step_timeout_s)[1]:
                    return (
                        f"shard {n} (pid {self.procs[n].pid}) has not answered its health check "
                        f"for {now - self.silent_since[n]:.0f} s"
                    )
        return None

    def stop(self, kill: bool = False) -> None:
        """SIGTERM, SIGKILL after the shards' own exit deadline (shard/server.py: the drain and
        10 s: a first start's shard may still be writing what it keeps for later starts)."""
        _stop(self.procs, timeout=self.args.drain_timeout_s + 15, kill_first=kill)
        for probe in self.probes:
            probe.close()
        self.probes = []


def serve(args) -> int:
    sockets = Path(tempfile.mkdtemp(prefix="shardline-"))
    stopping = False

    def on_signal(signum, _frame):
        nonlocal stopping
        stopping = True

    def pause(seconds: float) -> None:
        """Sleeps, but not past a stop request."""
        deadline = time.monotonic() + seconds
        while not stopping and time.monotonic() < deadline:
            time.sleep(0.05)

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    group = ShardProcesses(args, sockets)
    try:
        check_layout(resolve_model(args.model), args, group.shards())
    except (Unservable, FileNotFoundError) as e:
        print(f"shardline: {e}", file=sys.stderr, flush=True)
        sockets.rmdir()
        return REFUSED
    group.start()
    router = spawn_service(router_command(args, group.addresses))
    target = HealthProbe(f"{args.host}:{args.port}")
    ready, restarts, code = False, 0, 0
    try:
        while not stopping:
            if router.poll() is not None:
                print(
                    f"shardline: router (pid {router.pid}) exited with code {router.returncode}",
                    file=sys.stderr,
                    flush=True,
                )
                return 1
            why = group.failure()
            if why and group.refused():
                print(
                    f"shardline: {why}: it cannot serve this model (its message says why)", file=sys.stderr, flush=True
                )
                return REFUSED
            if why:
                if restarts >= args.shard_restarts:
                    print(f"shardline: {why}; giving up after {restarts} restarts", file=sys.stderr, flush=True)
                    return 1
                delay = BACKOFF_S[min(restarts, len(BACKOFF_S) - 1)]
                print(f"shardline: {why}; restarting the shard group in {delay} s", file=sys.stderr, flush=True)
                group.stop(kill=True)
                restarts += 1
                pause(delay)
                if stopping:
                    break
                group.start()
                continue
            if restarts and time.monotonic() - group.started > STABLE_S:
                restarts = 0
            if target.serving():
                group.serving()
                if not ready:
                    ready = True
                    print(f"ready {args.host}:{args.port}", flush=True)
            pause(0.5 if ready else 0.1)  # `ready` soon after the router serves
        # Drain: the router finishes what is in flight, then exits; the shards go after it.
        router.terminate()
        try:
            code = router.wait(args.drain_timeout_s + 15)
        except subprocess.TimeoutExpired:
            router.kill()
            code = 1
        return 0 if code == 0 else 1
    finally:
        _stop([router], timeout=args.drain_timeout_s + 15)
        group.stop()
        target.close()
        for sock in sockets.glob("*"):
            sock.unlink(missing_ok=True)
        sockets.rmdir()
