"""gRPC clients of the draft and target workers, with the delta protocol's coordinator
side: send what a worker lacks, resend from what it holds when it asks (restart, eviction,
another replica), retry transient failures with back-off."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import grpc

from specdec.errors import Unavailable
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc

log = logging.getLogger(__name__)

TRANSIENT = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}
# A worker asking for a resync twice in a row for the same call is broken, not restarted.
MAX_RESYNCS_PER_CALL = 2
RELEASE_TIMEOUT_S = 2.0


def channel_options(max_message_bytes: int) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        # Reconnect quickly to a restarted worker instead of backing off for up to 2 min.
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1000),
    ]


@dataclass
class WorkerSession:
    """The coordinator's view of one session on one worker."""

    session_id: str
    # Committed tokens the worker was last sent (it holds them unless it lost the session).
    sent: int = 0
    resyncs: int = 0
    wire_bytes: int = 0
    seconds: float = field(default=0.0)


class WorkerClient:
    def __init__(self, name: str, address: str, timeout_s: float, retries: int, backoff_s: float,
                 max_message_bytes: int):
        self.name = name
        self.address = address
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.channel = grpc.aio.insecure_channel(address, options=channel_options(max_message_bytes))

    async def close(self) -> None:
        await self.channel.close()

    async def info(self, timeout_s: float) -> common_pb2.WorkerInfo:
        """Waits up to timeout_s for the worker to come up (models take a while to load)."""
        return await self._stub.GetInfo(common_pb2.WorkerInfoRequest(), timeout=timeout_s, wait_for_ready=True)

    async def release(self, session: WorkerSession) -> None:
        try:
            await self._stub.Release(common_pb2.ReleaseRequest(session_id=session.session_id),
                                     timeout=RELEASE_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:  # the worker evicts it anyway, sooner or later
            log.info("release of %s on %s failed: %s", session.session_id, self.name, exc.code().name)

    async def _round(self, session: WorkerSession, committed: list[int], make_request, rpc):
        """One round's call: a delta from what the worker holds, resending on request and
        retrying transient failures. Returns the response's result message."""
        loop = asyncio.get_running_loop()
        began = loop.time()
        attempt = resyncs = 0
        start = min(session.sent, len(committed) - 1)
        while True:
            delta = common_pb2.SessionDelta(session_id=session.session_id, start=start, tokens=committed[start:])
            request = make_request(delta)
            try:
                response = await rpc(request, timeout=self.timeout_s)
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in TRANSIENT or attempt >= self.retries:
                    if exc.code() in TRANSIENT:
                        raise Unavailable(f"{self.name} worker at {self.address}: {exc.code().name}: "
                                          f"{exc.details()} (after {attempt + 1} attempts)") from exc
                    raise
                await asyncio.sleep(self.backoff_s * (2 ** attempt))
                attempt += 1
                continue
            session.wire_bytes += request.ByteSize() + response.ByteSize()
            kind = response.WhichOneof("result")
            if kind == "resync":
                resyncs += 1
                session.resyncs += 1
                if resyncs > MAX_RESYNCS_PER_CALL:
                    raise Unavailable(f"{self.name} worker at {self.address} keeps losing session state")
                start = min(response.resync.cached_len, len(committed) - 1)
                continue
            session.sent = len(committed)
            session.seconds += loop.time() - began
            return getattr(response, kind)


class DraftClient(WorkerClient):
    def __init__(self, address: str, **kwargs):
        super().__init__("draft", address, **kwargs)
        self._stub = draft_pb2_grpc.DraftWorkerStub(self.channel)

    async def propose(self, session: WorkerSession, committed: list[int], k: int) -> draft_pb2.DraftBlock:
        return await self._round(
            session, committed, lambda delta: draft_pb2.ProposeRequest(delta=delta, k=k), self._stub.Propose
        )


class TargetClient(WorkerClient):
    def __init__(self, address: str, **kwargs):
        super().__init__("target", address, **kwargs)
        self._stub = target_pb2_grpc.TargetWorkerStub(self.channel)

    async def verify(self, session: WorkerSession, committed: list[int], drafts: list[int],
                     sampling: common_pb2.SamplingParams | None = None) -> target_pb2.Verdict:
        return await self._round(
            session, committed,
            lambda delta: target_pb2.VerifyRequest(delta=delta, draft_tokens=drafts, sampling=sampling),
            self._stub.Verify,
        )
