"""`/v1/responses`: OpenAI's Responses API, served as the chat completion that asks for the same
generation (common/chat_bodies.py), answered in the Responses API's shape.

- A response is kept (response_store.py) unless its request says `store: false`; a request that
  names it in `previous_response_id` continues its conversation (an unknown one is a 404 before
  anything runs), and `GET` / `DELETE /v1/responses/{id}` read and drop it.
- `max_output_tokens` is a ceiling, as OpenAI states it: one the context cannot hold runs
  open-ended up to the context. A response that ran out of tokens is `incomplete`, reason
  `max_output_tokens`.
- `output`: the reasoning read apart as chat completions read it (router/api/reasoning.py) as a
  `reasoning` item of one `reasoning_text` part, the text as a `message` item of one
  `output_text` part, and/or the tool calls read back as chat completions read them
  (openai/tools.py) as `function_call` items.
- usage: `input_tokens` counts the whole prompt, `input_tokens_details.cached_tokens` what the
  prefix cache held; no reasoning tokens.
- Streams are the Responses API's events (`event: <type>` and its JSON, numbered by
  `sequence_number`): `response.created`, `response.in_progress`, then per output item
  `response.output_item.added`, for reasoning `response.reasoning_text.delta`s and `.done`, for
  text `response.content_part.added`,
  `response.output_text.delta`s, `response.output_text.done`, `response.content_part.done`, for
  a call one `response.function_call_arguments.delta` (a call is sent once it is whole) and
  `.done`, then `response.output_item.done`; last `response.completed` (or
  `response.incomplete`) with the whole response. A failure after the start is
  `response.failed`, the response with its `error`. No `[DONE]`.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from shardline.common.chat_bodies import responses_as_chat
from shardline.common.tokenizer import TextCodec
from shardline.protos import generation_pb2 as pb
from shardline.router.api.endpoint import Endpoint
from shardline.router.api.openai.chat import ChatAnswer, chat_requests
from shardline.router.api.openai.choices import Choices
from shardline.router.api.openai.errors import ApiError, invalid_body
from shardline.router.api.openai.response_store import ResponseStore, Stored
from shardline.router.api.openai.responses_schema import (
    InputTokensDetails,
    NamedFunction,
    OutputTokensDetails,
    Response,
    ResponsesRequest,
    Usage,
)
from shardline.router.api.openai.schema import TEMPERATURE, TOP_P, ChatCompletionRequest, TokenLogprob, ToolCall
from shardline.router.api.openai.tools import ToolFormat
from shardline.router.api.reasoning import ReasoningFormat

ERROR_CODES = {400: "invalid_prompt", 429: "rate_limit_exceeded"}  # the Response's error.code; else server_error


def not_found(response_id: str, param: str | None = None) -> ApiError:
    return ApiError(
        404,
        f"no response with id {response_id!r} is stored here (responses are kept in memory, the most recent only)",
        "not_found_error",
        param=param,
        code="response_not_found",
    )


def input_items(body: ResponsesRequest) -> list[dict]:
    """A request's input as items (a string is one user message)."""
    if isinstance(body.input, str):
        return [{"type": "message", "role": "user", "content": body.input}]
    return [item.model_dump(exclude_none=True) for item in body.input]


def as_chat(body: ResponsesRequest, history: list[dict], ceiling_fits: bool = True) -> ChatCompletionRequest:
    chat = responses_as_chat(body.model_dump(exclude_none=True, by_alias=True), history)
    if not ceiling_fits:
        chat.pop("max_tokens", None)
    try:
        return ChatCompletionRequest.model_validate(chat)
    except ValueError as e:  # pydantic's: a forced call and a text format together, ...
        raise invalid_body(e) from None


def endpoint(
    store: ResponseStore,
    tool_format: ToolFormat,
    context_length: Callable[[], int],
    reasoning: ReasoningFormat | None = None,
) -> Endpoint:
    """`/v1/responses` (http_app.py's Endpoint). `context_length`: the served model's."""

    def prepare(body: ResponsesRequest, tenant: str) -> None:
        if body.previous_response_id is not None:
            stored = store.get(tenant, body.previous_response_id)
            if stored is None:
                raise not_found(body.previous_response_id, "previous_response_id")
            body.history = stored.conversation

    def requests(body: ResponsesRequest) -> list[pb.GenerateRequest]:
        fits = body.max_output_tokens is None or body.max_output_tokens < context_length()
        return chat_requests(as_chat(body, body.history, fits), tool_format)

    def answer(body: ResponsesRequest, choices: Choices, model: str, codec: TextCodec) -> ResponsesAnswer:
        return ResponsesAnswer(body, choices, model, codec, tool_format, store, reasoning)

    return Endpoint("chat", ResponsesRequest, requests, answer, prepare)


def _function_call(call: ToolCall) -> dict:
    return {
        "type": "function_call",
        "id": "fc_" + call.id.removeprefix("call_"),
        "call_id": call.id,
        "name": call.function.name,
        "arguments": call.function.arguments,
        "status": "completed",
    }


def _delta_logprob(entry: TokenLogprob) -> dict:
    """A token's log-probability as a stream's text events write it (no bytes)."""
    top = [{"token": t.token, "logprob": t.logprob} for t in entry.top_logprobs]
    return {"token": entry.token, "logprob": entry.logprob, "top_logprobs": top}


class ResponsesAnswer(ChatAnswer):
    id_prefix = "resp_"

    def __init__(
        self,
        request: ResponsesRequest,
        choices: Choices,
        model: str,
        codec: TextCodec,
        tool_format: ToolFormat,
        store: ResponseStore,
        reasoning: ReasoningFormat | None = None,
    ):
        super().__init__(as_chat(request, request.history), choices, model, codec, tool_format, reasoning)
        self.request, self.store = request, store
        self.message_id = "msg_" + self.id.removeprefix(self.id_prefix)
        self.reasoning_id = "rs_" + self.id.removeprefix(self.id_prefix)
        self._sequence = 0  # the next event's sequence_number
        self._items = 0  # output items the stream has closed
        self._open: int | None = None  # the output index of the message the stream has open
        self._thinking: int | None = None  # the output index of the reasoning item it has open
        self._answered = False  # a message or a call has been opened

    # -- the Response -------------------------------------------------------------------------------
    def _usage(self) -> Usage:
        seq = self.choices.seqs[0]
        prompt, output = len(seq.prompt_ids), len(seq.output_ids)
        return Usage(
            input_tokens=prompt,
            input_tokens_details=InputTokensDetails(cached_tokens=seq.cached_prompt_tokens),
            output_tokens=output,
            output_tokens_details=OutputTokensDetails(reasoning_tokens=self.reasoning_tokens[0]),
            total_tokens=prompt + output,
        )

    def _status(self) -> str:
        return "incomplete" if self.finish[0] == "length" else "completed"

    def _message(self, status: str) -> dict:
        logprobs = [entry.model_dump() for entry in self.logprobs[0]]
        part = {"type": "output_text", "text": self.text[0], "annotations": [], "logprobs": logprobs}
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant", "content": [part]}

    def _reasoning_item(self, status: str) -> dict:
        content = [{"type": "reasoning_text", "text": self.reasoning[0]}]
        return {"type": "reasoning", "id": self.reasoning_id, "summary": [], "content": content, "status": status}

    def _output(self) -> list[dict]:
        calls = self.readers[0].calls
        reasoning = [self._reasoning_item(self._status())] if self.reasoning[0] else []
        message = [self._message(self._status())] if self.text[0] or not calls else []
        return reasoning + message + [_function_call(c) for c in calls]

    def _response(self, status: str, output: list[dict], usage: Usage | None, error: dict | None = None) -> Response:
        r = self.request
        text = {"format": {"type": "text"}, **(r.text.model_dump(by_alias=True, exclude_none=True) if r.text else {})}
        choice = r.tool_choice.model_dump() if isinstance(r.tool_choice, NamedFunction) else r.tool_choice or "auto"
        return Response(
            id=self.id,
            created_at=self.created,
            status=status,
            error=error,
            incomplete_details={"reason": "max_output_tokens"} if status == "incomplete" else None,
            instructions=r.instructions,
            max_output_tokens=r.max_output_tokens,
            model=self.model,
            output=output,
            parallel_tool_calls=r.parallel_tool_calls is not False,
            previous_response_id=r.previous_response_id,
            reasoning=r.reasoning.model_dump() if r.reasoning else {"effort": None, "summary": None},
            store=r.stores,
            temperature=TEMPERATURE if r.temperature is None else r.temperature,
            text=text,
            tool_choice=choice,
            tools=[t.model_dump() for t in r.tools or []],
            top_logprobs=r.top_logprobs or 0,
            top_p=TOP_P if r.top_p is None else r.top_p,
            usage=usage,
            user=r.user,
            metadata=r.metadata or {},
            prompt_cache_key=r.prompt_cache_key,
            safety_identifier=r.safety_identifier,
        )

    def _finished(self) -> Response:
        """The whole response, kept in the store where its request asked for that."""
        response = self._response(self._status(), self._output(), self._usage())
        if self.request.stores:
            data = response.model_dump()
            conversation = [*self.request.history, *input_items(self.request), *data["output"]]
            self.store.put(self.choices.tenant, Stored(data, conversation))
        return response

    def _whole(self) -> Response:
        return self._finished()

    # -- the stream ---------------------------------------------------------------------------------
    def _event(self, event: dict) -> bytes:
        event = {**event, "sequence_number": self._sequence}
        self._sequence += 1
        return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n".encode()

    def _error_event(self, error: ApiError) -> bytes:
        failure = {"code": ERROR_CODES.get(error.status, "server_error"), "message": error.body.error.message}
        return self._event(
            {"type": "response.failed", "response": self._response("failed", [], None, failure).model_dump()}
        )

    def _tail(self) -> bytes:
        return b""

    def _opening(self) -> list[dict]:
        start = self._response("in_progress", [], None).model_dump()
        return [{"type": "response.created", "response": start}, {"type": "response.in_progress", "response": start}]

    def _reasoning_chunks(self, index: int, delta: str) -> list[dict]:
        events = []
        if self._thinking is None:
            self._thinking = self._items
            item = {**self._reasoning_item("in_progress"), "content": []}
            events.append({"type": "response.output_item.added", "output_index": self._thinking, "item": item})
        at = {"item_id": self.reasoning_id, "output_index": self._thinking, "content_index": 0}
        return [*events, {"type": "response.reasoning_text.delta", **at, "delta": delta}]

    def _close_reasoning(self) -> list[dict]:
        if self._thinking is None:
            return []
        index, self._thinking = self._thinking, None
        self._items += 1
        at = {"item_id": self.reasoning_id, "output_index": index, "content_index": 0}
        return [
            {"type": "response.reasoning_text.done", **at, "text": self.reasoning[0]},
            {"type": "response.output_item.done", "output_index": index, "item": self._reasoning_item("completed")},
        ]

    def _open_message(self) -> list[dict]:
        self._answered = True
        self._open = self._items
        item = {"type": "message", "id": self.message_id, "status": "in_progress", "role": "assistant", "content": []}
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        at = {"item_id": self.message_id, "output_index": self._open, "content_index": 0}
        return [
            {"type": "response.output_item.added", "output_index": self._open, "item": item},
            {"type": "response.content_part.added", **at, "part": part},
        ]

    def _close_message(self) -> list[dict]:
        if self._open is None:
            return []
        index, self._open = self._open, None
        self._items += 1
        item = self._message(self._status())
        part = item["content"][0]
        at = {"item_id": self.message_id, "output_index": index, "content_index": 0}
        logprobs = [_delta_logprob(entry) for entry in self.logprobs[0]]
        return [
            {"type": "response.output_text.done", **at, "text": part["text"], "logprobs": logprobs},
            {"type": "response.content_part.done", **at, "part": part},
            {"type": "response.output_item.done", "output_index": index, "item": item},
        ]

    def _chunks(self, index: int, delta: str, calls: list[ToolCall], logprobs: list) -> list[dict]:
        events = self._close_reasoning() if delta or calls else []
        self._answered = self._answered or bool(calls)
        if delta:
            if self._open is None:
                events += self._open_message()
            at = {"item_id": self.message_id, "output_index": self._open, "content_index": 0}
            events.append(
                {
                    "type": "response.output_text.delta",
                    **at,
                    "delta": delta,
                    "logprobs": [_delta_logprob(entry) for entry in logprobs],
                }
            )
        for call in calls:
            events += self._close_message()
            item, at = _function_call(call), self._items
            self._items += 1
            events += [
                {
                    "type": "response.output_item.added",
                    "output_index": at,
                    "item": {**item, "arguments": "", "status": "in_progress"},
                },
                {
                    "type": "response.function_call_arguments.delta",
                    "item_id": item["id"],
                    "output_index": at,
                    "delta": item["arguments"],
                },
                {
                    "type": "response.function_call_arguments.done",
                    "item_id": item["id"],
                    "output_index": at,
                    "arguments": item["arguments"],
                },
                {"type": "response.output_item.done", "output_index": at, "item": item},
            ]
        return events

    def _closing(self) -> list[dict]:
        # An answer of no text and no call is an empty message, as the whole answer has it.
        events = self._close_reasoning()
        events += self._open_message() if not self._answered else []
        events += self._close_message()
        response = self._finished()
        return [*events, {"type": f"response.{response.status}", "response": response.model_dump()}]
