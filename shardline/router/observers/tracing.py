"""The router's spans: one per request, one per step, and the step's context in its plan.

- A request span continues the client's W3C `traceparent`/`tracestate` (gRPC metadata) or starts
  a trace. It is named and attributed per the OpenTelemetry GenAI conventions
  (`{gen_ai.operation.name} {gen_ai.request.model}`, usage and finish reasons at the end), with an
  event for queued, admitted, each prefill chunk, the first token and the finish. It carries the
  priority and whether a cache salt was sent, never the prompt or the salt.
- A step serves many requests, so each step is the root span of its own trace, linked to the
  span of every request it served, with its phase, batch size and token count. Its context
  travels with the step (`Step.trace_context`, the plan's on the wire), so every shard's step
  span is its child.
From a client's trace id a tracing view thus reaches the request span, through its links every
step that served it, and under each step every shard rank's work.
"""

from __future__ import annotations

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import Link, SpanKind, Status, StatusCode

from shardline.router.core.events import RequestEvents
from shardline.router.core.sequence import Ending, Failure, Sequence, ending_label


class Tracing(RequestEvents):
    def __init__(self, tracer, model: str):
        self.tracer, self.model = tracer, model
        self._steps: dict[int, trace.Span] = {}  # by step id: the steps in flight (one sent ahead too)

    def request_span(self, metadata, operation: str, attributes: dict) -> trace.Span:
        """Starts a request's span, continuing the trace context of the call's metadata."""
        parent = propagate.extract({k: v for k, v in metadata or () if isinstance(v, str)})
        return self.tracer.start_span(
            f"{operation} {self.model}",
            context=parent,
            kind=SpanKind.SERVER,
            attributes={"gen_ai.operation.name": operation, "gen_ai.request.model": self.model, **attributes},
        )

    # -- request events ---------------------------------------------------------------------------
    def queued(self, seq: Sequence) -> None:
        if seq.span is not None:
            seq.span.add_event("queued", {"gen_ai.usage.input_tokens": len(seq.prompt_ids)})

    def admitted(self, seq: Sequence) -> None:
        if seq.span is not None:
            seq.span.add_event("admitted", {"gen_ai.usage.cache_read.input_tokens": seq.cached_prompt_tokens})

    def token(self, seq: Sequence, first: bool) -> None:
        if first and seq.span is not None:
            seq.span.add_event("first_token")

    def finished(self, seq: Sequence, end: Ending) -> None:
        span = seq.span
        if span is None:
            return
        reason = ending_label(end)
        span.add_event("finished", {"reason": reason})
        span.set_attributes(
            {
                "gen_ai.usage.input_tokens": len(seq.prompt_ids),
                "gen_ai.usage.output_tokens": len(seq.output_ids),
                "gen_ai.usage.cache_read.input_tokens": seq.cached_prompt_tokens,
                "gen_ai.response.finish_reasons": [reason],
                "shardline.request.spec_proposed_tokens": seq.drafting.proposed if seq.drafting else 0,
                "shardline.request.spec_accepted_tokens": seq.drafting.accepted if seq.drafting else 0,
            }
        )
        if isinstance(end, Failure):
            span.set_status(Status(StatusCode.ERROR, reason))
        span.end()

    # -- steps ------------------------------------------------------------------------------------
    def step_started(self, step_id: int, step) -> None:
        for chunk in step.chunks if not step.layer_start else ():  # a chunk's first step
            seq = chunk.seq
            if seq.span is not None:
                seq.span.add_event(
                    "prefill_chunk",
                    {
                        "shardline.chunk.start": seq.num_computed,
                        "shardline.chunk.tokens": len(chunk.tokens),
                        "shardline.step.id": step_id,
                    },
                )
        links = [Link(s.seq.span.get_span_context()) for s in step.scheduled if s.seq.span is not None]
        span = self.tracer.start_span(
            "step",
            context=otel_context.Context(),
            kind=SpanKind.CLIENT,
            links=links,
            attributes={
                "shardline.step.id": step_id,
                "shardline.step.phase": step.phase.value,
                "shardline.step.batch_size": len(step.scheduled),
                "shardline.step.tokens": step.num_tokens,
                "shardline.step.sent_ahead": step.sampled_inputs,
                "shardline.step.layer_start": step.layer_start,
                # 0: through the last layer, as in the plan
                "shardline.step.layer_end": step.layer_end or 0,
            },
        )
        propagate.inject(step.trace_context, context=trace.set_span_in_context(span))
        self._steps[step_id] = span

    def step_done(self, step_id: int, step, result, wall_s: float) -> None:
        span = self._steps.pop(step_id)
        span.set_attributes(
            {
                "shardline.step.shard_compute_ms": result.compute_ms,
                "shardline.step.decode_graph_launches": result.graph_launches,
                "shardline.step.failed_sequences": result.failures,
                "shardline.step.spec_proposed_tokens": step.proposed,
                "shardline.step.spec_accepted_tokens": step.accepted,
            }
        )
        span.end()

    def step_failed(self, step_id: int, step, error: BaseException) -> None:
        span = self._steps.pop(step_id, None)
        if span is None:
            return
        span.record_exception(error)
        span.set_status(Status(StatusCode.ERROR, f"the step failed: {error}"))
        span.end()


def request_attributes(req) -> tuple[str, dict]:
    """(gen_ai.operation.name, the request's attributes) of a GenerateRequest, or of bytes that
    did not parse. Never the prompt, the stop strings or the cache salt themselves."""
    if not hasattr(req, "WhichOneof"):
        return "text_completion", {}
    s = req.sampling
    attributes = {
        "gen_ai.request.max_tokens": req.max_new_tokens,
        "gen_ai.request.temperature": s.temperature,
        "gen_ai.request.top_k": s.top_k,
        "gen_ai.request.stream": True,
        "shardline.request.priority": req.priority,
        "shardline.request.cache_salt_present": bool(req.cache_salt),
    }
    if s.HasField("top_p"):
        attributes["gen_ai.request.top_p"] = s.top_p
    if s.HasField("seed"):
        attributes["gen_ai.request.seed"] = s.seed
    return ("chat" if req.WhichOneof("input") == "messages" else "text_completion"), attributes
