"""The router's HTTP APIs, one FastAPI app on the router's event loop (common/http_server.py),
a second front end of the replica's admission (requests/admission.py) beside the gRPC one:

- OpenAI's: `/v1/chat/completions`, `/v1/completions`, `/v1/models` (openai/);
- OpenAI's Responses API: `/v1/responses`, and `GET` / `DELETE /v1/responses/{id}` of the
  responses this router keeps (openai/responses.py, openai/response_store.py);
- Anthropic's Messages API: `/v1/messages`, `/v1/messages/count_tokens` (anthropic/);
- vLLM's `/tokenize` and `/detokenize` (tokens.py), `/metrics` (Prometheus), `/health`.

Every generation endpoint is one `Endpoint`: its body's schema, the GenerateRequests the body
asks for, and the answer that writes their outputs in the API's shape. They share the rest:

- Errors have the API's shape (OpenAI's, or Anthropic's under `/v1/messages`) and the status of
  what the gRPC API answers (openai/errors.py).
- API keys as `Authorization: Bearer KEY` or `x-api-key: KEY`, with the same tenants and limits;
  a W3C `traceparent` header continues the client's trace as gRPC metadata does.
- `--served-model-name`: the names a client may ask for (the first is the one `/v1/models`
  lists first); a request names one of them, and its answer names what it asked for.
"""

from __future__ import annotations

import json
import logging
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from opentelemetry.trace import Status, StatusCode
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException

from shardline.common.auth import NO_TENANT, ApiKeys
from shardline.protos import generation_pb2 as pb
from shardline.router.api import tokens
from shardline.router.api.anthropic import messages
from shardline.router.api.anthropic.errors import anthropic_error
from shardline.router.api.endpoint import Endpoint
from shardline.router.api.openai import responses
from shardline.router.api.openai.answer import Answer, StreamedAnswer
from shardline.router.api.openai.chat import ChatAnswer, chat_requests
from shardline.router.api.openai.choices import Choices
from shardline.router.api.openai.completions import CompletionAnswer, completion_requests
from shardline.router.api.openai.errors import ApiError, invalid_body
from shardline.router.api.openai.response_store import ResponseStore
from shardline.router.api.openai.schema import ChatCompletionRequest, CompletionRequest, Model, ModelList
from shardline.router.api.openai.tools import tool_format
from shardline.router.api.reasoning import reasoning_format
from shardline.router.core.replica import Replica
from shardline.router.observers.tracing import Tracing, request_attributes
from shardline.router.requests.admission import Admission
from shardline.router.requests.validation import InvalidRequest

log = logging.getLogger(__name__)
MAX_BODY_BYTES = 4 << 20  # as gRPC's default message limit


async def read_body(request: Request) -> dict:
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


def parse(schema: type[BaseModel], data: dict):
    try:
        return schema.model_validate(data)
    except ValidationError as e:
        raise invalid_body(e) from None


class HttpApi:
    def __init__(
        self,
        replica: Replica,
        admission: Admission,
        tracing: Tracing | None = None,
        keys: ApiKeys | None = None,
        served_names: list[str] | None = None,
        metrics: CollectorRegistry | None = None,
        reasoning_parser: str = "auto",
    ):
        self.replica, self.admission, self.tracing, self.keys = replica, admission, tracing, keys
        self.served_names, self.metrics = list(served_names or []), metrics
        self.created = int(time.time())
        calls = self.tool_format = tool_format(replica.codec.template_source)  # how the model writes calls
        reasoning = reasoning_format(replica.codec, reasoning_parser)  # in <think> blocks, or harmony's
        app = self.app = FastAPI(title="Shardline", docs_url=None, redoc_url=None, openapi_url=None)
        app.add_exception_handler(ApiError, self._error)
        app.add_exception_handler(HTTPException, self._http_error)
        app.add_exception_handler(Exception, self._internal)
        app.get("/health")(self.health)
        app.get("/metrics")(self.prometheus)
        app.get("/v1/models")(self.models)
        self._route(
            "/v1/chat/completions",
            Endpoint(
                "chat",
                ChatCompletionRequest,
                lambda body: chat_requests(body, calls),
                lambda body, choices, model, codec: ChatAnswer(body, choices, model, codec, calls, reasoning),
            ),
        )
        self._route(
            "/v1/completions",
            Endpoint("text_completion", CompletionRequest, completion_requests, CompletionAnswer),
        )
        context_length = lambda: replica.served.head.context_length
        self.responses = ResponseStore()
        self._route("/v1/responses", responses.endpoint(self.responses, calls, context_length, reasoning))
        app.get("/v1/responses/{response_id}")(self.retrieve)
        app.delete("/v1/responses/{response_id}")(self.delete)
        self._route("/v1/messages", messages.endpoint(calls, context_length, reasoning))
        app.post("/v1/messages/count_tokens")(self.count_tokens)
        app.post("/tokenize")(self.tokenize)
        app.post("/detokenize")(self.detokenize)

    def _route(self, path: str, endpoint: Endpoint) -> None:
        async def serve(request: Request) -> Response:
            return await self._generate(request, endpoint)

        self.app.post(path)(serve)

    # -- errors -----------------------------------------------------------------------------------
    @staticmethod
    def _shaped(request: Request, e: ApiError) -> JSONResponse:
        """The error in the shape of the API the client called."""
        body = anthropic_error(e) if messages.is_anthropic(request.url.path) else e.body.model_dump()
        return JSONResponse(body, status_code=e.status)

    async def _error(self, request: Request, e: ApiError) -> JSONResponse:
        return self._shaped(request, e)

    async def _http_error(self, request: Request, e: HTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return self._shaped(request, ApiError(e.status_code, str(e.detail), kind))

    async def _internal(self, request: Request, e: Exception) -> JSONResponse:
        log.error("the HTTP API failed on %s", request.url.path, exc_info=e)
        message = f"internal error ({type(e).__name__}); the server's log has the details"
        return self._shaped(request, ApiError(500, message, "server_error"))

    # -- requests ---------------------------------------------------------------------------------
    def _tenant(self, request: Request) -> str:
        if self.keys is None:
            return NO_TENANT
        tenant = self.keys.tenant(request.headers.items())
        if tenant is None:
            raise ApiError(
                401,
                "a valid API key is required: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
                "authentication_error",
                code="invalid_api_key",
            )
        return tenant

    def _names(self) -> list[str]:
        """The names a client may ask for: --served-model-name's, else the model's own."""
        if self.replica.served is None:
            raise ApiError.of("UNAVAILABLE", f"not connected: {self.replica.down_reason}")
        return self.served_names or [self.replica.served.head.model]

    def _model(self, asked: str | None) -> str:
        """The served name a request asked for (None: the first); 404 for one not served."""
        names = self._names()
        if asked is None:
            return names[0]
        if asked not in names:
            served = ", ".join(repr(n) for n in names)
            raise ApiError(
                404,
                f"the model {asked!r} does not exist; this server serves {served}",
                "not_found_error",
                param="model",
                code="model_not_found",
            )
        return asked

    async def health(self) -> Response:
        serving = self.replica.serving and self.replica.accepting
        return Response(status_code=200 if serving else 503)

    async def prometheus(self) -> Response:
        if self.metrics is None:
            raise ApiError(404, "this server keeps no metrics", "not_found_error")
        return Response(generate_latest(self.metrics), media_type=CONTENT_TYPE_LATEST)

    async def models(self, request: Request) -> JSONResponse:
        self._tenant(request)
        return JSONResponse(ModelList(data=[Model(id=n, created=self.created) for n in self._names()]).model_dump())

    async def _generate(self, request: Request, endpoint: Endpoint) -> Response:
        tenant = self._tenant(request)
        span = None
        if self.tracing is not None:  # as the gRPC API: refused requests have a span too
            span = self.tracing.request_span(request.headers.items(), endpoint.operation, {})
        try:
            answer = await self._start(request, endpoint, tenant, span)
        except ApiError as e:
            if span is not None:
                span.set_status(Status(StatusCode.ERROR, e.body.error.message))
                span.end()
            raise
        if answer.body.stream:
            return StreamedAnswer(answer)
        return Response(await answer.whole(request), media_type="application/json")

    async def _start(self, request: Request, endpoint: Endpoint, tenant: str, span) -> Answer:
        body = parse(endpoint.schema, await read_body(request))
        model = self._model(body.model)
        if endpoint.prepare is not None:
            endpoint.prepare(body, tenant)
        try:
            reqs = endpoint.requests(body)
        except ValueError as e:  # what protobuf cannot carry: a lone surrogate, an int past its field
            raise ApiError(400, f"the request cannot be served: {e}", "invalid_request_error") from None
        if span is not None:
            span.set_attributes({**request_attributes(reqs[0])[1], "gen_ai.request.stream": bool(body.stream)})
        choices = Choices(self.admission, reqs, tenant, span, self.tracing.tracer if self.tracing else None)
        try:
            await choices.start()
        except InvalidRequest as e:
            raise ApiError.of(e.code.name, str(e)) from None
        if span is not None:
            span.set_attribute("gen_ai.response.id", choices.seqs[0].request_id)
        return endpoint.answer(body, choices, model, self.replica.codec)

    # -- counting tokens ----------------------------------------------------------------------------
    async def _prompt_ids(self, req: pb.GenerateRequest) -> list[int]:
        try:
            return await self.admission.tokenize(req)
        except InvalidRequest as e:
            raise ApiError.of(e.code.name, str(e)) from None

    async def count_tokens(self, request: Request) -> JSONResponse:
        self._tenant(request)
        body = parse(messages.CountTokensRequest, await read_body(request))
        self._model(body.model)
        return JSONResponse(
            {"input_tokens": len(await self._prompt_ids(messages.prompt_request(body, self.tool_format)))}
        )

    async def tokenize(self, request: Request) -> JSONResponse:
        self._tenant(request)
        body = parse(tokens.TokenizeRequest, await read_body(request))
        self._model(body.model)
        ids = await self._prompt_ids(tokens.prompt_request(body, self.tool_format.id_chars))
        return JSONResponse(tokens.tokenized(body, ids, self.replica.served.head.context_length, self.replica.codec))

    async def detokenize(self, request: Request) -> JSONResponse:
        self._tenant(request)
        body = parse(tokens.DetokenizeRequest, await read_body(request))
        self._model(body.model)
        vocab = self.replica.served.head.vocab_size
        if bad := [t for t in body.tokens if not 0 <= t < vocab]:
            raise ApiError(
                400,
                f"tokens: {bad[0]} is not a token id of this model (0 to {vocab - 1})",
                "invalid_request_error",
                param="tokens",
            )
        return JSONResponse({"prompt": self.replica.codec.decode(body.tokens, skip_special=False)})

    # -- stored responses (the Responses API) --------------------------------------------------------
    async def retrieve(self, request: Request, response_id: str) -> JSONResponse:
        stored = self.responses.get(self._tenant(request), response_id)
        if stored is None:
            raise responses.not_found(response_id)
        return JSONResponse(stored.response)

    async def delete(self, request: Request, response_id: str) -> JSONResponse:
        if not self.responses.delete(self._tenant(request), response_id):
            raise responses.not_found(response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})
