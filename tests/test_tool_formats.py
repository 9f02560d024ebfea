"""Each family's own tool-call format, as its chat template declares it (router/api/openai/tools.py):
Llama 3.x's `{"name": ..., "parameters": {...}}` (its real template, in tests/templates), read
back into `tool_calls` whole and streamed and into Anthropic's `tool_use` blocks, with "auto"
letting the model answer text or a valid call, and the call rendered back into the conversation
as the template writes it."""

import json
import shutil
from pathlib import Path

import anthropic
import httpx
import jsonschema
import openai
import pytest

from shardline.common.tokenizer import TextCodec
from shardline.router.api.openai.tools import HERMES, LLAMA3, PLAIN, tool_format
from tests.support import Server
from tests.test_structured import CLOCK, HERMES_TEMPLATE, WEATHER, model_of

TEMPLATES = Path(__file__).parent / "templates"
LLAMA_TEMPLATE = (TEMPLATES / "llama-3.2-instruct.jinja").read_text()
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}


def test_a_template_declares_its_models_call_format(tiny_models):
    assert tool_format(LLAMA_TEMPLATE) is LLAMA3
    assert tool_format(HERMES_TEMPLATE) is HERMES
    assert tool_format(TextCodec(tiny_models["llama"]).template_source) is PLAIN  # SmolLM2's: none


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
