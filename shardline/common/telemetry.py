"""OpenTelemetry tracing for both services: the provider, its OTLP/gRPC exporter, and log lines
that carry the current trace and span ids.

Tracing is on when `--otlp-endpoint` or the standard `OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT` names
a collector, and `OTEL_SDK_DISABLED` is not true; otherwise `setup_tracing` returns None and the
services create no spans at all. The SDK reads the other standard variables itself
(`OTEL_TRACES_SAMPLER[_ARG]`, `OTEL_RESOURCE_ATTRIBUTES`, `OTEL_BSP_*`, `OTEL_EXPORTER_OTLP_HEADERS`,
...). `service.name` is `shardline-router` or `shardline-shard` unless `OTEL_SERVICE_NAME` says
otherwise; `service.instance.id` names the process (and a shard's TP rank and PP stage).
"""

from __future__ import annotations

import atexit
import logging
import os
import socket

from opentelemetry import trace


def tracing_endpoint(flag: str) -> str | None:
    """The collector spans go to, or None when tracing is off."""
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    endpoint = (
        flag or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    )
    if not endpoint:
        return None
    return endpoint if "://" in endpoint else "http://" + endpoint  # host:port: plaintext gRPC


def setup_tracing(flag: str, service: str, instance: str, attributes: dict | None = None):
    """A tracer for `service` ('router' or 'shard'), or None when tracing is off. Spans are
    exported in batches; the batch left at exit is flushed."""
    endpoint = tracing_endpoint(flag)
    if endpoint is None:
        return None
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    own = {"service.instance.id": f"{socket.gethostname()}/{os.getpid()}/{instance}", **(attributes or {})}
    if not os.environ.get("OTEL_SERVICE_NAME"):
        own["service.name"] = f"shardline-{service}"
    provider = TracerProvider(resource=Resource.create(own))  # the sampler comes from the environment
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    atexit.register(provider.shutdown)
    logging.getLogger(__name__).info("exporting traces to %s", endpoint)
    return provider.get_tracer("shardline")


class TraceIds(logging.Filter):
    """Sets `trace_ids` on every record: " [trace=... span=...]" inside a span, else empty."""

    def filter(self, record: logging.LogRecord) -> bool:
        ctx = trace.get_current_span().get_span_context()
        record.trace_ids = (
            f" [trace={trace.format_trace_id(ctx.trace_id)} span={trace.format_span_id(ctx.span_id)}]"
            if ctx.is_valid
            else ""
        )
        return True


def log_with_trace_ids(fmt: str, level: str) -> None:
    handler = logging.StreamHandler()
    handler.addFilter(TraceIds())
    handler.setFormatter(logging.Formatter(fmt))
    logging.basicConfig(level=level, handlers=[handler])
