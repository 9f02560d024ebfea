"""docker-compose.yml for real: builds the image, starts Shardline's services in containers and
checks them from outside, the way a user would, timing each step.

    python3 deploy/compose_check.py [--base IMAGE] [--torch-wheel FILE] [--ca-bundle FILE] [--compose-file FILE]

Needs a Docker daemon and `docker-compose` (Debian: `apt-get install docker.io docker-compose
debootstrap`, then `dockerd &`); Python's standard library only. Steps:
1. a base image: --base, else python:3.11-slim when a registry answers, else a Debian bookworm made
   by `debootstrap` and `docker import` (kept as shardline-base:bookworm);
2. `shardline:cpu` built with the torch wheel and CA bundle given (or found on this machine);
3. `docker-compose up` of the certificates, two shards, two routers and the gateway (the
   Collector, Jaeger, Prometheus and Grafana come from a registry and are left out, so an override
   turns tracing off: no service logs export errors), until the gateway is healthy;
4. a streamed chat completion through the gateway, over TLS with an API key; a request without a
   key refused (401);
5. `docker kill` of replica 0's router: the next requests are served by replica 1;
6. replica 1's router crashes (its process SIGKILLed from the host, as an OOM kill would): the
   restart policy brings it back and it serves again;
7. no service logged a traceback or a failed span export;
8. `docker-compose down -v` leaves no container, network or volume behind.
--compose-file checks another file (a broken copy, say) with the repository as its project directory.
Exits 1 at the first step that fails, with what it saw.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import secrets
import shutil
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROJECT = "shardline-check"
SERVICES = ["certs", "shard-0", "shard-1", "router-0", "router-1", "gateway"]
GATEWAY = "https://localhost:8000"


def run(*cmd: str, check: bool = True, timeout: float = 1800, **kw) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    if check and done.returncode != 0:
        raise SystemExit(f"`{' '.join(cmd)}` failed ({done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return done


# The services checked run without the Collector: tracing off, or every span batch logs an error.
UNTRACED = {"services": {name: {"environment": {"OTEL_SDK_DISABLED": "true"}} for name in SERVICES[1:]}}
LOGGED_ERRORS = ("Traceback", "Failed to export", "while exporting")  # a crash; the OTLP exporter's complaints
FILES: list[str] = []  # the compose file and the override, set by main


def compose(*args: str, **kw) -> subprocess.CompletedProcess:
    files = [a for f in FILES for a in ("-f", f)]
    return run("docker-compose", "-p", PROJECT, "--project-directory", str(ROOT), *files, *args, cwd=ROOT, **kw)


def container(service: str) -> str:
    return f"{PROJECT}_{service}_1"


def wait(what: str, ready, timeout: float) -> None:
    end = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > end:
            raise SystemExit(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(1)


def healthy(service: str, restarting: bool = False) -> bool:
    """Whether the service's health check passes; stops the check where Docker has given up on it
    (its retries spent), with the end of its log. `restarting`: a container that was just killed
    reads "unhealthy" from its stop until its first check after the restart, which is no verdict."""
    status = run("docker", "inspect", "-f", "{{.State.Health.Status}}", container(service), check=False).stdout.strip()
    if status == "unhealthy" and not restarting:
        logs = run("docker", "logs", "--tail", "20", container(service), check=False)
        checks = run("docker", "inspect", "-f", "{{json .State.Health.Log}}", container(service), check=False)
        raise SystemExit(
            f"{service} is unhealthy; its last health checks:\n{checks.stdout[-1500:]}\n"
            f"its log ends:\n{logs.stdout}{logs.stderr}"
        )
    return status == "healthy"


def base_image(asked: str | None) -> str:
    if asked:
        return asked
    if run("docker", "pull", "python:3.11-slim", check=False, timeout=120).returncode == 0:
        return "python:3.11-slim"
    local = "shardline-base:bookworm"
    if run("docker", "image", "inspect", local, check=False).returncode != 0:
        with tempfile.TemporaryDirectory() as root:
            run("debootstrap", "--variant=minbase", "bookworm", root, "http://deb.debian.org/debian")
            tar = subprocess.Popen(["tar", "-C", root, "-c", "."], stdout=subprocess.PIPE)
            run("docker", "import", "-", local, stdin=tar.stdout)
    return local


def build(base: str, wheel: str | None, ca_bundle: str | None) -> int:
    args = ["--build-arg", f"BASE={base}"]
    copied = []
    if wheel:
        (ROOT / "wheels").mkdir(exist_ok=True)
        copied.append(ROOT / "wheels" / Path(wheel).name)
        shutil.copy(wheel, copied[-1])
        args += ["--build-arg", f"TORCH_SPEC=wheels/{Path(wheel).name}", "--build-arg", "TORCH_INDEX="]
    if ca_bundle:
        copied.append(ROOT / "ca-certificates.crt")
        shutil.copy(ca_bundle, copied[-1])
        args += ["--build-arg", "CA_BUNDLE=ca-certificates.crt"]
    try:
        run("docker", "build", *args, "-t", "shardline:cpu", ".", cwd=ROOT)
    finally:
        for path in copied:
            path.unlink(missing_ok=True)
    return int(run("docker", "image", "inspect", "-f", "{{.Size}}", "shardline:cpu").stdout)


def request(path: str, body: dict | None, key: str | None, context: ssl.SSLContext) -> tuple[int, str]:
    headers = {"content-type": "application/json"} | ({"authorization": f"Bearer {key}"} if key else {})
    data = json.dumps(body).encode() if body is not None else None
    try:
        with urllib.request.urlopen(
            urllib.request.Request(GATEWAY + path, data=data, headers=headers), context=context, timeout=120
        ) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def chat(key: str, context: ssl.SSLContext, stream: bool = False) -> str:
    body = {
        "model": "SmolLM2-135M-Instruct",
        "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": 8,
        "temperature": 0,
        "stream": stream,
    }
    status, text = request("/v1/chat/completions", body, key, context)
    if status != 200:
        raise SystemExit(f"a chat completion through the gateway answered {status}: {text[:500]}")
    return text


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", help="base image (default: python:3.11-slim, else a debootstrapped Debian)")
    wheels = sorted(glob.glob("/opt/wheels/torch-2.13.0+cpu-*.whl"))
    p.add_argument("--torch-wheel", default=wheels[0] if wheels else None, help="a local torch wheel")
    bundle = "/etc/ssl/certs/ca-certificates.crt"
    p.add_argument("--ca-bundle", default=bundle if os.path.exists(bundle) else None, help="CA bundle pip trusts")
    p.add_argument("--compose-file", default=str(ROOT / "docker-compose.yml"), help="the compose file to check")
    args = p.parse_args()
    timings: dict[str, float] = {}

    def step(name: str, action):
        t0 = time.monotonic()
        result = action()
        timings[name] = round(time.monotonic() - t0, 1)
        print(f"{name}: {timings[name]} s", flush=True)
        return result

    run("docker", "info")
    base = step("base image", lambda: base_image(args.base))
    size = step("image build", lambda: build(base, args.torch_wheel, args.ca_bundle))
    keys, made_keys = ROOT / "api-keys.txt", False
    if not keys.exists():
        keys.write_text(f"{secrets.token_hex(24)} check\n")
        made_keys = True
    key = next(line.split()[0] for line in keys.read_text().splitlines() if line.strip() and line[0] != "#")
    override = tempfile.NamedTemporaryFile("w", suffix=".yml", delete=False)
    json.dump(UNTRACED, override)  # JSON is YAML
    override.close()
    FILES[:] = [str(Path(args.compose_file).resolve()), override.name]
    try:
        step(
            "up until the gateway is healthy",
            lambda: (
                compose("up", "-d", *SERVICES),
                wait("the gateway to be healthy", lambda: healthy("gateway"), 600),
            ),
        )
        with tempfile.TemporaryDirectory() as tmp:
            run("docker", "cp", f"{container('gateway')}:/certs/ca.crt", f"{tmp}/ca.crt")
            context = ssl.create_default_context(cafile=f"{tmp}/ca.crt")
        streamed = step("streamed chat completion over TLS", lambda: chat(key, context, stream=True))
        if not streamed.rstrip().endswith("data: [DONE]") or '"content"' not in streamed:
            raise SystemExit(f"the stream did not end as OpenAI's do:\n{streamed[-500:]}")
        status, _ = request("/v1/models", None, None, context)
        if status != 401:
            raise SystemExit(f"a request without a key got {status}, not 401")
        run("docker", "kill", container("router-0"))
        step("served by the other replica", lambda: [chat(key, context) for _ in range(3)])
        pid = run("docker", "inspect", "-f", "{{.State.Pid}}", container("router-1")).stdout.strip()
        run("docker", "start", container("router-0"))
        run("kill", "-9", pid)
        step(
            "crashed router restarted and serving",
            lambda: (
                wait(
                    "router-1 to be restarted and healthy",
                    lambda: (
                        run("docker", "inspect", "-f", "{{.RestartCount}}", container("router-1")).stdout.strip() != "0"
                        and healthy("router-1", restarting=True)
                        and healthy("router-0", restarting=True)
                    ),
                    300,
                ),
                chat(key, context),
            ),
        )
        logs = compose("logs", "--no-color", *SERVICES).stdout
        bad = [line for line in logs.splitlines() if any(sign in line for sign in LOGGED_ERRORS)]
        if bad:
            raise SystemExit("services logged errors:\n" + "\n".join(bad[:20]))
    finally:
        step("down -v", lambda: compose("down", "-v", "--remove-orphans"))
        os.unlink(override.name)
        if made_keys:
            keys.unlink()
    listings = (
        ("ps", "-a", "--format", "{{.Names}}"),
        ("network", "ls", "--format", "{{.Name}}"),
        ("volume", "ls", "--format", "{{.Name}}"),
    )
    left = [name for listing in listings for name in run("docker", *listing).stdout.split() if name.startswith(PROJECT)]
    if left:
        raise SystemExit(f"left behind: {left}")
    print(json.dumps({"image_bytes": size, "seconds": timings}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
