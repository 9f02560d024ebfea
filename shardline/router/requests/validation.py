"""What a request may ask for, checked before it costs anything: one pure function of the request
and the served model's limits, shared by every front end.

Bounded here: stop strings, ids, salts and message counts; a prompt longer than the context
times the longest token can never fit and is refused before tokenizing. `prompt_fits` is the one
check of prompt + max_new_tokens against the context, for token ids at once and for text once it
is tokenized.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import grpc

from shardline.common.tokenizer import CHAT_ROLES
from shardline.protos import generation_pb2 as pb
from shardline.router.core.sequence import Sampling

MAX_STOPS, MAX_STOP_CHARS = 16, 256
MAX_ID_CHARS = 256  # request_id, cache_salt
MAX_MESSAGES = 1024
MAX_LOGPROBS = 20  # alternatives per position (the shard's own limit too)


class InvalidRequest(Exception):
    """A request refused with a status (a gRPC status code) and a message for the client."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


def invalid(message: str) -> InvalidRequest:
    return InvalidRequest(grpc.StatusCode.INVALID_ARGUMENT, message)


@dataclass(frozen=True)
class Limits:
    """Of the model and the replica being served."""

    context_length: int
    vocab_size: int
    max_token_chars: int  # the most characters one token stands for
    pool_tokens: int  # what the whole KV page pool holds


def new_tokens(req: pb.GenerateRequest, prompt_tokens: int, limits: Limits) -> int:
    """The most tokens the request generates: max_new_tokens, or where that is 0 (an open-ended
    request) what the context, and the page pool, leave after the prompt."""
    return req.max_new_tokens or max(1, min(limits.context_length, limits.pool_tokens) - prompt_tokens)


def prompt_fits(prompt_tokens: int, max_new_tokens: int, limits: Limits) -> None:
    if prompt_tokens == 0:
        raise invalid("the prompt has no tokens")
    if prompt_tokens + max_new_tokens > limits.context_length:
        raise invalid(
            f"prompt ({prompt_tokens} tokens) + max_new_tokens ({max_new_tokens}) "
            f"exceeds the model's context of {limits.context_length} tokens"
        )


def validate(req: pb.GenerateRequest, limits: Limits, open_ended: bool = False) -> None:
    """Raises InvalidRequest for anything the request may not ask for. `open_ended`:
    max_new_tokens 0 means up to the model's context (the OpenAI API's chat default)."""
    if req.max_new_tokens == 0 and not open_ended:
        raise invalid("max_new_tokens must be at least 1")
    if req.max_new_tokens >= limits.context_length:
        raise invalid(
            f"max_new_tokens ({req.max_new_tokens}) exceeds the model's context of {limits.context_length} tokens"
        )
    if len(req.stop) > MAX_STOPS:
        raise invalid(f"at most {MAX_STOPS} stop strings, got {len(req.stop)}")
    for s in req.stop:
        if not 1 <= len(s) <= MAX_STOP_CHARS:
            raise invalid(f"stop strings must have 1 to {MAX_STOP_CHARS} characters, got {len(s)}")
    for name in ("request_id", "cache_salt"):
        if len(getattr(req, name)) > MAX_ID_CHARS:
            raise invalid(f"{name} is longer than {MAX_ID_CHARS} characters")
    s = req.sampling
    if not (math.isfinite(s.temperature) and s.temperature >= 0):
        raise invalid(f"temperature must be a finite number >= 0, got {s.temperature}")
    if not 0.0 < _top_p(s) <= 1.0:  # NaN fails this too
        raise invalid(f"top_p must lie in (0, 1], got {_top_p(s)}")
    for name in ("logprobs", "prompt_logprobs"):
        if getattr(req, name) > MAX_LOGPROBS:
            raise invalid(f"{name} must lie in 0..{MAX_LOGPROBS}, got {getattr(req, name)}")
    _input(req, limits)


def _top_p(s: pb.SamplingParams) -> float:
    return s.top_p if s.HasField("top_p") else 1.0


def sampling_of(req: pb.GenerateRequest, seed_if_unset: int) -> Sampling:
    """A validated request's sampling as the shards take it; the server picks the seed of one
    that sets none."""
    s = req.sampling
    return Sampling(
        temperature=s.temperature,
        top_p=_top_p(s),
        top_k=s.top_k,
        seed=s.seed if s.HasField("seed") else seed_if_unset,
        logprobs=req.logprobs if req.HasField("logprobs") else None,
    )


def _json(name: str, text: str, kind: type) -> None:
    """Optional JSON given as text: an array of objects (`kind` list) or an object (dict)."""
    if not text:
        return
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise invalid(f"{name} is not JSON: {e}") from None
    if kind is list and not (isinstance(value, list) and all(isinstance(v, dict) for v in value)):
        raise invalid(f"{name} must be a JSON array of objects")
    if kind is dict and not isinstance(value, dict):
        raise invalid(f"{name} must be a JSON object")


def _input(req: pb.GenerateRequest, limits: Limits) -> None:
    kind = req.WhichOneof("input")
    if kind == "prompt_token_ids":
        ids = req.prompt_token_ids.ids
        prompt_fits(len(ids), new_tokens(req, len(ids), limits), limits)
        if max(ids) >= limits.vocab_size:
            raise invalid(f"token id {max(ids)} is outside the vocabulary (size {limits.vocab_size})")
        return
    if kind == "prompt":
        if not req.prompt:
            raise invalid("prompt is empty")
        chars = len(req.prompt)
    elif kind == "messages":
        messages = req.messages.messages
        if not messages:
            raise invalid("messages is empty")
        if len(messages) > MAX_MESSAGES:
            raise invalid(f"at most {MAX_MESSAGES} messages, got {len(messages)}")
        for m in messages:
            if m.role not in CHAT_ROLES:
                raise invalid(f"unknown chat role {m.role[:40]!r}; expected one of {sorted(CHAT_ROLES)}")
            _json("tool_calls_json", m.tool_calls_json, list)
        _json("tools_json", req.messages.tools_json, list)
        _json("template_kwargs_json", req.messages.template_kwargs_json, dict)
        chars = sum(len(m.content) + len(m.tool_calls_json) for m in messages) + len(req.messages.tools_json)
    else:
        raise invalid("no input: set prompt, prompt_token_ids or messages")
    limit = limits.context_length * limits.max_token_chars
    if chars > limit:
        raise invalid(
            f"the prompt has {chars} characters; no prompt over {limit} characters fits the "
            f"model's context of {limits.context_length} tokens"
        )
