"""TLS on the public API and mutual TLS between router and shards, with certificates made at test
time (trustme): real router and shard processes on loopback TCP."""

import os
import random
import ssl
import subprocess
import sys
import threading
import time

import grpc
import httpx
import pytest
import trustme

from harness.serve import free_port
from shardline.common.tls import channel_credentials
from shardline.processes import free_ports, spawn_service
from shardline.protos import generation_pb2 as pb
from shardline.protos import generation_pb2_grpc as pb_grpc
from shardline.protos import shard_pb2, shard_pb2_grpc
from tests.support import ROOT, assert_greedy_match, hf_greedy, hf_model, wait_for

pytestmark = pytest.mark.processes  # every test here starts processes

HOSTS = ("127.0.0.1", "localhost")


def _files(tmp, name: str, ca: trustme.CA, client: bool = False) -> dict:
    """PEM files of a certificate `ca` issues for loopback: {'cert', 'key', 'ca'} paths."""
    cert = ca.issue_cert(*HOSTS) if not client else ca.issue_cert(f"{name}.client")
    out = {"cert": tmp / f"{name}.crt", "key": tmp / f"{name}.key", "ca": tmp / f"{name}-ca.crt"}
    cert.cert_chain_pems[0].write_to_path(out["cert"])
    cert.private_key_pem.write_to_path(out["key"])
    ca.cert_pem.write_to_path(out["ca"])
    return {k: str(v) for k, v in out.items()}


def _creds(files: dict | None, ca: str, present: bool = True) -> grpc.ChannelCredentials:
    return channel_credentials(ca, files["cert"], files["key"]) if present else channel_credentials(ca)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pki")
    shards_ca, other_ca, public_ca = trustme.CA(), trustme.CA(), trustme.CA()
    return {
        "tmp": tmp,
        "public_ca": public_ca,
        "shard": _files(tmp, "shard", shards_ca),
        "router": _files(tmp, "router", shards_ca, client=True),
        "impostor": _files(tmp, "impostor", other_ca, client=True),
        "public": _files(tmp, "public", public_ca),
        "client": _files(tmp, "client", public_ca, client=True),
    }


def _https(url: str, ca: str, client: dict | None) -> httpx.Response:
    context = ssl.create_default_context(cafile=ca)
    if client is not None:
        context.load_cert_chain(client["cert"], client["key"])
    return httpx.get(url, verify=context, timeout=10)


def _mtls_flags(files: dict) -> list[str]:
    return [
        "--shard-tls-ca-file",
        files["ca"],
        "--shard-tls-cert-file",
        files["cert"],
        "--shard-tls-key-file",
        files["key"],
    ]


@pytest.fixture(scope="module")
def secure_shard(tiny_models, pki):
    port = free_port()
    proc = spawn_service(
        [
            "shard",
            "--model",
            str(tiny_models["llama"]),
            "--page-size",
            "16",
            "--listen",
            f"127.0.0.1:{port}",
            *_mtls_flags(pki["shard"]),
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    address = f"127.0.0.1:{port}"
    good = _creds(pki["router"], pki["shard"]["ca"])
    wait_for(lambda: _shard_info(address, good) is not None, 120, "the shard to answer over mutual TLS")
    yield address
    proc.kill()
    proc.wait()


def _shard_info(address: str, credentials) -> shard_pb2.ShardInfo | None:
    with grpc.secure_channel(address, credentials) as channel:
        try:
            return shard_pb2_grpc.ShardStub(channel).Info(shard_pb2.InfoRequest(), timeout=5)
        except grpc.RpcError:
            return None


def test_a_shard_serves_only_a_router_its_ca_signed(secure_shard, pki):
    ca = pki["shard"]["ca"]
    assert _shard_info(secure_shard, _creds(pki["router"], ca)).model
    assert _shard_info(secure_shard, _creds(None, ca, present=False)) is None  # no certificate
    assert _shard_info(secure_shard, _creds(pki["impostor"], ca)) is None  # another CA's
    with grpc.insecure_channel(secure_shard) as channel:  # plaintext
        with pytest.raises(grpc.RpcError):
            shard_pb2_grpc.ShardStub(channel).Info(shard_pb2.InfoRequest(), timeout=5)


class Router:
    """`shardline router` over one shard, with its output kept for the test to read."""

    def __init__(self, model, shard: str, mtls: dict, *public: str):
        self.port, self.http_port = free_ports(2)
        self.proc = spawn_service(
            [
                "router",
                "--model",
                str(model),
                "--page-size",
                "16",
                "--shards",
                shard,
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--http-port",
                str(self.http_port),
                "--shard-timeout",
                "2",  # a refused handshake is reported after this
                *_mtls_flags(mtls),
                *public,
            ],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []
        threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True).start()

    def read(self) -> str:
        return "".join(self.lines)

    def stop(self):
        self.proc.kill()
        self.proc.wait()


def test_a_router_with_a_foreign_certificate_gets_no_shard(secure_shard, pki, tiny_models):
    # a router presenting another CA's certificate (the shard refuses it), and a router that
    # does not trust the shard's CA (it refuses the shard)
    for mtls in ({**pki["impostor"], "ca": pki["shard"]["ca"]}, {**pki["router"], "ca": pki["impostor"]["ca"]}):
        router = Router(tiny_models["llama"], secure_shard, mtls)
        try:
            refused = lambda: "shard group not ready" in router.read()  # noqa: B023 - waited for here
            wait_for(refused, 60, "the router to report the refused shard")
            assert "router listening" not in router.read()
        finally:
            router.stop()


def test_streaming_over_tls_and_mutual_tls_matches_transformers(secure_shard, pki, tiny_models):
    ref = hf_model(tiny_models["llama"])
    rng = random.Random(5)
    prompt = [rng.randrange(ref.config.vocab_size) for _ in range(40)]
    want, margins = hf_greedy(ref, prompt, 8)
    public = pki["public"]
    router = Router(
        tiny_models["llama"],
        secure_shard,
        pki["router"],
        "--tls-cert-file",
        public["cert"],
        "--tls-key-file",
        public["key"],
        "--tls-client-ca-file",
        public["ca"],
    )
    target = f"127.0.0.1:{router.port}"
    try:
        wait_for(lambda: "router listening" in router.read(), 120, "the router to serve")
        request = pb.GenerateRequest(prompt_token_ids=pb.PromptTokens(ids=prompt), max_new_tokens=8, ignore_eos=True)
        with grpc.secure_channel(target, _creds(pki["client"], public["ca"])) as channel:
            tokens = [t for m in pb_grpc.GenerationStub(channel).Generate(request, timeout=60) for t in m.token_ids]
        assert_greedy_match(tokens, want, margins)
        cli = subprocess.run(
            [
                sys.executable,
                "-m",
                "shardline.cli",
                "generate",
                "--target",
                target,
                "--raw",
                "Hi",
                "--max-new-tokens",
                "2",
                "--tls-ca-file",
                public["ca"],
                "--tls-cert-file",
                pki["client"]["cert"],
                "--tls-key-file",
                pki["client"]["key"],
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert cli.returncode == 0 and "[length: " in cli.stderr, cli.stderr
        for credentials in (_creds(None, public["ca"], present=False), _creds(pki["impostor"], public["ca"])):
            with grpc.secure_channel(target, credentials) as channel:
                with pytest.raises(grpc.RpcError) as err:
                    list(pb_grpc.GenerationStub(channel).Generate(request, timeout=10))
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        # The HTTP API: the same certificate, the same client CA.
        https = f"https://127.0.0.1:{router.http_port}/v1/models"
        assert _https(https, public["ca"], pki["client"]).status_code == 200
        for client in (None, pki["impostor"]):
            with pytest.raises(httpx.HTTPError):
                _https(https, public["ca"], client)
        with pytest.raises(httpx.HTTPError):  # no plaintext beside it
            httpx.get(https.replace("https", "http"), timeout=5)
        # Rotation: new files in place are served to the next connection, without a restart.
        new_ca = trustme.CA()
        rotated = _files(pki["tmp"], "rotated", new_ca)
        time.sleep(0.01)
        for kind in ("cert", "key"):
            os.replace(rotated[kind], public[kind])

        def served_with_new_certificate():
            with grpc.secure_channel(target, _creds(pki["client"], rotated["ca"])) as channel:
                try:
                    return pb_grpc.GenerationStub(channel).Info(pb.InfoRequest(), timeout=5).model
                except grpc.RpcError:
                    return None

        assert wait_for(served_with_new_certificate, 30, "the rotated certificate")
        assert _https(https, rotated["ca"], pki["client"]).status_code == 200  # HTTP rotates too
        assert router.proc.poll() is None
    finally:
        router.stop()
