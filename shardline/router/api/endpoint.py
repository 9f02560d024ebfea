"""A generation endpoint of the HTTP APIs (http_app.py serves them): the body's schema, the
GenerateRequests a body asks for, and the answer that writes their outputs in its API's shape."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pydantic import BaseModel

from shardline.common.tokenizer import TextCodec
from shardline.protos import generation_pb2 as pb
from shardline.router.api.openai.answer import Answer
from shardline.router.api.openai.choices import Choices


@dataclass(frozen=True)
class Endpoint:
    """`requests(body)`: one GenerateRequest per choice (ValueError for what protobuf cannot
    carry); `answer(body, choices, model, codec)` writes their outputs. `prepare(body, tenant)`,
    where an API has one, first gives the body what the server keeps for that tenant (the
    conversation a Responses request continues), or raises ApiError."""

    operation: str  # the request span's gen_ai.operation.name
    schema: type[BaseModel]
    requests: Callable[[BaseModel], list[pb.GenerateRequest]]
    answer: Callable[[BaseModel, Choices, str, TextCodec], Answer]
    prepare: Callable[[BaseModel, str], None] | None = None
