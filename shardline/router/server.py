"""The public gRPC API (`shardline.v1.Generation`): a front end of the replica's admission
(router/admission.py), which every front end shares; served with health and reflection by
common/generation_service.py.

Bytes that do not parse are INVALID_ARGUMENT (not gRPC's INTERNAL); a failure of one request
ends its stream with that request's status.
"""
from __future__ import annotations

import grpc
from opentelemetry.trace import Status, StatusCode

from shardline.common.generation_service import Malformed
from shardline.protos import generation_pb2 as pb
from shardline.router.admission import Admission
from shardline.common.auth import ApiKeys, caller_tenant
from shardline.router.replica import Replica
from shardline.router.stats import StatsCounters, stats_response
from shardline.router.tracing import Tracing, request_attributes
from shardline.router.validation import InvalidRequest, invalid

class GenerationService:
    """The gRPC front end of `admission` (router/admission.py); `keys`: API keys (None: open to all)."""

    def __init__(self, replica: Replica, admission: Admission, stats: StatsCounters, tracing: Tracing | None = None,
                 keys: ApiKeys | None = None):
        self.replica, self.admission, self.stats, self.tracing, self.keys = replica, admission, stats, tracing, keys

    async def _tenant(self, context) -> str:
        return await caller_tenant(self.keys, context)

    async def Generate(self, request, context):
        tenant = await self._tenant(context)
        span = None
        if self.tracing is not None:
            span = self.tracing.request_span(context.invocation_metadata(), *request_attributes(request))
        try:
            if isinstance(request, Malformed):
                raise invalid(request.message)
            seq = await self.admission.admit(request, tenant, span)
        except InvalidRequest as e:
            if span is not None:
                span.set_status(Status(StatusCode.ERROR, f"{e.code.name}: {e}"))
                span.end()
            await context.abort(e.code, str(e))
        if span is not None:
            span.set_attribute("gen_ai.response.id", seq.request_id)
        try:
            while True:
                out = await seq.outputs.get()
                if out.failure is not None:
                    await context.abort(grpc.StatusCode[out.failure.code], out.failure.message)
                msg = pb.GenerateResponse(token_ids=out.token_ids, text=out.text,
                                          finish_reason=out.finish_reason.value if out.finish_reason else "",
                                          request_id=seq.request_id,
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
            self.admission.release(seq)

    async def Cancel(self, request, context):
        tenant = await self._tenant(context)
        if isinstance(request, Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        if not self.admission.cancel(tenant, request.request_id):
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no running request has request_id {request.request_id!r}")
        return pb.CancelResponse()

    async def Stats(self, request, context):
        await self._tenant(context)
        if isinstance(request, Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        return stats_response(self.replica, self.stats)

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
