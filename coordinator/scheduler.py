"""The coordinator's step scheduler: continuous batching of many requests' rounds.

Every request runs its own round loop (coordinator.rounds); when a round needs a worker, it
does not call the worker itself but queues its part of the next *step* on the replica that
holds its session. One step per replica is in flight at a time, and one step is ONE batched
request (a message on the replica's step stream, coordinator.step_stream, or a VerifyBatch /
ProposeBatch call) that the worker runs as one forward pass over all the sessions in it
(specdec.runtime.packed). While a step runs, the rounds of other requests queue up;
when it returns, every queued round (up to the step's budget) goes in the next one. So
requests join and leave between steps, a finished or cancelled request simply stops
queueing, and nobody waits for anyone's whole generation — the iteration-level scheduling
of Orca (Yu et al., OSDI 2022) that vLLM and TGI use.

Bounds:
- a step carries at most `max_rounds` rounds and about `token_budget` tokens (committed
  tokens the worker lacks plus drafts; a single round larger than the budget still goes,
  alone) — long prompts are cut into chunks of at most `prefill_chunk` tokens by the target
  client (coordinator.workers), so a new request's prompt never makes one step long for
  every running request, and time to first token stays bounded while long requests run;
- fairness: rounds leave the queue first in, first out, and each request has at most one
  round queued per worker kind, so no request waits more than ⌈queued tokens / budget⌉ steps;
- cohorts: a request answered by a target step queues its next round a little later (its
  tokens are committed and streamed first, and a drafting request asks the draft worker in
  between). If the next step left at once, those requests would wait a whole step, and the
  load settles into two half-size steps leapfrogging each other, with less throughput than
  gathered steps (benchmarks/load.py; figures in benchmarks/results/NOTES.md). So after a
  step a gathering batcher (the target's) waits, up to GATHER_FRACTION of a step and at most
  GATHER_MAX_S, for the requests it answered to queue again or finish, and only then sends
  the next step. The draft's batcher does not gather: its requests go to the target next;
- a queued round whose request is cancelled, or whose deadline passes, is dropped before
  its step is sent; a step call's own failure fails each of its rounds as that round's call
  would have failed, and each request retries on its own (coordinator.workers);
- a round already sent is not recalled: the worker runs it, and may create the session's
  cache in doing so, even when its request was cancelled meanwhile. So a request's worker
  sessions are released only once no step in flight carries its rounds (`settled`): a
  Release that overtook the step would leave a cache nobody frees but eviction.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc

from specdec import metrics

log = logging.getLogger(__name__)

# After a step, how long the batcher waits for the requests it answered to queue again: a
# share of the step's own duration, and never more than GATHER_MAX_S.
GATHER_FRACTION = 0.25
GATHER_MAX_S = 0.010
STEP_TIME_DECAY = 0.8  # memory of the step-duration estimate (~5 steps)


class RoundFailed(Exception):
    """One round's part of a batched call failed with this status (its RoundError, or the
    whole call's error); it quacks like grpc.aio.AioRpcError where the retry logic looks.
    `refused`: the worker refused this round alone (its RoundError), not the whole call."""

    _CODES = {code.value[0]: code for code in grpc.StatusCode}

    def __init__(self, code: grpc.StatusCode | int, details: str, refused: bool = False):
        super().__init__(details)
        self._code = self._CODES.get(code, grpc.StatusCode.UNKNOWN) if isinstance(code, int) else code
        self._details = details
        self.refused = refused

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


@dataclass
class _Queued:
    request: object  # a VerifyRequest / ProposeRequest
    key: str  # the generation it belongs to (see gathering)
    tokens: int  # what the round adds to a step's token count
    future: asyncio.Future
    deadline: float  # event-loop time after which the round is not worth sending


def _time_out(future: asyncio.Future) -> None:
    if not future.done():
        future.set_exception(TimeoutError())


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


class StepBatcher:
    """Queues rounds for one worker replica and sends them as batched steps."""

    def __init__(self, kind: str, send: Callable[[list, float], Awaitable], token_budget: int, max_rounds: int,
                 on_step: Callable[[object, list], None] | None = None, gather: bool = False):
        """send(requests, timeout_s) makes the batched call and returns its response (with
        `results`, one per request); on_step(response, requests) sees every step's response;
        gather: wait briefly after a step for the requests it answered."""
        self.kind = kind
        self._send = send
        self.token_budget = token_budget
        self.max_rounds = max_rounds
        self._on_step = on_step
        self._queue: deque[_Queued] = deque()
        self._queued_gauge = metrics.COORDINATOR_QUEUED.labels(kind)  # looked up once, not per round
        self._task: asyncio.Task | None = None
        self.steps = 0
        self.gather = gather
        self._awaited: set[str] = set()  # requests answered by the last step, not back yet
        self._all_back: asyncio.Future | None = None  # while gathering: resolved when all are back
        self._step_s = 0.0  # decayed duration of a step (its call, start to answer)
        self._in_flight: set[str] = set()  # keys of the rounds in the step being sent
        self._late: dict[str, asyncio.Future] = {}  # keys of rounds in steps past their deadline, still running
        self._step_over = asyncio.Event()

    @property
    def queued(self) -> int:
        return len(self._queue)

    async def submit(self, request, tokens: int, timeout_s: float, key: str = ""):
        """The round's own result from the next step that has room for it (a VerifyResponse
        / ProposeResponse); key names the request the round belongs to. Raises RoundFailed
        on a failed call, TimeoutError after timeout_s, CancelledError when the request is
        cancelled."""
        loop = asyncio.get_running_loop()
        queued = _Queued(request, key, tokens, loop.create_future(), loop.time() + timeout_s)
        self._queue.append(queued)
        self.forget(key)
        self._queued_gauge.inc()
        if self._task is None or self._task.done():
            self._task = loop.create_task(self._run())
        # A timer on the round's own future rather than wait_for(shield(...)): no extra
        # future and callbacks per round on the hot path.
        timer = loop.call_later(timeout_s, _time_out, queued.future)
        try:
            return await queued.future
        finally:
            timer.cancel()
            if not queued.future.done():
                queued.future.cancel()  # leaves the queue at the next step (or is ignored)

    def _take(self, now: float) -> list[_Queued]:
        """The next step: queued rounds in arrival order while they fit the budget."""
        step: list[_Queued] = []
        tokens = 0
        while self._queue and len(step) < self.max_rounds:
            head = self._queue[0]
            if head.future.done() or head.deadline <= now:  # cancelled, or too late to matter
                self._queue.popleft()
                self._queued_gauge.dec()
                if not head.future.done():
                    head.future.set_exception(RoundFailed(grpc.StatusCode.DEADLINE_EXCEEDED, "expired in the queue"))
                continue
            if step and tokens + head.tokens > self.token_budget:
                break
            self._queue.popleft()
            self._queued_gauge.dec()
            step.append(head)
            tokens += head.tokens
        return step

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while self._queue:
            now = loop.time()
            step = self._take(now)
            if not step:
                continue
            timeout = max(q.deadline for q in step) - now
            began = loop.time()
            self._in_flight = {q.key for q in step}
            self._step_over.clear()
            try:
                response = await self._send([q.request for q in step], timeout)
            except asyncio.CancelledError:
                for q in step:
                    if not q.future.done():
                        q.future.set_exception(RoundFailed(grpc.StatusCode.CANCELLED, "the coordinator is stopping"))
                raise
            except grpc.aio.AioRpcError as exc:
                self._wait_late(step, getattr(exc, "late", None))
                for q in step:
                    if not q.future.done():
                        q.future.set_exception(RoundFailed(exc.code(), exc.details() or exc.code().name))
                continue
            except Exception as exc:  # noqa: BLE001 - a failure to even make the call
                log.warning("%s step failed before reaching the worker: %s", self.kind, exc)
                for q in step:
                    if not q.future.done():
                        q.future.set_exception(RoundFailed(grpc.StatusCode.UNAVAILABLE, str(exc)))
                continue
            finally:
                self._in_flight = set()
                self._step_over.set()
            self.steps += 1
            took = loop.time() - began
            self._step_s = took if self.steps == 1 else STEP_TIME_DECAY * self._step_s + (1 - STEP_TIME_DECAY) * took
            if self._on_step is not None:
                self._on_step(response, [q.request for q in step])
            if len(response.results) != len(step):
                error = RoundFailed(grpc.StatusCode.INTERNAL,
                                    f"{self.kind} worker answered {len(response.results)} of {len(step)} rounds")
                for q in step:
                    if not q.future.done():
                        q.future.set_exception(error)
                continue
            for q, result in zip(step, response.results):
                if not q.future.done():
                    q.future.set_result(result)
                    if q.key and self.gather:
                        self._awaited.add(q.key)
            await self._gather()

    def _wait_late(self, step: list, late: asyncio.Future | None) -> None:
        """A step given up on locally (its deadline) that still runs on the worker (a step
        stream cannot cancel it there): its rounds stay unsettled until the worker answers."""
        if late is None or late.done():
            return
        keys = [q.key for q in step if q.key]
        for key in keys:
            self._late[key] = late

        def over(_) -> None:
            for key in keys:
                if self._late.get(key) is late:
                    del self._late[key]

        late.add_done_callback(over)

    async def settled(self, key: str) -> None:
        """Returns once no step in flight carries a round of `key` (the worker has answered
        it, or the call failed and cannot still run there): a Release sent after this cannot
        overtake the round."""
        while key in self._in_flight:
            await self._step_over.wait()
        late = self._late.get(key)
        if late is not None:
            await asyncio.wait({late})  # neither raises its error nor cancels it

    async def gathered(self) -> None:
        """Returns once the step being gathered has left (all the requests the last step
        answered are back, or the gathering gave up), at once when none is gathered. A
        request answered by a step does its work for the client after queueing its next
        round and awaiting this, so that work runs while the next step computes instead of
        delaying it (coordinator.rounds)."""
        if self._all_back is not None and not self._all_back.done():
            # Neither cancels the gathering when the waiter is cancelled nor raises when the
            # batcher is closed mid-gathering.
            await asyncio.wait({self._all_back})

    def forget(self, key: str) -> None:
        """The request is back (or finished): the step need not wait for it."""
        if key in self._awaited:
            self._awaited.discard(key)
            if not self._awaited and self._all_back is not None:
                _resolve(self._all_back)

    async def _gather(self) -> None:
        """Waits (briefly) for the requests the last step answered to queue again."""
        if not self._awaited:
            return
        # A future and a timer rather than wait_for(event.wait()): no task per step.
        loop = asyncio.get_running_loop()
        back = self._all_back = loop.create_future()
        timer = loop.call_later(min(GATHER_MAX_S, GATHER_FRACTION * self._step_s), _resolve, back)
        try:
            await back
        finally:
            timer.cancel()
            self._all_back = None
            self._awaited.clear()  # late ones are not waited for again

    async def close(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        while self._queue:
            q = self._queue.popleft()
            self._queued_gauge.dec()
            if not q.future.done():
                q.future.set_exception(RoundFailed(grpc.StatusCode.UNAVAILABLE, "the coordinator is stopping"))
