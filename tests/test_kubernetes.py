"""deploy/kubernetes stays true: every manifest validates against the Kubernetes schemas
(kubernetes-validate, offline, strict), and the manifests wire the same ports, names and flags as
the command line: each container's command parses with its environment as `shardline` parses
it, every SHARDLINE_* variable is a flag of that command, probes and Services point at the ports
the processes listen on, and the gateway, routers and shards find each other."""

import os
from pathlib import Path
from unittest import mock

import kubernetes_validate
import pytest
import yaml

from shardline.cli import build_parser
from shardline.flags import service_flags
from tests.support import ROOT

MANIFESTS = sorted((ROOT / "deploy" / "kubernetes").glob("*.yaml"))
KUBERNETES = "1.30.0"  # the oldest release we promise; strict: unknown fields are errors


def _documents() -> list[dict]:
    return [d for path in MANIFESTS for d in yaml.safe_load_all(path.read_text()) if d]


def _kind(kind: str) -> list[dict]:
    return [d for d in _documents() if d["kind"] == kind]


@pytest.mark.parametrize("path", MANIFESTS, ids=[p.name for p in MANIFESTS])
def test_every_manifest_validates_against_the_kubernetes_schemas(path: Path):
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    assert docs
    for doc in docs:
        kubernetes_validate.validate(doc, KUBERNETES, strict=True)


def _parsed(container: dict):
    """The container's command line as `shardline` parses it, with its environment."""
    argv = container["command"]
    assert argv[0] == "shardline", container["name"]
    env = {e["name"]: e["value"] for e in container.get("env", [])}
    command = argv[1]
    flags = {"SHARDLINE_" + f.upper().replace("-", "_") for f in service_flags(command)}
    assert set(env) <= flags, f"{container['name']}: not flags of `shardline {command}`: {set(env) - flags}"
    with mock.patch.dict(os.environ, env):
        return build_parser().parse_args(argv[1:] + container.get("args", []))


def _ports(container: dict) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container.get("ports", [])}


def _probe_target(probe: dict, container: dict) -> int:
    if "tcpSocket" in probe:
        port = probe["tcpSocket"]["port"]
        return _ports(container)[port] if isinstance(port, str) else port
    argv = probe["exec"]["command"]
    assert argv[:2] == ["shardline", "health"]
    args = build_parser().parse_args(argv[1:])
    host, _, port = args.target.rpartition(":")
    assert host == "127.0.0.1"
    return int(port)


def _pod(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def test_the_manifests_wire_what_the_command_line_serves():
    (replicas,) = _kind("StatefulSet")
    (gateway_deployment,) = _kind("Deployment")
    services = {s["metadata"]["name"]: s for s in _kind("Service")}
    pod = _pod(replicas)
    containers = {c["name"]: c for c in pod["containers"]}
    parsed = {n: _parsed(c) for n, c in containers.items()}
    shards = {n: a for n, a in parsed.items() if containers[n]["command"][1] == "shard"}
    (router_name,) = [n for n in parsed if containers[n]["command"][1] == "router"]
    router = parsed[router_name]
    # One pod per replica: the router's shards are this pod's shard containers, one TP group.
    assert sorted(router.shards.split(",")) == sorted(a.listen for a in shards.values())
    ((tp, pp),) = {(a.tp, a.pp) for a in shards.values()}
    assert sorted((a.pp_stage, a.tp_rank) for a in shards.values()) == [(s, r) for s in range(pp) for r in range(tp)]
    assert len({a.dist_init for a in shards.values()}) == 1 and all(a.dist_init for a in shards.values())
    assert {a.model for a in parsed.values()} == {router.model}
    # The router listens where its ports, its probe and the headless Service say.
    ports = _ports(containers[router_name])
    assert (ports["grpc"], ports["http"], ports["metrics"]) == (router.port, router.http_port, router.metrics_port)
    assert router.host == "0.0.0.0"
    for name, container in containers.items():
        for probe in ("readinessProbe", "livenessProbe"):
            target = _probe_target(container[probe], container)
            assert target == (router.port if name == router_name else int(parsed[name].listen.rpartition(":")[2]))
    headless = services[replicas["spec"]["serviceName"]]
    assert headless["spec"]["clusterIP"] == "None"
    labels = replicas["spec"]["template"]["metadata"]["labels"]
    assert headless["spec"]["selector"].items() <= labels.items()
    assert replicas["spec"]["selector"]["matchLabels"].items() <= labels.items()
    # The gateway resolves the headless Service, at the port that reaches the routers' gRPC API.
    (gateway_container,) = _pod(gateway_deployment)["containers"]
    gateway = _parsed(gateway_container)
    host, _, port = gateway.routers.rpartition(":")
    assert host == headless["metadata"]["name"]
    (grpc_port,) = [p for p in headless["spec"]["ports"] if p["port"] == int(port)]
    assert ports[grpc_port["targetPort"]] == router.port
    assert gateway.model == router.model and gateway.http_port and gateway.router_tls_ca_file
    gateway_ports = _ports(gateway_container)
    assert (gateway_ports["grpc"], gateway_ports["http"], gateway_ports["metrics"]) == (
        gateway.port,
        gateway.http_port,
        gateway.metrics_port,
    )
    front = services["shardline-gateway"]
    assert front["spec"]["selector"].items() <= gateway_deployment["spec"]["template"]["metadata"]["labels"].items()
    assert {p["targetPort"] for p in front["spec"]["ports"]} <= set(gateway_ports)
    assert _probe_target(gateway_container["readinessProbe"], gateway_container) == gateway.port


def test_tls_and_api_keys_come_from_secrets_mounted_where_the_flags_read_them():
    for workload in (*_kind("StatefulSet"), *_kind("Deployment")):
        pod = _pod(workload)
        secrets = {v["name"] for v in pod["volumes"] if "secret" in v}
        for container in pod["containers"]:
            mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
            args = _parsed(container)
            files = [v for k, v in vars(args).items() if k.endswith("_file") and v]
            assert any("tls" in k and v for k, v in vars(args).items()), f"{container['name']}: TLS must be on"
            for path in files:
                mount = next((m for m in mounts if path.startswith(m + "/")), None)
                assert mount is not None and mounts[mount] in secrets, f"{container['name']}: {path} is not in a Secret"
            if container["command"][1] in ("router", "gateway"):
                assert args.api_keys_file and args.tls_cert_file, f"{container['name']}: keys cross its public API"
