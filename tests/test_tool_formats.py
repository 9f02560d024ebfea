"""Each family's own tool-call format, as its chat template declares it (router/api/openai/tools.py):
Llama 3.x's `{"name": ..., "parameters": {...}}` (its real template, in tests/templates), read
back into `tool_calls` whole and streamed and into Anthropic's `tool_use` blocks, with "auto"
letting the model answer text or a valid call, and the call rendered back into the conversation
as the template writes it; Mistral's two `[TOOL_CALLS]` formats (Nemo's and Small 3.2's real
templates) read back, in any pieces, and their ids rendered as the templates take them."""

import json
import shutil
from pathlib import Path

import anthropic
import httpx
import jsonschema
import openai
import pytest

from shardline.common.tokenizer import TextCodec
from shardline.router.api.openai.tools import (
    HERMES,
    LLAMA3,
    MISTRAL_ARGS,
    MISTRAL_LIST,
    PLAIN,
    ToolCallReader,
    tool_format,
)
from tests.support import Server
from tests.test_structured import CLOCK, HERMES_TEMPLATE, WEATHER, model_of

TEMPLATES = Path(__file__).parent / "templates"
LLAMA_TEMPLATE = (TEMPLATES / "llama-3.2-instruct.jinja").read_text()
NEMO_TEMPLATE = (TEMPLATES / "mistral-nemo-instruct.jinja").read_text()
SMALL_TEMPLATE = (TEMPLATES / "mistral-small-3.2-instruct.jinja").read_text()
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}


def test_a_template_declares_its_models_call_format(tiny_models):
    assert tool_format(LLAMA_TEMPLATE) is LLAMA3
    assert tool_format(HERMES_TEMPLATE) is HERMES
    assert tool_format(TextCodec(tiny_models["llama"]).template_source) is PLAIN  # SmolLM2's: none
    assert tool_format(NEMO_TEMPLATE) is MISTRAL_LIST and tool_format(SMALL_TEMPLATE) is MISTRAL_ARGS


@pytest.mark.parametrize(
    "fmt, text, want",
    [
        (
            MISTRAL_LIST,
            '[TOOL_CALLS][{"name": "weather", "arguments": {"city": "Paris"}}, {"name": "clock", "arguments": {}}]',
            [("weather", '{"city": "Paris"}'), ("clock", "{}")],
        ),
        (
            MISTRAL_ARGS,
            '[TOOL_CALLS]weather[ARGS]{"city": "Paris"}[TOOL_CALLS]clock[CALL_ID]a1b2c3d4e[ARGS]{}',
            [("weather", '{"city": "Paris"}'), ("clock", "{}")],
        ),
        (MISTRAL_ARGS, "Sunny, I think.", "Sunny, I think."),  # text, passed through
        (MISTRAL_LIST, "[TOOL_CALLS][{broken", "[TOOL_CALLS][{broken"),  # no call: content as it is
    ],
)
def test_mistral_calls_are_read_back_in_any_pieces(fmt, text, want):
    for size in (1, 4, len(text)):
        reader, content, calls = ToolCallReader("auto", fmt), "", []
        for at in range(0, len(text), size):
            more, made = reader.feed(text[at : at + size])
            content, calls = content + more, calls + made
        more, made = reader.end()
        content, calls = content + more, calls + made
        assert (content or [(c.function.name, c.function.arguments) for c in calls]) == want, size


@pytest.fixture(scope="module")
def llama3(tiny_models, tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama3") / "tiny-llama3"
    shutil.copytree(tiny_models["llama"], folder)
    (folder / "chat_template.jinja").write_text(LLAMA_TEMPLATE)
    server = Server("--model", str(folder), "--page-size", "16")
    yield server
    assert server.stop() == 0


def _valid(name: str, arguments: str) -> None:
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


@pytest.mark.processes
def test_llama3_calls_answer_tool_calls_whole_streamed_and_as_tool_use(llama3):
    client = openai.OpenAI(base_url=llama3.http_url, api_key="unused", max_retries=0, timeout=120)
    model, messages = model_of(llama3), [{"role": "user", "content": "What is the weather in Paris?"}]
    ask = dict(model=model, messages=messages, tools=[WEATHER, CLOCK], max_tokens=80, temperature=0)
    named = client.chat.completions.create(**ask, tool_choice={"type": "function", "function": {"name": "weather"}})
    choice = named.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "weather" and call.id.startswith("call_")
    _valid("weather", call.function.arguments)

    streamed, content, finish = {}, "", None
    for chunk in client.chat.completions.create(**ask, tool_choice="required", stream=True):
        for c in chunk.choices:
            content += c.delta.content or ""
            for d in c.delta.tool_calls or []:
                entry = streamed.setdefault(d.index, {"name": d.function.name, "arguments": ""})
                entry["arguments"] += d.function.arguments or ""
            finish = c.finish_reason or finish
    assert finish == "tool_calls" and content == "" and len(streamed) == 1
    _valid(streamed[0]["name"], streamed[0]["arguments"])

    # The call and its answer go back into the conversation as the template writes them: the
    # call under "parameters", the answer as an ipython turn.
    history = [
        *messages,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
    ]
    root = llama3.http_url.removesuffix("/v1")
    ids = httpx.post(f"{root}/tokenize", json={"messages": history, "tools": [WEATHER]}, timeout=30).json()["tokens"]
    prompt = httpx.post(f"{root}/detokenize", json={"tokens": ids}, timeout=30).json()["prompt"]
    arguments = json.dumps(json.loads(call.function.arguments))
    assert '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "weather", "parameters": ' + arguments in prompt
    assert '<|start_header_id|>ipython<|end_header_id|>\n\n"sunny"<|eot_id|>' in prompt  # the template's tojson

    claude = anthropic.Anthropic(base_url=llama3.http_url.removesuffix("/v1"), api_key="unused", max_retries=0)
    tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in (WEATHER, CLOCK)]
    message = claude.messages.create(
        model=model, messages=messages, tools=tools, tool_choice={"type": "any"}, max_tokens=80
    )
    uses = [b for b in message.content if b.type == "tool_use"]
    assert message.stop_reason == "tool_use" and len(uses) == 1
    jsonschema.validate(uses[0].input, SCHEMAS[uses[0].name])


@pytest.mark.processes
def test_llama3_auto_answers_text_or_a_valid_call(llama3):
    """With "auto" the output is text that does not begin with "{", or a call: sampled over
    seeds, every answer is one or the other, and a started call is always valid."""
    client = openai.OpenAI(base_url=llama3.http_url, api_key="unused", max_retries=0, timeout=120)
    kinds = set()
    for seed in range(10):
        answer = client.chat.completions.create(
            model=model_of(llama3),
            messages=[{"role": "user", "content": "What time is it in zone 3?"}],
            tools=[WEATHER, CLOCK],
            temperature=1.0,
            seed=seed,
            max_tokens=60,
        )
        choice = answer.choices[0]
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls" and choice.message.content is None
            for call in choice.message.tool_calls:
                _valid(call.function.name, call.function.arguments)
            kinds.add("call")
        else:
            assert not choice.message.content.startswith("{")
            kinds.add("text")
    assert "text" in kinds


def test_llama3s_auto_grammar_lets_text_or_a_valid_call_through(tiny_models):
    """The grammar "auto" constrains a Llama 3 answer by (llguidance over SmolLM2's tokens): text
    that does not begin with "{", or a whole call of a given tool with valid arguments."""
    import llguidance as llg

    from shardline.router.api.openai.schema import ChatCompletionRequest
    from shardline.router.api.openai.tools import grammar

    body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "Hi"}], tools=[WEATHER, CLOCK])
    codec = TextCodec(tiny_models["llama"])
    tokenizer = llg.LLTokenizer((tiny_models["llama"] / "tokenizer.json").read_text(), n_vocab=codec.vocab_size)

    def accepts(text: str) -> bool:
        matcher = llg.LLMatcher(tokenizer, grammar(body, LLAMA3), log_level=0)
        ids = codec.encode(text)
        return matcher.validate_tokens(ids) == len(ids) and matcher.consume_tokens(ids) and matcher.is_accepting()

    assert accepts("It is noon in zone 3.")
    assert accepts('{"name": "clock", "parameters": {"zone": 3}}')
    assert not accepts('{"name": "clock", "parameters": {"zone": 99}}')  # outside its schema
    assert not accepts('{"name": "clock", "arguments": {"zone": 3}}')  # Hermes' key, not Llama's
    assert not accepts('{"zone": 3}')  # a "{" begins a call


@pytest.mark.processes
def test_mistral_nemo_calls_answer_tool_calls_and_their_ids_render_back(tiny_models, tmp_path):
    """The tiny model on Mistral Nemo's template, shaped to write its call format (its markers
    are text in SmolLM2's vocabulary, special tokens in Mistral's): a tool call, whole and
    streamed, whose id (and its tool result's) the template takes back: ids of 9 characters."""
    folder = shutil.copytree(tiny_models["llama"], tmp_path / "nemo")
    (folder / "chat_template.jinja").write_text(NEMO_TEMPLATE)
    server = Server("--model", str(folder), "--page-size", "16")
    client = openai.OpenAI(base_url=server.http_url, api_key="unused", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    shape = r'\[TOOL_CALLS\]\[\{"name": "weather", "arguments": \{"city": "[a-z]{3,8}", "unit": "celsius"\}\}\]'
    ask = dict(
        model=model_of(server),
        messages=messages,
        tools=[WEATHER],
        max_tokens=60,
        extra_body={"temperature": 0, "structured_outputs": {"regex": shape}},
    )
    try:
        choice = client.chat.completions.create(**ask).choices[0]
        streamed = [c.choices[0] for c in client.chat.completions.create(**ask, stream=True) if c.choices]
        (call,) = choice.message.tool_calls
        history = [
            *messages,
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
        ]
        root = server.http_url.removesuffix("/v1")
        tokenized = httpx.post(f"{root}/tokenize", json={"messages": history, "tools": [WEATHER]}, timeout=30)
        prompt = httpx.post(f"{root}/detokenize", json={"tokens": tokenized.json()["tokens"]}, timeout=30).json()
        answered = client.chat.completions.create(model=ask["model"], messages=history, tools=[WEATHER], max_tokens=2)
    finally:
        assert server.stop() == 0
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert call.function.name == "weather" and call.id.startswith("call_")
    _valid("weather", call.function.arguments)
    deltas = [d for s in streamed for d in s.delta.tool_calls or []]
    assert [d.function.name for d in deltas] == ["weather"] and streamed[-1].finish_reason == "tool_calls"
    # the template raises on an id of any other length than 9: both rendered as their last 9
    assert f'"id": "{call.id[-9:]}"' in prompt["prompt"] and f'"call_id": "{call.id[-9:]}"' in prompt["prompt"]
    assert answered.choices[0].finish_reason in ("length", "stop")
