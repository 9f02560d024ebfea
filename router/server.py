"""The public gRPC API (`shardline.v1.Generation`), health and reflection, on top of the engine."""
from __future__ import annotations

import itertools
import logging
import math
import random
import statistics
import uuid

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from protos import generation_pb2 as pb, generation_pb2_grpc as pb_grpc
from router.engine import Engine
from router.sequence import Sampling, Sequence
from router.tokenizer import CHAT_ROLES

log = logging.getLogger(__name__)
SERVICE = "shardline.v1.Generation"


class InvalidRequest(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


def _invalid(message: str) -> InvalidRequest:
    return InvalidRequest(grpc.StatusCode.INVALID_ARGUMENT, message)


class GenerationService(pb_grpc.GenerationServicer):
    def __init__(self, engine: Engine, info: pb.InfoResponse, eos_ids: frozenset[int], max_waiting: int):
        self.engine, self.info, self.eos_ids, self.max_waiting = engine, info, eos_ids, max_waiting
        self._ids = itertools.count(1)

    # -- validation ---------------------------------------------------------------------------
    def _prompt_ids(self, req: pb.GenerateRequest) -> list[int]:
        kind = req.WhichOneof("input")
        tok = self.engine.tokenizer
        if kind == "prompt":
            if not req.prompt:
                raise _invalid("prompt is empty")
            ids = tok.encode(req.prompt, add_special_tokens=False)
        elif kind == "prompt_token_ids":
            ids = list(req.prompt_token_ids.ids)
            bad = [t for t in ids if t >= self.info.vocab_size]
            if bad:
                raise _invalid(f"token id {bad[0]} is outside the vocabulary (size {self.info.vocab_size})")
        elif kind == "messages":
            if not req.messages.messages:
                raise _invalid("messages is empty")
            for m in req.messages.messages:
                if m.role not in CHAT_ROLES:
                    raise _invalid(f"unknown chat role {m.role!r}; expected one of {sorted(CHAT_ROLES)}")
            chat = [{"role": m.role, "content": m.content} for m in req.messages.messages]
            ids = list(tok.apply_chat_template(chat, tokenize=True, add_generation_prompt=True,
                                               return_dict=False))
        else:
            raise _invalid("no input: set prompt, prompt_token_ids or messages")
        if not ids:
            raise _invalid("the prompt has no tokens")
        return ids

    def _sampling(self, req: pb.GenerateRequest) -> Sampling:
        s = req.sampling
        if math.isnan(s.temperature) or s.temperature < 0 or math.isinf(s.temperature):
            raise _invalid(f"temperature must be a finite number >= 0, got {s.temperature}")
        top_p = s.top_p if s.HasField("top_p") else 1.0
        if not 0.0 < top_p <= 1.0:  # NaN fails this too
            raise _invalid(f"top_p must lie in (0, 1], got {top_p}")
        seed = s.seed if s.HasField("seed") else random.getrandbits(63)
        return Sampling(temperature=s.temperature, top_p=top_p, top_k=s.top_k, seed=seed)

    def _validate(self, req: pb.GenerateRequest) -> Sequence:
        ids = self._prompt_ids(req)
        context = self.info.context_length
        if req.max_new_tokens == 0:
            raise _invalid("max_new_tokens must be at least 1")
        if len(ids) + req.max_new_tokens > context:
            raise _invalid(f"prompt ({len(ids)} tokens) + max_new_tokens ({req.max_new_tokens}) "
                           f"exceeds the model's context of {context} tokens")
        if any(not s for s in req.stop):
            raise _invalid("stop strings must not be empty")
        sampling = self._sampling(req)
        scheduler = self.engine.scheduler
        if not scheduler.can_ever_fit(len(ids) + req.max_new_tokens):
            raise InvalidRequest(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                 f"the request needs {len(ids) + req.max_new_tokens} tokens of KV cache "
                                 f"but the whole page pool holds {self.info.num_pages * self.info.page_size}")
        if len(scheduler.waiting) >= self.max_waiting:
            raise InvalidRequest(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                 f"too many waiting requests ({self.max_waiting}); retry later")
        if self.engine.error:
            raise InvalidRequest(grpc.StatusCode.UNAVAILABLE, f"a shard is down: {self.engine.error}")
        return Sequence(seq_id=next(self._ids), request_id=req.request_id or uuid.uuid4().hex,
                        prompt_ids=ids, max_new_tokens=req.max_new_tokens, sampling=sampling,
                        cache_salt=req.cache_salt, priority=req.priority,
                        stop_token_ids=frozenset() if req.ignore_eos else self.eos_ids)

    # -- RPCs -----------------------------------------------------------------------------------
    async def Generate(self, request, context):
        try:
            seq = self._validate(request)
        except InvalidRequest as e:
            await context.abort(e.code, str(e))
        self.engine.submit(seq, list(request.stop))
        try:
            while True:
                out = await seq.outputs.get()
                if out.finish_reason == "error":
                    await context.abort(grpc.StatusCode.UNAVAILABLE,
                                        f"the replica failed while serving this request: {self.engine.error}")
                msg = pb.GenerateResponse(token_ids=out.token_ids, text=out.text,
                                          finish_reason=out.finish_reason, request_id=seq.request_id)
                if out.finish_reason:
                    msg.usage.CopyFrom(pb.Usage(prompt_tokens=len(seq.prompt_ids),
                                                cached_prompt_tokens=seq.cached_prompt_tokens,
                                                completion_tokens=len(seq.output_ids)))
                    yield msg
                    return
                yield msg
        finally:
            # Client cancelled, deadline passed or the stream broke: free the request's pages.
            self.engine.cancel(seq)

    async def Stats(self, request, context):
        sched, pages = self.engine.scheduler, self.engine.scheduler.pages
        return pb.StatsResponse(
            pages_total=pages.num_pages, pages_free=pages.free, pages_referenced=pages.referenced,
            pages_evictable=pages.evictable, pages_cached=pages.cached, pages_reserved=pages.reserved,
            pages_probation=len(pages.probation), pages_protected=len(pages.protected),
            prefix_hit_tokens=pages.hit_tokens, prefix_query_tokens=pages.query_tokens,
            requests_waiting=len(sched.waiting),
            requests_running=len(sched.prefilling) + len(sched.decoding),
            requests_prefilling=len(sched.prefilling), requests_decoding=len(sched.decoding),
            steps=self.engine.step_id,
            tokens_generated=self.engine.tokens_generated,
            prompt_tokens_computed=self.engine.prompt_tokens_computed,
            decode_step_ms_p50=_median([w for w, _ in self.engine.decode_step_times]),
            shard_decode_step_ms_p50=_median([c for _, c in self.engine.decode_step_times]))

    async def Info(self, request, context):
        return self.info


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def add_services(server: grpc.aio.Server, service: GenerationService | None,
                 health_servicer: health.HealthServicer) -> None:
    if service is not None:
        pb_grpc.add_GenerationServicer_to_server(service, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = (pb.DESCRIPTOR.services_by_name["Generation"].full_name,
             health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
