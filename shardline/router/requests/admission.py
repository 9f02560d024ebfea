"""How a request becomes a running sequence, the same for every front end: validated
(validation.py), tokenized on a worker thread, its constraint compiled (constraints.py), checked
against the replica's capacity and the tenant's limits, registered under (tenant, request id)
and queued in the replica's engine.

Tokenizing and chat templating run on one worker thread with the GIL released while tokenizing,
so a long prompt does not delay other streams' tokens, and a burst of long prompts queues there
instead of taking every core.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import uuid
from concurrent.futures import ThreadPoolExecutor

import grpc

from shardline.common.auth import cache_namespace
from shardline.common.prompts import prompt_ids
from shardline.common.tokenizer import TemplateError
from shardline.protos import generation_pb2 as pb
from shardline.router.core.replica import Replica
from shardline.router.core.sequence import Sequence
from shardline.router.requests.constraints import Grammars
from shardline.router.requests.validation import (
    InvalidRequest,
    Limits,
    invalid,
    new_tokens,
    prompt_fits,
    sampling_of,
    validate,
)


def _exhausted(message: str) -> InvalidRequest:
    return InvalidRequest(grpc.StatusCode.RESOURCE_EXHAUSTED, message)


class Admission:
    """`max_waiting`: requests queued before RESOURCE_EXHAUSTED. `tenant_max_requests` /
    `tenant_max_waiting`: a tenant's requests in flight / queued (0: no limit). `share_cache`:
    tenants share cached prefix pages (else each tenant's pages are its own).
    `constraint_timeout_s`: the most a constraint may take to compile."""

    def __init__(
        self,
        replica: Replica,
        max_waiting: int,
        tenant_max_requests: int = 0,
        tenant_max_waiting: int = 0,
        share_cache: bool = False,
        constraint_timeout_s: float = 5.0,
    ):
        self.replica, self.max_waiting, self.share_cache = replica, max_waiting, share_cache
        self.tenant_max_requests, self.tenant_max_waiting = tenant_max_requests, tenant_max_waiting
        self.constraint_timeout_s = constraint_timeout_s
        self._grammars: Grammars | None = None  # built once the served vocabulary is known
        self._ids = itertools.count(1)
        self._running: dict[tuple[str, str], Sequence] = {}  # until its front end releases it
        self._text_worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")

    def unavailable(self) -> InvalidRequest | None:
        replica = self.replica
        if not replica.accepting:
            return InvalidRequest(grpc.StatusCode.UNAVAILABLE, "the server is shutting down")
        if not replica.serving:
            return InvalidRequest(grpc.StatusCode.UNAVAILABLE, f"the shard group is not serving: {replica.down_reason}")
        return None

    def limits(self) -> Limits:
        served = self.replica.served
        return Limits(
            served.head.context_length, served.head.vocab_size, self.replica.codec.max_token_chars, served.pool_tokens
        )

    def grammars(self) -> Grammars:
        """The constraint compiler of the served vocabulary (the model is the router's: it stays
        across reconnects)."""
        if self._grammars is None:
            served = self.replica.served
            self._grammars = Grammars(
                self.replica.codec.tokenizer.to_str(),
                served.head.vocab_size,
                sorted(served.eos_ids),
                self.constraint_timeout_s,
            )
        return self._grammars

    async def tokenize(self, req: pb.GenerateRequest) -> list[int]:
        """The request's prompt as `admit` would compute it (templated, tokenized), checked as
        `admit` checks it; nothing is queued. Raises InvalidRequest."""
        if self.replica.served is None:
            raise self.unavailable() or InvalidRequest(grpc.StatusCode.UNAVAILABLE, "the shard group is not serving")
        validate(req, self.limits(), open_ended=True)
        try:
            return await asyncio.get_running_loop().run_in_executor(
                self._text_worker, prompt_ids, self.replica.codec, req
            )
        except TemplateError as e:
            raise invalid(str(e)) from None

    async def admit(
        self, req: pb.GenerateRequest, tenant: str, span=None, open_ended: bool = False, after: Sequence | None = None
    ) -> Sequence:
        """The request's sequence, queued in the engine; raises InvalidRequest. The caller must
        `release` it when its stream ends, however it ends. `open_ended`: max_new_tokens 0 means
        up to the model's context or what the page pool holds (its KV pages are reserved as for
        any other request). `after`: admitted once that sequence's prompt is computed."""
        if error := self.unavailable():
            raise error
        limits = self.limits()
        validate(req, limits, open_ended)
        try:
            ids = await asyncio.get_running_loop().run_in_executor(
                self._text_worker, prompt_ids, self.replica.codec, req
            )
        except TemplateError as e:
            raise invalid(str(e)) from None
        max_new = new_tokens(req, len(ids), limits)
        prompt_fits(len(ids), max_new, limits)
        constrained = await self.grammars().constrained(req) if req.WhichOneof("constraint") else None
        if constrained is not None and constrained.error:
            raise invalid(constrained.error)
        if error := self.unavailable():  # the group may have failed while we tokenized
            raise error
        self._check_room(len(ids) + max_new, tenant, req.request_id)
        # LongRoPE's long factors turn every position of a long prompt, so its pages hold other
        # K/V than a short prompt's of the same tokens: cached apart, under a namespace that
        # starts with a NUL (as no salt does by accident).
        long_rope = 0 < self.replica.served.head.rope_long_from < len(ids)
        namespace = cache_namespace(None if self.share_cache else tenant, req.cache_salt)
        seq = Sequence(
            seq_id=next(self._ids),
            request_id=req.request_id or uuid.uuid4().hex,
            prompt_ids=ids,
            max_new_tokens=max_new,
            sampling=sampling_of(req, random.getrandbits(63)),
            cache_namespace="\0long-rope\0" + namespace if long_rope else namespace,
            long_rope=long_rope,
            tenant=tenant,
            priority=req.priority,
            prompt_logprobs=req.prompt_logprobs if req.HasField("prompt_logprobs") else None,
            stop_token_ids=frozenset() if req.ignore_eos else self.replica.served.eos_ids,
            span=span,
            after=after,
            constrained=constrained,
            speculative=not req.HasField("speculative") or req.speculative,
        )
        # No await since _check_room: the id is still free.
        self._running[tenant, seq.request_id] = seq
        self.replica.submit(seq, list(req.stop))
        return seq

    def release(self, seq: Sequence) -> None:
        """The request's stream ended (finished, cancelled by its client, deadline, broken
        connection): its pages go back at the next step boundary."""
        self.replica.cancel(seq)
        if self._running.get((seq.tenant, seq.request_id)) is seq:  # not a later request with its id
            del self._running[seq.tenant, seq.request_id]

    def cancel(self, tenant: str, request_id: str) -> bool:
        """Cancels a running request of this tenant (a tenant sees only its own); its stream
        ends with finish reason `cancelled`. False when none runs under that id."""
        seq = self._running.get((tenant, request_id))
        if seq is None:
            return False
        self.replica.cancel(seq)
        return True

    def _check_room(self, tokens: int, tenant: str, request_id: str) -> None:
        replica = self.replica
        if not replica.can_ever_fit(tokens):
            raise _exhausted(
                f"the request needs {tokens} tokens of KV cache "
                f"but the whole page pool holds {replica.served.pool_tokens}"
            )
        if replica.waiting() >= self.max_waiting:
            raise _exhausted(f"too many waiting requests ({self.max_waiting}); retry later")
        if (tenant, request_id) in self._running:
            raise InvalidRequest(
                grpc.StatusCode.ALREADY_EXISTS, f"a request with request_id {request_id!r} is already running"
            )
        if self.tenant_max_requests and sum(t == tenant for t, _ in self._running) >= self.tenant_max_requests:
            raise _exhausted(
                f"this tenant already has {self.tenant_max_requests} requests in flight, its limit; retry later"
            )
        if self.tenant_max_waiting and replica.waiting(tenant) >= self.tenant_max_waiting:
            raise _exhausted(
                f"this tenant already has {self.tenant_max_waiting} requests waiting, its limit; retry later"
            )
