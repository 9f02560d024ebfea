"""Anthropic's Messages API against live servers, with the official `anthropic` client and raw
HTTP: the same greedy text as chat completions for the same conversation, every stream event,
forced tool calls valid for their schema and a tool_result round trip, count_tokens, stop
reasons, keys as `x-api-key`, served model names, and errors in Anthropic's shape."""

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest

from tests.support import Server

pytestmark = pytest.mark.processes  # every test here starts processes

GREEDY = {"temperature": 0}  # not a named argument of Anthropic's client any more: sent as older clients send it
SYSTEM = "You are a helpful assistant. Answer briefly."
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}
KEY = "key-of-tenant-a-0123456789"


@pytest.fixture(scope="module")
def smol(smollm2_server):
    base = smollm2_server.http_url.removesuffix("/v1")
    model = openai.OpenAI(base_url=smollm2_server.http_url, api_key="x").models.list().data[0].id
    return (
        smollm2_server,
        anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0, timeout=120),
        openai.OpenAI(base_url=smollm2_server.http_url, api_key="unused", max_retries=0, timeout=120),
        model,
    )


@pytest.fixture(scope="module")
def tiny(tiny_models, tmp_path_factory):
    """A tiny model under two served names, behind a key, with a pool of 256 tokens."""
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text(f"{KEY} a\n")
    server = Server(
        "--model",
        str(tiny_models["llama"]),
        "--num-pages",
        "16",
        "--page-size",
        "16",
        "--api-keys-file",
        str(keys),
        "--served-model-name",
        "tiny",
        "claude-tiny",
    )
    server.metadata = [("authorization", f"Bearer {KEY}")]
    yield server
    assert server.wait_idle().pages_referenced == 0
    assert server.stop() == 0


def _conversation(question: str) -> list[dict]:
    return [{"role": "user", "content": question}]


def _chat_message(client, model, messages, max_tokens, **kw) -> str:
    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "system", "content": SYSTEM}, *messages],
        max_tokens=max_tokens,
        temperature=0,
        **kw,
    )
    return chat.choices[0].message


def test_greedy_text_equals_chat_completions_whole_and_streamed(smol):
    server, client, oai, model = smol
    messages = _conversation("What is the capital of France?")
    answer = client.messages.create(model=model, system=SYSTEM, messages=messages, max_tokens=24, extra_body=GREEDY)
    assert answer.type == "message" and answer.role == "assistant" and answer.model == model
    assert answer.id.startswith("msg_")
    assert [b.type for b in answer.content] == ["text"]
    assert answer.content[0].text == _chat_message(oai, model, messages, 24).content
    assert answer.stop_reason in ("end_turn", "max_tokens")
    usage = answer.usage
    assert usage.output_tokens <= 24 and usage.input_tokens + usage.cache_read_input_tokens > 10

    with client.messages.stream(model=model, system=SYSTEM, messages=messages, max_tokens=24, extra_body=GREEDY) as s:
        streamed = s.get_final_message()
    assert streamed.content[0].text == answer.content[0].text
    assert streamed.stop_reason == answer.stop_reason and streamed.usage.output_tokens == usage.output_tokens
    # A repeated prompt is read from the prefix cache, and said so.
    assert streamed.usage.cache_read_input_tokens > 0
    assert streamed.usage.input_tokens + streamed.usage.cache_read_input_tokens == (
        usage.input_tokens + usage.cache_read_input_tokens
    )


def _events(server, body: dict, headers: dict | None = None) -> list[tuple[str, dict]]:
    """(event name, data) of a raw stream: what the client library hides (ping) too."""
    out, name = [], None
    with httpx.stream(
        "POST",
        server.http_url.removesuffix("/v1") + "/v1/messages",
        json={**body, "stream": True},
        headers=headers or {},
        timeout=120,
    ) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: ") :]
            elif line.startswith("data: "):
                data = json.loads(line[len("data: ") :])
                assert data["type"] == name  # each event names its data's type
                out.append((name, data))
    return out


def test_a_stream_has_every_event_in_order(smol):
    server, _, _, model = smol
    body = {"model": model, "max_tokens": 12, "messages": _conversation("Count to ten."), **GREEDY}
    events = _events(server, body)
    names = [n for n, _ in events]
    assert names[:4] == ["message_start", "ping", "content_block_start", "content_block_delta"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["input_tokens"] > 0
    text = "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta")
    assert len(text) > 0 and all(d["index"] == 0 for n, d in events if n.startswith("content_block"))
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == 12


def test_a_stop_sequence_ends_the_answer_and_is_named(smol):
    server, client, _, model = smol
    free = client.messages.create(
        model=model, max_tokens=20, messages=_conversation("Say hello to the world."), extra_body=GREEDY
    )
    text = free.content[0].text
    stop = text.split()[2]  # a word the answer does contain, after its start
    cut = client.messages.create(
        model=model,
        max_tokens=20,
        messages=_conversation("Say hello to the world."),
        stop_sequences=["@@never@@", stop],
        extra_body=GREEDY,
    )
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[: text.index(stop)]


def test_a_forced_tool_call_is_valid_for_its_schema_and_a_tool_result_round_trips(smol):
    server, client, oai, model = smol
    question = _conversation("What is the weather in Paris?")
    call = client.messages.create(
        model=model,
        max_tokens=80,
        system=SYSTEM,
        messages=question,
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
        extra_body=GREEDY,
    )
    assert call.stop_reason == "tool_use"
    (use,) = [b for b in call.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.id.startswith("toolu_")
    jsonschema.validate(use.input, WEATHER["input_schema"])

    # Streamed: the same call, its input as one input_json_delta.
    events = _events(
        server,
        {
            "model": model,
            "max_tokens": 80,
            "system": SYSTEM,
            "messages": question,
            "tools": [WEATHER],
            "tool_choice": {"type": "any"},
            **GREEDY,
        },
    )
    starts = [d["content_block"] for n, d in events if n == "content_block_start"]
    assert starts[-1]["type"] == "tool_use" and starts[-1]["name"] == "get_weather" and starts[-1]["input"] == {}
    partial = "".join(d["delta"]["partial_json"] for n, d in events if n == "content_block_delta")
    assert json.loads(partial) == use.input
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"

    # The result goes back as a tool_result block: the answer equals chat completions' for the
    # same conversation in OpenAI's terms (a tool call, then a tool message).
    result = "Sunny, 21 degrees."
    follow = client.messages.create(
        model=model,
        max_tokens=24,
        system=SYSTEM,
        messages=[
            *question,
            {"role": "assistant", "content": call.content},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": result}]},
        ],
        tools=[WEATHER],
        extra_body=GREEDY,
    )
    openai_tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": WEATHER["description"],
            "parameters": WEATHER["input_schema"],
        },
    }
    expected = _chat_message(
        oai,
        model,
        [
            *question,
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": use.id,
                        "type": "function",
                        "function": {"name": use.name, "arguments": json.dumps(use.input)},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": use.id, "content": result},
        ],
        24,
        tools=[openai_tool],
    )
    assert follow.content[0].text == expected.content and follow.stop_reason in ("end_turn", "max_tokens")


def test_count_tokens_counts_the_prompt_a_message_is_served_with(smol):
    server, client, _, model = smol
    kw = dict(model=model, system=SYSTEM, messages=_conversation("Hello there"), tools=[WEATHER])
    counted = client.messages.count_tokens(**kw).input_tokens
    served = client.messages.create(max_tokens=1, extra_body=GREEDY, **kw).usage
    assert counted == served.input_tokens + served.cache_read_input_tokens > 20
    tool = {"name": "get_weather", "description": WEATHER["description"], "parameters": WEATHER["input_schema"]}
    tokenized = httpx.post(  # vLLM's /tokenize of the same conversation in OpenAI's terms
        server.http_url.removesuffix("/v1") + "/tokenize",
        json={
            "messages": [{"role": "system", "content": SYSTEM}, *kw["messages"]],
            "tools": [{"type": "function", "function": tool}],
            "return_token_strs": True,
        },
        timeout=30,
    ).json()
    assert tokenized["count"] == counted == len(tokenized["tokens"]) == len(tokenized["token_strs"])
    assert tokenized["max_model_len"] == 8192
    text = httpx.post(
        server.http_url.removesuffix("/v1") + "/detokenize", json={"tokens": tokenized["tokens"]}, timeout=30
    ).json()["prompt"]
    assert text.startswith("<|im_start|>system") and "Hello there" in text
    assert text == "".join(tokenized["token_strs"]).replace("Ġ", " ").replace("Ċ", "\n")  # byte-level pieces


def _error(response: httpx.Response, status: int, kind: str, phrase: str) -> None:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == kind, body
    assert phrase in body["error"]["message"], body


@pytest.mark.parametrize(
    "change, phrase",
    [
        ({"max_tokens": None}, "max_tokens"),
        ({"messages": []}, "at least 1 item"),
        ({"temperature": 1.5}, "less than or equal to 1"),
        ({"frobnicate": 1}, "Extra inputs are not permitted"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "not supported"),
        ({"messages": [{"role": "assistant", "content": "Hi"}]}, "prefill is not supported"),
        ({"tool_choice": {"type": "any"}}, "needs tools"),
        ({"tools": [{**WEATHER, "type": "web_search_20250305"}]}, "tools.0.type"),
    ],
    ids=[
        "no max_tokens",
        "no messages",
        "hot",
        "unknown field",
        "image",
        "prefill",
        "any without tools",
        "server tool",
    ],
)
def test_bad_bodies_are_400_in_anthropics_shape(tiny, change, phrase):
    body = {"model": "tiny", "max_tokens": 4, "messages": _conversation("Hi")}
    body = {k: v for k, v in {**body, **change}.items() if v is not None}
    _error(_post(tiny, "/v1/messages", body), 400, "invalid_request_error", phrase)


def _post(server, path, body, key=KEY, raw=None):
    return httpx.post(
        server.http_url.removesuffix("/v1") + path,
        json=body if raw is None else None,
        content=raw,
        headers={"x-api-key": key, "content-type": "application/json"} if key else {},
        timeout=60,
    )


def test_keys_names_limits_and_errors_in_anthropics_shape(tiny):
    client = anthropic.Anthropic(base_url=tiny.http_url.removesuffix("/v1"), api_key=KEY, max_retries=0)
    body = {"model": "claude-tiny", "max_tokens": 3, "messages": _conversation("Hi"), **GREEDY}
    answer = client.messages.create(**{k: v for k, v in body.items() if k != "temperature"}, extra_body=GREEDY)
    assert answer.model == "claude-tiny"  # the name it was asked for
    assert _post(tiny, "/v1/messages", {**body, "model": "tiny"}).json()["model"] == "tiny"
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=client.base_url, api_key="wrong-0123456789", max_retries=0).messages.create(
            model="tiny", max_tokens=3, messages=_conversation("Hi")
        )
    _error(_post(tiny, "/v1/messages", body, key=None), 401, "authentication_error", "API key")
    _error(_post(tiny, "/v1/messages", {**body, "model": "claude-opus"}), 404, "not_found_error", "'claude-tiny'")
    _error(_post(tiny, "/v1/messages", None, raw=b'{"model": '), 400, "invalid_request_error", "not JSON")
    _error(_post(tiny, "/v1/messages/count_tokens", {"model": "tiny"}), 400, "invalid_request_error", "messages")
    _error(_post(tiny, "/v1/messages/nowhere", body), 404, "not_found_error", "Not Found")
    # A prompt the page pool (256 tokens) can never hold: 429, as Anthropic says "rate limit".
    huge = {**body, "messages": _conversation("hello " * 400)}
    _error(_post(tiny, "/v1/messages", huge), 429, "rate_limit_error", "whole page pool holds 256")
    # Coding agents ask for more than the context holds: served up to what it holds, and said so.
    events = _events(tiny, {**body, "max_tokens": 32000}, headers={"x-api-key": KEY})
    delta = events[-2][1]
    assert delta["delta"]["stop_reason"] == "model_context_window_exceeded"
    start = events[0][1]["message"]["usage"]
    assert start["input_tokens"] + start["cache_read_input_tokens"] + delta["usage"]["output_tokens"] == 256
    models = httpx.get(tiny.http_url + "/models", headers={"x-api-key": KEY}, timeout=10).json()
    assert [m["id"] for m in models["data"]] == ["tiny", "claude-tiny"]
