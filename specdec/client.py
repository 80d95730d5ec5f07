"""The Python client of the coordinator, used by `specdec generate`, the tests and the
benchmarks."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from specdec.v1 import coordinator_pb2, coordinator_pb2_grpc

STATS_FIELDS = ("rounds", "proposed", "accepted", "acceptance_rate", "tokens_per_round", "ttft_s", "tokens_per_s")
EXTRA_STATS_FIELDS = ("prompt_tokens", "generated_tokens", "draft_s", "verify_s", "wire_bytes", "resyncs", "seed",
                      "rejected_blocks", "alternative_tokens")


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

    async def complete(self, request: coordinator_pb2.GenerateRequest, timeout: float | None = None,
                       wait_for_ready: bool = False, on_text=None, request_id: str = "") -> Completion:
        """Runs a request to the end; on_text(delta) is called as text streams in."""
        began = time.perf_counter()
        result = Completion()
        async for response in self.stream(request, timeout=timeout, wait_for_ready=wait_for_ready,
                                          request_id=request_id):
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
