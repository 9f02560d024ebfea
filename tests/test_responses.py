"""OpenAI's Responses API against a live server, with the official `openai` client and raw HTTP:
the same greedy text as chat completions for the same conversation, every stream event in
order, a JSON schema text format, a forced function call and its output round trip, a stored
conversation continued by `previous_response_id`, GET and DELETE of stored responses, and
errors in OpenAI's shape; in process, the chat body a Responses body is served as, the bodies
Codex CLI and the Agents SDK send, and the store's bound and tenants."""

import json

import httpx
import jsonschema
import openai
import pytest

from shardline.common.chat_bodies import responses_as_chat
from shardline.router.api.openai.response_store import ResponseStore, Stored
from shardline.router.api.openai.responses import as_chat
from shardline.router.api.openai.responses_schema import ResponsesRequest

SYSTEM = "You are a helpful assistant. Answer briefly."
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
    "strict": True,
}
CHAT_WEATHER = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}


@pytest.fixture(scope="module")
def smol(smollm2_server):
    client = openai.OpenAI(base_url=smollm2_server.http_url, api_key="unused", max_retries=0, timeout=120)
    return smollm2_server, client, client.models.list().data[0].id


def _chat(client, model, messages, max_tokens, **kw):
    answer = client.chat.completions.create(
        model=model,
        messages=[{"role": "system", "content": SYSTEM}, *messages],
        max_tokens=max_tokens,
        temperature=0,
        **kw,
    )
    return answer.choices[0].message, answer.usage


def _events(server, body: dict) -> list[tuple[str, dict]]:
    """(event name, data) of a raw stream, each checked to name its data's type."""
    out, name = [], None
    with httpx.stream("POST", server.http_url + "/responses", json={**body, "stream": True}, timeout=120) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: ") :]
            elif line.startswith("data: "):
                data = json.loads(line[len("data: ") :])
                assert data["type"] == name
                out.append((name, data))
    assert [d["sequence_number"] for _, d in out] == list(range(len(out)))
    return out


@pytest.mark.processes
def test_greedy_text_equals_chat_completions_whole_and_streamed(smol):
    server, client, model = smol
    question = "What is the capital of France?"
    answer = client.responses.create(
        model=model, instructions=SYSTEM, input=question, max_output_tokens=24, temperature=0
    )
    expected, usage = _chat(client, model, [{"role": "user", "content": question}], 24)
    assert answer.object == "response" and answer.id.startswith("resp_") and answer.model == model
    assert answer.output_text == expected.content
    (message,) = answer.output
    assert message.type == "message" and message.id.startswith("msg_") and message.role == "assistant"
    assert answer.status == ("incomplete" if usage.completion_tokens == 24 else "completed")
    assert answer.usage.input_tokens == usage.prompt_tokens and answer.usage.output_tokens == usage.completion_tokens
    assert answer.usage.total_tokens == usage.total_tokens and answer.usage.output_tokens_details.reasoning_tokens == 0
    assert answer.instructions == SYSTEM and answer.max_output_tokens == 24 and answer.store is True

    with client.responses.stream(
        model=model, instructions=SYSTEM, input=question, max_output_tokens=24, temperature=0
    ) as stream:
        streamed = stream.get_final_response()
    assert streamed.output_text == answer.output_text and streamed.usage.input_tokens == usage.prompt_tokens
    assert streamed.usage.input_tokens_details.cached_tokens > 0  # the same prompt, read from the prefix cache

    # Every event, in order; the whole response last. Short, so that the model runs out of tokens.
    events = _events(server, {"model": model, "input": "Count to ten.", "max_output_tokens": 6, "temperature": 0})
    names = [n for n, _ in events]
    assert names[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert names[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert set(names[4:-4]) == {"response.output_text.delta"}
    assert events[0][1]["response"]["status"] == "in_progress" and events[0][1]["response"]["output"] == []
    text = "".join(d["delta"] for n, d in events if n == "response.output_text.delta")
    last = events[-1][1]["response"]
    assert last["status"] == "incomplete" and last["incomplete_details"] == {"reason": "max_output_tokens"}
    assert last["output"][0]["content"][0]["text"] == text == events[-4][1]["text"]
    assert last["usage"]["output_tokens"] == 6


@pytest.mark.processes
def test_a_json_schema_text_format_is_followed(smol):
    _, client, model = smol
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
        "required": ["city", "population"],
        "additionalProperties": False,
    }
    answer = client.responses.create(
        model=model,
        input="Name a large city and its population.",
        text={"format": {"type": "json_schema", "name": "city", "schema": schema, "strict": True}},
        max_output_tokens=60,
        temperature=0,
    )
    assert answer.status == "completed"
    jsonschema.validate(json.loads(answer.output_text), schema)
    assert answer.text.format.type == "json_schema"


@pytest.mark.processes
def test_a_forced_function_call_and_its_output_round_trip(smol):
    server, client, model = smol
    question = "What is the weather in Paris?"
    kw = dict(model=model, instructions=SYSTEM, tools=[WEATHER], max_output_tokens=80, temperature=0)
    call = client.responses.create(input=question, tool_choice={"type": "function", "name": "get_weather"}, **kw)
    (item,) = call.output
    assert item.type == "function_call" and item.name == "get_weather" and item.status == "completed"
    assert item.id.startswith("fc_") and item.call_id.startswith("call_")
    jsonschema.validate(json.loads(item.arguments), WEATHER["parameters"])

    # Streamed: the same call, its arguments in one delta.
    events = _events(server, {**kw, "input": question, "tool_choice": "required"})
    names = [n for n, _ in events]
    assert names == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert json.loads(events[3][1]["delta"]) == json.loads(item.arguments) == json.loads(events[4][1]["arguments"])

    # The output goes back as a function_call_output item of a request continuing the stored
    # conversation: the answer is chat completions' for the whole conversation.
    result = "Sunny, 21 degrees."
    follow = client.responses.create(
        previous_response_id=call.id,
        input=[{"type": "function_call_output", "call_id": item.call_id, "output": result}],
        **{**kw, "max_output_tokens": 24},
    )
    assert follow.previous_response_id == call.id
    tool_call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
    expected, usage = _chat(
        client,
        model,
        [
            {"role": "user", "content": question},
            {"role": "assistant", "content": "", "tool_calls": [tool_call]},
            {"role": "tool", "tool_call_id": item.call_id, "content": result},
        ],
        24,
        tools=[CHAT_WEATHER],
    )
    assert follow.output_text == expected.content and follow.usage.input_tokens == usage.prompt_tokens


@pytest.mark.processes
def test_previous_response_id_continues_the_stored_conversation(smol):
    _, client, model = smol
    first = client.responses.create(
        model=model, instructions=SYSTEM, input="Name a color.", max_output_tokens=12, temperature=0
    )
    second = client.responses.create(
        model=model,
        instructions=SYSTEM,
        previous_response_id=first.id,
        input=[{"role": "user", "content": "And another one?"}],
        max_output_tokens=12,
        temperature=0,
    )
    expected, usage = _chat(
        client,
        model,
        [
            {"role": "user", "content": "Name a color."},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "And another one?"},
        ],
        12,
    )
    assert second.usage.input_tokens == usage.prompt_tokens  # the same prompt
    assert second.output_text == expected.content


@pytest.mark.processes
def test_stored_responses_are_read_and_deleted_and_store_false_keeps_none(smol):
    server, client, model = smol
    kept = client.responses.create(model=model, input="Hi", max_output_tokens=2, temperature=0)
    assert client.responses.retrieve(kept.id).model_dump() == kept.model_dump()
    deleted = httpx.delete(f"{server.http_url}/responses/{kept.id}", timeout=30).json()
    assert deleted == {"id": kept.id, "object": "response", "deleted": True}
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(kept.id)

    unkept = client.responses.create(model=model, input="Hi", max_output_tokens=2, temperature=0, store=False)
    assert unkept.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unkept.id)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=model, input="Hi", previous_response_id=unkept.id, max_output_tokens=2)
    assert e.value.body["param"] == "previous_response_id" and unkept.id in e.value.body["message"]


@pytest.mark.processes
@pytest.mark.parametrize(
    "change, param, phrase",
    [
        ({"frobnicate": 1}, "frobnicate", "Extra inputs are not permitted"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, None, "reads text"),
        ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input.0", "does not match"),
        ({"tool_choice": "required"}, None, "needs tools"),
        ({"tools": [{"type": "web_search"}]}, "tools.0.type", "'function'"),
        ({"truncation": "auto"}, "truncation", "not supported"),
        ({"temperature": 3}, "temperature", "less than or equal to 2"),
    ],
    ids=["unknown field", "image", "hosted tool item", "required without tools", "hosted tool", "truncation", "hot"],
)
def test_bad_bodies_are_400_in_openais_shape(smol, change, param, phrase):
    server, _, model = smol
    response = httpx.post(server.http_url + "/responses", json={"model": model, "input": "Hi", **change}, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and phrase in error["message"], error
    assert param is None or error["param"] == param


@pytest.mark.processes
def test_an_unknown_model_is_404_in_openais_shape(smol):
    _, client, _ = smol
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model="gpt-9", input="Hi")
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"


def test_the_store_keeps_the_most_recent_and_a_tenant_reads_its_own():
    store = ResponseStore(size=2)
    for i in range(3):
        store.put("a", Stored({"id": f"resp_{i}"}, []))
    assert store.get("a", "resp_0") is None and store.get("a", "resp_1") is not None
    store.put("a", Stored({"id": "resp_3"}, []))  # resp_1 was used since resp_2: resp_2 goes
    assert store.get("a", "resp_2") is None and store.get("a", "resp_1") is not None
    assert store.get("b", "resp_1") is None and not store.delete("b", "resp_1")
    assert store.delete("a", "resp_1") and store.get("a", "resp_1") is None


def test_a_body_and_its_history_as_the_chat_body_that_asks_for_the_same_generation():
    history = [
        {"role": "user", "content": "Weather in Paris?"},  # the short form of a message
        {"type": "reasoning", "id": "rs_1", "summary": []},  # left out of the prompt
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me look."}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
    ]
    body = {
        "model": "m",
        "instructions": "Be brief.",
        "input": [{"type": "function_call_output", "call_id": "call_1", "output": "Sunny."}],
        "tools": [WEATHER],
        "tool_choice": {"type": "function", "name": "get_weather"},
        "parallel_tool_calls": False,
        "text": {"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}, "strict": True}},
        "max_output_tokens": 9,
    }
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    assert responses_as_chat(body, history) == {
        "model": "m",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "Let me look.", "tool_calls": [call]},  # one answer, text and call
            {"role": "tool", "tool_call_id": "call_1", "content": "Sunny."},
        ],
        "stream": False,
        "max_tokens": 9,
        "tools": [CHAT_WEATHER],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "parallel_tool_calls": False,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "w", "schema": {"type": "object"}, "strict": True},
        },
    }
    assert responses_as_chat({"model": "m", "input": "Hi"}, [])["messages"] == [{"role": "user", "content": "Hi"}]


def test_what_codex_and_the_agents_sdk_send_is_accepted():
    codex = {  # Codex CLI's request (codex-rs ResponsesApiRequest), store off, nothing to reason with
        "model": "m",
        "instructions": "You are Codex.",
        "input": [
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "<permissions>"}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "List files."}]},
            {"type": "reasoning", "summary": [], "content": None, "encrypted_content": None},
            {"type": "function_call", "name": "shell", "arguments": '{"command": ["ls"]}', "call_id": "call_1"},
            {"type": "function_call_output", "call_id": "call_1", "output": "README.md"},
        ],
        "tools": [{"type": "function", "name": "shell", "description": "Runs", "strict": False, "parameters": {}}],
        "tool_choice": "auto",
        "parallel_tool_calls": False,
        "reasoning": None,
        "store": False,
        "stream": True,
        "include": [],
        "prompt_cache_key": "0199-thread",
        "text": {"verbosity": "medium"},
        "client_metadata": {"x-codex-turn": "1"},
    }
    agents = {  # the Agents SDK's, continuing its own stored response with the items it got back
        "model": "m",
        "previous_response_id": "resp_1",
        "input": [
            {
                "id": "msg_1",
                "type": "message",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": "Hi", "annotations": [], "logprobs": []}],
            },
            {"role": "user", "content": "More?"},
        ],
        "include": ["reasoning.encrypted_content"],
        "truncation": "disabled",
        "metadata": {"run": "7"},
        "top_logprobs": 0,
        "service_tier": "auto",
        "prompt_cache_retention": "in_memory",
    }
    for body in (codex, agents):
        ResponsesRequest.model_validate(body)
        as_chat(ResponsesRequest.model_validate(body), [])  # and the chat body it is served as
