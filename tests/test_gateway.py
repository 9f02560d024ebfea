"""The gateway end to end: `shardline serve --replicas 2` (two tiny-model replicas, each a router
and its shard, behind a gateway), driven over gRPC with API keys of two tenants."""

import os
import random
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import anthropic
import grpc
import httpx
import openai
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shardline.protos import generation_pb2 as pb
from shardline.protos import generation_pb2_grpc as pb_grpc
from tests.support import Server, wait_for

pytestmark = pytest.mark.processes  # every test here starts processes

KEYS = {"alice": "alice-key-0123456789abcdef", "bob": "bob-key-0123456789abcdef"}
PAGE = 16


def _auth(tenant: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {KEYS[tenant]}")]


def _free_run(n: int) -> int:
    """The first of n consecutive free loopback ports (the gateway's metrics port, then each replica's)."""
    for _ in range(100):
        base = random.randrange(20000, 60000)
        socks = [socket.socket() for _ in range(n)]
        try:
            for i, sock in enumerate(socks):
                sock.bind(("127.0.0.1", base + i))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError(f"no {n} consecutive free ports")


@pytest.fixture(scope="module")
def fleet(tiny_models, tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys"
    keys.write_text("".join(f"{k} {t}\n" for t, k in KEYS.items()))
    server = Server(
        "--model",
        str(tiny_models["llama"]),
        "--page-size",
        str(PAGE),
        "--replicas",
        "2",
        "--api-keys-file",
        str(keys),
        "--num-pages",
        "512",
        "--metrics-port",
        str(_free_run(3)),
    )
    server.metadata = _auth("alice")
    wait_for(lambda: sum(r.serving for r in server.stats().replicas) == 2, 30, "both replicas to be routable")
    yield server
    assert server.stop() == 0


def _generate(fleet, ids, tenant="alice", **kw) -> pb.GenerateResponse:
    replies = list(
        fleet.stub.Generate(
            pb.GenerateRequest(prompt_token_ids=pb.PromptTokens(ids=ids), max_new_tokens=2, ignore_eos=True, **kw),
            metadata=_auth(tenant),
            timeout=60,
        )
    )
    return replies[-1]


def _routed(fleet) -> dict[str, int]:
    return {r.address: r.requests_routed for r in fleet.stats().replicas}


def _cached(fleet) -> dict[str, tuple[int, int]]:
    return {r.address: (r.predicted_cached_tokens, r.reported_cached_tokens) for r in fleet.stats().replicas}


def _prompt(rng, n):
    return [rng.randrange(10, 250) for _ in range(n)]


def test_follow_ups_of_a_shared_prefix_go_to_the_replica_that_caches_it(fleet):
    rng = random.Random(1)
    system = _prompt(rng, 6 * PAGE)
    before = _routed(fleet)
    first = _generate(fleet, system + _prompt(rng, 5))
    assert first.usage.cached_prompt_tokens == 0
    (home,) = [a for a, n in _routed(fleet).items() if n > before[a]]
    time.sleep(0.1)  # the router's index reaches the gateway within its publishing period (20 ms)
    for _ in range(4):
        assert _generate(fleet, system + _prompt(rng, 5)).usage.cached_prompt_tokens == 6 * PAGE
    after = _routed(fleet)
    assert after[home] - before[home] == 5 and sum(after.values()) - sum(before.values()) == 5
    st = {r.address: r for r in fleet.stats().replicas}[home]
    assert st.reported_cached_tokens >= 4 * 6 * PAGE and st.predicted_cached_tokens == st.reported_cached_tokens


def test_new_prefixes_spread_over_both_replicas(fleet):
    rng = random.Random(2)
    before = _routed(fleet)
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda p: _generate(fleet, p), [_prompt(rng, 3 * PAGE) for _ in range(8)]))
    after = _routed(fleet)
    assert all(after[a] > before[a] for a in after), (before, after)


def test_tenants_never_meet_in_the_gateways_index(fleet):
    rng = random.Random(3)
    shared = _prompt(rng, 4 * PAGE)
    _generate(fleet, shared, "alice")
    time.sleep(0.1)
    predicted = sum(r.predicted_cached_tokens for r in fleet.stats().replicas)
    bob = _generate(fleet, shared, "bob")
    assert bob.usage.cached_prompt_tokens == 0
    assert sum(r.predicted_cached_tokens for r in fleet.stats().replicas) == predicted  # nothing predicted for bob
    time.sleep(0.1)
    assert _generate(fleet, shared, "alice").usage.cached_prompt_tokens == 3 * PAGE  # the last token is computed
    with pytest.raises(grpc.RpcError) as err:
        list(fleet.stub.Generate(pb.GenerateRequest(prompt="hi", max_new_tokens=1), timeout=10))
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_cancel_through_the_gateway_reaches_the_replica_that_runs_it(fleet):
    stream = fleet.stub.Generate(
        pb.GenerateRequest(request_id="long-one", prompt="hello", max_new_tokens=2000, ignore_eos=True),
        metadata=_auth("alice"),
        timeout=60,
    )
    next(stream)
    fleet.stub.Cancel(pb.CancelRequest(request_id="long-one"), metadata=_auth("alice"), timeout=10)
    assert list(stream)[-1].finish_reason == "cancelled"
    with pytest.raises(grpc.RpcError) as err:  # a tenant cancels only its own
        fleet.stub.Cancel(pb.CancelRequest(request_id="long-one"), metadata=_auth("bob"), timeout=10)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_the_openai_api_through_the_gateway_routes_by_prefix_too(fleet):
    client = openai.OpenAI(base_url=fleet.http_url, api_key=KEYS["bob"], max_retries=0)
    system = "You are a terse assistant who answers in one word. " * 8
    before, cached_before = _routed(fleet), _cached(fleet)
    for question in ("Hi?", "Why?", "How?"):
        chat = client.chat.completions.create(
            model="llama",
            max_tokens=2,
            temperature=0,
            messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
        )
        assert chat.choices[0].finish_reason == "length"
        time.sleep(0.1)
    after = _routed(fleet)
    assert sorted(after[a] - before[a] for a in after) == [0, 3]  # all three on the replica that cached it
    assert chat.usage.prompt_tokens_details.cached_tokens > 0
    ((predicted, reported),) = [
        (p - cached_before[a][0], r - cached_before[a][1])
        for a, (p, r) in _cached(fleet).items()
        if after[a] > before[a]
    ]
    assert predicted == reported > 0  # the gateway hashed the chat template's text as the router did
    stream = client.completions.create(model="llama", prompt="Once upon a time", max_tokens=3, stream=True)
    assert sum(len(c.choices[0].text) > 0 for c in stream if c.choices) >= 1
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=fleet.http_url, api_key="wrong-key-0123456789", max_retries=0).models.list()
    assert httpx.get(fleet.http_url.removesuffix("/v1") + "/health", timeout=10).status_code == 200
    # A client that leaves mid-stream: the gateway closes its side, and nothing stays open.
    with httpx.stream(
        "POST",
        fleet.http_url + "/completions",
        headers={"authorization": f"Bearer {KEYS['bob']}"},
        json={"model": "llama", "prompt": "Tell me", "max_tokens": 1500, "stream": True},
        timeout=30,
    ) as response:
        assert response.status_code == 200
        next(response.iter_raw())

    def running_anywhere():  # asked of the routers themselves, not of the gateway's view of them
        count = fleet.stats().requests_running
        for address in (r.address for r in fleet.stats().replicas):
            with grpc.insecure_channel(address) as channel:
                count += (
                    pb_grpc.GenerationStub(channel)
                    .Stats(pb.StatsRequest(), metadata=_auth("bob"), timeout=10)
                    .requests_running
                )
        return count

    wait_for(lambda: running_anywhere() == 0, 2, "every stream to be closed, the router's too")


def test_anthropics_api_through_the_gateway_routes_by_prefix_and_answers_in_its_shape(fleet):
    base = fleet.http_url.removesuffix("/v1")
    client = anthropic.Anthropic(base_url=base, api_key=KEYS["bob"], max_retries=0, timeout=60)
    system = "You are a careful assistant who answers in few words. " * 8
    before, cached_before = _routed(fleet), _cached(fleet)
    for question in ("Hi?", "Why?", "How?"):
        answer = client.messages.create(
            model="llama", max_tokens=2, system=system, messages=[{"role": "user", "content": question}]
        )
        assert answer.stop_reason == "max_tokens"
        time.sleep(0.1)
    after = _routed(fleet)
    assert sorted(after[a] - before[a] for a in after) == [0, 3]  # all three on the replica that cached it
    assert answer.usage.cache_read_input_tokens > 0
    ((predicted, reported),) = [
        (p - cached_before[a][0], r - cached_before[a][1])
        for a, (p, r) in _cached(fleet).items()
        if after[a] > before[a]
    ]
    assert predicted == reported > 0  # the gateway hashed the same prompt as the router, read Anthropic's usage
    with client.messages.stream(
        model="llama", max_tokens=3, system=system, messages=[{"role": "user", "content": "Now?"}]
    ) as stream:
        assert stream.get_final_message().usage.output_tokens == 3
    counted = client.messages.count_tokens(model="llama", system=system, messages=[{"role": "user", "content": "Hi?"}])
    tokenized = httpx.post(
        base + "/tokenize",
        headers={"authorization": f"Bearer {KEYS['bob']}"},
        json={"messages": [{"role": "system", "content": system}, {"role": "user", "content": "Hi?"}]},
        timeout=30,
    ).json()
    assert counted.input_tokens == tokenized["count"] > 100
    refused = httpx.post(base + "/v1/messages", json={"model": "llama"}, headers={"x-api-key": "wrong"}, timeout=10)
    assert refused.status_code == 401 and refused.json()["error"]["type"] == "authentication_error"
    bad = httpx.post(base + "/v1/messages", json={"model": "llama"}, headers={"x-api-key": KEYS["bob"]}, timeout=10)
    assert bad.status_code == 400 and bad.json()["type"] == "error"  # the router's own answer, passed on


def test_openais_responses_through_the_gateway_find_their_stored_conversation(fleet):
    client = openai.OpenAI(base_url=fleet.http_url, api_key=KEYS["bob"], max_retries=0, timeout=60)
    instructions = "You are a patient assistant who answers in few words. " * 8
    before, cached_before = _routed(fleet), _cached(fleet)
    first = None
    for question in ("Hi?", "Why?", "How?"):
        first = client.responses.create(model="llama", instructions=instructions, input=question, max_output_tokens=2)
        time.sleep(0.1)
    after = _routed(fleet)
    assert sorted(after[a] - before[a] for a in after) == [0, 3]  # routed by the prefix the router computes
    ((home, (predicted, reported)),) = [
        (a, (p - cached_before[a][0], r - cached_before[a][1]))
        for a, (p, r) in _cached(fleet).items()
        if after[a] > before[a]
    ]
    assert predicted == reported > 0 and first.usage.input_tokens_details.cached_tokens > 0

    # The conversation is kept by the replica that answered: a request naming it goes there,
    # whatever else routing would pick (a stream's id is learned from its first event).
    def routed_to(action):
        before = _routed(fleet)
        result = action()
        after = _routed(fleet)
        return [a for a in after for _ in range(after[a] - before[a])], result

    def stream_one():
        events = list(client.responses.create(model="llama", input="Again?", max_output_tokens=2, stream=True))
        return events[0].response.id

    (elsewhere,), streamed = routed_to(stream_one)
    for stored, kept in ((first.id, home), (streamed, elsewhere)):
        assert routed_to(lambda stored=stored: client.responses.retrieve(stored))[0] == [kept]
        where, follow = routed_to(
            lambda stored=stored: client.responses.create(
                model="llama", previous_response_id=stored, input="Then?", max_output_tokens=2
            )
        )
        assert where == [kept] and follow.usage.input_tokens > 20
    assert routed_to(lambda: client.responses.delete(first.id))[0] == [home]
    tried, _ = routed_to(lambda: pytest.raises(openai.NotFoundError, client.responses.retrieve, first.id))
    assert sorted(tried) == sorted(after)  # no replica keeps it now: each was asked


def _scrape(port: int) -> dict[tuple[str, str], float]:
    """(metric name, its labels as text) -> value, from a Prometheus endpoint on loopback."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return {
        (s.name, ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_the_gateways_metrics_say_what_its_stats_say_per_replica(fleet):
    """--metrics-port M: the gateway's on M (per replica: routed, predicted and reported cached
    tokens, failovers, cache size, serving), each replica's router's on M + 1 + i."""
    args = fleet.proc.args
    port = int(args[args.index("--metrics-port") + 1])

    def generated() -> float:  # by the routers, as their own metrics say
        return sum(_scrape(port + 1 + i)[("shardline:generation_tokens_total", "")] for i in range(2))

    routed_before, generated_before = sum(r.requests_routed for r in fleet.stats().replicas), generated()
    _generate(fleet, _prompt(random.Random(9), 2 * PAGE))

    def agreed():  # the gateway hears of the new pages within the routers' publishing period
        nonlocal stats, got
        stats, got = fleet.stats(), _scrape(port)
        return all(
            got[("shardline:gateway_replica_cached_pages", f"replica={r.address}")] == r.pages_cached
            for r in stats.replicas
        )

    stats = got = None
    wait_for(agreed, 5, "a scrape and Stats taken together")
    assert got[("shardline:gateway_serving", "")] == 1
    for r in stats.replicas:
        label = f"replica={r.address}"
        assert got[("shardline:gateway_requests_routed_total", label)] == r.requests_routed
        assert got[("shardline:gateway_predicted_cached_tokens_total", label)] == r.predicted_cached_tokens
        assert got[("shardline:gateway_reported_cached_tokens_total", label)] == r.reported_cached_tokens
        assert got[("shardline:gateway_failovers_total", label)] == r.failovers
        assert got[("shardline:gateway_replica_serving", label)] == 1
        assert got[("shardline:gateway_replica_cached_pages", label)] == r.pages_cached
    assert sum(r.requests_routed for r in stats.replicas) == routed_before + 1
    assert generated() == generated_before + 2  # the request routed above, its 2 tokens


def _replica_pid(fleet, address: str) -> int:
    port = address.rpartition(":")[2]
    return next(
        p.pid for p in psutil.Process(fleet.proc.pid).children() if "serve" in p.cmdline() and port in p.cmdline()
    )


def test_a_replica_killed_gets_no_requests_and_comes_back_resynced(fleet):
    rng = random.Random(4)
    system = _prompt(rng, 4 * PAGE)
    _generate(fleet, system)
    time.sleep(0.1)
    replicas = {r.address: r for r in fleet.stats().replicas}
    victim = max(replicas.values(), key=lambda r: r.pages_cached).address
    assert replicas[victim].pages_cached > 0
    os.kill(_replica_pid(fleet, victim), signal.SIGKILL)
    t0 = time.monotonic()
    wait_for(lambda: not {r.address: r for r in fleet.stats().replicas}[victim].serving, 5, "the gateway to drop it")
    assert time.monotonic() - t0 < 5
    health = health_pb2_grpc.HealthStub(fleet.channel)
    assert health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == health_pb2.HealthCheckResponse.SERVING
    before = _routed(fleet)
    for _ in range(6):  # the system prompt's follow-ups too: served by the replica left
        assert _generate(fleet, system + _prompt(rng, 3)).finish_reason == "length"
    after = _routed(fleet)
    assert after[victim] == before[victim]
    # `serve` starts the replica again; the gateway resyncs to its empty cache (a new epoch).
    wait_for(lambda: {r.address: r for r in fleet.stats().replicas}[victim].serving, 60, "the replica to be back")
    back = {r.address: r for r in fleet.stats().replicas}[victim]
    assert back.epoch != replicas[victim].epoch and back.pages_cached == 0
