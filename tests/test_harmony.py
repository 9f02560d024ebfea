"""gpt-oss's harmony messages read back (router/api/harmony.py): what a whole text splits into
(analysis as reasoning, final and preambles as the answer, commentary to functions.NAME as
calls), that a text streamed in any pieces splits into the same, and through the official
clients a model on gpt-oss's own chat template (tests/templates/gpt-oss.jinja, llama.cpp's copy)
answering reasoning apart and calls as calls in chat completions, Anthropic Messages and the
Responses API, whole and streamed."""

import json
import re
import shutil
from pathlib import Path

import anthropic
import openai
import pytest
from hypothesis import given
from hypothesis import strategies as st

from shardline.common.tokenizer import TextCodec
from shardline.protos import generation_pb2 as pb
from shardline.router.api.harmony import HarmonyReader
from shardline.router.api.reasoning import ReasoningFormat, reasoning_format
from tests.support import Server

TEMPLATE = Path(__file__).parent / "templates" / "gpt-oss.jinja"


def _split(pieces: list[str]) -> tuple[str, str, list[tuple[str, str]]]:
    reader, reasoning, answer, calls = HarmonyReader(), "", "", []
    for i, piece in enumerate(pieces):
        r, a, c = reader.read(piece, final=i == len(pieces) - 1)
        reasoning, answer, calls = reasoning + r, answer + a, calls + c
    assert reader.calls == calls
    return reasoning, answer, [(c.function.name, c.function.arguments) for c in calls]


ANALYSIS = "<|channel|>analysis<|message|>User asks 2+2. <easy>.<|end|>"
CALL = '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}'
CASES = [
    (
        ANALYSIS + "<|start|>assistant<|channel|>final<|message|>4 < 5, so: 4.",
        ("User asks 2+2. <easy>.", "4 < 5, so: 4.", []),
    ),
    (ANALYSIS + CALL, ("User asks 2+2. <easy>.", "", [("get_weather", '{"city": "Paris"}')])),
    # as the template writes a call: the recipient first; a preamble to the user, then two calls
    (
        "<|channel|>commentary<|message|>Checking.<|end|>"
        "<|start|>assistant to=functions.a<|channel|>commentary json<|message|>{}<|call|>"
        '<|start|>assistant to=functions.b<|channel|>commentary json<|message|>{"x": 1}',
        ("", "Checking.", [("a", "{}"), ("b", '{"x": 1}')]),
    ),
    ("<|channel|>analysis<|message|>cut off while thinking", ("cut off while thinking", "", [])),
    ("Plain text, no harmony <|here|>", ("", "Plain text, no harmony <|here|>", [])),
    ("<|chan", ("", "", [])),  # a header cut off: nothing to show
    ("<|channel|>final<|message|>ends on <|", ("", "ends on <|", [])),  # what only began to look like a marker
]


def test_a_whole_text_splits_into_its_messages():
    for text, want in CASES:
        assert _split([text]) == want, text


@given(st.sampled_from([text for text, _ in CASES]), st.lists(st.integers(0, 200), max_size=8))
def test_any_pieces_of_a_stream_split_as_the_whole_text_does(text, cuts):
    bounds = sorted({0, len(text), *(c for c in cuts if c < len(text))})
    assert _split([text[a:b] for a, b in zip(bounds, bounds[1:])]) == _split([text])


def test_a_harmony_template_keeps_its_markers_in_the_text_and_ends_turns_at_return_and_call(tiny_models, tmp_path):
    folder = shutil.copytree(tiny_models["llama"], tmp_path / "harmony")
    plain = TextCodec(folder)
    (folder / "chat_template.jinja").write_text(TEMPLATE.read_text())
    codec = TextCodec(folder)
    assert codec.harmony and not plain.harmony
    assert reasoning_format(codec) == ReasoningFormat(harmony=True)
    assert reasoning_format(codec, "think") == ReasoningFormat(opened=False)  # --reasoning-parser think
    assert codec.end_token_ids == plain.end_token_ids  # SmolLM2's vocabulary has no <|return|> or <|call|>
    prompt = codec.render_chat([{"role": "user", "content": "Hi"}])
    assert prompt.endswith("<|start|>user<|message|>Hi<|end|><|start|>assistant")


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
WORD = "[a-z]{3,8}"
ANSWERS = (
    rf"<\|channel\|>analysis<\|message\|>{WORD} {WORD}<\|end\|><\|start\|>assistant"
    rf"<\|channel\|>final<\|message\|>{WORD}"
)
CALLS = (
    rf"<\|channel\|>analysis<\|message\|>{WORD}<\|end\|><\|start\|>assistant<\|channel\|>commentary "
    rf'to=functions\.get_weather <\|constrain\|>json<\|message\|>\{{"city": "{WORD}"\}}'
)


@pytest.mark.processes
def test_every_api_reads_harmonys_reasoning_and_calls_whole_and_streamed(tiny_models, tmp_path):
    """The tiny model on gpt-oss's template, constrained to write harmony messages (its markers
    are text in SmolLM2's vocabulary, special tokens in gpt-oss's): an analysis message then a
    final one, or then a call."""
    folder = shutil.copytree(tiny_models["llama"], tmp_path / "harmony")
    (folder / "chat_template.jinja").write_text(TEMPLATE.read_text())
    server = Server("--model", str(folder), "--page-size", "16")
    model = server.stub.Info(pb.InfoRequest()).model
    chat = openai.OpenAI(base_url=server.http_url, api_key="unused", max_retries=0, timeout=120)
    claude = anthropic.Anthropic(base_url=server.http_url.removesuffix("/v1"), api_key="unused", max_retries=0)
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]

    def shaped(regex: str) -> dict:
        return {"temperature": 0, "structured_outputs": {"regex": regex}}

    try:
        request = dict(model=model, messages=ask, max_tokens=60, extra_body=shaped(ANSWERS))
        answer = chat.chat.completions.create(**request).choices[0]
        deltas = [c.choices[0].delta for c in chat.chat.completions.create(**request, stream=True) if c.choices]
        calling = dict(model=model, messages=ask, max_tokens=60, tools=TOOLS, extra_body=shaped(CALLS))
        called = chat.chat.completions.create(**calling).choices[0]
        streamed = [c.choices[0] for c in chat.chat.completions.create(**calling, stream=True) if c.choices]
        thought = claude.messages.create(model=model, messages=ask, max_tokens=60, extra_body=shaped(ANSWERS))
        used = claude.messages.create(
            model=model,
            messages=ask,
            max_tokens=60,
            tools=[
                {
                    "name": "get_weather",
                    "description": "The weather in a city",
                    "input_schema": TOOLS[0]["function"]["parameters"],
                }
            ],
            extra_body=shaped(CALLS),
        )
        response = chat.responses.create(model=model, input=ask, max_output_tokens=60, extra_body=shaped(ANSWERS))
    finally:
        assert server.stop() == 0
    message = answer.message
    reasoning = message.model_extra["reasoning_content"]
    assert re.fullmatch(f"{WORD} {WORD}", reasoning) and re.fullmatch(WORD, message.content), message
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == reasoning
    assert "".join(d.content or "" for d in deltas) == message.content and answer.finish_reason == "stop"

    assert called.finish_reason == "tool_calls" and called.message.content is None
    [call] = called.message.tool_calls
    assert call.function.name == "get_weather" and re.fullmatch(WORD, json.loads(call.function.arguments)["city"])
    assert re.fullmatch(WORD, called.message.model_extra["reasoning_content"])
    streamed_calls = [c for s in streamed for c in s.delta.tool_calls or []]
    assert [(c.function.name, c.function.arguments) for c in streamed_calls] == [
        ("get_weather", call.function.arguments)
    ]
    assert streamed[-1].finish_reason == "tool_calls"

    assert [b.type for b in thought.content] == ["thinking", "text"] and thought.content[0].thinking == reasoning
    assert thought.content[1].text == message.content
    assert [b.type for b in used.content] == ["thinking", "tool_use"] and used.stop_reason == "tool_use"
    assert used.content[1].name == "get_weather" and used.content[1].input == json.loads(call.function.arguments)

    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.output[0].content[0].text == reasoning and response.output_text == message.content
