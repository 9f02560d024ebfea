"""docker-compose.yml stays true: its services' commands, with their environment, started as local
processes on loopback (Docker itself is not on every machine that runs the tests)."""
import os
import re
import subprocess
import sys
import time

import grpc
import pytest
import yaml

from protos import generation_pb2 as pb, generation_pb2_grpc as pb_grpc
from common.process import spawn_service
from tests.support import ROOT, free_port

ADDRESS = re.compile(r"([A-Za-z0-9][\w.-]*):(\d+)")


def load_compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


class Loopback:
    """Maps each (service, container port) to a free loopback port, and rewrites addresses."""

    def __init__(self, services: dict):
        self.services, self.ports = services, {}

    def port(self, service: str, port: str) -> int:
        return self.ports.setdefault((service, port), free_port())

    def rewrite(self, service: str, key: str, value: str) -> str:
        if key == "SHARDLINE_HOST":
            return "127.0.0.1"
        if key == "SHARDLINE_PORT":
            return str(self.port(service, value))

        def swap(m):
            host, port = m.group(1), m.group(2)
            owner = service if host in ("0.0.0.0", "127.0.0.1", "localhost") else host  # itself
            assert owner in self.services, f"{service}: {key} names an unknown host {host!r}"
            return f"127.0.0.1:{self.port(owner, port)}"
        return ADDRESS.sub(swap, value)

    def command(self, service: str, argv: list[str]) -> list[str]:
        """`shardline` arguments, for `python -m common.cli`."""
        assert argv[0] == "shardline"
        return [self.rewrite(service, "", a) for a in argv[1:]]


def _wait_healthy(loop: Loopback, name: str, service: dict, proc, timeout=180):
    check = loop.command(name, service["healthcheck"]["test"][1:])
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"{name} exited with {proc.returncode}"
        if subprocess.run([sys.executable, "-m", "common.cli", *check], cwd=ROOT, capture_output=True).returncode == 0:
            return
        time.sleep(0.5)
    raise AssertionError(f"{name} never became healthy")


def test_compose_file_shape():
    compose = load_compose()
    services = {n: s for n, s in compose["services"].items() if "profiles" not in s}
    shards = [n for n, s in services.items() if s["command"][1] == "shard"]
    routers = [n for n, s in services.items() if s["command"][1] == "router"]
    assert len(routers) == 1 and len(shards) == 2
    assert all("ports" not in services[n] for n in shards), "shards must not be exposed outside"
    assert services[routers[0]]["ports"]
    assert all(s["healthcheck"]["test"][1:3] == ["shardline", "health"] for s in services.values())
    # A broken shard group exits as a whole and must come back on its own; drains need time.
    assert all(s["restart"] == "unless-stopped" and s["stop_grace_period"] for s in services.values())
    cuda = [n for n, s in compose["services"].items() if "cuda" in s.get("profiles", [])]
    assert cuda and (ROOT / "Dockerfile").is_file()


@pytest.mark.smollm2
def test_compose_services_serve_a_request_on_loopback():
    compose = load_compose()
    services = {n: s for n, s in compose["services"].items() if "profiles" not in s}
    loop = Loopback(services)
    order = sorted(services, key=lambda n: bool(services[n].get("depends_on")))  # shards first
    procs = {}
    try:
        for name in order:
            service = services[name]
            for dep in service.get("depends_on", {}):
                _wait_healthy(loop, dep, services[dep], procs[dep])
            env = {k: loop.rewrite(name, k, str(v)) for k, v in service["environment"].items()}
            procs[name] = spawn_service(loop.command(name, service["command"]), cwd=ROOT, env={**os.environ, **env},
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        router = next(n for n in order if services[n]["command"][1] == "router")
        _wait_healthy(loop, router, services[router], procs[router])
        port = loop.port(router, str(services[router]["environment"]["SHARDLINE_PORT"]))
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.GenerationStub(channel)
            info = stub.Info(pb.InfoRequest())
            assert info.tensor_parallel == 2
            text = "".join(m.text for m in stub.Generate(
                pb.GenerateRequest(prompt="The capital of France is", max_new_tokens=4), timeout=120))
        assert "Paris" in text
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait()
