"""`/v1/messages`: Anthropic's Messages API, served as the chat completion that asks for the same
generation (common/chat_bodies.py), answered in Anthropic's shape.

- `max_tokens` is a ceiling, as Anthropic states it: one the context cannot hold (coding agents
  ask for 32k of an 8k model) runs open-ended up to the context, and ends with `stop_reason`
  `model_context_window_exceeded` where the context ran out first.
- `stop_reason`: `end_turn` (the model's end of turn, or a constraint complete), `max_tokens`,
  `stop_sequence` (with the `stop_sequence` met), `tool_use` (the answer holds calls).
- Reasoning is read apart as chat completions read it (router/api/reasoning.py) and answered as
  a `thinking` block before the text (its `signature` empty: nothing here signs it).
- Tool calls are read back as chat completions read them (openai/tools.py) and answered as
  `tool_use` blocks, their `input` the call's arguments; their ids are `toolu_` ids.
- usage: `input_tokens` counts the prompt tokens not read from the prefix cache,
  `cache_read_input_tokens` those that were.
- Streams are Anthropic's events (`event: <type>` and its JSON): `message_start`, `ping`, each
  content block's `content_block_start`, `_delta` (`thinking_delta`, `text_delta`,
  `input_json_delta`) and
  `_stop`, then `message_delta` (stop reason, and the whole usage: what the prefix cache held is
  known only once the request is scheduled, after `message_start`) and `message_stop`; a
  failure after the start is an `error` event.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from shardline.common.chat_bodies import messages_as_chat
from shardline.common.tokenizer import TextCodec
from shardline.protos import generation_pb2 as pb
from shardline.router.api.anthropic.errors import anthropic_error
from shardline.router.api.anthropic.schema import CountTokensRequest, MessageAnswer, MessagesRequest, Usage
from shardline.router.api.endpoint import Endpoint
from shardline.router.api.openai.chat import ChatAnswer, chat_requests
from shardline.router.api.openai.choices import Choices
from shardline.router.api.openai.errors import ApiError, invalid_body
from shardline.router.api.openai.schema import ChatCompletionRequest, ToolCall
from shardline.router.api.openai.tools import ToolFormat
from shardline.router.api.reasoning import ReasoningFormat
from shardline.router.core.sequence import FinishReason, Output

PREFIX = "/v1/messages"
__all__ = ["CountTokensRequest", "endpoint", "is_anthropic", "prompt_request"]


def is_anthropic(path: str) -> bool:
    return path == PREFIX or path.startswith(PREFIX + "/")


def as_chat(body: CountTokensRequest, max_tokens: int | None = None) -> ChatCompletionRequest:
    chat = messages_as_chat(body.model_dump(exclude_none=True, by_alias=True))
    if max_tokens:
        chat["max_tokens"] = max_tokens
    try:
        return ChatCompletionRequest.model_validate(chat)
    except ValueError as e:  # pydantic's: a tool choice naming no tool, ...
        raise invalid_body(e) from None


def prompt_request(body: CountTokensRequest, tool_format: ToolFormat) -> pb.GenerateRequest:
    """The prompt a Messages request would be served with (what count_tokens counts)."""
    return chat_requests(as_chat(body), tool_format)[0]


def endpoint(tool_format: ToolFormat, context_length: Callable[[], int], reasoning: ReasoningFormat | None = None):
    """`/v1/messages` (http_app.py's Endpoint). `context_length`: the served model's."""

    def requests(body: MessagesRequest) -> list[pb.GenerateRequest]:
        fits = body.max_tokens < context_length()
        return chat_requests(as_chat(body, body.max_tokens if fits else None), tool_format)

    def answer(body: MessagesRequest, choices: Choices, model: str, codec: TextCodec) -> MessagesAnswer:
        return MessagesAnswer(body, choices, model, codec, tool_format, reasoning)

    return Endpoint("chat", MessagesRequest, requests, answer)


def _thinking(text: str) -> dict:
    return {"type": "thinking", "thinking": text, "signature": ""}


def _tool_use(call: ToolCall) -> dict:
    try:
        arguments = json.loads(call.function.arguments)
    except ValueError:
        arguments = {}
    return {
        "type": "tool_use",
        "id": "toolu_" + call.id.removeprefix("call_"),
        "name": call.function.name,
        "input": arguments,
    }


class MessagesAnswer(ChatAnswer):
    id_prefix = "msg_"

    def __init__(
        self,
        request: MessagesRequest,
        choices: Choices,
        model: str,
        codec: TextCodec,
        tool_format: ToolFormat,
        reasoning: ReasoningFormat | None = None,
    ):
        super().__init__(as_chat(request, request.max_tokens), choices, model, codec, tool_format, reasoning)
        self.request = request
        self.stop_reason: str | None = None
        self.stop_sequence: str | None = None
        self._blocks = 0  # content blocks started in the stream
        self._open: str | None = None  # the kind of the block the stream writes into: thinking, text

    def _take(self, index: int, out: Output) -> tuple[str, str, list[ToolCall]]:
        reasoning, text, calls = super()._take(index, out)
        if out.finish_reason is not None:
            self.stop_sequence = out.stop
            self.stop_reason = (
                "tool_use"
                if self.readers[0].calls
                else "stop_sequence"
                if out.stop is not None
                else "max_tokens"
                if out.finish_reason is FinishReason.LENGTH
                and len(self.choices.seqs[0].output_ids) >= self.request.max_tokens
                else "model_context_window_exceeded"
                if out.finish_reason is FinishReason.LENGTH
                else "end_turn"
            )
        return reasoning, text, calls

    def _usage(self) -> Usage:
        seq = self.choices.seqs[0]
        cached = seq.cached_prompt_tokens
        return Usage(
            input_tokens=len(seq.prompt_ids) - cached, output_tokens=len(seq.output_ids), cache_read_input_tokens=cached
        )

    def _content(self) -> list[dict]:
        thinking = [_thinking(self.reasoning[0])] if self.reasoning[0] else []
        text = [{"type": "text", "text": self.text[0]}] if self.text[0] else []
        return thinking + text + [_tool_use(c) for c in self.readers[0].calls]

    def _whole(self) -> MessageAnswer:
        return MessageAnswer(
            id=self.id,
            model=self.model,
            content=self._content(),
            stop_reason=self.stop_reason,
            stop_sequence=self.stop_sequence,
            usage=self._usage(),
        )

    # -- the stream ---------------------------------------------------------------------------------
    def _event(self, event: dict) -> bytes:
        return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n".encode()

    def _error_event(self, error: ApiError) -> bytes:
        return self._event(anthropic_error(error))

    def _tail(self) -> bytes:
        return b""

    def _opening(self) -> list[dict]:
        start = MessageAnswer(
            id=self.id, model=self.model, content=[], stop_reason=None, stop_sequence=None, usage=self._usage()
        )
        return [{"type": "message_start", "message": start.model_dump()}, {"type": "ping"}]

    def _close_block(self) -> list[dict]:
        if self._open is None:
            return []
        self._open = None
        self._blocks += 1
        return [{"type": "content_block_stop", "index": self._blocks - 1}]

    def _write(self, kind: str, delta: dict) -> list[dict]:
        """A delta into the open block of `kind` (thinking, text), started here where it is not."""
        events = []
        if self._open != kind:
            events += self._close_block()
            self._open = kind
            start = _thinking("") if kind == "thinking" else {"type": "text", "text": ""}
            events.append({"type": "content_block_start", "index": self._blocks, "content_block": start})
        return [*events, {"type": "content_block_delta", "index": self._blocks, "delta": delta}]

    def _reasoning_chunks(self, index: int, delta: str) -> list[dict]:
        return self._write("thinking", {"type": "thinking_delta", "thinking": delta})

    def _chunks(self, index: int, delta: str, calls: list[ToolCall], logprobs: list) -> list[dict]:
        events = self._write("text", {"type": "text_delta", "text": delta}) if delta else []
        for call in calls:
            events += self._close_block()
            use = _tool_use(call)
            i = self._blocks
            self._blocks += 1
            events += [
                {"type": "content_block_start", "index": i, "content_block": {**use, "input": {}}},
                {
                    "type": "content_block_delta",
                    "index": i,
                    "delta": {"type": "input_json_delta", "partial_json": json.dumps(use["input"], ensure_ascii=False)},
                },
                {"type": "content_block_stop", "index": i},
            ]
        return events

    def _closing(self) -> list[dict]:
        return [
            *self._close_block(),
            {
                "type": "message_delta",
                "delta": {"stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence},
                "usage": self._usage().model_dump(),  # the cache's share is known by now
            },
            {"type": "message_stop"},
        ]
