"""Bearer-token authentication of the coordinator's client API.

Accepted tokens come from a file (one per line; blank lines and # comments ignored), re-read
whenever its modification time changes, so tokens rotate without a restart, and/or from the
environment (SPECDEC_AUTH_TOKENS, comma-separated). Clients send `authorization: Bearer
<token>` metadata. The health and reflection services stay open, so probes need no token.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
from pathlib import Path

import grpc

log = logging.getLogger(__name__)

PROTECTED_PREFIX = "/specdec.v1.Coordinator/"
BEARER = "bearer "


class TokenSet:
    def __init__(self, path: Path | None, env_tokens: str = ""):
        self.path = Path(path) if path else None
        self._env = {t.strip() for t in env_tokens.split(",") if t.strip()}
        self._file: set[str] = set()
        self._stamp: tuple[int, int] | None = None
        if self.path is not None:
            self._reload(required=True)

    @property
    def enabled(self) -> bool:
        return self.path is not None or bool(self._env)

    def _reload(self, required: bool = False) -> None:
        try:
            stat = self.path.stat()
        except OSError as exc:
            if required:
                raise ValueError(f"--auth-token-file {self.path}: {exc.strerror}") from exc
            log.error("auth token file %s unreadable (%s); keeping the last tokens", self.path, exc.strerror)
            return
        stamp = (stat.st_mtime_ns, stat.st_size)
        if stamp == self._stamp:
            return
        lines = self.path.read_text().splitlines()
        self._file = {line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")}
        self._stamp = stamp
        log.info("auth: %d token(s) loaded from %s", len(self._file), self.path)

    def accepts(self, token: str) -> bool:
        if self.path is not None:
            self._reload()
        candidates = self._file | self._env
        # Compare against every token in constant time per token: no early exit on a match.
        matched = False
        for candidate in candidates:
            matched |= hmac.compare_digest(candidate.encode(), token.encode())
        return matched and bool(token)


def bearer_token(metadata) -> str | None:
    for key, value in metadata or ():
        if key == "authorization" and isinstance(value, str) and value.lower().startswith(BEARER):
            return value[len(BEARER):].strip()
    return None


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Answers UNAUTHENTICATED to client-API calls without an accepted bearer token."""

    def __init__(self, tokens: TokenSet):
        self.tokens = tokens

    async def intercept_service(self, continuation, handler_call_details):
        if not handler_call_details.method.startswith(PROTECTED_PREFIX):
            return await continuation(handler_call_details)
        token = bearer_token(handler_call_details.invocation_metadata)
        if token is not None and self.tokens.accepts(token):
            return await continuation(handler_call_details)
        message = "missing bearer token" if token is None else "invalid bearer token"
        handler = await continuation(handler_call_details)

        async def deny_stream(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
            yield  # pragma: no cover - makes this an async generator

        async def deny_unary(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

        # No request deserializer: a refused caller's bytes are never parsed.
        if handler is not None and handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(deny_stream,
                                                        response_serializer=handler.response_serializer)
        return grpc.unary_unary_rpc_method_handler(
            deny_unary, response_serializer=handler.response_serializer if handler else None)


def client_identity(context: grpc.aio.ServicerContext, authenticated: bool) -> str:
    """Who a call comes from, for per-client limits: with authentication on, its (accepted)
    token; otherwise its address. A token is never an identity when nothing checks it, or a
    caller could dodge every per-client limit by sending a new random token each time."""
    token = bearer_token(context.invocation_metadata()) if authenticated else None
    if token:
        return _token_identity(token)
    peer = context.peer() or "unknown"
    # ipv4:1.2.3.4:5678 -> ipv4:1.2.3.4 (one client, many ports)
    return peer.rsplit(":", 1)[0]


def http_identity(token: str | None, host: str, authenticated: bool) -> str:
    """client_identity for an HTTP caller, spelled as gRPC spells its peers, so a client
    holds one set of limits whichever API it calls."""
    if token and authenticated:
        return _token_identity(token)
    return f"ipv6:[{host}]" if ":" in host else f"ipv4:{host}"


def _token_identity(token: str) -> str:
    return "token:" + hashlib.sha256(token.encode()).hexdigest()[:12]  # never the token itself


def env_tokens() -> str:
    return os.environ.get("SPECDEC_AUTH_TOKENS", "")
