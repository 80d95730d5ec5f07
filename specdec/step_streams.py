"""The worker side of the step streams (TargetWorker.VerifyStream, DraftWorker.ProposeStream):
one long-lived bidirectional stream per coordinator and replica carries the batched steps that
VerifyBatch / ProposeBatch carry one call each, so a step costs a message each way instead of
a call (the coordinator's side: coordinator.step_stream).

Invariants:
- a step runs through the unary handler itself, so it is validated, handed to the model
  thread and counted exactly as a VerifyBatch / ProposeBatch call; its failure becomes the
  answer's error_code / error_message, with the status the call would have failed with
  (specdec.errors.status_for), and the stream goes on;
- every step read is answered once, echoing its step_id; steps run one after another in the
  order read (the model thread is one queue anyway), though the contract promises no order;
- with `ahead` (a worker running sessions' rounds by itself, target_worker.run_ahead): while
  it has rounds waiting for a stream, the stream's next step runs them at once with whatever
  steps were already read, instead of waiting for a step; its answers to them are written
  after the step's own answer;
- the stream ends OK once the client half-closes and every step read is answered;
- draining (`stop`, a companion of the server: serving.RunningServer.companions): a stream
  idle between steps ends UNAVAILABLE at once, one running a step ends UNAVAILABLE right after
  answering it — within the server's grace period, so no answer is cut off by the stop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Protocol

import grpc

from specdec.errors import refuse_malformed, status_for

log = logging.getLogger(__name__)

# What a stream's `ended` future holds when the stream ends because the server drains.
DRAINED = "drained"


class Ahead(Protocol):
    """Rounds a worker runs by itself for a stream (target_worker.run_ahead.RunsAhead)."""

    def waiting(self, stream: object) -> bool:
        """Whether rounds wait to run for `stream`."""

    async def step(self, request, context: grpc.aio.ServicerContext, stream: object) -> list:
        """Runs one step: `request`'s rounds (None: none were read) and the rounds waiting
        for `stream`; returns the answers to write, the request's own first."""

    def close(self, stream: object) -> None:
        """The stream ended: its rounds run no more."""


class _Stream:
    __slots__ = ("ended", "running")

    def __init__(self, ended: asyncio.Future):
        self.ended = ended  # None: the client half-closed; DRAINED; or the reader's exception
        self.running = False  # between reading a step and writing its answer

    def end(self, reason: str | None) -> None:
        if not self.ended.done():
            self.ended.set_result(reason)


class StepStreams:
    """The open step streams of one worker server, and their drain."""

    def __init__(self, kind: str):
        self.kind = kind
        self._draining = False
        self._open: set[_Stream] = set()
        self._all_closed = asyncio.Event()
        self._all_closed.set()

    async def serve(self, context: grpc.aio.ServicerContext, step: Callable[..., Awaitable],
                    failed: Callable[..., object], ahead: Ahead | None = None) -> None:
        """Serves one stream: each request read is run by `step(request, context)` (the unary
        handler) and answered — by `ahead.step` instead where given; `failed(error_code=,
        error_message=)` builds a failed step's answer. Returns (status OK) once the client
        half-closes; aborts UNAVAILABLE when the server drains."""
        if self._draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"the {self.kind} worker is draining")
        loop = asyncio.get_running_loop()
        stream = _Stream(loop.create_future())
        self._open.add(stream)
        self._all_closed.clear()
        # One reader per stream, not a task per step: the handler itself only waits for the
        # end, so that a drain can end a stream whose reader waits for a step that never comes.
        reader = loop.create_task(self._answer(context, stream, step, failed, ahead))
        try:
            reason = await stream.ended
        finally:
            reader.cancel()
            if ahead is not None:
                ahead.close(stream)
            self._open.discard(stream)
            if not self._open:
                self._all_closed.set()
        if reason == DRAINED:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"the {self.kind} worker is draining")

    async def _answer(self, context: grpc.aio.ServicerContext, stream: _Stream, step, failed,
                      ahead: Ahead | None) -> None:
        inbox: asyncio.Queue = asyncio.Queue()
        reading = asyncio.get_running_loop().create_task(self._read(context, inbox))
        try:
            while True:
                if ahead is not None and ahead.waiting(stream):
                    request = None if inbox.empty() else inbox.get_nowait()  # never wait for a step
                else:
                    request = await inbox.get()
                if request is grpc.aio.EOF:
                    stream.end(None)
                    return
                if isinstance(request, Exception):
                    raise request
                stream.running = True
                try:
                    if ahead is not None:
                        responses = await ahead.step(request, context, stream)
                    else:
                        responses = [await step(request, context)]
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # noqa: BLE001 - the unary call's status, as the interceptor maps it
                    code, message = status_for(exc)
                    responses = [failed(error_code=code.value[0], error_message=message)]
                if request is not None:
                    responses[0].step_id = request.step_id
                for response in responses:
                    await context.write(response)
                stream.running = False
                if self._draining:
                    stream.end(DRAINED)
                    return
        except Exception as exc:  # noqa: BLE001 - the handler raises it, the interceptor maps it
            if not stream.ended.done():
                stream.ended.set_exception(exc)
        finally:
            reading.cancel()

    @staticmethod
    async def _read(context: grpc.aio.ServicerContext, inbox: asyncio.Queue) -> None:
        """Puts each step read into `inbox`, then EOF — or the exception that ended reading
        (a malformed step has no step_id to answer: the stream itself is refused)."""
        try:
            while True:
                request = await context.read()
                if request is not grpc.aio.EOF:
                    refuse_malformed(request)
                inbox.put_nowait(request)
                if request is grpc.aio.EOF:
                    return
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - raised by the answering loop
            inbox.put_nowait(exc)

    async def stop(self, grace: float) -> None:
        """Drains: no stream takes a new step; each ends UNAVAILABLE once it answered the step
        it runs (idle ones at once). Waits up to `grace` s for them all to end."""
        self._draining = True
        for stream in list(self._open):
            if not stream.running:
                stream.end(DRAINED)
        if not self._open:
            return
        try:
            await asyncio.wait_for(self._all_closed.wait(), grace)
        except TimeoutError:
            log.warning("%s worker: %d step stream(s) still running a step after the %g s grace", self.kind,
                        len(self._open), grace)
