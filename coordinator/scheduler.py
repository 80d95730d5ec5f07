"""The coordinator's step scheduler: continuous batching of many requests' rounds.

Every request runs its own round loop (coordinator.rounds); when a round needs a worker, it
does not call the worker itself but queues its part of the next *step* on the replica that
holds its session. One step per replica is in flight at a time, and one step is ONE batched
call (VerifyBatch / ProposeBatch) that the worker runs as one forward pass over all the
sessions in it (specdec.ragged). While a step runs, the rounds of other requests queue up;
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
- a queued round whose request is cancelled, or whose deadline passes, is dropped before
  its step is sent; a step call's own failure fails each of its rounds as that round's call
  would have failed, and each request retries on its own (coordinator.workers).
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


class RoundFailed(Exception):
    """One round's part of a batched call failed with this status (its RoundError, or the
    whole call's error); it quacks like grpc.aio.AioRpcError where the retry logic looks."""

    _CODES = {code.value[0]: code for code in grpc.StatusCode}

    def __init__(self, code: grpc.StatusCode | int, details: str):
        super().__init__(details)
        self._code = self._CODES.get(code, grpc.StatusCode.UNKNOWN) if isinstance(code, int) else code
        self._details = details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


@dataclass
class _Queued:
    request: object  # a VerifyRequest / ProposeRequest
    tokens: int  # what the round adds to a step's token count
    future: asyncio.Future
    deadline: float  # event-loop time after which the round is not worth sending


class StepBatcher:
    """Queues rounds for one worker replica and sends them as batched steps."""

    def __init__(self, kind: str, send: Callable[[list, float], Awaitable], token_budget: int, max_rounds: int,
                 on_step: Callable[[object, int], None] | None = None):
        """send(requests, timeout_s) makes the batched call and returns its response (with
        `results`, one per request); on_step(response, rounds) sees every step's response."""
        self.kind = kind
        self._send = send
        self.token_budget = token_budget
        self.max_rounds = max_rounds
        self._on_step = on_step
        self._queue: deque[_Queued] = deque()
        self._task: asyncio.Task | None = None
        self.steps = 0

    @property
    def queued(self) -> int:
        return len(self._queue)

    async def submit(self, request, tokens: int, timeout_s: float):
        """The round's own result from the next step that has room for it (a VerifyResponse
        / ProposeResponse). Raises RoundFailed on a failed call, TimeoutError after
        timeout_s, CancelledError when the request is cancelled."""
        loop = asyncio.get_running_loop()
        queued = _Queued(request, tokens, loop.create_future(), loop.time() + timeout_s)
        self._queue.append(queued)
        metrics.COORDINATOR_QUEUED.labels(self.kind).inc()
        if self._task is None or self._task.done():
            self._task = loop.create_task(self._run())
        try:
            return await asyncio.wait_for(asyncio.shield(queued.future), timeout_s)
        finally:
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
                metrics.COORDINATOR_QUEUED.labels(self.kind).dec()
                if not head.future.done():
                    head.future.set_exception(RoundFailed(grpc.StatusCode.DEADLINE_EXCEEDED, "expired in the queue"))
                continue
            if step and tokens + head.tokens > self.token_budget:
                break
            self._queue.popleft()
            metrics.COORDINATOR_QUEUED.labels(self.kind).dec()
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
            try:
                response = await self._send([q.request for q in step], timeout)
            except asyncio.CancelledError:
                for q in step:
                    if not q.future.done():
                        q.future.set_exception(RoundFailed(grpc.StatusCode.CANCELLED, "the coordinator is stopping"))
                raise
            except grpc.aio.AioRpcError as exc:
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
            self.steps += 1
            if self._on_step is not None:
                self._on_step(response, len(step))
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

    async def close(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        while self._queue:
            q = self._queue.popleft()
            metrics.COORDINATOR_QUEUED.labels(self.kind).dec()
            if not q.future.done():
                q.future.set_exception(RoundFailed(grpc.StatusCode.UNAVAILABLE, "the coordinator is stopping"))
