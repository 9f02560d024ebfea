"""docker-compose.yml stays true: its services' commands, with their environment, started as local
processes on loopback (Docker itself is not on every machine that runs the tests)."""

import os
import re
import ssl
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import grpc
import httpx
import pytest
import yaml

from harness.otlp_receiver import OtlpReceiver
from shardline.processes import spawn_service
from shardline.protos import generation_pb2 as pb
from shardline.protos import generation_pb2_grpc as pb_grpc
from tests.support import ROOT, free_port, wait_for

ADDRESS = re.compile(r"([A-Za-z0-9][\w.-]*):(\d+)")


def load_compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def shardline_services(compose: dict) -> dict:
    """The gateway, routers and shards of the default profile (not the one-shot certs, the
    observability stack or CUDA)."""
    return {
        n: s
        for n, s in compose["services"].items()
        if "profiles" not in s
        and str(s.get("image", "")).startswith("shardline")
        and s["command"][1] in ("gateway", "router", "shard")
    }


def _of_kind(services: dict, kind: str) -> dict:
    return {n: s for n, s in services.items() if s["command"][1] == kind}


class Loopback:
    """Maps each (service, container port) to a free loopback port, and rewrites addresses and
    the container paths in `paths` (prefix -> local path)."""

    def __init__(self, services: dict, paths: dict[str, str] | None = None):
        self.services, self.ports, self.paths = services, {}, paths or {}

    def port(self, service: str, port: str) -> int:
        return self.ports.setdefault((service, port), free_port())

    def rewrite(self, service: str, key: str, value: str) -> str:
        if key == "SHARDLINE_HOST":
            return "127.0.0.1"
        if key in ("SHARDLINE_PORT", "SHARDLINE_HTTP_PORT", "SHARDLINE_METRICS_PORT"):
            return str(self.port(service, value))
        for prefix, local in self.paths.items():
            if value == prefix or value.startswith(prefix + "/"):
                return local + value[len(prefix) :]

        def swap(m):
            host, port = m.group(1), m.group(2)
            owner = service if host in ("0.0.0.0", "127.0.0.1", "localhost") else host  # itself
            assert owner in self.services, f"{service}: {key} names an unknown host {host!r}"
            return f"127.0.0.1:{self.port(owner, port)}"

        return ADDRESS.sub(swap, value)

    def command(self, service: str, argv: list[str]) -> list[str]:
        """`shardline` arguments, for `python -m shardline.cli`."""
        assert argv[0] == "shardline"
        return [self.rewrite(service, "", a) for a in argv[1:]]


def _wait_healthy(loop: Loopback, name: str, service: dict, proc, timeout=180):
    check = loop.command(name, service["healthcheck"]["test"][1:])
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"{name} exited with {proc.returncode}"
        if (
            subprocess.run([sys.executable, "-m", "shardline.cli", *check], cwd=ROOT, capture_output=True).returncode
            == 0
        ):
            return
        time.sleep(0.5)
    raise AssertionError(f"{name} never became healthy")


def test_compose_file_shape():
    compose = load_compose()
    services = shardline_services(compose)
    networks = compose["networks"]
    for name, s in services.items():  # shards and routers reach only the internal network; the gateway both
        internal = [n for n in s["networks"] if networks[n] and networks[n].get("internal")]
        assert internal, f"{name} is on no internal network"
        if s["command"][1] == "gateway":
            assert set(s["networks"]) - set(internal), "the gateway must also be reachable from outside"
            assert s["environment"]["SHARDLINE_ROUTER_TLS_CA_FILE"], "the gateway must reach the routers over TLS"
        else:
            assert internal == s["networks"], f"{name} must be on internal networks only"
            tls = [k for k in s["environment"] if k.startswith("SHARDLINE_SHARD_TLS_")]
            assert len(tls) == 3, f"{name}: mutual TLS between router and shards must be on"
        if s["command"][1] != "shard":
            assert s["environment"]["SHARDLINE_TLS_CERT_FILE"], "the public API must be TLS (API keys cross it)"
    certs = compose["services"]["certs"]
    assert certs["command"][1] == "certs" and certs["restart"] == "no"
    assert all(s["depends_on"] for s in services.values())
    shards, routers, gateways = (_of_kind(services, k) for k in ("shard", "router", "gateway"))
    assert len(routers) == 2 and len(shards) == 2 and len(gateways) == 1
    assert all("ports" not in s for s in (*shards.values(), *routers.values())), "only the gateway is published"
    (gateway,) = gateways.values()
    assert gateway["ports"]
    # The gateway names every router where it listens; each router its own shards; each name has a certificate.
    assert gateway["environment"]["SHARDLINE_ROUTERS"].split(",") == [
        f"{n}:{s['environment']['SHARDLINE_PORT']}" for n, s in routers.items()
    ]
    listens = {n: s["environment"]["SHARDLINE_LISTEN"].rpartition(":")[2] for n, s in shards.items()}
    served = [a for s in routers.values() for a in s["environment"]["SHARDLINE_SHARDS"].split(",")]
    assert sorted(served) == sorted(f"{n}:{p}" for n, p in listens.items())
    named = certs["command"][certs["command"].index("--names") + 1].split(",")
    assert set(routers) | set(shards) <= set(named)
    assert all(s["healthcheck"]["test"][1:3] == ["shardline", "health"] for s in services.values())
    # A broken shard group exits as a whole and must come back on its own; drains need time.
    assert all(s["restart"] == "unless-stopped" and s["stop_grace_period"] for s in services.values())
    cuda = [n for n, s in compose["services"].items() if "cuda" in s.get("profiles", [])]
    assert cuda and (ROOT / "Dockerfile").is_file()


@pytest.mark.processes
@pytest.mark.smollm2
def test_compose_services_serve_a_request_on_loopback(tmp_path):
    compose = load_compose()
    services = shardline_services(compose)
    # The certs service's command makes the certificates; the API keys secret is a test file.
    certs, keys = tmp_path / "certs", tmp_path / "api-keys.txt"
    key = "compose-test-key-0123456789"
    keys.write_text(f"{key} compose\n")
    router_env = next(iter(_of_kind(services, "router").values()))["environment"]
    loop = Loopback(compose["services"], {"/certs": str(certs), router_env["SHARDLINE_API_KEYS_FILE"]: str(keys)})
    subprocess.run(
        [sys.executable, "-m", "shardline.cli", *loop.command("certs", compose["services"]["certs"]["command"])],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    auth = [("authorization", f"Bearer {key}")]
    kinds = ("shard", "router", "gateway")
    order = sorted(services, key=lambda n: kinds.index(services[n]["command"][1]))  # what each depends on first
    procs = {}
    # The test's own OTLP receiver stands in for the collector, on the port its address maps to.
    collector = _collector_address(compose)
    receiver = OtlpReceiver(port=loop.port(*collector)).__enter__()
    try:
        for name in order:
            service = services[name]
            for dep in service.get("depends_on", {}):
                if dep in services:
                    _wait_healthy(loop, dep, services[dep], procs[dep])
            env = {k: loop.rewrite(name, k, str(v)) for k, v in service["environment"].items()}
            procs[name] = spawn_service(
                loop.command(name, service["command"]),
                cwd=ROOT,
                env={**os.environ, **env},
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        (gateway,) = _of_kind(services, "gateway")
        _wait_healthy(loop, gateway, services[gateway], procs[gateway])
        port = loop.port(gateway, str(services[gateway]["environment"]["SHARDLINE_PORT"]))
        ca = (certs / "ca.crt").read_bytes()  # the public API is TLS too, with the same local CA
        with grpc.secure_channel(f"127.0.0.1:{port}", grpc.ssl_channel_credentials(ca)) as channel:
            stub = pb_grpc.GenerationStub(channel)
            wait_for(
                lambda: sum(r.serving for r in stub.Stats(pb.StatsRequest(), metadata=auth).replicas) == 2,
                60,
                "the gateway to route to both replicas",
            )
            info = stub.Info(pb.InfoRequest(), metadata=auth)
            assert info.tensor_parallel == 1
            replies = list(
                stub.Generate(
                    pb.GenerateRequest(prompt="The capital of France is", max_new_tokens=4), metadata=auth, timeout=120
                )
            )
            assert "Paris" in "".join(m.text for m in replies)
            generated = sum(len(m.token_ids) for m in replies)
            for n in range(20):  # new prompts until both replicas served one (the gateway spreads them)
                if all(r.requests_routed for r in stub.Stats(pb.StatsRequest(), metadata=auth).replicas):
                    break
                generated += sum(
                    len(m.token_ids)
                    for m in stub.Generate(
                        pb.GenerateRequest(prompt=f"{n} plus {n} is", max_new_tokens=2), metadata=auth, timeout=120
                    )
                )
            with pytest.raises(grpc.RpcError) as err:  # no key, no service
                stub.Info(pb.InfoRequest(), timeout=10)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # Every service exports its spans where the compose file says, and the routers' metrics
        # endpoints are where Prometheus scrapes them.
        names = {"shardline-router": 2, "shardline-shard": 2}
        wait_for(
            lambda: all(
                len({s.resource["service.instance.id"] for s in receiver.spans() if s.resource["service.name"] == n})
                == k
                for n, k in names.items()
            ),
            60,
            "spans from both routers and both shards",
        )
        counted = 0.0
        for router, s in _of_kind(services, "router").items():
            metrics_port = loop.port(router, str(s["environment"]["SHARDLINE_METRICS_PORT"]))
            text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
            counted += float(re.search(r"^shardline:generation_tokens_total (\S+)$", text, re.M).group(1))
        assert counted == generated
        # The gateway's own metrics count every request it routed, on both replicas.
        gateway_metrics = loop.port(gateway, str(services[gateway]["environment"]["SHARDLINE_METRICS_PORT"]))
        text = urllib.request.urlopen(f"http://127.0.0.1:{gateway_metrics}/metrics", timeout=10).read().decode()
        routed = [float(v) for v in re.findall(r"^shardline:gateway_requests_routed_total\{[^}]*\} (\S+)$", text, re.M)]
        assert len(routed) == 2 and all(routed) and sum(routed) >= 2
        # The OpenAI-compatible API is published by the gateway too, over TLS with the same key.
        http_port = loop.port(gateway, str(services[gateway]["environment"]["SHARDLINE_HTTP_PORT"]))
        https = httpx.Client(verify=ssl.create_default_context(cafile=str(certs / "ca.crt")), timeout=60)
        with https:
            answer = https.post(
                f"https://127.0.0.1:{http_port}/v1/completions",
                headers=dict(auth),
                json={"model": info.model, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0},
            )
            assert answer.status_code == 200 and "Paris" in answer.json()["choices"][0]["text"], answer.text
            assert https.get(f"https://127.0.0.1:{http_port}/v1/models").status_code == 401
        assert "8000:8000" in services[gateway]["ports"]  # published where the README says
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait()
        receiver.__exit__()


def _collector_address(compose: dict) -> tuple[str, str]:
    """(service, port) of the OTLP endpoint every Shardline service exports to."""
    endpoints = {
        s["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"]
        for s in shardline_services(compose).values()
        if s["command"][1] != "gateway"
    }
    assert len(endpoints) == 1, f"the services export to different collectors: {endpoints}"
    host, port = ADDRESS.search(endpoints.pop()).groups()
    return host, port


def _mounted(service: dict, target: str) -> Path:
    """The repo file or folder a service mounts at `target`."""
    for volume in service.get("volumes", []):
        source, mount = volume.split(":")[:2]
        if mount == target:
            path = ROOT / source
            assert path.exists(), f"{source} is mounted but not in the repo"
            return path
    raise AssertionError(f"nothing is mounted at {target}")


def test_the_observability_wiring_points_at_services_that_exist():
    compose = load_compose()
    services = compose["services"]

    def exposes(name: str, port: str) -> bool:
        s = services[name]
        return port in map(str, s.get("expose", [])) or any(str(p).split(":")[-1] == port for p in s.get("ports", []))

    # Shardline -> collector: a service that receives OTLP/gRPC on that port.
    host, port = _collector_address(compose)
    assert host in services and exposes(host, port)
    collector = yaml.safe_load(_mounted(services[host], "/etc/otelcol/config.yaml").read_text())
    assert collector["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"].endswith(f":{port}")
    # Collector -> its exporters; every traces pipeline uses defined parts.
    for name, exporter in collector["exporters"].items():
        target, target_port = ADDRESS.search(exporter["endpoint"]).groups()
        assert target in services and exposes(target, target_port), f"{name} -> {exporter['endpoint']}"
    for pipeline in collector["service"]["pipelines"].values():
        for kind in ("receivers", "processors", "exporters"):
            assert set(pipeline.get(kind, [])) <= set(collector.get(kind) or {}), kind
    # Prometheus -> the routers' and the gateway's metrics ports.
    scraped = {n: s for n, s in shardline_services(compose).items() if s["command"][1] in ("router", "gateway")}
    prometheus = yaml.safe_load(_mounted(services["prometheus"], "/etc/prometheus/prometheus.yml").read_text())
    targets = [t for job in prometheus["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]]
    assert {t.split(":")[0] for t in targets} == set(scraped)
    for target in targets:
        name, target_port = target.split(":")
        assert name in scraped and scraped[name]["environment"]["SHARDLINE_METRICS_PORT"] == target_port
        assert exposes(name, target_port)
    # Grafana -> its data sources; the dashboard asks only for metrics the router serves.
    provisioning = _mounted(services["grafana"], "/etc/grafana/provisioning")
    sources = yaml.safe_load((provisioning / "datasources" / "datasources.yaml").read_text())["datasources"]
    for source in sources:
        target, target_port = ADDRESS.search(source["url"].split("//")[1]).groups()
        assert target in services and exposes(target, target_port), source["url"]
    dashboard = (_mounted(services["grafana"], "/var/lib/grafana/dashboards") / "shardline.json").read_text()
    served = _served_metric_names()
    asked = set(re.findall(r"shardline:[a-z_]+", dashboard))
    assert asked and asked <= served, f"the dashboard asks for metrics the router does not serve: {asked - served}"


def _served_metric_names() -> set[str]:
    """Every sample name the router's registry can produce (families with their suffixes)."""
    from shardline.router.observers.metrics import Metrics

    metrics = Metrics()
    metrics.watch(SimpleNamespace(failures=0, recoveries=0, load=lambda: None, pool=None, window_pool=None))
    names = set()
    for family in metrics.registry.collect():
        names |= {
            family.name,
            family.name + "_total",
            family.name + "_bucket",
            family.name + "_count",
            family.name + "_sum",
        }
    return names


@pytest.mark.processes
def test_no_secret_or_private_key_is_in_the_repo():
    compose = load_compose()
    for name, secret in compose.get("secrets", {}).items():
        ignored = subprocess.run(["git", "check-ignore", "-q", secret["file"]], cwd=ROOT)
        assert ignored.returncode == 0, f"secret {name} ({secret['file']}) is not git-ignored"
    tracked = subprocess.run(
        ["git", "grep", "-l", "-e", "BEGIN [A-Z ]*PRIVATE KEY", "--", "."], cwd=ROOT, capture_output=True, text=True
    )
    assert tracked.returncode == 1 and not tracked.stdout, f"private keys in the repo: {tracked.stdout}"
