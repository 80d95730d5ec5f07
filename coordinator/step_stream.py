"""The coordinator's side of a step stream (TargetWorker.VerifyStream, DraftWorker.ProposeStream;
the worker's side is specdec.step_streams): one long-lived bidirectional stream per worker
replica, opened by the first step sent there and shared by every step after it, so that a
batched step costs a message each way instead of a unary call.

Invariants, each making a step on the stream fail exactly as its VerifyBatch / ProposeBatch
call would have (so coordinator.scheduler and the retry, resync, hedging and ejection logic
of coordinator.workers cannot tell the two apart):
- a step is a future keyed by its step_id, awaited with the step's own deadline; past it the
  step fails DEADLINE_EXCEEDED, here, and its late answer is dropped — but the error's
  `late` future stays pending until the worker has answered (or the stream ended), so the
  scheduler releases no session a step still running there would bring back;
- an answer with an error_code fails its step with that status;
- a stream that breaks fails every step pending on it UNAVAILABLE, and the next step opens
  a new stream;
- a worker answering UNIMPLEMENTED predates the streams: the stream is `unsupported` for
  good and its pending steps raise StreamUnsupported, for the caller to send as unary calls;
- a message answering no step (step_id 0: rounds the worker ran ahead, target_worker.run_ahead)
  goes to `unsolicited`, and the end of each stream is told to `ended` after its pending
  steps failed.

Per step: one future and one timer, no task; one reader task per open stream.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc

log = logging.getLogger(__name__)

_CODES = {code.value[0]: code for code in grpc.StatusCode}


class StreamUnsupported(Exception):
    """The replica serves no step stream (UNIMPLEMENTED): send the step as a unary call."""


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    """The error a unary call failing with `code` raises."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


def _expire(caller: asyncio.Future, answer: asyncio.Future) -> None:
    if not caller.done():
        error = rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
        error.late = answer  # done once the worker has answered the step anyway (or the stream ended)
        caller.set_exception(error)


def _forward(answer: asyncio.Future, caller: asyncio.Future) -> None:
    if caller.done():
        return
    if answer.cancelled():
        caller.cancel()
    elif answer.exception() is not None:
        caller.set_exception(answer.exception())
    else:
        caller.set_result(answer.result())


class _Open:
    """One open stream: its call, the steps awaiting an answer on it, and its reader."""

    __slots__ = ("call", "pending", "reader", "writing")

    def __init__(self, call):
        self.call = call
        self.pending: dict[int, asyncio.Future] = {}
        self.reader: asyncio.Task | None = None
        # gRPC takes one write at a time per call (a second fails the whole call): steps
        # sent at once, which the scheduler's one step per replica makes rare, queue here.
        self.writing = asyncio.Lock()


class StepStream:
    """The step stream to one replica."""

    def __init__(self, open_call: Callable[[], object], name: str, channel: object = None,
                 unsolicited: Callable[[object], None] | None = None, ended: Callable[[], None] | None = None):
        """open_call() starts the stream's call (e.g. stub.VerifyStream); name: the replica,
        for messages; channel: the channel it runs on (a new channel needs a new stream);
        unsolicited(response) sees each message with step_id 0; ended() each stream's end."""
        self._open_call = open_call
        self._unsolicited = unsolicited
        self._on_end = ended
        self.name = name
        self.channel = channel
        self._open: _Open | None = None
        self._last_id = 0
        self.unsupported = False
        self.opened = 0  # streams started, the first included

    async def step(self, request, timeout_s: float):
        """Sends one batched request (its step_id is set here) and returns its answer; raises
        grpc.aio.AioRpcError as the unary call would have, or StreamUnsupported."""
        if self.unsupported:
            raise StreamUnsupported(self.name)
        opened = self._open or self._start()
        self._last_id += 1
        step_id = request.step_id = self._last_id
        loop = asyncio.get_running_loop()
        # The worker's answer stays pending after the caller gave up (its deadline): the step
        # still runs there, and a Release must not overtake it (DEADLINE_EXCEEDED's `late`).
        answer, caller = loop.create_future(), loop.create_future()
        opened.pending[step_id] = answer
        answer.add_done_callback(lambda done: _forward(done, caller))
        timer = loop.call_later(timeout_s, _expire, caller, answer)
        try:
            try:
                async with opened.writing:
                    await opened.call.write(request)
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
                # The call is over: its reader reads why, and fails the pending steps with it.
                pass
            response = await caller
        finally:
            timer.cancel()
        if response.error_code:
            raise rpc_error(_CODES.get(response.error_code, grpc.StatusCode.UNKNOWN), response.error_message)
        return response

    def _start(self) -> _Open:
        opened = self._open = _Open(self._open_call())
        opened.reader = asyncio.get_running_loop().create_task(self._read(opened))
        self.opened += 1
        return opened

    async def _read(self, opened: _Open) -> None:
        code, details = grpc.StatusCode.UNAVAILABLE, "the worker ended the stream"
        try:
            while True:
                response = await opened.call.read()
                if response is grpc.aio.EOF:
                    break
                if not response.step_id:
                    if self._unsolicited is not None:
                        self._unsolicited(response)
                    continue
                future = opened.pending.pop(response.step_id, None)
                if future is not None and not future.done():
                    future.set_result(response)
        except grpc.aio.AioRpcError as exc:
            code, details = exc.code(), exc.details() or exc.code().name
        except asyncio.CancelledError:
            code, details = grpc.StatusCode.CANCELLED, "the stream was closed"
            raise
        finally:
            self._ended(opened, code, details)

    def _ended(self, opened: _Open, code: grpc.StatusCode, details: str) -> None:
        if self._open is opened:
            self._open = None
        if code == grpc.StatusCode.UNIMPLEMENTED:
            self.unsupported = True
            error: Exception = StreamUnsupported(self.name)
        else:
            log.log(logging.DEBUG if code == grpc.StatusCode.CANCELLED else logging.INFO,
                    "step stream to %s ended: %s: %s", self.name, code.name, details)
            error = rpc_error(grpc.StatusCode.UNAVAILABLE, f"the step stream to {self.name} broke: "
                                                           f"{code.name}: {details}")
        for future in opened.pending.values():
            if not future.done():
                future.set_exception(error)
        opened.pending.clear()
        if self._on_end is not None:
            self._on_end()

    async def close(self) -> None:
        """Ends the open stream, failing its pending steps UNAVAILABLE."""
        opened = self._open
        if opened is None:
            return
        opened.call.cancel()
        if opened.reader is not None:
            opened.reader.cancel()
            await asyncio.gather(opened.reader, return_exceptions=True)
