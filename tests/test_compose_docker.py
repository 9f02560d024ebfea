"""docker-compose.yml in containers: `deploy/compose_check.py` builds the image, brings the fleet up
and checks it from outside. Deselected by default (a build from nothing takes minutes and needs a
Docker daemon, which CI's machines lack); `pytest -m docker tests/test_compose_docker.py` runs it.
The broken copies prove the check can fail: a gateway that reaches the routers without TLS, and one
given a wrong router address, never become healthy."""

import json
import subprocess
import sys

import pytest
import yaml

from tests.support import ROOT

pytestmark = [pytest.mark.docker, pytest.mark.processes]


def check(*args: str) -> subprocess.CompletedProcess:
    if subprocess.run(["docker", "info"], capture_output=True).returncode != 0:
        pytest.fail("these tests need a Docker daemon and docker-compose (README: Containers)")
    return subprocess.run(
        [sys.executable, str(ROOT / "deploy" / "compose_check.py"), *args], capture_output=True, text=True, timeout=1800
    )


def test_the_fleet_serves_over_tls_survives_a_kill_and_leaves_nothing():
    done = check()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(done.stdout[done.stdout.index("{") :])
    assert report["image_bytes"] > 0
    assert set(report["seconds"]) >= {
        "image build",
        "up until the gateway is healthy",
        "streamed chat completion over TLS",
        "served by the other replica",
        "crashed router restarted and serving",
        "down -v",
    }


def _without_router_tls(gateway: dict) -> None:
    del gateway["environment"]["SHARDLINE_ROUTER_TLS_CA_FILE"]


def _wrong_router_port(gateway: dict) -> None:
    gateway["environment"]["SHARDLINE_ROUTERS"] = "router-0:50099,router-1:50099"


@pytest.mark.parametrize("breaking", [_without_router_tls, _wrong_router_port])
def test_a_broken_gateway_fails_the_check(tmp_path, breaking):
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    breaking(compose["services"]["gateway"])
    broken = tmp_path / "docker-compose.yml"
    broken.write_text(yaml.safe_dump(compose))
    done = check("--compose-file", str(broken))
    assert done.returncode != 0
    assert "gateway is unhealthy" in done.stdout + done.stderr, done.stdout[-3000:] + done.stderr[-3000:]
