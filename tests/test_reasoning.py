"""The reading of reasoning apart from the answer (router/api/reasoning.py): what a whole text
splits into, that a text streamed in any pieces splits into the same, what a chat template says,
and chat completions' `reasoning_content` through the official client."""

import re
import shutil

import anthropic
import openai
import pytest
from hypothesis import given
from hypothesis import strategies as st

from shardline.common.tokenizer import TemplateError, TextCodec
from shardline.protos import generation_pb2 as pb
from shardline.router.api.reasoning import ReasoningFormat, ReasoningReader, reasoning_format
from tests.support import Server, smollm2_codec

THINKS, OPENED = ReasoningFormat(), ReasoningFormat(opened=True)


def _split(fmt, pieces: list[str]) -> tuple[str, str]:
    reader, reasoning, answer = ReasoningReader(fmt), "", ""
    for piece in pieces:
        r, a = reader.feed(piece)
        reasoning, answer = reasoning + r, answer + a
    r, a = reader.end()
    assert reader.reasoning == reasoning + r
    return reasoning + r, answer + a


def test_a_whole_text_splits_at_its_think_block():
    cases = [
        (THINKS, "<think>\nPlan: add.\n</think>\n\n4", ("\nPlan: add.\n", "4")),
        (THINKS, "  <think>x</think>y", ("x", "y")),  # leading whitespace before the block
        (THINKS, "4, no reasoning", ("", "4, no reasoning")),
        (THINKS, "the <think> later is text", ("", "the <think> later is text")),
        (THINKS, "<think>never closed", ("never closed", "")),  # cut off while reasoning
        (THINKS, "<think></think>\n\n\nanswer\n", ("", "answer\n")),  # only the leading newlines go
        (THINKS, "<thin", ("", "<thin")),  # ended on what only began to look like the tag
        (OPENED, "step one</think>\n\ndone", ("step one", "done")),  # the prompt opened the block
        (OPENED, "all reasoning", ("all reasoning", "")),
        (None, "<think>x</think>y", ("", "<think>x</think>y")),  # a template without <think>
    ]
    for fmt, text, want in cases:
        assert _split(fmt, [text]) == want, (fmt, text)


words = st.lists(st.sampled_from(["<think>", "</think>", "<", "</th", "think", ">", "\n", " ", "a", "b4"]), max_size=6)
# texts shaped as a model writes them (a block, then newlines and an answer), with noise in each part
texts = st.tuples(
    st.sampled_from(["", " ", "\n"]),
    st.sampled_from(["<think>", "", "<thi"]),
    words.map("".join),
    st.sampled_from(["</think>", "", "</thi"]),
    st.sampled_from(["", "\n", "\n\n"]),
    words.map("".join),
).map("".join)


@given(st.sampled_from([THINKS, OPENED, None]), texts, st.lists(st.integers(0, 40), max_size=6))
def test_any_pieces_of_a_stream_split_as_the_whole_text_does(fmt, text, cuts):
    bounds = sorted({0, len(text), *(c for c in cuts if c < len(text))})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    assert _split(fmt, pieces) == _split(fmt, [text])


# Qwen3's shape: ChatML turns, and <think> blocks, skipped where `enable_thinking` is false
TURNS = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
THINKING_TEMPLATE = (
    TURNS + "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
# the thinking variants of Qwen3-2507 and DeepSeek-R1: the prompt opens the block
OPENING_TEMPLATE = TURNS + "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"


def _model_with(template: str, tiny_models, folder):
    shutil.copytree(tiny_models["llama"], folder)
    (folder / "chat_template.jinja").write_text(template)
    return folder


def test_a_template_says_whether_its_model_reasons_and_whether_its_prompt_opens_the_block(tiny_models, tmp_path):
    found = {
        name: reasoning_format(TextCodec(_model_with(template, tiny_models, tmp_path / name)))
        for name, template in [("thinks", THINKING_TEMPLATE), ("opens", OPENING_TEMPLATE)]
    }
    assert found == {"thinks": ReasoningFormat(opened=False), "opens": ReasoningFormat(opened=True)}
    assert reasoning_format(TextCodec(tiny_models["llama"])) is None  # SmolLM2's template
    # --reasoning-parser: <think> blocks whatever the template says, or none
    assert reasoning_format(TextCodec(tiny_models["llama"]), "think") == ReasoningFormat(opened=False)
    assert reasoning_format(TextCodec(tmp_path / "opens"), "none") is None


def test_chat_template_kwargs_reach_the_template_and_may_not_set_its_own_variables(tiny_models, tmp_path):
    codec = TextCodec(_model_with(THINKING_TEMPLATE, tiny_models, tmp_path / "thinks"))
    ask = [{"role": "user", "content": "Hi"}]
    assert codec.render_chat(ask).endswith("<|im_start|>assistant\n")
    assert codec.render_chat(ask, None, {"enable_thinking": False}).endswith("assistant\n<think>\n\n</think>\n\n")
    with pytest.raises(TemplateError, match="may not set the template's own add_generation_prompt"):
        codec.render_chat(ask, None, {"add_generation_prompt": False})


@pytest.mark.processes
def test_chat_completions_answer_reasoning_as_reasoning_content_whole_and_streamed(tiny_models, tmp_path):
    """The tiny model, constrained to write a <think> block and then an answer, through the
    official client: the block's text is `reasoning_content` (message and stream deltas), the rest
    the content, the same whole and streamed."""
    server = Server(
        "--model", str(_model_with(THINKING_TEMPLATE, tiny_models, tmp_path / "thinks")), "--page-size", "16"
    )
    client = openai.OpenAI(base_url=server.http_url, api_key="unused", max_retries=0, timeout=120)
    shape = r"<think>\n[a-z]{3,8} [a-z]{3,8}\n</think>\n\n[a-z]{2,6}"
    request = dict(
        model=server.stub.Info(pb.InfoRequest()).model,
        messages=[{"role": "user", "content": "What is two and two?"}],
        temperature=0,
        max_tokens=40,
        extra_body={"structured_outputs": {"regex": shape}},
    )
    try:
        whole = client.chat.completions.create(**request)
        message = whole.choices[0].message
        deltas = [c.choices[0].delta for c in client.chat.completions.create(**request, stream=True) if c.choices]
        # Asked to skip the reasoning (vLLM's chat_template_kwargs; Anthropic's thinking disabled),
        # the template closes an empty block in the prompt, its tokens more of it
        brief = dict(model=request["model"], messages=request["messages"], max_tokens=1)
        plain = client.chat.completions.create(**brief).usage.prompt_tokens
        off = {"chat_template_kwargs": {"enable_thinking": False}}
        skipped_usage = client.chat.completions.create(**brief, extra_body=off).usage
        skipped = skipped_usage.prompt_tokens
        claude = anthropic.Anthropic(base_url=server.http_url.removesuffix("/v1"), api_key="unused", max_retries=0)
        usage = claude.messages.create(**brief, extra_body={"thinking": {"type": "disabled"}}).usage
        with pytest.raises(openai.BadRequestError, match="template's own messages"):
            client.chat.completions.create(**brief, extra_body={"chat_template_kwargs": {"messages": []}})
    finally:
        assert server.stop() == 0
    empty_block = len(smollm2_codec().encode("<think>\n\n</think>\n\n"))
    assert skipped == plain + empty_block and usage.input_tokens + usage.cache_read_input_tokens == skipped
    reasoning, answer = message.model_extra["reasoning_content"], message.content
    assert re.fullmatch(r"\n[a-z]{3,8} [a-z]{3,8}\n", reasoning) and re.fullmatch(r"[a-z]{2,6}", answer), message
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == reasoning
    assert "".join(d.content or "" for d in deltas) == answer
    first_answer = next(i for i, d in enumerate(deltas) if d.content)
    assert not any((d.model_extra or {}).get("reasoning_content") for d in deltas[first_answer:])
    # The block's tokens, its tags among them, counted apart (at least as many as its text
    # encodes to: a constrained answer may spell it in more); an answer without one has none.
    block = len(smollm2_codec().encode(f"<think>{reasoning}</think>"))
    assert block <= whole.usage.completion_tokens_details.reasoning_tokens < whole.usage.completion_tokens
    assert skipped_usage.completion_tokens_details.reasoning_tokens == 0


@pytest.mark.processes
def test_every_api_answers_the_reasoning_of_a_prompt_that_opens_its_block(tiny_models, tmp_path):
    """A template whose prompt opens the <think> block, and an answer cut off inside it: all of
    the text is reasoning, the same in chat completions' `reasoning_content`, an Anthropic
    `thinking` block and a Responses `reasoning` item, whole and through each client's stream."""
    server = Server("--model", str(_model_with(OPENING_TEMPLATE, tiny_models, tmp_path / "opens")), "--page-size", "16")
    model = server.stub.Info(pb.InfoRequest()).model
    chat = openai.OpenAI(base_url=server.http_url, api_key="unused", max_retries=0, timeout=120)
    claude = anthropic.Anthropic(base_url=server.http_url.removesuffix("/v1"), api_key="unused", max_retries=0)
    ask = [{"role": "user", "content": "What is two and two?"}]
    try:
        whole_chat = chat.chat.completions.create(model=model, messages=ask, max_tokens=12, temperature=0)
        message = whole_chat.choices[0].message
        greedy = {"temperature": 0}  # no longer a named argument of Anthropic's client: sent as older ones send it
        answer = claude.messages.create(model=model, messages=ask, max_tokens=12, extra_body=greedy)
        with claude.messages.stream(model=model, messages=ask, max_tokens=12, extra_body=greedy) as stream:
            streamed = stream.get_final_message()
        response = chat.responses.create(model=model, input=ask, max_output_tokens=12, temperature=0)
        # cut off: the stream ends with `response.incomplete` (the client's helper waits for `.completed`)
        events = list(chat.responses.create(model=model, input=ask, max_output_tokens=12, temperature=0, stream=True))
    finally:
        assert server.stop() == 0
    reasoning = message.model_extra["reasoning_content"]
    assert reasoning and message.content == ""
    assert whole_chat.usage.completion_tokens_details.reasoning_tokens == whole_chat.usage.completion_tokens == 12
    assert response.usage.output_tokens_details.reasoning_tokens == response.usage.output_tokens == 12
    for whole in (answer, streamed):
        assert [(b.type, b.thinking, b.signature) for b in whole.content] == [("thinking", reasoning, "")]
    assert events[-1].type == "response.incomplete"
    for whole in (response, events[-1].response):
        assert [item.type for item in whole.output] == ["reasoning", "message"]
        assert [part.text for part in whole.output[0].content] == [reasoning] and whole.output_text == ""
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert "".join(deltas) == reasoning and events[2].type == "response.output_item.added"
