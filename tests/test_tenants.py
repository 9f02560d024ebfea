"""API keys, tenants and their isolation, end to end against a real server (and the key check
as a unit)."""

import hmac
from unittest import mock

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shardline.common.auth import ApiKeys, cache_namespace
from shardline.protos import generation_pb2 as pb
from tests.support import Server

KEYS = {"alice": "alice-key-0123456789abcdef", "bob": "bob-key-0123456789abcdef0"}
LONE = "a-key-without-a-tenant-name-42"
PROMPT = pb.PromptTokens(ids=list(range(10, 30)))  # 20 tokens: 4 full pages of 4 can be cached


def _auth(key: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {key}")]


@pytest.fixture(scope="module")
def keyed_server(tiny_models, tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys"
    path.write_text("# tenants\n" + "".join(f"{k} {t}\n" for t, k in KEYS.items()) + f"\n{LONE}\n")
    server = Server(
        "--model",
        str(tiny_models["llama"]),
        "--page-size",
        "4",
        "--api-keys-file",
        str(path),
        "--tenant-max-requests",
        "2",
    )
    yield server
    assert server.stop() == 0


def _generate(server, key, n=2, **kw):
    replies = list(
        server.stub.Generate(
            pb.GenerateRequest(prompt_token_ids=PROMPT, max_new_tokens=n, ignore_eos=True, **kw),
            metadata=_auth(key),
            timeout=60,
        )
    )
    return replies[-1]


@pytest.mark.processes
def test_every_call_but_health_needs_a_valid_key(keyed_server):
    stub = keyed_server.stub
    calls = {
        "Generate": lambda md: list(
            stub.Generate(pb.GenerateRequest(prompt="hi", max_new_tokens=1), metadata=md, timeout=30)
        ),
        "Cancel": lambda md: stub.Cancel(pb.CancelRequest(request_id="x"), metadata=md, timeout=10),
        "Stats": lambda md: stub.Stats(pb.StatsRequest(), metadata=md, timeout=10),
        "Info": lambda md: stub.Info(pb.InfoRequest(), metadata=md, timeout=10),
    }
    messages = set()
    for name, call in calls.items():
        for md in (
            None,
            _auth("wrong-key-0123456789abcdef"),
            _auth(KEYS["alice"][:-1]),
            [("authorization", KEYS["alice"])],
        ):  # no "Bearer": not a key
            with pytest.raises(grpc.RpcError) as err:
                call(md)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, name
            messages.add(err.value.details())
    assert len(messages) == 1  # missing and wrong keys are told the same
    assert stub.Info(pb.InfoRequest(), metadata=_auth(LONE), timeout=10).model
    health = health_pb2_grpc.HealthStub(keyed_server.channel)
    assert health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.processes
def test_tenants_never_share_cached_pages_but_hit_their_own(keyed_server):
    alice, bob = KEYS["alice"], KEYS["bob"]
    assert _generate(keyed_server, alice).usage.cached_prompt_tokens == 0
    assert _generate(keyed_server, alice).usage.cached_prompt_tokens == 16
    assert _generate(keyed_server, bob).usage.cached_prompt_tokens == 0  # identical prompt and salt
    assert _generate(keyed_server, LONE).usage.cached_prompt_tokens == 0
    assert _generate(keyed_server, bob).usage.cached_prompt_tokens == 16
    assert _generate(keyed_server, bob, cache_salt="s").usage.cached_prompt_tokens == 0  # salt within a tenant


@pytest.mark.processes
def test_a_tenant_at_its_limit_is_refused_while_others_are_served(keyed_server):
    stub, alice = keyed_server.stub, KEYS["alice"]
    long = [
        stub.Generate(
            pb.GenerateRequest(request_id=f"long{i}", prompt="go", max_new_tokens=2000, ignore_eos=True),
            metadata=_auth(alice),
            timeout=120,
        )
        for i in range(2)
    ]
    try:
        for call in long:
            next(call)
        with pytest.raises(grpc.RpcError) as err:
            _generate(keyed_server, alice)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert _generate(keyed_server, KEYS["bob"]).finish_reason == "length"
        with pytest.raises(grpc.RpcError) as err:  # a tenant cannot reach another's requests
            stub.Cancel(pb.CancelRequest(request_id="long0"), metadata=_auth(KEYS["bob"]), timeout=10)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        stub.Cancel(pb.CancelRequest(request_id="long0"), metadata=_auth(alice), timeout=10)
        assert list(long[0])[-1].finish_reason == "cancelled"
        assert _generate(keyed_server, alice).finish_reason == "length"  # room again
    finally:
        for call in long:
            call.cancel()


@pytest.mark.processes
def test_sharing_across_tenants_is_an_operator_choice(tiny_models, tmp_path):
    path = tmp_path / "keys"
    path.write_text("".join(f"{k} {t}\n" for t, k in KEYS.items()))
    server = Server(
        "--model",
        str(tiny_models["llama"]),
        "--page-size",
        "4",
        "--api-keys-file",
        str(path),
        "--prefix-cache-sharing",
        "all",
    )
    try:
        assert _generate(server, KEYS["alice"]).usage.cached_prompt_tokens == 0
        assert _generate(server, KEYS["bob"]).usage.cached_prompt_tokens == 16
    finally:
        assert server.stop() == 0


def test_a_key_is_compared_with_every_known_key_whatever_matches():
    keys = ApiKeys([(f"key-{i}-0123456789abcdef", f"t{i}") for i in range(5)])
    for presented, want in [("key-0-0123456789abcdef", "t0"), ("key-4-0123456789abcdef", "t4"), ("nope", None)]:
        with mock.patch("shardline.common.auth.hmac.compare_digest", wraps=hmac.compare_digest) as compare:
            assert keys.tenant([("authorization", f"Bearer {presented}")]) == want
        assert compare.call_count == 5


def test_cache_namespaces_of_different_tenant_and_salt_pairs_never_meet():
    pairs = [("a", ""), ("a:", ""), ("a", ":"), ("", "a"), ("ab", "c"), ("a", "bc"), ("1:a", "")]
    spaces = [cache_namespace(t or None, s) for t, s in pairs]
    assert len(set(spaces)) == len(spaces)
