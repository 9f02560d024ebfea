"""The OpenAI-compatible HTTP API (`/v1/chat/completions`, `/v1/completions`, `/v1/models`,
`/health`): a second front end of the replica's admission (requests/admission.py), beside the
gRPC one, on the router's event loop (FastAPI on uvicorn, common/http_server.py). Chat and text
completions each write their answers (chat.py, completions.py) from what they share (answer.py).

- Errors have OpenAI's shape and the status of what the gRPC API answers (errors.py).
- API keys as `Authorization: Bearer KEY`, with the same tenants and limits; a W3C
  `traceparent` header continues the client's trace as gRPC metadata does.
- Log-probabilities are those of the model's raw distribution (before temperature, top-k and
  top-p), as in the gRPC API: chat's `logprobs.content[]`, text completions' legacy format.
- `response_format` (json_object, json_schema) and vLLM's `structured_outputs` (json, regex,
  grammar, choice) become the request's constraint (requests/constraints.py); `tools` and
  `tool_choice` become a grammar and are read back as `tool_calls` (tools.py).
"""

from __future__ import annotations

import json
import logging
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from opentelemetry.trace import Status, StatusCode
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from shardline.common.auth import NO_TENANT, ApiKeys
from shardline.router.api.openai.answer import Answer, StreamedAnswer
from shardline.router.api.openai.chat import ChatAnswer, chat_requests
from shardline.router.api.openai.choices import Choices
from shardline.router.api.openai.completions import CompletionAnswer, completion_requests
from shardline.router.api.openai.errors import ApiError, invalid_body
from shardline.router.api.openai.schema import (
    BaseRequest,
    ChatCompletionRequest,
    CompletionRequest,
    Error,
    ErrorResponse,
    Model,
    ModelList,
)
from shardline.router.api.openai.tools import declares_calls
from shardline.router.core.replica import Replica
from shardline.router.observers.tracing import Tracing, request_attributes
from shardline.router.requests.admission import Admission
from shardline.router.requests.validation import InvalidRequest

log = logging.getLogger(__name__)
MAX_BODY_BYTES = 4 << 20  # as gRPC's default message limit


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


class OpenAiApi:
    def __init__(
        self, replica: Replica, admission: Admission, tracing: Tracing | None = None, keys: ApiKeys | None = None
    ):
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
        return JSONResponse(
            ErrorResponse(error=Error(message=str(e.detail), type=kind)).model_dump(), status_code=e.status_code
        )

    @staticmethod
    async def _internal(request: Request, e: Exception) -> JSONResponse:
        log.error("the HTTP API failed on %s", request.url.path, exc_info=e)
        return JSONResponse(
            ErrorResponse(
                error=Error(
                    message=f"internal error ({type(e).__name__}); the server's log has the details",
                    type="server_error",
                )
            ).model_dump(),
            status_code=500,
        )

    # -- requests ---------------------------------------------------------------------------------
    def _tenant(self, request: Request) -> str:
        if self.keys is None:
            return NO_TENANT
        tenant = self.keys.tenant([("authorization", request.headers.get("authorization", ""))])
        if tenant is None:
            raise ApiError(
                401,
                "a valid API key is required: send 'Authorization: Bearer <key>'",
                "authentication_error",
                code="invalid_api_key",
            )
        return tenant

    def _model(self) -> str:
        if self.replica.served is None:
            raise ApiError.of("UNAVAILABLE", f"not connected: {self.replica.down_reason}")
        return self.replica.served.head.model

    async def health(self) -> Response:
        serving = self.replica.serving and self.replica.accepting
        return Response(status_code=200 if serving else 503)

    async def models(self, request: Request) -> JSONResponse:
        self._tenant(request)
        return JSONResponse(ModelList(data=[Model(id=self._model(), created=self.created)]).model_dump())

    async def chat_completions(self, request: Request) -> Response:
        return await self._complete(request, "chat", ChatCompletionRequest)

    async def completions(self, request: Request) -> Response:
        return await self._complete(request, "text_completion", CompletionRequest)

    async def _complete(self, request: Request, operation: str, schema: type[BaseRequest]) -> Response:
        tenant = self._tenant(request)
        span = None
        if self.tracing is not None:  # as the gRPC API: refused requests have a span too
            span = self.tracing.request_span(request.headers.items(), operation, {})
        try:
            answer = await self._start(request, schema, tenant, span)
        except ApiError as e:
            if span is not None:
                span.set_status(Status(StatusCode.ERROR, e.body.error.message))
                span.end()
            raise
        if answer.body.stream:
            return StreamedAnswer(answer)
        return Response(await answer.whole(request), media_type="application/json")

    async def _start(self, request: Request, schema: type[BaseRequest], tenant: str, span) -> Answer:
        try:
            body = schema.model_validate(await _body(request))
        except ValidationError as e:
            raise invalid_body(e) from None
        model = self._model()
        if body.model != model:
            raise ApiError(
                404,
                f"the model {body.model!r} does not exist; this server serves {model!r}",
                "not_found_error",
                param="model",
                code="model_not_found",
            )
        chat = isinstance(body, ChatCompletionRequest)
        try:
            reqs = chat_requests(body, self.tool_blocks) if chat else completion_requests(body)
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
        codec = self.replica.codec
        if chat:
            return ChatAnswer(body, choices, model, codec, self.tool_blocks)
        return CompletionAnswer(body, choices, model, codec)
