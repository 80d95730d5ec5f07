"""The Python client of the coordinator, used by `specdec generate`, the tests and the
benchmarks."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from specdec.v1 import coordinator_pb2, coordinator_pb2_grpc

STATS_FIELDS = ("rounds", "proposed", "accepted", "acceptance_rate", "tokens_per_round", "ttft_s", "tokens_per_s")
EXTRA_STATS_FIELDS = ("prompt_tokens", "generated_tokens", "draft_s", "verify_s", "wire_bytes", "resyncs", "seed",
                      "rejected_blocks", "alternative_tokens", "resumes")
# Statuses of a broken stream that another attempt can fix: the coordinator went away
# (crash, restart, a drain's end), the connection failed, or the server cancelled the stream
# (a server stopped past its grace period; a cancel of this client's own surfaces as
# asyncio.CancelledError instead, and is never resumed).
RESUMABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED, grpc.StatusCode.CANCELLED})


@dataclass(frozen=True)
class Resume:
    """How a broken stream is resumed: at most `attempts` times per request, each after a
    back-off drawn uniformly from [0, min(max_backoff_s, backoff_s * 2**n)] ("full jitter":
    a crowd of clients cut off at once does not come back at once)."""

    attempts: int = 5
    backoff_s: float = 0.2
    max_backoff_s: float = 5.0

    def delay(self, attempt: int) -> float:
        return random.uniform(0.0, min(self.max_backoff_s, self.backoff_s * 2 ** attempt))


NO_RESUME = Resume(attempts=0)


def pushed_back(error: grpc.aio.AioRpcError) -> bool:
    """The server said not to try again (gRPC A6 retry pushback: a negative or malformed
    grpc-retry-pushback-ms), as a coordinator does when its workers stayed unavailable
    through its own retries."""
    for key, value in error.trailing_metadata() or ():
        if key == "grpc-retry-pushback-ms":
            try:
                return int(value) < 0
            except ValueError:
                return True
    return False


def make_request(prompt: str | list[int], *, raw: bool = False, max_new_tokens: int = 128, k: int | None = None,
                 speculate: bool = True, stop: list[str] | None = None,
                 request_id: str = "", temperature: float | None = None, top_k: int | None = None,
                 top_p: float | None = None, seed: int | None = None) -> coordinator_pb2.GenerateRequest:
    """A GenerateRequest: a list of ids is sent as token_ids, text as one user chat message
    (through the target's chat template) unless raw."""
    request = coordinator_pb2.GenerateRequest(max_new_tokens=max_new_tokens, disable_speculation=not speculate,
                                              stop=stop or [], request_id=request_id)
    if isinstance(prompt, list):
        request.token_ids.ids.extend(prompt)
    elif raw:
        request.text = prompt
    else:
        request.chat.messages.add(role="user", content=prompt)
    if k is not None:
        request.num_speculative_tokens = k
    for name, value in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p), ("seed", seed)):
        if value is not None:
            setattr(request, name, value)
    return request


@dataclass
class Completion:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    stats: dict = field(default_factory=dict)
    wall_s: float = 0.0

    def to_json(self) -> dict:
        return {"text": self.text, "token_ids": self.token_ids, "finish_reason": self.finish_reason,
                "stats": self.stats, "wall_s": self.wall_s}


class Client:
    def __init__(self, address: str, max_message_bytes: int = 16 * 1024 * 1024, tls=None, token: str | None = None):
        """tls: a specdec.security.tls.ClientTLS to connect over TLS; token: a bearer token."""
        from specdec.security.tls import channel

        options = [("grpc.max_receive_message_length", max_message_bytes),
                   ("grpc.max_send_message_length", max_message_bytes)]
        self.channel = channel(address, tls, options)
        self.stub = coordinator_pb2_grpc.CoordinatorStub(self.channel)
        self.token = token

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        await self.channel.close()

    def stream(self, request: coordinator_pb2.GenerateRequest, timeout: float | None = None,
               wait_for_ready: bool = False, request_id: str = "") -> AsyncIterator[coordinator_pb2.GenerateResponse]:
        metadata = []
        if self.token:
            metadata.append(("authorization", f"Bearer {self.token}"))
        if request_id:
            metadata.append(("x-request-id", request_id))
        return self.stub.Generate(request, timeout=timeout, wait_for_ready=wait_for_ready, metadata=metadata or None)

    async def generate(self, request: coordinator_pb2.GenerateRequest, timeout: float | None = None,
                       wait_for_ready: bool = False, request_id: str = "",
                       resume: Resume = Resume()) -> AsyncIterator[coordinator_pb2.GenerateResponse]:
        """Streams a request's responses, resuming it when the stream breaks with a status
        another attempt can fix (RESUMABLE): the request goes again with the token ids
        received so far (resume_token_ids), the first response's seed and request id, and
        the stream goes on where it broke, exactly as if it had not (the coordinator's
        contract). The last response's stats.resumes counts the resumes. `timeout` bounds the
        whole request, resumes included."""
        deadline = None if timeout is None else time.monotonic() + timeout
        received: list[int] = []
        seed, first_id, resumes = None, "", 0
        while True:
            attempt = request
            if resumes:
                attempt = coordinator_pb2.GenerateRequest()
                attempt.CopyFrom(request)
                attempt.resume_token_ids[:] = received
                if seed is not None and not request.HasField("seed"):
                    attempt.seed = seed
                if first_id and not request.request_id:
                    attempt.request_id = first_id
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            first, finished = True, False
            call = self.stream(attempt, timeout=remaining, wait_for_ready=wait_for_ready, request_id=request_id)
            try:
                async for response in call:
                    if first:
                        first = False
                        seed, first_id = response.seed, first_id or response.request_id
                    received.extend(response.token_ids)
                    if response.finish_reason:
                        response.stats.resumes = resumes
                    finished = finished or bool(response.finish_reason)
                    yield response
                return
            except grpc.aio.AioRpcError as exc:
                if finished:
                    # The request is complete: a stream that breaks after its last message
                    # (a coordinator killed before the status) has nothing left to resume.
                    return
                if exc.code() not in RESUMABLE or resumes >= resume.attempts or pushed_back(exc):
                    raise
                pause = resume.delay(resumes)
                if deadline is not None:  # past it, the next attempt ends DEADLINE_EXCEEDED at once
                    pause = min(pause, max(0.0, deadline - time.monotonic()))
                resumes += 1
                await asyncio.sleep(pause)
            finally:
                call.cancel()  # a no-op once the call ended; frees the request when the caller stops reading

    async def complete(self, request: coordinator_pb2.GenerateRequest, timeout: float | None = None,
                       wait_for_ready: bool = False, on_text=None, request_id: str = "",
                       resume: Resume = Resume()) -> Completion:
        """Runs a request to the end, resuming a broken stream (see generate; NO_RESUME: do
        not); on_text(delta) is called as text streams in."""
        began = time.perf_counter()
        result = Completion()
        async for response in self.generate(request, timeout=timeout, wait_for_ready=wait_for_ready,
                                            request_id=request_id, resume=resume):
            result.text += response.text
            result.token_ids.extend(response.token_ids)
            if on_text is not None and response.text:
                on_text(response.text)
            if response.finish_reason:
                result.finish_reason = coordinator_pb2.FinishReason.Name(response.finish_reason)
                stats = response.stats
                result.stats = {name: getattr(stats, name) for name in STATS_FIELDS + EXTRA_STATS_FIELDS}
        result.wall_s = time.perf_counter() - began
        return result
