"""The OpenAI API's errors: OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, with
the HTTP status of what the gRPC API answers (INVALID_ARGUMENT 400, UNAUTHENTICATED 401,
NOT_FOUND 404, a body over the limit 413, RESOURCE_EXHAUSTED 429, UNAVAILABLE 503, INTERNAL
500)."""

from __future__ import annotations

import re

from pydantic import ValidationError

from shardline.router.api.openai.schema import Error, ErrorResponse

HTTP_STATUS = {
    "INVALID_ARGUMENT": (400, "invalid_request_error"),
    "UNAUTHENTICATED": (401, "authentication_error"),
    "NOT_FOUND": (404, "not_found_error"),
    "ALREADY_EXISTS": (409, "conflict_error"),
    "RESOURCE_EXHAUSTED": (429, "rate_limit_error"),
    "UNAVAILABLE": (503, "service_unavailable_error"),
    "INTERNAL": (500, "server_error"),
}


class ApiError(Exception):
    def __init__(self, status: int, message: str, type: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.body = status, ErrorResponse(error=Error(message=message, type=type, param=param, code=code))

    @classmethod
    def of(cls, code: str, message: str) -> ApiError:
        """The error a gRPC status code (its name) stands for."""
        status, type_ = HTTP_STATUS.get(code, (500, "server_error"))
        return cls(status, message, type_, code=code.lower())


def invalid_body(e: ValidationError) -> ApiError:
    """A 400 naming the first field of the body that pydantic refused."""
    first = e.errors()[0]
    # A union's members name themselves in the location (prompt.str, prompt.list[int].0): not fields.
    param = (
        ".".join(
            str(part)
            for part in first["loc"]
            if isinstance(part, int)
            or re.fullmatch(r"[a-z_]+", part)
            and part not in ("str", "int", "float", "bool", "list", "dict", "none")
        )
        or None
    )
    message = first["msg"].removeprefix("Value error, ")
    return ApiError(
        400,
        f"{param}: {message}" if param and not message.startswith(param) else message,
        "invalid_request_error",
        param=param,
    )
