"""OpenAI's error object, `{"error": {"message", "type", "param", "code"}}`, and the HTTP
status of every failure a request can meet, from the status code its gRPC twin carries
(specdec.errors), so both APIs refuse the same things the same way."""

from __future__ import annotations

import math

import grpc
from fastapi.responses import JSONResponse

from specdec.errors import ResourceExhausted, SpecdecError

# gRPC status -> (HTTP status, OpenAI error type, code).
STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error", None),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error", None),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error", None),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error", "invalid_api_key"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error", None),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error", "model_not_found"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error", "rate_limit_exceeded"),
    grpc.StatusCode.CANCELLED: (499, "cancelled", None),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable", "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout", "deadline_exceeded"),
}
INTERNAL = (500, "server_error", None)
# The hint a 429 carries when the limit that refused it gave none (a worker's cache, say).
DEFAULT_RETRY_AFTER_S = 1


class HttpError(Exception):
    """A refusal made by the HTTP layer itself (a path, a body, a token)."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type_, code, param


def body(message: str, type_: str, code: str | None = None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def describe(exc: BaseException) -> tuple[int, dict, dict]:
    """(HTTP status, OpenAI error body, extra headers) of an exception a request raised."""
    if isinstance(exc, HttpError):
        return exc.status, body(exc.message, exc.type, exc.code, exc.param), {}
    if isinstance(exc, SpecdecError):
        code, message = exc.code, str(exc)
    elif isinstance(exc, grpc.aio.AioRpcError):  # a worker's own status, passed through
        code, message = exc.code(), exc.details() or exc.code().name
    else:
        status, type_, err_code = INTERNAL
        return status, body(f"internal error: {type(exc).__name__}", type_, err_code), {}
    status, type_, err_code = STATUS.get(code, INTERNAL)
    if status == 400 and "do not fit the model's context" in message:
        err_code = "context_length_exceeded"
    headers = {}
    if status == 429:
        retry = exc.retry_after_s if isinstance(exc, ResourceExhausted) and exc.retry_after_s else None
        headers["Retry-After"] = str(math.ceil(retry or DEFAULT_RETRY_AFTER_S))
    param = message.split(":", 1)[0] if status == 400 and ":" in message and " " not in message.split(":", 1)[0] \
        else None
    return status, body(message, type_, err_code, param), headers


def response(exc: BaseException) -> JSONResponse:
    status, content, headers = describe(exc)
    return JSONResponse(content, status_code=status, headers=headers)
