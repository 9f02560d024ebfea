"""The OpenAI-compatible HTTP API against a live server, with the official `openai` client (sync
and async) and raw HTTP: the same answers as the gRPC API, streaming, usage, log-probabilities,
n choices over one computed prompt, disconnects, every error status in OpenAI's shape, keys and
tenants, traces and metrics, and a drain."""

import asyncio
import json
import os
import random
import secrets
import signal
import subprocess
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from harness.otlp_receiver import OtlpReceiver
from shardline.processes import spawn_service
from shardline.protos import generation_pb2 as pb
from tests.support import ROOT, Server, free_port, smollm2_codec, wait_for

POISON_SEED = 666  # tests/faults: sampling raises inside the shard for this seed
FAULTS = {
    "PYTHONPATH": os.pathsep.join([str(ROOT / "tests" / "faults"), os.environ.get("PYTHONPATH", "")]),
    "SHARDLINE_TEST_POISON_SEED": str(POISON_SEED),
    "OTEL_BSP_SCHEDULE_DELAY": "50",
    "OTEL_TRACES_SAMPLER": "always_on",
}
PAGE = 16
GREEDY = dict(temperature=0, max_tokens=12, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def receiver():
    with OtlpReceiver() as receiver:
        yield receiver


@pytest.fixture(scope="module")
def server(tiny_models, receiver):
    server = Server(
        "--model",
        str(tiny_models["llama"]),
        "--page-size",
        str(PAGE),
        "--otlp-endpoint",
        receiver.endpoint,
        "--metrics-port",
        str(free_port()),
        env=FAULTS,
    )
    server.model = server.stub.Info(pb.InfoRequest()).model
    yield server
    assert server.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.http_url, api_key="unused", max_retries=0, timeout=120)


def grpc_answer(server, **request) -> tuple[list[int], str, pb.GenerateResponse, list]:
    tokens, text, last, logprobs = [], "", None, []
    for msg in server.stub.Generate(pb.GenerateRequest(**request), timeout=120):
        tokens += msg.token_ids
        text += msg.text
        logprobs += msg.logprobs
        last = msg
    return tokens, text, last, logprobs


def chat(content: str) -> list[dict]:
    return [{"role": "system", "content": "Be brief."}, {"role": "user", "content": content}]


def grpc_chat(content: str) -> pb.ChatMessages:
    return pb.ChatMessages(messages=[pb.ChatMessage(role=m["role"], content=m["content"]) for m in chat(content)])


# -- the same answers as the gRPC API -------------------------------------------------------------
@pytest.mark.processes
def test_models_lists_the_served_model(server, client):
    assert [m.id for m in client.models.list().data] == [server.model]


@pytest.mark.processes
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_greedy_text_equals_the_grpc_apis(server, client, stream):
    _, text, last, _ = grpc_answer(server, messages=grpc_chat("Name three colors."), max_new_tokens=12, ignore_eos=True)
    answer = client.chat.completions.create(
        model=server.model,
        messages=chat("Name three colors."),
        stream=stream,
        stream_options={"include_usage": True} if stream else None,
        **GREEDY,
    )
    if stream:
        chunks = list(answer)
        assert chunks[0].choices[0].delta.role == "assistant"
        got = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert finish == ["length"]  # in the last content chunk only
        usage = chunks[-1].usage
        assert chunks[-1].choices == [] and usage is not None
    else:
        got, usage = answer.choices[0].message.content, answer.usage
        assert answer.choices[0].finish_reason == "length" and answer.object == "chat.completion"
    assert got == text
    assert (usage.prompt_tokens, usage.completion_tokens) == (last.usage.prompt_tokens, 12)
    assert usage.total_tokens == usage.prompt_tokens + 12
    assert usage.prompt_tokens_details.cached_tokens >= 0


@pytest.mark.processes
@pytest.mark.parametrize("prompt", ["The capital of France is", [5, 6, 7, 300, 301, 302]], ids=["text", "token-ids"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_completions_greedy_text_equals_the_grpc_apis(server, client, prompt, stream):
    tokens, text, _, _ = grpc_answer(
        server,
        **({"prompt": prompt} if isinstance(prompt, str) else {"prompt_token_ids": pb.PromptTokens(ids=prompt)}),
        max_new_tokens=12,
        ignore_eos=True,
    )
    answer = client.completions.create(model=server.model, prompt=prompt, stream=stream, **GREEDY)
    got = "".join(c.choices[0].text for c in answer if c.choices) if stream else answer.choices[0].text
    assert got == text and len(tokens) == 12


def cold() -> str:
    """A cache salt no request used: its prompt is computed whole, in the same order for both APIs."""
    return secrets.token_hex(4)


@pytest.mark.processes
def test_chat_logprobs_equal_the_grpc_apis(server, client):
    codec = smollm2_codec()
    tokens, _, _, want = grpc_answer(
        server, messages=grpc_chat("Count to five."), max_new_tokens=6, ignore_eos=True, logprobs=3, cache_salt=cold()
    )
    answer = client.chat.completions.create(
        model=server.model,
        messages=chat("Count to five."),
        temperature=0,
        max_tokens=6,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True, "cache_salt": cold()},
    )
    got = answer.choices[0].logprobs.content
    assert [g.token for g in got] == [codec.token_text(t) for t in tokens]
    assert [bytes(g.bytes) for g in got] == [codec.token_bytes(t) for t in tokens]
    for g, w in zip(got, want):
        assert g.logprob == pytest.approx(w.logprob, abs=1e-6)
        assert [t.token for t in g.top_logprobs] == [codec.token_text(t.token_id) for t in w.top]
        assert [t.logprob for t in g.top_logprobs] == pytest.approx([t.logprob for t in w.top], abs=1e-6)


@pytest.mark.processes
def test_completion_logprobs_are_the_legacy_format_of_the_same_numbers(server, client):
    codec = smollm2_codec()
    tokens, text, _, want = grpc_answer(
        server, prompt="Once upon a time", max_new_tokens=6, ignore_eos=True, logprobs=2, cache_salt=cold()
    )
    lp = (
        client.completions.create(
            model=server.model,
            prompt="Once upon a time",
            temperature=0,
            max_tokens=6,
            logprobs=2,
            extra_body={"ignore_eos": True, "cache_salt": cold()},
        )
        .choices[0]
        .logprobs
    )
    assert lp.tokens == [codec.token_text(t) for t in tokens]
    assert lp.token_logprobs == pytest.approx([w.logprob for w in want], abs=1e-6)
    for top, w in zip(lp.top_logprobs, want):
        assert top == pytest.approx({codec.token_text(t.token_id): t.logprob for t in w.top}, abs=1e-6)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset) and lp.text_offset[-1] < len(text)


@pytest.mark.processes
def test_n_choices_compute_the_prompt_once_and_a_seed_reproduces_them(server, client):
    ids = [random.Random(3).randrange(1000, 30000) for _ in range(40)]  # two full pages and 8 tokens
    salt = cold()
    before = server.stats().prompt_tokens_computed

    def four():
        return client.completions.create(
            model=server.model,
            prompt=ids,
            n=4,
            temperature=1.0,
            seed=7,
            max_tokens=8,
            extra_body={"ignore_eos": True, "cache_salt": salt},
        )

    first = four()
    # The first choice computes the prompt; the others only what lies past its last full page.
    assert server.stats().prompt_tokens_computed - before == 40 + 3 * (40 - 2 * PAGE)
    assert first.usage.prompt_tokens == 40 and first.usage.completion_tokens == 4 * 8
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    texts = [c.text for c in sorted(first.choices, key=lambda c: c.index)]
    assert [c.index for c in sorted(first.choices, key=lambda c: c.index)] == [0, 1, 2, 3]
    assert len(set(texts)) > 1, "each choice samples with its own seed"
    assert [c.text for c in sorted(four().choices, key=lambda c: c.index)] == texts


@pytest.mark.processes
def test_stop_strings_and_limits_as_openai_defines_them(server, client):
    _, text, _, _ = grpc_answer(server, prompt="The capital of France is", max_new_tokens=12, ignore_eos=True)
    stop = text[3:6]  # somewhere in the greedy answer
    _, stopped, last, _ = grpc_answer(
        server, prompt="The capital of France is", max_new_tokens=12, ignore_eos=True, stop=[stop]
    )
    answer = client.completions.create(model=server.model, prompt="The capital of France is", stop=stop, **GREEDY)
    assert answer.choices[0].text == stopped and answer.choices[0].finish_reason == "stop" == last.finish_reason
    default = client.completions.create(model=server.model, prompt="Hi", extra_body={"ignore_eos": True})
    assert default.usage.completion_tokens == 16  # OpenAI's default for text completions
    chat_ = client.chat.completions.create(
        model=server.model, messages=chat("Hi"), max_completion_tokens=3, max_tokens=9, extra_body={"ignore_eos": True}
    )
    assert chat_.usage.completion_tokens == 3  # max_completion_tokens wins, as OpenAI's


@pytest.mark.processes
def test_streamed_choices_come_with_their_index(server, client):
    chunks = list(
        client.chat.completions.create(
            model=server.model,
            messages=chat("Hi"),
            n=3,
            stream=True,
            max_tokens=5,
            seed=1,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    ended = sorted(c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason)
    assert ended == [0, 1, 2]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3 * 5  # every choice's


async def _all(stream) -> list:
    return [c async for c in stream]


@pytest.mark.processes
def test_the_async_client_streams_too(server):
    async def main():
        async with openai.AsyncOpenAI(base_url=server.http_url, api_key="unused", max_retries=0) as client:
            streams = await asyncio.gather(
                *(
                    client.completions.create(model=server.model, prompt=f"Story {i}:", stream=True, **GREEDY)
                    for i in range(4)
                )
            )
            return [await _all(s) for s in streams]

    for chunks in asyncio.run(main()):
        assert sum(1 for c in chunks if c.choices and c.choices[0].text) >= 1
        assert chunks[-1].choices[0].finish_reason == "length"


# -- nothing is lost --------------------------------------------------------------------------------
@pytest.mark.processes
def test_a_client_that_disconnects_cancels_its_request_and_leaves_no_page_held(server):
    cancelled = finished(server, "cancelled")
    body = {"model": server.model, "prompt": "A long story:", "max_tokens": 2000, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", server.http_url + "/completions", json=body) as response:
            assert next(line for line in response.iter_lines() if line.startswith("data: "))
        # ... and one that gives up waiting for a whole answer, and one of four choices
        for request in ({**body, "stream": False}, {**body, "stream": False, "n": 4}):
            with pytest.raises(httpx.ReadTimeout):
                http.post(server.http_url + "/completions", json=request, timeout=1.0)
    wait_for(lambda: finished(server, "cancelled") == cancelled + 6, 30, "the six sequences to be cancelled")
    st = server.wait_idle(30)
    assert st.pages_referenced == 0 and st.requests_running == 0 and st.requests_waiting == 0


def test_a_stream_whose_client_left_before_its_first_event_is_released():
    """A unit test of the streamed response with a stand-in answer: the client left while the
    request was admitted, so Starlette cancels the response before it iterates the answer at
    all, and the answer's finally never runs; the response releases it all the same."""
    from shardline.router.api.openai.answer import StreamedAnswer

    class Answer:
        closed = iterated = False

        async def stream(self):
            Answer.iterated = True
            yield b"data: never sent\n\n"

        def close(self):
            Answer.closed = True

    async def receive():
        return {"type": "http.disconnect"}

    async def send(message):
        await asyncio.sleep(3600)  # a client that reads nothing more

    asyncio.run(StreamedAnswer(Answer()).__call__({"type": "http", "asgi": {"spec_version": "2.3"}}, receive, send))
    assert Answer.closed and not Answer.iterated


# -- errors in OpenAI's shape -----------------------------------------------------------------------
def post(server, path: str, body, headers: dict | None = None, raw: bytes | None = None) -> httpx.Response:
    return httpx.post(
        server.http_url + path,
        content=raw if raw is not None else json.dumps(body),
        headers={"content-type": "application/json", **(headers or {})},
        timeout=60,
    )


def assert_error(response: httpx.Response, status: int, phrase: str, param: str | None = None):
    assert response.status_code == status, (response.status_code, response.text)
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"} and phrase in error["message"], error
    if param is not None:
        assert error["param"] == param


DROP = object()  # a field left out


@pytest.mark.processes
@pytest.mark.parametrize(
    "body,phrase,param",
    [
        ({"model": DROP, "messages": [{"role": "user", "content": "hi"}]}, "model: Field required", "model"),
        ({"messages": []}, "at least 1 item", "messages"),
        ({"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, "must be a number", "temperature"),
        (
            {"messages": [{"role": "user", "content": "hi"}], "temperature": -1},
            "greater than or equal to 0",
            "temperature",
        ),
        ({"messages": [{"role": "user", "content": "hi"}], "n": 99}, "less than or equal to 16", "n"),
        (
            {"messages": [{"role": "user", "content": "hi"}], "frobnicate": 1},
            "Extra inputs are not permitted",
            "frobnicate",
        ),
        (
            {"messages": [{"role": "user", "content": "hi"}], "presence_penalty": 0.5},
            "not supported",
            "presence_penalty",
        ),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role", "messages.0.role"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5000}, "exceeds the model's context", None),
        ({"messages": [{"role": "user", "content": "hi"}], "stop": ["x"] * 17}, "at most 16 stop strings", None),
    ],
    ids=[
        "no model",
        "no messages",
        "wrong type",
        "out of range",
        "too many choices",
        "unknown field",
        "unsupported",
        "unknown role",
        "over the context",
        "too many stops",
    ],
)
def test_bad_requests_are_400_with_a_message(server, body, phrase, param):
    body = {k: v for k, v in {"model": server.model, **body}.items() if v is not DROP}
    assert_error(post(server, "/chat/completions", body), 400, phrase, param)


@pytest.mark.processes
def test_every_other_error_status_has_openais_shape(server):
    assert_error(post(server, "/chat/completions", None, raw=b'{"model": "x", '), 400, "not JSON")
    assert_error(post(server, "/completions", None, raw=b"[1, 2]"), 400, "a JSON object")
    assert_error(post(server, "/completions", {"model": "gpt-4", "prompt": "hi"}), 404, "does not exist", "model")
    assert_error(post(server, "/completions", None, raw=b'{"prompt": "' + b"x" * (5 << 20) + b'"}'), 413, "over")
    assert_error(httpx.get(server.http_url + "/nowhere"), 404, "Not Found")
    poisoned = {"model": server.model, "prompt": "hi", "max_tokens": 4, "temperature": 1.0, "seed": POISON_SEED}
    assert_error(post(server, "/completions", poisoned), 500, "injected fault: poisoned request")
    events = [
        line
        for line in httpx.post(
            server.http_url + "/completions", json={**poisoned, "stream": True}, timeout=60
        ).text.splitlines()
        if line.startswith("data: ")
    ]
    assert "injected fault" in json.loads(events[-2][len("data: ") :])["error"]["message"]
    assert events[-1] == "data: [DONE]"
    # one failing choice of two fails the request, and frees the other
    assert_error(
        post(server, "/completions", {**poisoned, "n": 2, "ignore_eos": True, "max_tokens": 50}), 500, "injected fault"
    )
    assert httpx.get(server.http_url.removesuffix("/v1") + "/health").status_code == 200
    assert server.wait_idle().pages_referenced == 0


@pytest.mark.processes
def test_tokenize_and_detokenize_as_vllm_shapes_them(server):
    base = server.http_url.removesuffix("/v1")
    text = "Hello, world"
    tokens = httpx.post(base + "/tokenize", json={"model": server.model, "prompt": text}, timeout=30).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0 and tokens["token_strs"] is None
    assert tokens["max_model_len"] == server.stub.Info(pb.InfoRequest()).context_length
    assert httpx.post(base + "/detokenize", json={"tokens": tokens["tokens"]}, timeout=30).json() == {"prompt": text}
    chat_ids = httpx.post(base + "/tokenize", json={"messages": chat("Hi")}, timeout=30).json()
    usage = post(server, "/chat/completions", {"model": server.model, "messages": chat("Hi"), "max_tokens": 1})
    assert chat_ids["count"] == usage.json()["usage"]["prompt_tokens"]  # the prompt a chat is served with
    for body, status, phrase in (
        ({"prompt": "a", "messages": chat("Hi")}, 400, "exactly one of prompt and messages"),
        ({"model": "gpt-4", "prompt": "a"}, 404, "does not exist"),
        ({"prompt": "a", "add_special_tokens": False}, 400, "not supported"),
    ):
        assert_error(httpx.post(base + "/tokenize", json=body, timeout=30), status, phrase)
    assert_error(httpx.post(base + "/detokenize", json={"tokens": [0, 10**9]}, timeout=30), 400, "not a token id")
    assert_error(httpx.post(base + "/detokenize", json={"tokens": "abc"}, timeout=30), 400, "tokens")


# -- keys, tenants and limits ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def guarded(tiny_models, tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text("key-of-tenant-a-0123456789 a\nkey-of-tenant-b-0123456789 b\n")
    # One sequence at a time, prompts a token per step: a long prompt stays in flight for seconds.
    server = Server(
        "--model",
        str(tiny_models["llama"]),
        "--page-size",
        str(PAGE),
        "--num-pages",
        "16",
        "--api-keys-file",
        str(keys),
        "--tenant-max-requests",
        "1",
        "--max-batch",
        "1",
        "--chunk-size",
        "1",
    )
    server.metadata = [("authorization", "Bearer key-of-tenant-a-0123456789")]
    yield server
    assert server.stop() == 0


@pytest.mark.processes
def test_keys_are_required_and_a_tenants_limits_apply(guarded):
    a, b = ({"authorization": f"Bearer key-of-tenant-{t}-0123456789"} for t in "ab")
    body = {"model": "llama", "prompt": "hi", "max_tokens": 3}
    for headers in ({}, {"authorization": "Bearer wrong-key-0123456789"}):
        assert_error(post(guarded, "/completions", body, headers), 401, "API key")
    assert_error(httpx.get(guarded.http_url + "/models"), 401, "API key")
    assert post(guarded, "/completions", body, a).status_code == 200
    assert post(guarded, "/completions", body, {"x-api-key": "key-of-tenant-a-0123456789"}).status_code == 200
    assert_error(
        post(guarded, "/completions", {**body, "prompt": list(range(100, 400))}, a), 429, "whole page pool holds 256"
    )
    # A chat without max_tokens: up to what the context and the pool (256 tokens) leave.
    open_ended = post(guarded, "/chat/completions", {"model": "llama", "messages": chat("Hi"), "ignore_eos": True}, a)
    assert open_ended.status_code == 200 and open_ended.json()["choices"][0]["finish_reason"] == "length"
    assert sum(open_ended.json()["usage"][k] for k in ("prompt_tokens", "completion_tokens")) == 256
    with ThreadPoolExecutor(1) as pool:  # tenant a's one request in flight: 240 prompt tokens, one a step
        long = pool.submit(post, guarded, "/completions", {**body, "prompt": list(range(100, 340))}, a)
        wait_for(lambda: guarded.stats().requests_prefilling == 1, 30, "the long prompt to be in flight")
        assert_error(post(guarded, "/completions", body, a), 429, "1 requests in flight")
        assert post(guarded, "/completions", body, b).status_code == 200  # another tenant: after it, not refused
        assert long.result().status_code == 200
    assert guarded.wait_idle().pages_referenced == 0


# -- traces and metrics ------------------------------------------------------------------------------
@pytest.mark.processes
def test_a_traceparent_header_continues_the_clients_trace(server, receiver, client):
    trace_id, parent_id = secrets.token_hex(16), secrets.token_hex(8)
    client.chat.completions.create(
        model=server.model,
        messages=chat("Hi"),
        max_tokens=3,
        extra_headers={"traceparent": f"00-{trace_id}-{parent_id}-01"},
    )
    span = wait_for(lambda: next((s for s in receiver.spans() if s.trace_id == trace_id), None), 30, "the request span")
    assert span.parent_span_id == parent_id and span.name == f"chat {server.model}"
    assert span.attributes["gen_ai.usage.output_tokens"] == 3


@pytest.mark.processes
def test_prometheus_counts_http_requests(server, client):
    before = finished(server, "length")
    client.completions.create(model=server.model, prompt="Hi", max_tokens=2)
    wait_for(lambda: finished(server, "length") == before + 1, 10, "the counter to move")

    # The HTTP API's port serves the same registry at /metrics, as vLLM's does.
    wait_for(lambda: finished(server, "length", http=True) == before + 1, 10, "the HTTP port's /metrics to agree")


def finished(server, reason: str, http: bool = False) -> float:
    """The router's count of requests that ended with `reason` (its Prometheus endpoint, or the
    HTTP API's /metrics)."""
    args = server.proc.args
    port = server.http_port if http else int(args[args.index("--metrics-port") + 1])
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    family = next(f for f in text_string_to_metric_families(text) if f.name == "shardline:request_finished")
    return sum(s.value for s in family.samples if s.name.endswith("_total") and s.labels["finished_reason"] == reason)


@pytest.mark.processes
def test_a_router_without_its_shards_answers_503(tmp_path, tiny_models):
    port, http_port = free_port(), free_port()
    router = spawn_service(
        [
            "router",
            "--model",
            str(tiny_models["llama"]),
            "--page-size",
            str(PAGE),
            "--port",
            str(port),
            "--http-port",
            str(http_port),
            "--shards",
            f"unix:{tmp_path}/nobody.sock",
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        url = f"http://127.0.0.1:{http_port}"
        wait_for(lambda: _answers(url + "/health") == 503, 60, "the router's HTTP API")
        refused = httpx.post(url + "/v1/completions", json={"model": "llama", "prompt": "hi"}, timeout=10)
        assert_error(refused, 503, "not connected")
    finally:
        router.kill()
        router.wait()


def _answers(url: str) -> int | None:
    try:
        return httpx.get(url, timeout=2).status_code
    except httpx.HTTPError:
        return None


# -- a drain -----------------------------------------------------------------------------------------
@pytest.mark.processes
def test_sigterm_drains_http_streams(tiny_models):
    server = Server("--model", str(tiny_models["llama"]), "--page-size", str(PAGE), "--drain-timeout-s", "60")
    body = {"model": "llama", "prompt": "A story:", "max_tokens": 400, "stream": True, "ignore_eos": True}
    try:
        with httpx.Client(timeout=60) as http:
            with http.stream("POST", server.http_url + "/completions", json=body) as response:
                lines = response.iter_lines()
                next(line for line in lines if line.startswith("data: "))
                server.proc.send_signal(signal.SIGTERM)
                health = server.http_url.removesuffix("/v1") + "/health"
                wait_for(lambda: httpx.get(health, timeout=5).status_code == 503, 30, "the drain to begin")
                refused = post(server, "/completions", {**body, "stream": False, "max_tokens": 2})
                assert_error(refused, 503, "shutting down")
                rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][len("data: ") :])["choices"][0]["finish_reason"] == "length"
        assert server.proc.wait(60) == 0
    finally:
        server.stop()
