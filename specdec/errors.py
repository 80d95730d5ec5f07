"""Typed errors raised by plain Python code, and the one interceptor per server that maps
them to gRPC status codes. Handlers never pick status codes for these themselves, so a
`ValueError` from deep inside can never surface as INTERNAL with a stack trace."""

from __future__ import annotations

import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc

log = logging.getLogger(__name__)


class SpecdecError(Exception):
    """Base of the errors that carry their own gRPC status."""

    code = grpc.StatusCode.INTERNAL


class InvalidArgument(SpecdecError, ValueError):
    """The request is malformed; the message names the field."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class ResourceExhausted(SpecdecError):
    """A limit was hit (sessions, memory, queue); retrying later may work, after
    `retry_after_s` seconds when the limit knows (None: it does not)."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED

    def __init__(self, message: str, retry_after_s: float | None = None):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class FailedPrecondition(SpecdecError):
    """The service is not in a state to serve this (e.g. mismatched workers)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class DeadlineExceeded(SpecdecError):
    """The client's deadline passed before the request could finish."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class NotFound(SpecdecError):
    """The request names something this service does not serve (e.g. a model)."""

    code = grpc.StatusCode.NOT_FOUND


class Unavailable(SpecdecError):
    """A worker the request needs cannot be reached."""

    code = grpc.StatusCode.UNAVAILABLE


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status a handler's exception becomes (what the interceptor below sends, and what a
    step stream puts in a failed step's answer, specdec.step_streams)."""
    if isinstance(exc, SpecdecError):
        return exc.code, str(exc)
    if isinstance(exc, grpc.aio.AioRpcError):
        # A worker's own status, passed through with the worker named by the caller.
        return exc.code(), exc.details() or exc.code().name
    log.exception("unexpected error", exc_info=exc)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}"


class _Malformed:
    """A request that did not parse (e.g. invalid UTF-8 in a string field)."""

    def __init__(self, error: Exception):
        self.error = error


def _lenient(deserializer):
    """Parsing happens before any handler code runs; a failure there would surface as
    UNKNOWN with a logged trace. Hand the handler a marker instead, which it refuses."""
    if deserializer is None:
        return None

    def parse(data: bytes):
        try:
            return deserializer(data)
        except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError and friends
            return _Malformed(exc)

    return parse


def _malformed_message(request: _Malformed) -> str:
    return f"malformed request: {request.error} (string fields must be valid UTF-8)"


def refuse_malformed(request) -> None:
    """Raises InvalidArgument for a message of a client stream that did not parse: a
    bidirectional handler reads its requests itself (context.read()), past the interceptor."""
    if isinstance(request, _Malformed):
        raise InvalidArgument(_malformed_message(request))


class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):
    """Wraps every unary, server-streaming and coroutine bidirectional handler so that typed
    errors become statuses. A bidirectional handler reads its requests through its context:
    it calls `refuse_malformed` on each."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                _wrap_unary(handler.unary_unary),
                request_deserializer=_lenient(handler.request_deserializer),
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                _wrap_stream(handler.unary_stream),
                request_deserializer=_lenient(handler.request_deserializer),
                response_serializer=handler.response_serializer,
            )
        if handler.stream_stream is not None and inspect.iscoroutinefunction(handler.stream_stream):
            # Not reflection's, an async generator: it maps nothing of ours.
            return grpc.stream_stream_rpc_method_handler(
                _wrap_unary(handler.stream_stream),  # its "request" is the request iterator
                request_deserializer=_lenient(handler.request_deserializer),
                response_serializer=handler.response_serializer,
            )
        return handler


def _wrap_unary(behavior: Callable[..., Awaitable]):
    async def wrapped(request, context: grpc.aio.ServicerContext):
        if isinstance(request, _Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _malformed_message(request))
        try:
            return await behavior(request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001 - this is the one place that maps them
            code, message = status_for(exc)
            await context.abort(code, message)

    return wrapped


def _wrap_stream(behavior: Callable[..., AsyncIterator]):
    async def wrapped(request, context: grpc.aio.ServicerContext):
        if isinstance(request, _Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _malformed_message(request))
        try:
            async for response in behavior(request, context):
                yield response
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001
            code, message = status_for(exc)
            await context.abort(code, message)

    return wrapped
