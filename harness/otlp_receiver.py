"""A real OTLP/gRPC trace receiver (the collector's TraceService from `opentelemetry-proto`) that
keeps what it receives, for the tracing tests and the tracing-overhead benchmark.

    with OtlpReceiver() as rx:      # rx.endpoint: "127.0.0.1:PORT"
        ...
        spans = rx.spans()          # every span so far, flattened with its resource's attributes
"""

from __future__ import annotations

import threading
from concurrent import futures
from dataclasses import dataclass

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue


def value(v: AnyValue):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


def attributes(kvs) -> dict:
    return {kv.key: value(kv.value) for kv in kvs}


@dataclass
class Span:
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    attributes: dict
    resource: dict
    links: list[tuple[str, str]]  # (trace id, span id) of each linked span
    events: list[tuple[str, dict]]
    status_code: int  # 0 unset, 1 ok, 2 error


class _Service(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self):
        self.lock = threading.Lock()
        self.received: list[Span] = []

    def Export(self, request, context):
        spans = []
        for rs in request.resource_spans:
            resource = attributes(rs.resource.attributes)
            for ss in rs.scope_spans:
                for s in ss.spans:
                    spans.append(
                        Span(
                            s.name,
                            s.trace_id.hex(),
                            s.span_id.hex(),
                            s.parent_span_id.hex(),
                            attributes(s.attributes),
                            resource,
                            [(link.trace_id.hex(), link.span_id.hex()) for link in s.links],
                            [(e.name, attributes(e.attributes)) for e in s.events],
                            s.status.code,
                        )
                    )
        with self.lock:
            self.received.extend(spans)
        return trace_service_pb2.ExportTraceServiceResponse()


class OtlpReceiver:
    def __init__(self, host: str = "127.0.0.1", port: int = 0):
        self._service = _Service()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self._service, self._server)
        self.port = self._server.add_insecure_port(f"{host}:{port}")
        self.endpoint = f"{host}:{self.port}"

    def __enter__(self) -> OtlpReceiver:
        self._server.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.stop(grace=None)

    def spans(self) -> list[Span]:
        with self._service.lock:
            return list(self._service.received)
