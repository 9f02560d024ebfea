"""The OpenAI-compatible HTTP API (`/v1/chat/completions`, `/v1/completions`, `/v1/models`,
`/health`): a second front end of the replica's admission (router/admission.py), beside the gRPC
one, on the router's event loop (FastAPI on uvicorn, common/http_server.py).

- Streams are server-sent events: one chunk per output of the engine (a step's text delta),
  `finish_reason` in each choice's last content chunk, with `stream_options.include_usage` a last
  chunk of usage and no choices, then `data: [DONE]`. An error after the stream started ends it
  with an error event, then `[DONE]`.
- Errors have OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, and the status of
  what the gRPC API answers: INVALID_ARGUMENT 400, UNAUTHENTICATED 401, NOT_FOUND 404, a body
  over the limit 413, RESOURCE_EXHAUSTED 429, UNAVAILABLE 503 (not serving, or draining),
  INTERNAL 500.
- A client that disconnects cancels its request at the next step; its pages go back.
- API keys as `Authorization: Bearer KEY`, with the same tenants and limits; a W3C
  `traceparent` header continues the client's trace as gRPC metadata does.
- Log-probabilities are those of the model's raw distribution (before temperature, top-k and
  top-p), as in the gRPC API: chat's `logprobs.content[]`, text completions' legacy format.
- `response_format` (json_object, json_schema) and vLLM's `structured_outputs` (json, regex,
  grammar, choice) become the request's constraint (router/constraints.py); `tools` and
  `tool_choice` become a grammar and are read back as `tool_calls` (router/openai_tools.py).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from opentelemetry.trace import Status, StatusCode
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException

from shardline.router.admission import Admission
from shardline.common.auth import NO_TENANT, ApiKeys
from shardline.router import openai_tools
from shardline.router.openai_choices import Choices, generate_requests, running
from shardline.router.openai_schema import (ChatChoice, ChatChunkChoice, ChatCompletion, ChatCompletionChunk,
                                  ChatCompletionRequest, ChatLogprobs, ChatMessage, Completion, CompletionChoice,
                                  CompletionLogprobs, CompletionRequest, Delta, Error, ErrorResponse, Model, ModelList,
                                  PromptTokensDetails, TokenLogprob, ToolCall, TopLogprob, Usage)
from shardline.router.openai_tools import ToolCallReader, declares_calls
from shardline.router.replica import Replica
from shardline.router.sequence import FinishReason, Output
from shardline.router.tracing import Tracing, request_attributes
from shardline.router.validation import InvalidRequest

log = logging.getLogger(__name__)
MAX_BODY_BYTES = 4 << 20   # as gRPC's default message limit
FINISH = {FinishReason.STOP: "stop", FinishReason.EOS: "stop", FinishReason.LENGTH: "length",
          FinishReason.CANCELLED: "abort"}  # vLLM's word for a request cancelled on the server
HTTP_STATUS = {"INVALID_ARGUMENT": (400, "invalid_request_error"), "UNAUTHENTICATED": (401, "authentication_error"),
               "NOT_FOUND": (404, "not_found_error"), "ALREADY_EXISTS": (409, "conflict_error"),
               "RESOURCE_EXHAUSTED": (429, "rate_limit_error"), "UNAVAILABLE": (503, "service_unavailable_error"),
               "INTERNAL": (500, "server_error")}


class ApiError(Exception):
    def __init__(self, status: int, message: str, type: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.body = status, ErrorResponse(error=Error(message=message, type=type, param=param, code=code))

    @classmethod
    def of(cls, code: str, message: str) -> "ApiError":
        """The error a gRPC status code (its name) stands for."""
        status, type_ = HTTP_STATUS.get(code, (500, "server_error"))
        return cls(status, message, type_, code=code.lower())


def _invalid(e: ValidationError) -> ApiError:
    first = e.errors()[0]
    # A union's members name themselves in the location (prompt.str, prompt.list[int].0): not fields.
    param = ".".join(str(part) for part in first["loc"] if isinstance(part, int) or re.fullmatch(r"[a-z_]+", part)
                     and part not in ("str", "int", "float", "bool", "list", "dict", "none")) or None
    message = first["msg"].removeprefix("Value error, ")
    return ApiError(400, f"{param}: {message}" if param and not message.startswith(param) else message,
                    "invalid_request_error", param=param)


async def _body(request: Request) -> dict:
    """The request's JSON object, of at most MAX_BODY_BYTES. An oversized body is read on (up
    to 8 times the limit, then the connection is dropped), so that its client gets to read the
    413 instead of a connection reset in the middle of sending."""
    data, received = bytearray(), 0
    async for part in request.stream():
        received += len(part)
        if received <= MAX_BODY_BYTES:
            data += part
        elif received > 8 * MAX_BODY_BYTES:
            break
    if received > MAX_BODY_BYTES:
        raise ApiError(413, f"the request body is over {MAX_BODY_BYTES} bytes", "invalid_request_error")
    try:
        body = json.loads(data)
    except (ValueError, RecursionError) as e:
        raise ApiError(400, f"the request body is not JSON: {e}", "invalid_request_error") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", "invalid_request_error")
    return body


def _json(model: BaseModel) -> str:
    """As OpenAI writes its bodies: every field, null where there is no value."""
    return model.model_dump_json()


def _sse(data: str) -> bytes:
    return f"data: {data}\n\n".encode()


class OpenAiApi:
    def __init__(self, replica: Replica, admission: Admission, tracing: Tracing | None = None,
                 keys: ApiKeys | None = None):
        self.replica, self.admission, self.tracing, self.keys = replica, admission, tracing, keys
        self.created = int(time.time())
        self.tool_blocks = declares_calls(replica.codec.template_source)  # the model writes <tool_call> blocks
        self.app = FastAPI(title="Shardline", docs_url=None, redoc_url=None, openapi_url=None)
        self.app.add_exception_handler(ApiError, self._error)
        self.app.add_exception_handler(HTTPException, self._http_error)
        self.app.add_exception_handler(Exception, self._internal)
        self.app.get("/health")(self.health)
        self.app.get("/v1/models")(self.models)
        self.app.post("/v1/chat/completions")(self.chat_completions)
        self.app.post("/v1/completions")(self.completions)

    # -- errors -----------------------------------------------------------------------------------
    @staticmethod
    async def _error(request: Request, e: ApiError) -> JSONResponse:
        return JSONResponse(e.body.model_dump(), status_code=e.status)

    @staticmethod
    async def _http_error(request: Request, e: HTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(ErrorResponse(error=Error(message=str(e.detail), type=kind)).model_dump(),
                            status_code=e.status_code)

    @staticmethod
    async def _internal(request: Request, e: Exception) -> JSONResponse:
        log.error("the HTTP API failed on %s", request.url.path, exc_info=e)
        return JSONResponse(ErrorResponse(error=Error(message=f"internal error ({type(e).__name__}); the server's log "
                                                      "has the details", type="server_error")).model_dump(),
                            status_code=500)

    # -- requests ---------------------------------------------------------------------------------
    def _tenant(self, request: Request) -> str:
        if self.keys is None:
            return NO_TENANT
        tenant = self.keys.tenant([("authorization", request.headers.get("authorization", ""))])
        if tenant is None:
            raise ApiError(401, "a valid API key is required: send 'Authorization: Bearer <key>'",
                           "authentication_error", code="invalid_api_key")
        return tenant

    def _model(self) -> str:
        if self.replica.info is None:
            raise ApiError.of("UNAVAILABLE", f"not connected: {self.replica.down_reason}")
        return self.replica.info.model

    async def health(self) -> Response:
        serving = self.replica.serving and self.replica.accepting
        return Response(status_code=200 if serving else 503)

    async def models(self, request: Request) -> JSONResponse:
        self._tenant(request)
        return JSONResponse(ModelList(data=[Model(id=self._model(), created=self.created)]).model_dump())

    async def chat_completions(self, request: Request) -> Response:
        return await self._complete(request, ChatCompletionRequest, chat=True)

    async def completions(self, request: Request) -> Response:
        return await self._complete(request, CompletionRequest, chat=False)

    async def _complete(self, request: Request, schema: type, chat: bool) -> Response:
        tenant = self._tenant(request)
        span = None
        if self.tracing is not None:  # as the gRPC API: refused requests have a span too
            span = self.tracing.request_span(request.headers.items(), "chat" if chat else "text_completion", {})
        try:
            body, choices = await self._start(request, schema, tenant, span, chat)
        except ApiError as e:
            if span is not None:
                span.set_status(Status(StatusCode.ERROR, e.body.error.message))
                span.end()
            raise
        answer = Answer(self, body, choices, chat)
        if body.stream:
            return _Stream(answer)
        return Response(await answer.whole(request), media_type="application/json")

    async def _start(self, request: Request, schema: type, tenant: str, span, chat: bool) -> tuple:
        try:
            body = schema.model_validate(await _body(request))
        except ValidationError as e:
            raise _invalid(e) from None
        model = self._model()
        if body.model != model:
            raise ApiError(404, f"the model {body.model!r} does not exist; this server serves {model!r}",
                           "not_found_error", param="model", code="model_not_found")
        try:
            reqs = generate_requests(body, openai_tools.grammar(body, self.tool_blocks) if chat else None)
        except ValueError as e:  # what protobuf cannot carry: a lone surrogate, an int past its field
            raise ApiError(400, f"the request cannot be served: {e}", "invalid_request_error") from None
        if span is not None:
            span.set_attributes({**request_attributes(reqs[0])[1], "gen_ai.request.stream": body.stream})
        choices = Choices(self.admission, reqs, tenant, span, self.tracing.tracer if self.tracing else None)
        try:
            await choices.start()
        except InvalidRequest as e:
            raise ApiError.of(e.code.name, str(e)) from None
        if span is not None:
            span.set_attribute("gen_ai.response.id", choices.seqs[0].request_id)
        return body, choices


class _Stream(StreamingResponse):
    """An answer's server-sent events, and its release however the response ends: also when the
    client left before the first event (Starlette then cancels the response before it iterates)."""

    def __init__(self, answer: "Answer"):
        super().__init__(answer.stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.answer = answer

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
            self.answer.close()


class Answer:
    """One request's answer, streamed or whole, from its choices' outputs."""

    def __init__(self, api: OpenAiApi, body, choices: Choices, chat: bool):
        self.api, self.body, self.choices, self.chat = api, body, choices, chat
        self.model = api.replica.info.model
        self.id = ("chatcmpl-" if chat else "cmpl-") + (body.request_id or choices.seqs[0].request_id)
        self.created = int(time.time())
        n = len(choices.reqs)
        self.text = [""] * n
        self.finish: list[str | None] = [None] * n
        self.logprobs = [[] for _ in range(n)]   # chat: TokenLogprob; completions: (token, logprob, top, offset)
        self.offsets = [0] * n                   # completions: where the next token's text begins
        self.codec = api.replica.codec
        blocks = api.tool_blocks
        kind = openai_tools.mode(body, blocks) if chat else None
        self.readers = [ToolCallReader(kind, blocks) for _ in range(n)]
        self._closed = False

    def _take(self, index: int, out: Output) -> tuple[str, list[ToolCall]]:
        """Records an output; returns its content delta and the tool calls it completed."""
        for entry in out.logprobs:
            self.logprobs[index].append(self._logprob(index, entry))
        reader = self.readers[index]
        text, calls = reader.feed(out.text)
        if out.finish_reason:
            rest, more = reader.end()
            text, calls = text + rest, calls + more
            self.finish[index] = FINISH[out.finish_reason]
            if reader.calls and self.finish[index] == "stop":
                self.finish[index] = "tool_calls"
        self.text[index] += text
        return text, calls

    def _logprob(self, index: int, entry):
        token = self.codec.token_text(entry.token_id)
        if self.chat:
            return TokenLogprob(token=token, logprob=entry.logprob, bytes=list(self.codec.token_bytes(entry.token_id)),
                                top_logprobs=[TopLogprob(token=self.codec.token_text(t), logprob=v,
                                                         bytes=list(self.codec.token_bytes(t)))
                                              for t, v in zip(entry.top_ids, entry.top_logprobs)])
        offset, self.offsets[index] = self.offsets[index], self.offsets[index] + len(token)
        return token, entry.logprob, {self.codec.token_text(t): v for t, v in zip(entry.top_ids, entry.top_logprobs)}, offset

    def _choice_logprobs(self, entries: list):
        if not self.choices.reqs[0].HasField("logprobs"):
            return None
        if self.chat:
            return ChatLogprobs(content=entries)
        return CompletionLogprobs(tokens=[e[0] for e in entries], token_logprobs=[e[1] for e in entries],
                                  top_logprobs=[e[2] for e in entries], text_offset=[e[3] for e in entries])

    def _usage(self) -> Usage:
        seqs = self.choices.seqs
        prompt, completion = len(seqs[0].prompt_ids), sum(len(s.output_ids) for s in seqs)
        return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=seqs[0].cached_prompt_tokens))

    async def _outputs(self) -> AsyncIterator[tuple[int, Output]]:
        """The choices' outputs until all ended; a failure raises ApiError."""
        async with running(self.choices) as outputs:
            async for index, out in outputs:
                if out.failure is not None:
                    raise ApiError.of(out.failure.code, out.failure.message)
                yield index, out

    def close(self) -> None:
        """Releases the choices (the engine cancels what still runs at the next step) and ends a
        request span of several choices (one choice's ends with its sequence). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.choices.release()
        span = self.choices.span
        if span is not None and len(self.choices.reqs) > 1:
            span.end()

    def _failed(self, e: ApiError) -> None:
        span = self.choices.span
        if span is not None and len(self.choices.reqs) > 1:
            span.set_status(Status(StatusCode.ERROR, e.body.error.message))

    async def whole(self, request: Request) -> str:
        # Nothing reads the request while the answer is made: a watcher hears the client leave.
        gone = asyncio.ensure_future(_disconnect(request))
        gone.add_done_callback(lambda task: task.cancelled() or self.close())
        try:
            async with contextlib.aclosing(self._outputs()) as outputs:
                async for index, out in outputs:
                    self._take(index, out)
        except ApiError as e:
            self._failed(e)
            raise
        finally:
            gone.cancel()
            self.close()
        n = range(len(self.text))
        if self.chat:
            answer = ChatCompletion(id=self.id, created=self.created, model=self.model, usage=self._usage(), choices=[
                ChatChoice(index=i, message=self._message(i), finish_reason=self.finish[i],
                           logprobs=self._choice_logprobs(self.logprobs[i])) for i in n])
        else:
            answer = Completion(id=self.id, created=self.created, model=self.model, usage=self._usage(), choices=[
                CompletionChoice(index=i, text=self.text[i], finish_reason=self.finish[i],
                                 logprobs=self._choice_logprobs(self.logprobs[i])) for i in n])
        return _json(answer)

    def _message(self, index: int) -> ChatMessage:
        calls = self.readers[index].calls
        return ChatMessage(content=self.text[index] or None if calls else self.text[index], tool_calls=calls or None)

    async def stream(self) -> AsyncIterator[bytes]:
        try:
            if self.chat:  # OpenAI opens every choice with the assistant's role
                yield _sse(_json(self._chat_chunk([ChatChunkChoice(index=i, delta=Delta(role="assistant", content=""))
                                                   for i in range(len(self.text))])))
            async with contextlib.aclosing(self._outputs()) as outputs:
                async for index, out in outputs:
                    seen = len(self.logprobs[index])
                    delta, calls = self._take(index, out)
                    if not (delta or calls or out.finish_reason or out.logprobs):
                        continue  # withheld text (half a character, a possible stop string, a call)
                    entries = self.logprobs[index][seen:]
                    if self.chat:
                        tool_calls = self.readers[index].deltas(calls) if calls else None
                        content = delta if delta or not tool_calls else None
                        choice = ChatChunkChoice(index=index, delta=Delta(content=content, tool_calls=tool_calls),
                                                 finish_reason=self.finish[index],
                                                 logprobs=self._choice_logprobs(entries))
                        yield _sse(_json(self._chat_chunk([choice])))
                    else:
                        choice = CompletionChoice(index=index, text=delta, logprobs=self._choice_logprobs(entries),
                                                  finish_reason=self.finish[index])
                        yield _sse(_json(Completion(id=self.id, created=self.created, model=self.model,
                                                    choices=[choice])))
            options = self.body.stream_options
            if options is not None and options.include_usage:
                usage = (self._chat_chunk([], self._usage()) if self.chat else
                         Completion(id=self.id, created=self.created, model=self.model, choices=[], usage=self._usage()))
                yield _sse(_json(usage))
        except ApiError as e:
            self._failed(e)
            yield _sse(_json(e.body))
        except Exception as e:  # noqa: BLE001 - whatever went wrong, the stream ends with an error event
            log.error("a stream of the HTTP API failed", exc_info=e)
            yield _sse(_json(ErrorResponse(error=Error(message=f"internal error ({type(e).__name__})",
                                                       type="server_error"))))
        finally:
            self.close()
        yield _sse("[DONE]")

    def _chat_chunk(self, choices: list, usage: Usage | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=choices, usage=usage)


async def _disconnect(request: Request) -> None:
    """Returns when the client has gone away (its body was read, so that is the next message)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
