"""The routes of the OpenAI-compatible API (FastAPI). Every completion goes through
`CoordinatorServicer.generate`, exactly as a gRPC Generate does.

Streaming (`stream: true`) answers server-sent events (sse-starlette) ending in
`data: [DONE]`. The first round runs before the response starts, so what refuses a request
(validation, limits, no target) still answers with its HTTP status; an error after that
arrives as an event carrying OpenAI's error object. A client that disconnects cancels its
request, which frees its worker sessions (RoundRunner.run's cleanup).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sse_starlette import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from coordinator.openai_api import errors
from coordinator.openai_api.errors import HttpError
from coordinator.openai_api.schemas import ChatCompletionRequest, CompletionRequest
from specdec.errors import InvalidArgument, NotFound, SpecdecError
from specdec.security.auth import TokenSet, http_identity
from specdec.v1 import coordinator_pb2

FINISH_REASONS = {coordinator_pb2.FINISH_REASON_EOS: "stop", coordinator_pb2.FINISH_REASON_STOP: "stop",
                  coordinator_pb2.FINISH_REASON_LENGTH: "length"}
REQUEST_ID_HEADER = "x-request-id"
# The caller's deadline in seconds (OpenAI's clients time out on their side only; a
# gateway or client that wants the server to give up sends this): past it, 504.
TIMEOUT_HEADER = "x-request-timeout"
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that went away


def build_app(servicer, tokens: TokenSet, model_names: list[str], max_body_bytes: int) -> FastAPI:
    """servicer: a CoordinatorServicer; model_names: the names a request may give, the
    first listed by /v1/models."""
    app = FastAPI(title="specdec", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.draining = False
    created = int(time.time())

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return errors.response(HttpError(400, _validation_message(exc), param=_validation_param(exc)))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        message = f"{request.method} {request.url.path}: " + ("no such route" if exc.status_code == 404
                                                              else str(exc.detail))
        return errors.response(HttpError(exc.status_code, message, code=code))

    @app.exception_handler(Exception)
    async def failed(request: Request, exc: Exception) -> JSONResponse:
        return errors.response(exc)

    @app.exception_handler(HttpError)
    @app.exception_handler(SpecdecError)
    @app.exception_handler(grpc.aio.AioRpcError)
    async def refused(request: Request, exc: Exception) -> JSONResponse:
        return errors.response(exc)

    def authorize(request: Request) -> str:
        """The caller's identity for the limits; 401 without an accepted bearer token."""
        header = request.headers.get("authorization", "")
        token = header[7:].strip() if header[:7].lower() == "bearer " else None
        if tokens.enabled and not (token and tokens.accepts(token)):
            raise HttpError(401, "missing bearer token" if token is None else "invalid bearer token",
                            "authentication_error", "invalid_api_key")
        host = request.client.host if request.client else "unknown"
        return http_identity(token, host, tokens.enabled)

    def check_model(name: str) -> str:
        if name not in model_names:
            raise NotFound(f"model {name!r} is not served here; this server serves {model_names[0]!r}")
        return model_names[0]

    @app.get("/health")
    async def health() -> Response:
        if app.state.draining:
            return errors.response(HttpError(503, "draining", "service_unavailable", "draining"))
        if not servicer.serving_targets():
            return errors.response(HttpError(503, "no target replica is serving", "service_unavailable",
                                             "service_unavailable"))
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        """The process's Prometheus metrics (specdec_* and the vLLM names), as vLLM serves
        them on its API port."""
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        authorize(request)
        return JSONResponse({"object": "list", "data": [
            {"id": model_names[0], "object": "model", "created": created, "owned_by": "specdec",
             "root": model_names[-1], "parent": None, "max_model_len": servicer.max_context}]})

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await _complete(request, body, chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await _complete(request, body, chat=False)

    async def _complete(request: Request, body, chat: bool) -> Response:
        client = authorize(request)
        model = check_model(body.model)
        proto = body.to_proto(servicer.config.max_new_tokens_limit)
        if app.state.draining:
            raise HttpError(503, "the server is draining; retry on another replica", "service_unavailable",
                            "draining")
        request_id = request.headers.get(REQUEST_ID_HEADER, "")
        stream = servicer.generate(proto, client, request_id, _timeout(request))
        shape = _Shape(chat, model, body.return_token_ids)
        if not body.stream:
            return await _whole(request, stream, shape)
        try:
            first = await anext(stream)
        except BaseException:
            await stream.aclose()
            raise
        headers = {REQUEST_ID_HEADER: request_id} if request_id else {}
        return EventSourceResponse(_events(first, stream, shape, body.include_usage), headers=headers,
                                   ping=15, sep="\n")

    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    return app


class BodyLimit:
    """Refuses (413) a request body larger than max_bytes, before it is read or parsed; a
    pure ASGI middleware, so streamed responses and disconnects pass through untouched."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            length = dict(scope["headers"]).get(b"content-length", b"")
            if length.isdigit() and int(length) > self.max_bytes:
                refusal = errors.response(HttpError(413, f"request body of {int(length)} bytes exceeds the limit of "
                                                         f"{self.max_bytes}", code="request_too_large"))
                await refusal(scope, receive, send)
                return
            received = 0

            async def limited():
                nonlocal received
                message = await receive()
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise HttpError(413, f"request body exceeds the limit of {self.max_bytes} bytes",
                                    code="request_too_large")
                return message

            await self.app(scope, limited, send)
            return
        await self.app(scope, receive, send)


def _timeout(request: Request) -> float | None:
    value = request.headers.get(TIMEOUT_HEADER)
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not 0 < seconds < 1e7:
        raise InvalidArgument(f"{TIMEOUT_HEADER}: a positive number of seconds, got {value!r}")
    return seconds


class _Shape:
    """How one request's responses look: chat or text completion, its id and model."""

    def __init__(self, chat: bool, model: str, token_ids: bool):
        self.chat, self.model, self.token_ids = chat, model, token_ids
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def envelope(self, choices: list, streaming: bool) -> dict:
        kind = ("chat.completion" if self.chat else "text_completion") + (".chunk" if streaming and self.chat else "")
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    def choice(self, text: str | None, token_ids: list[int], finish: str | None, streaming: bool,
               role: bool = False) -> dict:
        if self.chat:
            message = {"role": "assistant"} if role or not streaming else {}
            if text is not None:
                message["content"] = text
            choice = {"index": 0, ("delta" if streaming else "message"): message}
        else:
            choice = {"index": 0, "text": text or ""}
        choice["logprobs"] = None
        choice["finish_reason"] = finish
        if self.token_ids:
            choice["token_ids"] = token_ids
        return choice


def _usage(stats: coordinator_pb2.GenerationStats) -> dict:
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.generated_tokens,
            "total_tokens": stats.prompt_tokens + stats.generated_tokens}


def _specdec(stats: coordinator_pb2.GenerationStats) -> dict:
    """The request's speculative statistics (GenerationStats, field for field)."""
    return {field.name: getattr(stats, field.name) for field in stats.DESCRIPTOR.fields}


async def _whole(request: Request, stream: AsyncIterator, shape: _Shape) -> Response:
    """A non-streamed completion; the request is cancelled if its client goes away."""
    async def collect() -> list:
        return [response async for response in stream]

    work = asyncio.ensure_future(collect())
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if not work.done():
        work.cancel()
        await asyncio.gather(work, return_exceptions=True)
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    responses = work.result()
    last = responses[-1]
    text = "".join(r.text for r in responses)
    ids = [t for r in responses for t in r.token_ids]
    content = shape.envelope([shape.choice(text, ids, FINISH_REASONS.get(last.finish_reason), False)], False)
    content["usage"] = _usage(last.stats)
    content["specdec"] = _specdec(last.stats)
    return JSONResponse(content)


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _events(first, stream: AsyncIterator, shape: _Shape, include_usage: bool) -> AsyncIterator[dict]:
    """The SSE events of a streamed completion: a role chunk (chat), one chunk per response
    with text (or ids, when asked for), a chunk with finish_reason and the specdec
    statistics, the usage chunk when asked for, then [DONE]."""
    def chunk(choices: list, **extra) -> dict:
        content = shape.envelope(choices, True)
        if include_usage:
            content["usage"] = None
        content.update(extra)
        return {"data": json.dumps(content, separators=(",", ":"))}

    try:
        if shape.chat:
            yield chunk([shape.choice("", [], None, True, role=True)])
        response = first
        while True:
            if response.text or (shape.token_ids and response.token_ids):
                yield chunk([shape.choice(response.text, list(response.token_ids), None, True)])
            if response.finish_reason:
                yield chunk([shape.choice(None if shape.chat else "", [], FINISH_REASONS.get(response.finish_reason),
                                          True)], specdec=_specdec(response.stats))
                if include_usage:
                    yield chunk([], usage=_usage(response.stats))
                break
            response = await anext(stream)
    except Exception as exc:  # noqa: BLE001 - after the 200 the error travels as an event
        status, content, _ = errors.describe(exc)
        content["error"]["code"] = content["error"]["code"] or status
        yield {"data": json.dumps(content)}
    finally:
        await stream.aclose()
    yield {"data": "[DONE]"}


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for error in exc.errors()[:3]:
        location = ".".join(str(p) for p in error.get("loc", ()) if p != "body") or "body"
        if error.get("type") == "extra_forbidden":
            parts.append(f"{location}: not supported by specdec")
        elif error.get("type") == "json_invalid":
            parts.append(f"body: invalid JSON ({error.get('ctx', {}).get('error', 'parse error')})")
        else:
            parts.append(f"{location}: {error.get('msg', 'invalid')}")
    return "; ".join(parts)


def _validation_param(exc: RequestValidationError) -> str | None:
    errors_ = exc.errors()
    if not errors_:
        return None
    location = [str(p) for p in errors_[0].get("loc", ()) if p != "body"]
    return location[0] if location else None
