"""The gateway's HTTP APIs: every `/v1/...` request (OpenAI's and Anthropic's), `/tokenize` and
`/detokenize` passed to a replica's own HTTP API (the port its Fleet snapshot names) and the
answer, streamed or not, passed back byte for byte; `/health` answers 200 while the gateway
serves, 503 otherwise. Errors of the gateway's own have the shape of the API called.

Completions, chat completions, Anthropic's messages and OpenAI's responses are routed like gRPC
requests (gateway/service.py): their prompt is read from the JSON body as the router reads it
(the text, the token ids, or the chat messages and tools through the chat template; a Messages
or Responses body as the chat body common/chat_bodies.py makes of it) and hashed in the
caller's tenant namespace. A request naming a stored response goes to the replica that keeps
it (response_homes.py).
A body the gateway cannot read is still passed on, routed by load alone: the router answers it
with its own error. A replica that cannot be reached, or answers 503, before anything was sent
back is left for the next one, once. The routers check API keys themselves.
"""

from __future__ import annotations

import json
import ssl

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from shardline.common.auth import NO_TENANT
from shardline.common.chat_bodies import messages_as_chat, responses_as_chat
from shardline.gateway.replicas import Replica
from shardline.gateway.response_homes import HEAD, ResponseHomes, answered_id, named_response
from shardline.gateway.service import GatewayService, Placement
from shardline.protos import generation_pb2 as pb

PASSED_ON = (
    "authorization",
    "x-api-key",
    "anthropic-version",
    "anthropic-beta",
    "content-type",
    "accept",
    "traceparent",
    "tracestate",
    "x-request-id",
)
USAGE_TAIL = 1 << 16  # bytes of an answer kept to read its usage from


def _error(path: str, status: int, message: str, kind: str) -> JSONResponse:
    """An error of the gateway's own, in the shape of the API at `path` (below /v1)."""
    if path == "messages" or path.startswith("messages/"):
        kind = {401: "authentication_error", 503: "overloaded_error"}.get(status, "api_error")
        return JSONResponse({"type": "error", "error": {"type": kind, "message": message}}, status_code=status)
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": None}}, status_code=status)


def routing_request(path: str, body: bytes) -> pb.GenerateRequest | None:
    """The prompt of a completion, chat completion or Messages body as a GenerateRequest (what
    common/prompts.py tokenizes), read as router/api/openai/choices.py reads it; None otherwise."""
    try:
        data = json.loads(body)
        if path == "messages":
            data, path = messages_as_chat(data), "chat/completions"
        elif path == "responses" and not data.get("previous_response_id"):  # with one: to its home
            data, path = responses_as_chat(data, []), "chat/completions"
        req = pb.GenerateRequest(cache_salt=data.get("cache_salt") or "")
        if path == "completions":
            prompt = data["prompt"]
            if isinstance(prompt, str):
                req.prompt = prompt
            else:
                req.prompt_token_ids.ids.extend(prompt)
        elif path == "chat/completions":
            for m in data["messages"]:
                content = m.get("content") or ""
                text = content if isinstance(content, str) else "".join(p.get("text", "") for p in content)
                calls = json.dumps(m["tool_calls"]) if m.get("tool_calls") else ""
                req.messages.messages.append(
                    pb.ChatMessage(
                        role="system" if m["role"] == "developer" else m["role"],
                        content=text,
                        tool_calls_json=calls,
                        tool_call_id=m.get("tool_call_id") or "",
                        name=m.get("name") or "",
                    )
                )
            if data.get("tools"):
                req.messages.tools_json = json.dumps(data["tools"])
            if data.get("chat_template_kwargs"):
                req.messages.template_kwargs_json = json.dumps(data["chat_template_kwargs"])
        else:
            return None
        return req
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


def _cached_tokens(tail: bytes) -> int | None:
    """The prompt tokens the answer's usage says were cached (a JSON body, or the last
    server-sent event that carries a usage): OpenAI's prompt_tokens_details.cached_tokens (the
    Responses API's input_tokens_details), or Anthropic's cache_read_input_tokens; None when it has
    none."""
    for chunk in reversed(tail.split(b"\n")):
        chunk = chunk.removeprefix(b"data: ").strip()
        if b'"usage"' not in chunk:
            continue
        try:
            data = json.loads(chunk)
            usage = data.get("usage") or (data.get("response") or {}).get("usage") or {}  # a Responses event's
        except (ValueError, AttributeError):
            return None
        if "cache_read_input_tokens" in usage:  # Anthropic's
            return usage["cache_read_input_tokens"]
        details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details") or {}  # chat's, responses'
        return details.get("cached_tokens", 0)
    return None


class _Relayed(StreamingResponse):
    """A replica's answer, streamed on as it comes. However the response ends (done, or the client
    gone, even before its first byte) the replica's response is closed and `end` runs, once."""

    def __init__(self, upstream: httpx.Response, content, end):
        super().__init__(
            content,
            status_code=upstream.status_code,
            headers={k: v for k, v in upstream.headers.items() if k.lower() in ("content-type", "cache-control")},
        )
        self.upstream, self.end = upstream, end

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.upstream.aclose()
            self.end()


class HttpProxy:
    """`tls`: (CA file, client certificate, key) to reach the routers' HTTP APIs over TLS, as
    --router-tls-*; the replica's host name from --routers is the name checked."""

    def __init__(self, service: GatewayService, tls: tuple[str, str, str] | None = None):
        self.service, self.tls = service, tls
        self.homes = ResponseHomes()  # where each stored response of the Responses API is kept
        self._clients: dict[str, httpx.AsyncClient] = {}
        self.app = Starlette(
            routes=[
                Route("/health", self.health),
                Route("/v1/{path:path}", self.proxy, methods=["GET", "POST", "DELETE"]),
                Route("/{path:path}", self.proxy, methods=["POST"]),  # vLLM's /tokenize, /detokenize
            ]
        )

    async def health(self, request: Request) -> Response:
        return Response(status_code=200 if self.service.serving else 503)

    def _client(self, replica: Replica) -> httpx.AsyncClient:
        host = replica.address.rpartition(":")[0]
        base = f"{'https' if self.tls else 'http'}://{host}:{replica.http_port}"
        client = self._clients.get(base)
        if client is None:
            verify: ssl.SSLContext | bool = False
            if self.tls:
                ca, cert, key = self.tls
                verify = ssl.create_default_context(cafile=ca)
                if cert:
                    verify.load_cert_chain(cert, key)
            client = self._clients[base] = httpx.AsyncClient(
                base_url=base, verify=verify, timeout=httpx.Timeout(None, connect=5.0)
            )
        return client

    async def proxy(self, request: Request) -> Response:
        service, path = self.service, request.url.path.removeprefix("/v1/")
        if path.lstrip("/") not in ("tokenize", "detokenize") and not request.url.path.startswith("/v1/"):
            return _error(path, 404, "Not Found", "not_found_error")
        if not service.accepting:
            return _error(path, 503, "the gateway is shutting down", "server_error")
        tenant = NO_TENANT
        if service.keys is not None:
            tenant = service.keys.tenant(request.headers.items())
            if tenant is None:
                message = "a valid API key is required: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'"
                return _error(path, 401, message, "authentication_error")
        body = await request.body()
        gen = routing_request(path, body) if request.method == "POST" else None
        prompt = await service.prompt(gen) if gen is not None else None
        order = [
            route for route in service.order(prompt, tenant, gen.cache_salt if gen else "") if route.replica.http_port
        ]
        if not order:
            return _error(path, 503, "no replica is serving the HTTP API", "server_error")
        headers = {k: v for k, v in request.headers.items() if k.lower() in PASSED_ON}
        named = named_response(request.method, path, body)
        # A request naming a stored response goes to its home, then on a 404 to every other
        # replica (response_homes.py); any other is tried twice at most.
        tries = self.homes.first(order, named, lambda route: route.replica.address) if named else order[:2]
        for attempt, route in enumerate(tries):
            replica = route.replica
            client = self._client(replica)
            last = attempt == len(tries) - 1
            replica.counters.requests_routed += 1
            replica.open(route.hashes, route.uncached)  # from now on its prefix counts as coming here
            service.in_flight += 1
            try:
                upstream = await client.send(
                    client.build_request(
                        request.method, request.url.path, headers=headers, content=body, extensions=self._sni(replica)
                    ),
                    stream=True,
                )
            except httpx.TransportError as e:
                self._closed(route, False)
                if not last:
                    replica.counters.failovers += 1
                    continue
                return _error(path, 503, f"replica {replica.address} cannot be reached: {e!r}", "server_error")
            except BaseException:
                self._closed(route, False)
                raise
            if upstream.status_code == 503 and not last or named and upstream.status_code == 404 and not last:
                await upstream.aclose()
                self._closed(route, False)
                replica.counters.failovers += upstream.status_code == 503
                continue
            replica.first_token(route.uncached)  # the answer has begun
            if named and request.method == "DELETE" and upstream.status_code == 200:
                self.homes.forget(named)
            stores = request.method == "POST" and path == "responses" and upstream.status_code == 200
            return _Relayed(
                upstream,
                self._relay(upstream, route, gen is not None, stores),
                lambda route=route: self._closed(route, True),
            )
        raise AssertionError("unreachable: the last attempt returns")

    def _closed(self, route: Placement, answered: bool) -> None:
        self.service.in_flight -= 1
        route.replica.close(route.hashes, route.uncached, answered)

    def _sni(self, replica: Replica) -> dict:
        """The name the router's certificate is checked against: its --routers entry's host."""
        name = self.service.replicas.host_of(replica.address)
        return {"sni_hostname": name} if self.tls and name else {}

    async def _relay(self, upstream: httpx.Response, route: Placement, completion: bool, stores: bool = False):
        """Passes the answer on; reads the cached tokens its usage reports and, where it stores a
        response, the response's id."""
        replica, tail, head = route.replica, b"", b"" if stores else None
        async for chunk in upstream.aiter_raw():
            tail = (tail + chunk)[-USAGE_TAIL:]
            if head is not None:
                head += chunk
                if (response_id := answered_id(head)) is not None or len(head) >= HEAD:
                    if response_id is not None:
                        self.homes.learn(response_id, replica.address)
                    head = None
            yield chunk
        reported = _cached_tokens(tail) if completion else None
        if reported is not None:
            replica.counters.predicted_cached_tokens += route.predicted
            replica.counters.reported_cached_tokens += reported

    async def close(self) -> None:
        for client in self._clients.values():
            await client.aclose()
