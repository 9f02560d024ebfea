"""Serving `shardline.v1.Generation` (protos/generation.proto) with health and reflection: the
same registration for a router and for a gateway, whose handlers differ.

Request bytes that do not parse answer INVALID_ARGUMENT with the parser's message, not gRPC's
INTERNAL: the deserializer hands the handler a `Malformed` in place of the request.
"""

from __future__ import annotations

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from shardline.protos import generation_pb2 as pb

SERVICE = "shardline.v1.Generation"


class Malformed:
    """Stands in for a request whose bytes did not parse; the handler answers INVALID_ARGUMENT."""

    def __init__(self, message: str):
        self.message = message


def parser(cls):
    def parse(data: bytes):
        try:
            return cls.FromString(data)
        except Exception as e:  # DecodeError, or whatever else hostile bytes provoke
            return Malformed(f"the request does not parse as {cls.DESCRIPTOR.full_name}: {e}")

    return parse


def _as_is(data: bytes) -> bytes:
    return data


def add_generation_service(
    server: grpc.aio.Server,
    service,
    health_servicer: health.aio.HealthServicer,
    other_services: tuple[str, ...] = (),
    serialized_responses: bool = False,
) -> None:
    """`service`: an object with the Generate, Cancel, Stats and Info handlers;
    `other_services`: the names of services added beside it, for reflection;
    `serialized_responses`: Generate yields its responses serialized already (a gateway passes
    a router's on as they came)."""
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            service.Generate,
            request_deserializer=parser(pb.GenerateRequest),
            response_serializer=_as_is if serialized_responses else pb.GenerateResponse.SerializeToString,
        ),
        "Cancel": grpc.unary_unary_rpc_method_handler(
            service.Cancel,
            request_deserializer=parser(pb.CancelRequest),
            response_serializer=pb.CancelResponse.SerializeToString,
        ),
        "Stats": grpc.unary_unary_rpc_method_handler(
            service.Stats,
            request_deserializer=parser(pb.StatsRequest),
            response_serializer=pb.StatsResponse.SerializeToString,
        ),
        "Info": grpc.unary_unary_rpc_method_handler(
            service.Info,
            request_deserializer=parser(pb.InfoRequest),
            response_serializer=pb.InfoResponse.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = (
        SERVICE,
        *other_services,
        health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
        reflection.SERVICE_NAME,
    )
    reflection.enable_server_reflection(names, server)
