"""The public gRPC API (`shardline.v1.Generation`): a front end of the replica's admission
(requests/admission.py), which every front end shares; served with health and reflection by
common/generation_service.py.

Bytes that do not parse are INVALID_ARGUMENT (not gRPC's INTERNAL); a failure of one request
ends its stream with that request's status.
"""

from __future__ import annotations

import statistics

import grpc
from opentelemetry.trace import Status, StatusCode

from shardline.common.auth import ApiKeys, caller_tenant
from shardline.common.generation_service import Malformed
from shardline.protos import generation_pb2 as pb
from shardline.router.core.replica import Replica
from shardline.router.observers.stats import StatsCounters
from shardline.router.observers.tracing import Tracing, request_attributes
from shardline.router.requests.admission import Admission
from shardline.router.requests.validation import InvalidRequest, invalid


class GenerationService:
    """The gRPC front end of `admission` (router/admission.py); `keys`: API keys (None: open to all)."""

    def __init__(
        self,
        replica: Replica,
        admission: Admission,
        stats: StatsCounters,
        tracing: Tracing | None = None,
        keys: ApiKeys | None = None,
    ):
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
                msg = pb.GenerateResponse(
                    token_ids=out.token_ids,
                    text=out.text,
                    finish_reason=out.finish_reason.value if out.finish_reason else "",
                    request_id=seq.request_id,
                    logprobs=map(_public_logprob, out.logprobs),
                    prompt_logprobs=map(_public_logprob, out.prompt_logprobs),
                )
                if out.finish_reason:
                    msg.usage.CopyFrom(
                        pb.Usage(
                            prompt_tokens=len(seq.prompt_ids),
                            cached_prompt_tokens=seq.cached_prompt_tokens,
                            completion_tokens=len(seq.output_ids),
                        )
                    )
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
        if self.replica.served is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"not connected: {self.replica.down_reason}")
        return info_response(self.replica)


def _public_logprob(entry) -> pb.TokenLogprob:
    """A token's log-probability (core/sequence.py: parallel id and value tuples) as the API's message."""
    return pb.TokenLogprob(
        token_id=entry.token_id,
        logprob=entry.logprob,
        top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in zip(entry.top_ids, entry.top_logprobs)],
    )


def info_response(replica: Replica) -> pb.InfoResponse:
    """The model, layout, pool and policies of a replica that has been connected."""
    config, served = replica.config, replica.served
    head, infos, warmups = served.head, served.infos, served.warmups
    return pb.InfoResponse(
        model=head.model,
        page_size=head.page_size,
        num_pages=served.num_pages,
        tensor_parallel=head.tp_size,
        pipeline_parallel=head.pp_size,
        max_batch=config.max_batch,
        context_length=head.context_length,
        vocab_size=head.vocab_size,
        dtype=head.dtype,
        device=head.device,
        prefix_cache=config.prefix_cache,
        eviction_policy=config.eviction,
        slru_protected_ratio=config.slru_protected_ratio,
        chunk_size=config.chunk_size,
        max_batch_tokens=config.max_batch_tokens,
        mixed_steps=config.mixed_steps,
        layer_groups=served.layer_groups,
        step_timeout_s=config.step_timeout_s,
        drain_timeout_s=config.drain_timeout_s,
        shard_weight_bytes=max(i.weight_bytes for i in infos),
        shard_kv_pool_bytes=max(w.kv_pool_bytes for w in warmups),
        decode_graphs=bool(warmups[0].decode_graph_buckets),
        decode_graph_buckets=warmups[0].decode_graph_buckets,
        decode_graph_capture_s=max(w.capture_s for w in warmups),
        weight_formats={k: v for i in infos for k, v in i.weight_formats.items()},
        kv_dtype=head.kv_dtype,
        speculative=config.speculative,
        spec_tokens=config.spec_tokens,
    )


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def stats_response(replica: Replica, counters: StatsCounters) -> pb.StatsResponse:
    """The replica's live page pool and queue counts, and the router's counters."""
    st = pb.StatsResponse(
        serving=replica.serving, replica_failures=replica.failures, replica_recoveries=replica.recoveries
    )
    load, pages, c = replica.load(), replica.pool, counters
    if load is None:
        return st
    st.MergeFrom(
        pb.StatsResponse(
            pages_total=pages.num_pages,
            pages_free=pages.free,
            pages_referenced=pages.referenced,
            pages_evictable=pages.evictable,
            pages_cached=pages.cached,
            pages_reserved=pages.reserved,
            pages_probation=len(pages.probation),
            pages_protected=len(pages.protected),
            prefix_hit_tokens=pages.hit_tokens,
            prefix_query_tokens=pages.query_tokens,
            requests_waiting=load.waiting,
            requests_running=load.running,
            requests_prefilling=load.prefilling,
            requests_decoding=load.decoding,
            steps=c.steps,
            tokens_generated=c.tokens_generated,
            prompt_tokens_computed=c.prompt_tokens_computed,
            requests_failed=c.requests_failed,
            decode_graph_launches=c.decode_graph_launches,
            eager_decode_steps=c.eager_decode_steps,
            mixed_steps=c.mixed_steps,
            layer_group_steps=c.layer_group_steps,
            spec_proposed_tokens=c.spec_proposed_tokens,
            spec_accepted_tokens=c.spec_accepted_tokens,
            spec_verifications=c.spec_verifications,
            decode_step_ms_p50=_median([w for w, _ in c.decode_step_times]),
            shard_decode_step_ms_p50=_median([s for _, s in c.decode_step_times]),
        )
    )
    return st
