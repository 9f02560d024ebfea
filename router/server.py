"""The public gRPC API (`shardline.v1.Generation`), health and reflection, on top of the replica.

Hostile input is bounded before it costs anything: bytes that do not parse are INVALID_ARGUMENT
(not gRPC's INTERNAL); stop strings, ids, salts and message counts have limits; a prompt longer
than the context times the longest token can never fit and is refused before tokenizing.
Tokenizing and chat templating run on a worker thread, with the GIL released while tokenizing,
so a long prompt does not delay other streams' tokens.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import math
import random
import statistics
import uuid
from concurrent.futures import ThreadPoolExecutor

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from opentelemetry.trace import Status, StatusCode

from protos import generation_pb2 as pb
from router.auth import NO_TENANT, ApiKeys, cache_namespace
from router.replica import Replica
from router.sequence import Sampling, Sequence
from router.tracing import Tracing, request_attributes
from router.tokenizer import CHAT_ROLES, TemplateError

log = logging.getLogger(__name__)
SERVICE = "shardline.v1.Generation"
MAX_STOPS, MAX_STOP_CHARS = 16, 256
MAX_ID_CHARS = 256        # request_id, cache_salt
MAX_MESSAGES = 1024
MAX_LOGPROBS = 20         # alternatives per position (the shard's own limit too)


class InvalidRequest(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


def _invalid(message: str) -> InvalidRequest:
    return InvalidRequest(grpc.StatusCode.INVALID_ARGUMENT, message)


class Malformed:
    """Stands in for a request whose bytes did not parse; the handler answers INVALID_ARGUMENT."""

    def __init__(self, message: str):
        self.message = message


def _parser(cls):
    def parse(data: bytes):
        try:
            return cls.FromString(data)
        except Exception as e:  # DecodeError, or whatever else hostile bytes provoke
            return Malformed(f"the request does not parse as {cls.DESCRIPTOR.full_name}: {e}")
    return parse


class GenerationService:
    """`keys`: API keys (None: open to all). `tenant_max_requests` / `tenant_max_waiting`: a
    tenant's streams in flight / requests queued (0: no limit). `share_cache`: tenants share
    cached prefix pages (else each tenant's pages are its own)."""

    def __init__(self, replica: Replica, max_waiting: int, tracing: Tracing | None = None,
                 keys: ApiKeys | None = None, tenant_max_requests: int = 0, tenant_max_waiting: int = 0,
                 share_cache: bool = False):
        self.replica, self.max_waiting, self.tracing = replica, max_waiting, tracing
        self.keys, self.share_cache = keys, share_cache
        self.tenant_max_requests, self.tenant_max_waiting = tenant_max_requests, tenant_max_waiting
        self._ids = itertools.count(1)
        # (tenant, request_id) -> its sequence, until its stream ends
        self._running: dict[tuple[str, str], Sequence] = {}
        # One thread: a burst of long prompts queues here instead of taking every core.
        self._text_worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")

    async def _tenant(self, context) -> str:
        """The caller's tenant; aborts UNAUTHENTICATED without a valid key."""
        if self.keys is None:
            return NO_TENANT
        tenant = self.keys.tenant(context.invocation_metadata())
        if tenant is None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                "a valid API key is required: send 'authorization: Bearer <key>'")
        return tenant

    # -- validation ---------------------------------------------------------------------------
    def _check_cheap(self, req: pb.GenerateRequest, info: pb.InfoResponse) -> None:
        """Everything that costs nothing to check, before any tokenizing."""
        if req.max_new_tokens == 0:
            raise _invalid("max_new_tokens must be at least 1")
        if req.max_new_tokens >= info.context_length:
            raise _invalid(f"max_new_tokens ({req.max_new_tokens}) exceeds the model's context of "
                           f"{info.context_length} tokens")
        if len(req.stop) > MAX_STOPS:
            raise _invalid(f"at most {MAX_STOPS} stop strings, got {len(req.stop)}")
        for s in req.stop:
            if not 1 <= len(s) <= MAX_STOP_CHARS:
                raise _invalid(f"stop strings must have 1 to {MAX_STOP_CHARS} characters, got {len(s)}")
        for name in ("request_id", "cache_salt"):
            if len(getattr(req, name)) > MAX_ID_CHARS:
                raise _invalid(f"{name} is longer than {MAX_ID_CHARS} characters")
        self._sampling(req)
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(req, name) > MAX_LOGPROBS:
                raise _invalid(f"{name} must lie in 0..{MAX_LOGPROBS}, got {getattr(req, name)}")
        kind = req.WhichOneof("input")
        limit = info.context_length * self.replica.codec.max_token_chars
        if kind == "prompt":
            if not req.prompt:
                raise _invalid("prompt is empty")
            chars = len(req.prompt)
        elif kind == "prompt_token_ids":
            ids = req.prompt_token_ids.ids
            if not ids:
                raise _invalid("the prompt has no tokens")
            if len(ids) + req.max_new_tokens > info.context_length:
                raise _invalid(f"prompt ({len(ids)} tokens) + max_new_tokens ({req.max_new_tokens}) "
                               f"exceeds the model's context of {info.context_length} tokens")
            if max(ids) >= info.vocab_size:
                raise _invalid(f"token id {max(ids)} is outside the vocabulary (size {info.vocab_size})")
            return
        elif kind == "messages":
            messages = req.messages.messages
            if not messages:
                raise _invalid("messages is empty")
            if len(messages) > MAX_MESSAGES:
                raise _invalid(f"at most {MAX_MESSAGES} messages, got {len(messages)}")
            for m in messages:
                if m.role not in CHAT_ROLES:
                    raise _invalid(f"unknown chat role {m.role[:40]!r}; expected one of {sorted(CHAT_ROLES)}")
            chars = sum(len(m.content) for m in messages)
        else:
            raise _invalid("no input: set prompt, prompt_token_ids or messages")
        if chars > limit:
            raise _invalid(f"the prompt has {chars} characters; no prompt over {limit} characters fits the "
                           f"model's context of {info.context_length} tokens")

    def _prompt_ids(self, req: pb.GenerateRequest) -> list[int]:
        """Tokenizes (and templates) the input; runs on the worker thread."""
        codec, kind = self.replica.codec, req.WhichOneof("input")
        if kind == "prompt_token_ids":
            return list(req.prompt_token_ids.ids)
        if kind == "prompt":
            return codec.encode(req.prompt)
        chat = [{"role": m.role, "content": m.content} for m in req.messages.messages]
        return codec.encode(codec.render_chat(chat))

    @staticmethod
    def _sampling(req: pb.GenerateRequest) -> Sampling:
        s = req.sampling
        if not (math.isfinite(s.temperature) and s.temperature >= 0):
            raise _invalid(f"temperature must be a finite number >= 0, got {s.temperature}")
        top_p = s.top_p if s.HasField("top_p") else 1.0
        if not 0.0 < top_p <= 1.0:  # NaN fails this too
            raise _invalid(f"top_p must lie in (0, 1], got {top_p}")
        seed = s.seed if s.HasField("seed") else random.getrandbits(63)
        return Sampling(temperature=s.temperature, top_p=top_p, top_k=s.top_k, seed=seed)

    def _unavailable(self) -> InvalidRequest | None:
        replica = self.replica
        if not replica.accepting:
            return InvalidRequest(grpc.StatusCode.UNAVAILABLE, "the server is shutting down")
        if not replica.serving:
            return InvalidRequest(grpc.StatusCode.UNAVAILABLE,
                                  f"the shard group is not serving: {replica.down_reason}")
        return None

    async def _accept(self, req, tenant: str) -> Sequence:
        if isinstance(req, Malformed):
            raise _invalid(req.message)
        if error := self._unavailable():
            raise error
        info = self.replica.info
        self._check_cheap(req, info)
        try:
            ids = await asyncio.get_running_loop().run_in_executor(self._text_worker, self._prompt_ids, req)
        except TemplateError as e:
            raise _invalid(str(e)) from None
        if not ids:
            raise _invalid("the prompt has no tokens")
        if len(ids) + req.max_new_tokens > info.context_length:
            raise _invalid(f"prompt ({len(ids)} tokens) + max_new_tokens ({req.max_new_tokens}) "
                           f"exceeds the model's context of {info.context_length} tokens")
        if error := self._unavailable():  # the group may have failed while we tokenized
            raise error
        info, scheduler = self.replica.info, self.replica.engine.scheduler
        if not scheduler.can_ever_fit(len(ids) + req.max_new_tokens):
            raise InvalidRequest(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                 f"the request needs {len(ids) + req.max_new_tokens} tokens of KV cache "
                                 f"but the whole page pool holds {info.num_pages * info.page_size}")
        if len(scheduler.waiting) >= self.max_waiting:
            raise InvalidRequest(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                 f"too many waiting requests ({self.max_waiting}); retry later")
        if (tenant, req.request_id) in self._running:
            raise InvalidRequest(grpc.StatusCode.ALREADY_EXISTS,
                                 f"a request with request_id {req.request_id!r} is already running")
        if self.tenant_max_requests and sum(t == tenant for t, _ in self._running) >= self.tenant_max_requests:
            raise InvalidRequest(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                 f"this tenant already has {self.tenant_max_requests} requests in flight, "
                                 "its limit; retry later")
        if self.tenant_max_waiting and sum(s.tenant == tenant for s in scheduler.waiting) >= self.tenant_max_waiting:
            raise InvalidRequest(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                 f"this tenant already has {self.tenant_max_waiting} requests waiting, "
                                 "its limit; retry later")
        return Sequence(seq_id=next(self._ids), request_id=req.request_id or uuid.uuid4().hex,
                        prompt_ids=ids, max_new_tokens=req.max_new_tokens, sampling=self._sampling(req),
                        cache_namespace=cache_namespace(None if self.share_cache else tenant, req.cache_salt),
                        tenant=tenant, priority=req.priority,
                        logprobs=req.logprobs if req.HasField("logprobs") else None,
                        prompt_logprobs=req.prompt_logprobs if req.HasField("prompt_logprobs") else None,
                        stop_token_ids=frozenset() if req.ignore_eos else self.replica.eos_ids)

    # -- RPCs -----------------------------------------------------------------------------------
    async def Generate(self, request, context):
        tenant = await self._tenant(context)
        span = None
        if self.tracing is not None:
            span = self.tracing.request_span(context.invocation_metadata(), *request_attributes(request))
        try:
            seq = await self._accept(request, tenant)
        except InvalidRequest as e:
            if span is not None:
                span.set_status(Status(StatusCode.ERROR, f"{e.code.name}: {e}"))
                span.end()
            await context.abort(e.code, str(e))
        seq.span = span
        if span is not None:
            span.set_attribute("gen_ai.response.id", seq.request_id)
        self._running[tenant, seq.request_id] = seq  # no await since _accept checked the id is free
        engine = self.replica.engine
        try:
            engine.submit(seq, list(request.stop))
            while True:
                out = await seq.outputs.get()
                if out.failure is not None:
                    await context.abort(grpc.StatusCode[out.failure.code], out.failure.message)
                msg = pb.GenerateResponse(token_ids=out.token_ids, text=out.text,
                                          finish_reason=out.finish_reason, request_id=seq.request_id,
                                          logprobs=map(_public_logprob, out.logprobs),
                                          prompt_logprobs=map(_public_logprob, out.prompt_logprobs))
                if out.finish_reason:
                    msg.usage.CopyFrom(pb.Usage(prompt_tokens=len(seq.prompt_ids),
                                                cached_prompt_tokens=seq.cached_prompt_tokens,
                                                completion_tokens=len(seq.output_ids)))
                    yield msg
                    return
                yield msg
        finally:
            # Client cancelled, deadline passed or the stream broke: free the request's pages.
            engine.cancel(seq)
            del self._running[tenant, seq.request_id]

    async def Cancel(self, request, context):
        tenant = await self._tenant(context)
        if isinstance(request, Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        seq = self._running.get((tenant, request.request_id))  # a tenant sees only its own requests
        if seq is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no running request has request_id {request.request_id!r}")
        self.replica.engine.cancel(seq)
        return pb.CancelResponse()

    async def Stats(self, request, context):
        await self._tenant(context)
        if isinstance(request, Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        replica, engine = self.replica, self.replica.engine
        st = pb.StatsResponse(serving=replica.serving, replica_failures=replica.failures,
                              replica_recoveries=replica.recoveries)
        if engine is None:
            return st
        sched, pages = engine.scheduler, engine.scheduler.pages
        st.MergeFrom(pb.StatsResponse(
            pages_total=pages.num_pages, pages_free=pages.free, pages_referenced=pages.referenced,
            pages_evictable=pages.evictable, pages_cached=pages.cached, pages_reserved=pages.reserved,
            pages_probation=len(pages.probation), pages_protected=len(pages.protected),
            prefix_hit_tokens=pages.hit_tokens, prefix_query_tokens=pages.query_tokens,
            requests_waiting=len(sched.waiting),
            requests_running=len(sched.prefilling) + len(sched.decoding),
            requests_prefilling=len(sched.prefilling), requests_decoding=len(sched.decoding),
            steps=engine.step_id, tokens_generated=engine.tokens_generated,
            prompt_tokens_computed=engine.prompt_tokens_computed, requests_failed=engine.requests_failed,
            decode_graph_launches=engine.decode_graph_launches, eager_decode_steps=engine.eager_decode_steps,
            decode_step_ms_p50=_median([w for w, _ in engine.decode_step_times]),
            shard_decode_step_ms_p50=_median([c for _, c in engine.decode_step_times])))
        return st

    async def Info(self, request, context):
        await self._tenant(context)
        if isinstance(request, Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        if self.replica.info is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"not connected: {self.replica.down_reason}")
        return self.replica.info


def _public_logprob(entry) -> pb.TokenLogprob:
    """A shard's TokenLogprob (parallel id and value lists) as the API's message."""
    return pb.TokenLogprob(token_id=entry.token_id, logprob=entry.logprob,
                           top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in zip(entry.top_ids, entry.top_logprobs)])


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def add_services(server: grpc.aio.Server, service: GenerationService,
                 health_servicer: health.aio.HealthServicer) -> None:
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            service.Generate, request_deserializer=_parser(pb.GenerateRequest),
            response_serializer=pb.GenerateResponse.SerializeToString),
        "Cancel": grpc.unary_unary_rpc_method_handler(
            service.Cancel, request_deserializer=_parser(pb.CancelRequest),
            response_serializer=pb.CancelResponse.SerializeToString),
        "Stats": grpc.unary_unary_rpc_method_handler(
            service.Stats, request_deserializer=_parser(pb.StatsRequest),
            response_serializer=pb.StatsResponse.SerializeToString),
        "Info": grpc.unary_unary_rpc_method_handler(
            service.Info, request_deserializer=_parser(pb.InfoRequest),
            response_serializer=pb.InfoResponse.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = (SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
