"""`shardline serve --replicas N`: N replicas and a gateway in front of them on --port, as child
processes of one command.

- Replica i is a `serve` of its own (a router and its shard group, supervised as one by
  shardline/launcher.py) whose router listens on free ports (gRPC, and HTTP when --http-port is
  set, which the gateway's HTTP API passes requests on to); with --metrics-port M, the gateway's
  metrics are on M and replica i's on M + 1 + i; KV event endpoints on a port P take P + i.
- A replica whose `serve` exits is started again after a backoff that doubles from 1 s to 30 s;
  the gateway routes around it meanwhile, and resyncs its (empty) cache when it is back.
- The gateway (`shardline gateway`) exiting ends the command with 1.
- A model that the replicas' shards cannot serve, or that does not fit this host N times over, is
  refused before anything starts, with exit status 2 and why (shard/footprint.py).
- SIGTERM / Ctrl-C: the gateway drains and exits, then the replicas drain and exit; the command
  exits 0 when all of that went cleanly. Children die with the command (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from shardline.common.model_source import resolve_model
from shardline.launcher import BACKOFF_S, STABLE_S, passed_on
from shardline.processes import HealthProbe, free_ports, spawn_service
from shardline.shard.footprint import REFUSED, Unservable, check_layout


def replica_command(args, port: int, http_port: int, n: int) -> list[str]:
    metrics = args.metrics_port + 1 + n if args.metrics_port else 0
    return [
        "serve",
        *passed_on(args, "serve"),
        "--replicas",
        "1",
        "--port",
        str(port),
        "--http-port",
        str(http_port if args.http_port else 0),
        "--metrics-port",
        str(metrics),
        "--kv-events-endpoint",
        offset_endpoint(args.kv_events_endpoint, n),
        "--kv-events-replay-endpoint",
        offset_endpoint(args.kv_events_replay_endpoint, n),
    ]


def offset_endpoint(endpoint: str, n: int) -> str:
    """Replica n's ZMQ endpoint, as vLLM offsets one per data-parallel rank: a TCP port + n, or
    `_dp<n>` after another address."""
    if not endpoint or n == 0:
        return endpoint
    address, _, port = endpoint.rpartition(":")
    if endpoint.startswith("tcp://"):
        return f"{address}:{int(port) + n}" if port.isdigit() else endpoint  # the router refuses a bad one
    return f"{endpoint}_dp{n}"


def gateway_command(args, routers: list[str]) -> list[str]:
    return ["gateway", *passed_on(args, "gateway"), "--routers", ",".join(routers)]


def _terminate(procs: list[subprocess.Popen], timeout: float) -> bool:
    """SIGTERM to each, waited for up to `timeout` together (then SIGKILL); whether all exited 0."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    deadline, clean = time.monotonic() + timeout, True
    for proc in procs:
        try:
            clean &= proc.wait(timeout=max(0.1, deadline - time.monotonic())) == 0
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            clean = False
    return clean


def serve_replica_set(args) -> int:
    stopping = False

    def on_signal(signum, _frame):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    shards = [divmod(n, args.tp) for n in range(args.tp * args.pp)]
    try:  # every replica's shards load on this host at once
        check_layout(resolve_model(args.model), args, shards * args.replicas)
    except (Unservable, FileNotFoundError) as e:
        print(f"shardline: {e}", file=sys.stderr, flush=True)
        return REFUSED
    free = [p for p in free_ports(2 * args.replicas + 2) if p not in (args.port, args.http_port)]
    ports, http_ports = free[: args.replicas], free[args.replicas : 2 * args.replicas]
    routers = [f"127.0.0.1:{p}" for p in ports]
    replicas = [spawn_service(replica_command(args, p, h, n)) for n, (p, h) in enumerate(zip(ports, http_ports))]
    started = [time.monotonic()] * len(replicas)
    restarts = [0] * len(replicas)
    down_since: list[float | None] = [None] * len(replicas)
    gateway = spawn_service(gateway_command(args, routers))
    target = HealthProbe(f"{args.host}:{args.port}")
    router_probes = [HealthProbe(r) for r in routers]
    ready = False
    try:
        while not stopping:
            if gateway.poll() is not None:
                print(
                    f"shardline: the gateway (pid {gateway.pid}) exited with code {gateway.returncode}",
                    file=sys.stderr,
                    flush=True,
                )
                return 1
            now = time.monotonic()
            for n, proc in enumerate(replicas):
                if proc.poll() == REFUSED:  # it said why; starting it again changes nothing
                    return REFUSED
                if proc.poll() is not None and down_since[n] is None:
                    delay = BACKOFF_S[min(restarts[n], len(BACKOFF_S) - 1)]
                    print(
                        f"shardline: replica {n} (pid {proc.pid}, {routers[n]}) exited with code "
                        f"{proc.returncode}; starting it again in {delay} s",
                        file=sys.stderr,
                        flush=True,
                    )
                    down_since[n] = now
                elif (
                    down_since[n] is not None and now - down_since[n] >= BACKOFF_S[min(restarts[n], len(BACKOFF_S) - 1)]
                ):
                    replicas[n] = spawn_service(replica_command(args, ports[n], http_ports[n], n))
                    started[n], down_since[n] = now, None
                    restarts[n] += 1
                elif restarts[n] and now - started[n] > STABLE_S:
                    restarts[n] = 0
            if not ready and target.serving() and all(p.serving() for p in router_probes):
                ready = True  # every replica serves, not only the first one up
                for probe in router_probes:
                    probe.close()
                print(f"ready {args.host}:{args.port}", flush=True)
            time.sleep(0.1)
        clean = _terminate([gateway], args.drain_timeout_s + 15)
        clean &= _terminate(replicas, args.drain_timeout_s + 15)
        return 0 if clean else 1
    finally:
        _terminate([gateway, *replicas], 10)
        target.close()
