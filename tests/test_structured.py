"""Constrained decoding against live tiny-model servers: every kind of constraint holds in both
APIs; greedy constrained tokens equal transformers' with the same llguidance mask applied to its
logits (chunked and not, prefix cache hit); a constraint costs its own request only (neighbours'
tokens unchanged, a bad or slow one refused alone); tool calls in the OpenAI API, in the generic
JSON format and in a template's <tool_call> blocks, whole and streamed."""

import asyncio
import json
import re
import shutil

import grpc
import jsonschema
import openai
import pytest

from harness.client import concurrently, token_request
from harness.schemas import SCHEMAS, prompt
from shardline.protos import generation_pb2 as pb
from tests.support import Server, assert_constrained_match, hf_constrained_greedy, hf_model

PAGE = 16
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
# 2,000 properties of alternatives: compiles in well over a second, past the test servers' limit.
SLOW_SCHEMA = {
    "type": "object",
    "properties": {
        f"p{i}": {
            "anyOf": [
                {"type": "integer", "minimum": i, "maximum": i * 1000 + 7},
                {"type": "string", "format": "date-time"},
            ]
        }
        for i in range(2000)
    },
}
HERMES_TEMPLATE = """{%- if tools %}<|im_start|>system
You may call these tools:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Call one as <tool_call>
{"name": <name>, "arguments": <arguments>}
</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.tool_calls %}<|im_start|>assistant
{%- for call in message.tool_calls %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "clock",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def chunked(tiny_models):
    """Tiny llama (SmolLM2's chat template: no tool-call format), prompts in chunks of 7."""
    server = Server(
        "--model",
        str(tiny_models["llama"]),
        "--page-size",
        str(PAGE),
        "--chunk-size",
        "7",
        "--constraint-timeout-s",
        "0.4",
    )
    yield server
    assert server.stop() == 0


@pytest.fixture(scope="module")
def hermes(tiny_models, tmp_path_factory):
    """The same weights with a chat template that declares <tool_call> blocks, prompts whole."""
    folder = tmp_path_factory.mktemp("hermes") / "tiny-hermes"
    shutil.copytree(tiny_models["llama"], folder)
    (folder / "chat_template.jinja").write_text(HERMES_TEMPLATE)
    server = Server("--model", str(folder), "--page-size", str(PAGE))
    yield server
    assert server.stop() == 0


def client_of(server) -> openai.OpenAI:
    # A liveness deadline, not a speed bound: 16 constrained answers at once beside another
    # test file's servers on 2 cores took past 120 s.
    return openai.OpenAI(base_url=server.http_url, api_key="unused", max_retries=0, timeout=600)


def model_of(server) -> str:
    return server.stub.Info(pb.InfoRequest()).model


def sampled(server, seeds, **constraint) -> list[tuple[str, str]]:
    """(text, finish reason) of one temperature-1 request per seed."""
    reqs = [
        pb.GenerateRequest(
            prompt="Describe a person:",
            max_new_tokens=48,
            sampling=pb.SamplingParams(temperature=1.0, seed=s),
            **constraint,
        )
        for s in seeds
    ]
    _, streams = asyncio.run(concurrently(server.target, reqs, timeout=120))
    assert all(s.error is None for s in streams), [s.error for s in streams]
    return [(s.text, s.finish_reason) for s in streams]


# -- every kind holds --------------------------------------------------------------------------------
CHECKS = {
    "json_schema": (dict(json_schema=json.dumps(SCHEMA)), lambda t: jsonschema.validate(json.loads(t), SCHEMA)),
    "json_object": (dict(json_object=True), lambda t: isinstance(json.loads(t), dict) or pytest.fail(t)),
    "regex": (
        dict(regex=r"[0-9]{3}-[a-z]{2,4}( ok)?"),
        lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2,4}( ok)?", t) or pytest.fail(t),
    ),
    "grammar": (
        dict(grammar='start: "(" item ")" | "(" item "," item ")"\nitem: "x" | "y" | "(" ("x" | "y") ")"'),
        lambda t: re.fullmatch(r"[()xy,]+", t) and t.count("(") == t.count(")") or pytest.fail(t),
    ),
    "gbnf": (
        dict(grammar='root ::= "yes" | "no" | "maybe " [0-9]'),
        lambda t: re.fullmatch(r"yes|no|maybe [0-9]", t) or pytest.fail(t),
    ),
    "choice": (
        dict(choice=pb.Choice(options=["red", "green", "blue sky"])),
        lambda t: t in ("red", "green", "blue sky") or pytest.fail(t),
    ),
}


@pytest.mark.processes
@pytest.mark.parametrize("kind", CHECKS)
def test_every_kind_of_constraint_holds_for_every_seed(chunked, kind):
    constraint, check = CHECKS[kind]
    answers = sampled(chunked, range(8), **constraint)
    finished = [text for text, reason in answers if reason in ("stop", "eos")]  # eos: where the constraint may end
    assert finished, f"no answer finished: {answers}"
    for text in finished:
        check(text)
    assert all(reason in ("stop", "eos", "length") for _, reason in answers)
    assert chunked.wait_idle().pages_referenced == 0


# -- exactness against transformers with the same mask ----------------------------------------------
@pytest.fixture(scope="module")
def reference(tiny_models):
    model = hf_model(tiny_models["llama"])
    return lambda prompt, req, max_new: hf_constrained_greedy(model, prompt, req, max_new)


@pytest.mark.processes
@pytest.mark.parametrize("kind", ["json_schema", "grammar", "regex"])
@pytest.mark.parametrize("which", ["chunked", "hermes"], ids=["chunk-7", "chunk-off"])
def test_greedy_constrained_tokens_equal_transformers_with_the_same_mask(request, reference, which, kind):
    server = request.getfixturevalue(which)
    prompt = list(range(200, 241))  # 41 tokens: two full pages to find cached the second time
    req = token_request(prompt, 40, **CHECKS[kind][0])
    want = reference(prompt, req, 40)
    for _ in range(2):
        got, _, last = server.generate(**{f.name: v for f, v in req.ListFields()})
        assert_constrained_match(got, want)
        assert last.finish_reason in ("stop", "length") and (last.finish_reason == "length") == (len(got) == 40)
    assert last.usage.cached_prompt_tokens == 2 * PAGE


# -- isolation -----------------------------------------------------------------------------------------
@pytest.mark.processes
def test_a_constrained_request_leaves_seven_greedy_neighbours_unchanged(chunked):
    prompts = [list(range(300 + 9 * i, 320 + 9 * i)) for i in range(7)]
    alone = [chunked.generate(**{f.name: v for f, v in token_request(p, 24).ListFields()})[0] for p in prompts]
    constrained = pb.GenerateRequest(
        prompt="Tell me about yourself",
        max_new_tokens=48,
        json_schema=json.dumps(SCHEMA),
        sampling=pb.SamplingParams(temperature=1.0, seed=3),
    )
    _, streams = asyncio.run(concurrently(chunked.target, [constrained] + [token_request(p, 24) for p in prompts]))
    assert [s.ids for s in streams[1:]] == alone
    assert streams[0].error is None


@pytest.mark.processes
def test_a_constraint_that_fails_to_compile_or_takes_too_long_is_refused_alone(chunked):
    bad = {
        "json_schema": "{not json",
        "regex": "[0-9",
        "grammar": "start: missing_rule",
        "json_schema ": json.dumps({"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}),
        "slow": json.dumps(SLOW_SCHEMA),
    }
    beside = token_request(list(range(400, 420)), 60)
    alone = chunked.generate(**{f.name: v for f, v in beside.ListFields()})[0]

    async def run():
        async with grpc.aio.insecure_channel(chunked.target) as channel:
            from shardline.protos import generation_pb2_grpc

            stub = generation_pb2_grpc.GenerationStub(channel)
            neighbour = asyncio.ensure_future(_collect(stub.Generate(beside)))
            errors = {}
            for name, text in bad.items():
                field = "json_schema" if name in ("json_schema ", "slow") else name
                try:
                    await _collect(stub.Generate(pb.GenerateRequest(prompt="Hi", max_new_tokens=8, **{field: text})))
                except grpc.aio.AioRpcError as e:
                    errors[name] = (e.code(), e.details())
            return await neighbour, errors

    tokens, errors = asyncio.run(run())
    assert tokens == alone
    assert set(errors) == set(bad) and all(code == grpc.StatusCode.INVALID_ARGUMENT for code, _ in errors.values())
    assert "took over 0.4 s" in errors["slow"][1] and "unclosed" in errors["regex"][1]
    assert "missing_rule" in errors["grammar"][1] and "nowhere" in errors["json_schema "][1]
    with pytest.raises(grpc.RpcError) as refused:
        chunked.generate(prompt="Hi", max_new_tokens=8, choice=pb.Choice(options=["a", ""]))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # Text SmolLM2's tokens cannot spell (no token holds the byte 0x14): refused when it is reached.
    with pytest.raises(grpc.RpcError) as unspellable:
        chunked.generate(prompt="Hi", max_new_tokens=8, choice=pb.Choice(options=["\u00bd\u00a3\u0014;"]))
    assert unspellable.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "cannot be continued with this model's tokens" in unspellable.value.details()
    assert chunked.wait_idle().pages_referenced == 0


def test_the_compile_timeout_counts_from_the_compile_not_from_the_wait_for_a_worker(tiny_models):
    """Both workers busy with slow schemas (each abandoned at the timeout, compiling on to its
    end): an ordinary schema queued behind them still compiles, and the slow ones are refused."""
    from shardline.router.requests.constraints import Grammars
    from shardline.router.requests.validation import InvalidRequest

    tokenizer = (tiny_models["llama"] / "tokenizer.json").read_text()
    grammars = Grammars(tokenizer, 49152, [0], timeout_s=0.4)
    slow = [dict(SLOW_SCHEMA, title=f"slow {i}") for i in range(2)]

    async def run():
        await grammars.constrained(pb.GenerateRequest(regex="warm"))  # the tokenizer's build is not timed
        asks = [grammars.constrained(pb.GenerateRequest(json_schema=json.dumps(s))) for s in slow + [SCHEMA]]
        return await asyncio.gather(*asks, return_exceptions=True)

    *refused, ordinary = asyncio.run(run())
    assert all(isinstance(r, InvalidRequest) and "took over 0.4 s" in str(r) for r in refused), refused
    assert not isinstance(ordinary, BaseException), ordinary


async def _collect(call) -> list[int]:
    return [t async for msg in call for t in msg.token_ids]


# -- the OpenAI API -------------------------------------------------------------------------------------
@pytest.mark.processes
def test_response_format_and_structured_outputs_with_n_seeds_and_logprobs(chunked):
    client, model = client_of(chunked), model_of(chunked)
    answer = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "A person, as JSON"}],
        n=4,
        seed=11,
        temperature=1.0,
        max_tokens=96,
        logprobs=True,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}},
    )
    finished = [c for c in answer.choices if c.finish_reason == "stop"]
    assert finished and len({c.message.content for c in answer.choices}) > 1
    for c in finished:
        jsonschema.validate(json.loads(c.message.content), SCHEMA)
    assert sum(len(c.logprobs.content) for c in answer.choices) == answer.usage.completion_tokens
    assert all(lp.logprob <= 0 for c in answer.choices for lp in c.logprobs.content)
    again = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "A person, as JSON"}],
        n=4,
        seed=11,
        temperature=1.0,
        max_tokens=96,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}},
    )
    assert [c.message.content for c in again.choices] == [c.message.content for c in answer.choices]
    choice = client.completions.create(
        model=model,
        prompt="Pick:",
        max_tokens=8,
        temperature=1.0,
        seed=1,
        extra_body={"structured_outputs": {"choice": ["left", "right"]}},
    )
    assert choice.choices[0].text in ("left", "right") and choice.choices[0].finish_reason == "stop"
    streamed = "".join(
        chunk.choices[0].delta.content or ""
        for chunk in client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Code?"}],
            max_tokens=12,
            stream=True,
            extra_body={"structured_outputs": {"regex": "[A-Z]{2}-[0-9]{4}"}},
        )
        if chunk.choices
    )
    assert re.fullmatch(r"[A-Z]{2}-[0-9]{4}", streamed)
    obj = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "JSON"}],
        max_tokens=40,
        temperature=0,
        response_format={"type": "json_object"},
    )
    assert obj.choices[0].finish_reason == "length" or isinstance(json.loads(obj.choices[0].message.content), dict)


@pytest.mark.processes
def test_bad_constraints_over_http_are_400_in_openai_shape(chunked):
    client, model = client_of(chunked), model_of(chunked)
    cases = [
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/no"}}}},
        {"response_format": {"type": "json_schema"}},
        {"extra_body": {"structured_outputs": {"regex": "(", "choice": ["a"]}}},
        {"extra_body": {"structured_outputs": {"grammar": "start: nope"}}},
        {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nosuch"}}},
        {"tool_choice": "required"},
    ]
    for case in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4, **case
            )
        assert e.value.body["type"] == "invalid_request_error", case
    assert chunked.wait_idle().pages_referenced == 0


# -- tool calls -------------------------------------------------------------------------------------------
def _tools_ok(calls) -> None:
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


@pytest.mark.processes
@pytest.mark.parametrize("which", ["chunked", "hermes"], ids=["json-format", "tool_call-blocks"])
def test_required_and_named_tool_choices_answer_valid_calls(request, which):
    server = request.getfixturevalue(which)
    client, model = client_of(server), model_of(server)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    for seed in range(3):
        answer = client.chat.completions.create(
            model=model,
            messages=messages,
            tools=[WEATHER, CLOCK],
            tool_choice="required",
            temperature=1.0,
            seed=seed,
            max_tokens=80,
        )
        choice = answer.choices[0]
        if choice.finish_reason == "tool_calls":
            assert choice.message.content is None and choice.message.tool_calls
            _tools_ok(choice.message.tool_calls)
        else:
            assert choice.finish_reason == "length"
    named = client.chat.completions.create(
        model=model,
        messages=messages,
        tools=[WEATHER, CLOCK],
        max_tokens=80,
        tool_choice={"type": "function", "function": {"name": "clock"}},
        temperature=0,
    )
    assert named.choices[0].finish_reason == "tool_calls"
    calls = named.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["clock"]
    _tools_ok(calls)
    # The call goes back into the conversation, and the answer to it: the template renders both.
    follow = client.chat.completions.create(
        model=model,
        max_tokens=4,
        temperature=0,
        tools=[WEATHER, CLOCK],
        messages=messages
        + [
            {"role": "assistant", "content": None, "tool_calls": [c.model_dump() for c in calls]},
            {"role": "tool", "tool_call_id": calls[0].id, "content": "12:00"},
        ],
    )
    assert follow.usage.prompt_tokens > named.usage.prompt_tokens


@pytest.mark.processes
def test_tool_call_blocks_stream_as_tool_call_deltas_and_auto_allows_text_or_calls(hermes):
    client, model = client_of(hermes), model_of(hermes)
    messages = [{"role": "user", "content": "What time is it in zone 3?"}]
    without = client.chat.completions.create(model=model, messages=messages, max_tokens=1)
    with_tools = client.chat.completions.create(
        model=model, messages=messages, max_tokens=1, tools=[CLOCK], tool_choice="none"
    )
    assert with_tools.usage.prompt_tokens > without.usage.prompt_tokens, "the template renders the tools"
    calls, content, finish = {}, "", None
    for chunk in client.chat.completions.create(
        model=model,
        messages=messages,
        tools=[WEATHER, CLOCK],
        stream=True,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=1.0,
        seed=4,
        max_tokens=160,
    ):
        for c in chunk.choices:
            content += c.delta.content or ""
            for d in c.delta.tool_calls or []:
                entry = calls.setdefault(d.index, {"id": d.id, "name": d.function.name, "arguments": ""})
                entry["arguments"] += d.function.arguments or ""
            finish = c.finish_reason or finish
    assert finish == "tool_calls" and len(calls) == 1 and content == ""
    for entry in calls.values():
        schema = {"weather": WEATHER, "clock": CLOCK}[entry["name"]]["function"]["parameters"]
        jsonschema.validate(json.loads(entry["arguments"]), schema)
    kinds = set()
    for seed in range(12):
        answer = client.chat.completions.create(
            model=model,
            messages=messages,
            tools=[WEATHER, CLOCK],
            tool_choice="auto",
            temperature=1.0,
            seed=seed,
            max_tokens=60,
        )
        choice = answer.choices[0]
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls"
            _tools_ok(choice.message.tool_calls)
            kinds.add("call")
        else:
            assert not choice.message.content.startswith("<tool_call>")
            kinds.add("text")
    assert "text" in kinds
    assert hermes.wait_idle().pages_referenced == 0


# -- SmolLM2: JSON that validates -------------------------------------------------------------------
@pytest.mark.processes
@pytest.mark.smollm2
def test_smollm2_sampled_answers_to_every_schema_validate(smollm2_server):
    """harness/schemas.py's schemas, one seed each at temperature 1 (bench.structured runs many):
    every answer that finishes parses and validates, and nearly all finish."""
    client = client_of(smollm2_server)
    model = model_of(smollm2_server)

    def ask(i):
        what, schema = SCHEMAS[i]
        answer = client.chat.completions.create(
            model=model,
            messages=prompt(what),
            temperature=1.0,
            seed=i,
            max_tokens=96,
            response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}},
        )
        return schema, answer.choices[0]

    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(ask, range(len(SCHEMAS))))
    finished = [(schema, c.message.content) for schema, c in answers if c.finish_reason == "stop"]
    assert len(finished) >= len(SCHEMAS) - 3, [c.message.content for _, c in answers if c.finish_reason != "stop"]
    for schema, text in finished:
        jsonschema.validate(json.loads(text), schema, format_checker=jsonschema.FormatChecker())
