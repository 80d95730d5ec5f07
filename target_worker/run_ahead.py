"""Rounds the target worker runs by itself, ahead of the coordinator (VerifyRequest.run_ahead).

Without it every round is a trip coordinator → worker → coordinator: the worker's step for a
session waits for the coordinator to read the verdict, commit it and send the next round. A
round that goes straight to the target (drafted by the head on this worker, or no drafts at
all) needs nothing from the coordinator but the verdict's own tokens, so the worker can build
the next round itself: the same session, its committed tokens extended by what the verdict
commits (drafts[:accepted], next_token, extra), the head's next_drafts as the drafts, the same
sampling and draft_next. The coordinator still owns the truth: it commits each verdict as it
arrives, exactly as a verdict it asked for, checks that it continues the sequence it holds,
and ends the run by sending a round of its own for the session or releasing it.

Invariants:
- a run belongs to the stream its first round came on, and its rounds are answered there,
  one VerifyBatchResponse (step_id 0, `continued`) per step;
- a round is built from the previous round and its verdict alone, so it is the round the
  coordinator would have sent; it never drafts past the token room (max_new_tokens and the
  context: VerifyRequest.token_room), and no round follows one that commits a stop token,
  uses up the room or ends the run's count;
- a round the coordinator sends for a session ends its run before the step runs (the
  coordinator's round is the truth), so are Release and the end of the stream; a run whose
  round failed or lost its session ends with that result;
- a step takes at most max_batch_rounds rounds: the coordinator's first, then waiting runs,
  the longest waiting first;
- a RunChange sets the draft_next and min_draft_prob of the run's next round to run (and so
  of the rounds after it), and adds its more_rounds to the run's count: a coordinator that
  tops the count up as it commits keeps the run going, and the worker never more than its
  grant ahead; each round answered says which draft_next its own drafts were drafted with;
- a step's rows, time and head time are reported once, with the counts of its rounds that
  were runs' (VerifyBatchResponse.ahead_*), so the coordinator's cost model sees every round.
"""

from __future__ import annotations

import itertools
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace

from specdec.errors import status_for
from specdec.v1 import target_pb2
from target_worker.verify import Round, Verdict


# The most rounds a run may have left, whatever the grants add up to.
MAX_RUN_ROUNDS = 1 << 16


@dataclass
class _Run:
    run_id: int
    stream: object
    round: Round  # the next round to run
    left: int  # rounds it may run after `round`
    room: int  # tokens the session may still commit, `round`'s included
    stop_ids: frozenset[int]
    request_id: str
    drafted_with: int = 0  # the draft_next `round`'s drafts were drafted with


def next_round(last: Round, verdict: Verdict, room: int, stop_ids: frozenset[int]) -> tuple[Round | None, int]:
    """The round after `last` given its verdict, and the token room it leaves; None where the
    verdict commits a stop token or uses up the room."""
    committed = list(last.drafts[:verdict.accepted]) + [verdict.next_token] + list(verdict.extra)
    room -= len(committed)
    if room < 1 or not stop_ids.isdisjoint(committed):
        return None, room
    return replace(last, start=last.start + len(last.tokens), tokens=committed,
                   drafts=list(verdict.next_drafts[:room - 1]), features=False), room


class RunsAhead:
    """The runs of one target worker, over all its streams (specdec.step_streams.Ahead).
    Lives on the event loop; the model thread never sees it.

    `parse(request)` validates a step and returns its rounds; `run(rounds)` runs them as one
    step (BatchOutcome); `answer(requests, results, outcome)` is the step's
    VerifyBatchResponse to `requests`; `result(result, request_id)` one round's
    VerifyResponse — the servicer's VerifyBatch, in parts."""

    def __init__(self, parse: Callable, run: Callable[[list[Round]], Awaitable], answer: Callable,
                 result: Callable, max_batch_rounds: int):
        self._parse, self._run, self._answer, self._result = parse, run, answer, result
        self.max_batch_rounds = max_batch_rounds
        self._runs: dict[str, _Run] = {}
        self._by_stream: dict[object, dict[str, _Run]] = {}
        # Random start: ids from a restarted worker do not match a run of the one before it.
        self._ids = itertools.count(secrets.randbits(62) + 1)

    def __len__(self) -> int:
        return len(self._runs)

    def waiting(self, stream: object) -> bool:
        return bool(self._by_stream.get(stream))

    def end(self, session_id: str) -> None:
        """The session's run, if any, runs no more rounds."""
        run = self._runs.pop(session_id, None)
        if run is not None:
            mine = self._by_stream.get(run.stream)
            if mine is not None:
                mine.pop(session_id, None)
                if not mine:
                    del self._by_stream[run.stream]

    def close(self, stream: object) -> None:
        for session_id in list(self._by_stream.get(stream, {})):
            self.end(session_id)

    def _advance(self, run: _Run, verdict: Verdict) -> bool:
        """Whether `run`, no longer registered, goes on after its round's verdict: its next
        round then waits behind the stream's other runs (a step too small for them all takes
        the longest waiting)."""
        following, run.room = next_round(run.round, verdict, run.room, run.stop_ids)
        if following is None or run.left < 1:
            return False
        run.round, run.left, run.drafted_with = following, run.left - 1, run.round.draft_next
        self._runs[following.session_id] = run
        self._by_stream.setdefault(run.stream, {})[following.session_id] = run
        return True

    def change(self, change: target_pb2.RunChange) -> None:
        """The coordinator's new draft_next and min_draft_prob for a run, from its next round
        on (a price that is not a finite number >= 0 fails that round, as in a VerifyRequest),
        and the rounds it adds to the run's allowance (never past MAX_RUN_ROUNDS)."""
        run = self._runs.get(change.session_id)
        if run is not None and run.run_id == change.run_id:
            run.round = replace(run.round, draft_next=change.draft_next, min_draft_prob=change.min_draft_prob)
            run.left = min(MAX_RUN_ROUNDS, run.left + change.more_rounds)

    async def step(self, request: target_pb2.VerifyBatchRequest | None, context, stream: object) -> list:
        """Runs one step for the stream: `request`'s rounds (None: none came) and its waiting runs.
        A request of run changes alone is answered at once, and the runs it changed take the
        same turn's step: a change never costs the stream a turn of its own."""
        if request is not None and request.run_changes:
            for change in request.run_changes:
                self.change(change)
        asked = self._parse(request) if request is not None and request.rounds else []
        for r in asked:
            self.end(r.session_id)  # the coordinator's round is the truth
        runs = list(self._by_stream.get(stream, {}).values())[:max(0, self.max_batch_rounds - len(asked))]
        # A request of changes alone: its (empty) answer first; the step and its failure are the runs'.
        changed = [target_pb2.VerifyBatchResponse()] if request is not None and not asked else []
        if not asked and not runs:
            return changed  # nothing to run
        try:
            outcome = await self._run(asked + [run.round for run in runs])
            return changed + self._answers(request if asked else None, asked, runs, outcome, stream)
        except Exception as exc:  # noqa: BLE001 - the step's status, as VerifyBatch would fail
            responses = changed
            if asked:
                code, message = status_for(exc)
                responses.append(target_pb2.VerifyBatchResponse(error_code=code.value[0], error_message=message))
            for r in asked:
                self.end(r.session_id)  # a run its failed answer may have started
            ended = target_pb2.VerifyBatchResponse()
            for run in runs:
                # Ended with the step's error, whatever became of it: the coordinator sends
                # the session's next round itself.
                self.end(run.round.session_id)
                self._add(ended, run, run.round, self._result(exc, run.request_id), 0, run.drafted_with)
            return responses + ([ended] if ended.continued else [])

    def _answers(self, request, asked: list[Round], runs: list[_Run], outcome, stream: object) -> list:
        """The step's answers: to the coordinator's rounds (starting runs where asked), then
        to the runs' rounds (going on or ending)."""
        responses: list[target_pb2.VerifyBatchResponse] = []
        ran = [run.round for run in runs]
        share = dict(ahead_rounds=len(ran), ahead_drafts=sum(len(r.drafts) for r in ran),
                     ahead_drafting=sum(1 for r in ran if r.drafts),
                     ahead_head_rounds=sum(1 for r in ran if r.draft_next))
        if request is not None:
            answer = self._answer(request.rounds, outcome.results[:len(asked)], outcome)
            for r, parsed, result, item in zip(request.rounds, asked, outcome.results, answer.results):
                if r.run_ahead and not r.return_features and isinstance(result, Verdict):
                    run = _Run(next(self._ids), stream, parsed, r.run_ahead, r.token_room,
                               frozenset(r.stop_token_ids), r.delta.request_id)
                    if self._advance(run, result):
                        item.verdict.run_id = run.run_id
            for key, value in share.items():
                setattr(answer, key, value)
            responses.append(answer)
        # The step's figures go once: with its answer, else with the runs' message.
        continued = (target_pb2.VerifyBatchResponse() if request is not None else
                     target_pb2.VerifyBatchResponse(step_s=outcome.step_s, rows=outcome.rows, draft_s=outcome.draft_s,
                                                    **share))
        for run, result in zip(runs, outcome.results[len(asked):]):
            if self._runs.get(run.round.session_id) is not run:
                continue  # released or superseded while its step ran: nobody waits for it
            ran, drafted_with = run.round, run.drafted_with
            self.end(ran.session_id)
            goes_on = isinstance(result, Verdict) and self._advance(run, result)
            self._add(continued, run, ran, self._result(result, run.request_id), run.run_id if goes_on else 0,
                      drafted_with)
        if continued.continued:
            responses.append(continued)
        return responses

    @staticmethod
    def _add(response: target_pb2.VerifyBatchResponse, run: _Run, ran: Round, item: target_pb2.VerifyResponse,
             run_id: int, drafted_with: int) -> None:
        entry = response.continued.add(session_id=ran.session_id, context_len=ran.start + len(ran.tokens),
                                       draft_tokens=ran.drafts, run_id=run.run_id, drafted_with=drafted_with)
        entry.result.CopyFrom(item)
        if entry.result.WhichOneof("result") == "verdict":
            entry.result.verdict.run_id = run_id
