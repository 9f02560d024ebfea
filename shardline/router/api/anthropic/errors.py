"""Anthropic's error shape, `{"type": "error", "error": {"type", "message"}}`, for the errors the
HTTP API raises (openai/errors.py's ApiError, whose status is what the gRPC API answers). The
type is Anthropic's word for the status."""

from __future__ import annotations

from shardline.router.api.openai.errors import ApiError

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "invalid_request_error",  # a request id already running
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",  # no shard group serving, or a drain: a client retries
}


def anthropic_error(e: ApiError) -> dict:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(e.status, "api_error"), "message": e.body.error.message}}
