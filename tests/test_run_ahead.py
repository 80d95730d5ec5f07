"""Rounds the target worker runs by itself, ahead of the coordinator (target_worker.run_ahead):
the output is the target's alone — greedy with a head on the target, greedy without
speculation, seeded sampling — with fewer rounds sent by the coordinator; a stop string, an
end of the stream, a coordinator round, a Release and a failed step each end a run cleanly."""

from __future__ import annotations

import asyncio
import time

import pytest

from specdec import metrics
from specdec.client import Client, make_request
from specdec.errors import Unavailable
from specdec.sampling import GREEDY
from specdec.v1 import common_pb2, target_pb2
from target_worker.run_ahead import RunsAhead, next_round
from target_worker.verify import BatchOutcome, Round, Verdict
from tests.harness import reference_greedy, run, running_stack
from tests.test_eagle_services import ALWAYS, make_head, target, tokenizer  # noqa: F401
from tests.test_services import chat_ids

PROMPTS = ["Explain how tides work.", "Write a haiku about rain.", "def add(a, b):"]
MAX_NEW = 40


def counting_sent_rounds(stack) -> list[int]:
    """Counts the rounds the coordinator sends the target worker (the runs' own are not)."""
    runs = stack.target_servicer.runs
    sent = [0]
    parse = runs._parse

    def counted(request):
        sent[0] += len(request.rounds)
        return parse(request)

    runs._parse = counted
    return sent


def serve(target, tokenizer, requests, head=None, **options):
    """Runs `requests` at once; returns (completions, rounds the coordinator sent, rounds run
    ahead, what the worker still holds afterwards: (runs, sessions))."""
    async def scenario():
        async with running_stack(target, tokenizer, target_head=head, target_options=ALWAYS if head else None,
                                 **options) as stack:
            sent = counting_sent_rounds(stack)
            before = metrics.ROUNDS_RUN_AHEAD._value.get()
            async with Client(stack.address) as client:
                results = await asyncio.gather(*(client.complete(r) for r in requests))
            await stack.coordinator_servicer.runner.drain()  # the releases
            held = len(stack.target_servicer.runs), len(stack.target_servicer.store)
            return results, sent[0], metrics.ROUNDS_RUN_AHEAD._value.get() - before, held

    return run(scenario())


def test_a_head_on_the_target_runs_ahead_token_identical(target, tokenizer):
    requests = [make_request(p, max_new_tokens=MAX_NEW, k=4) for p in PROMPTS]
    results, sent, ahead, held = serve(target, tokenizer, requests, head=make_head(target), run_ahead_rounds=8)
    for prompt, result in zip(PROMPTS, results):
        assert result.token_ids == reference_greedy(target, chat_ids(tokenizer, prompt), MAX_NEW)
    rounds = sum(r.stats["rounds"] for r in results)
    assert sum(r.stats["proposed"] for r in results) > 0  # the head drafted
    assert ahead > 0 and sent + ahead >= rounds
    assert sent <= rounds / 2, (sent, rounds)  # most rounds never waited for the coordinator
    assert held == (0, 0)  # every run ended, every session released
    plain, plain_sent, plain_ahead, _ = serve(target, tokenizer, requests, head=make_head(target), run_ahead_rounds=0)
    assert [r.token_ids for r in plain] == [r.token_ids for r in results]
    assert plain_ahead == 0 and plain_sent >= sum(r.stats["rounds"] for r in plain)


def test_a_run_follows_the_controllers_k_round_by_round(target, tokenizer, monkeypatch):
    """The adaptive controller decides every round's next block, runs or not: here it flips
    between 4 and 0 each round, and each decision reaches the running replica (RunChange)
    without ending the run."""
    from coordinator.adaptive import AdaptiveK

    def flipping(self, *args):
        self.flips = getattr(self, "flips", 0) + 1
        self.asked = 4 if self.flips % 2 else 0
        return self.asked

    monkeypatch.setattr(AdaptiveK, "next_k", flipping)
    head = make_head(target)

    async def scenario():
        async with running_stack(target, tokenizer, target_head=head, target_options=ALWAYS,
                                 run_ahead_rounds=1000) as stack:
            runs = stack.target_servicer.runs
            changes, asked_next = [], []
            change, step = runs.change, runs._run

            def changed(c):
                changes.append(c.draft_next)
                change(c)

            async def stepped(rounds):
                asked_next.extend(r.draft_next for r in rounds)
                return await step(rounds)

            runs.change, runs._run = changed, stepped
            before = metrics.ROUNDS_RUN_AHEAD._value.get()
            async with Client(stack.address) as client:
                results = await asyncio.gather(*(client.complete(make_request(p, max_new_tokens=MAX_NEW, k=4))
                                                 for p in PROMPTS))
            return results, changes, asked_next, metrics.ROUNDS_RUN_AHEAD._value.get() - before

    results, changes, asked_next, ahead = run(scenario())
    for prompt, result in zip(PROMPTS, results):
        assert result.token_ids == reference_greedy(target, chat_ids(tokenizer, prompt), MAX_NEW)
    assert ahead > 0 and sorted(set(changes)) == [0, 4]
    assert asked_next.count(0) > 3 and asked_next.count(4) > 3  # the worker drafted as told
    assert sum(r.stats["proposed"] for r in results) > 0


def test_decoding_without_speculation_runs_ahead(target, tokenizer):
    requests = [make_request(p, max_new_tokens=MAX_NEW, speculate=False) for p in PROMPTS]
    results, sent, ahead, held = serve(target, tokenizer, requests, run_ahead_rounds=4)
    for prompt, result in zip(PROMPTS, results):
        assert result.token_ids == reference_greedy(target, chat_ids(tokenizer, prompt), MAX_NEW)
        assert result.finish_reason == "FINISH_REASON_LENGTH" and len(result.token_ids) == MAX_NEW
    assert ahead > 0
    # A run of 4 after each round sent: about one round in five goes from the coordinator.
    assert sent <= 3 * (MAX_NEW // 5 + 2), sent
    assert held == (0, 0)


def test_a_run_the_coordinator_tops_up_lasts_the_whole_request(target, tokenizer, monkeypatch):
    """Granted more rounds as it commits them (TargetClient.run_grant), a session's run does
    not end every run_ahead rounds: far fewer rounds go from the coordinator than when
    each run ends at its count, and the output is the same."""
    from coordinator.workers import TargetClient

    requests = [make_request(p, max_new_tokens=MAX_NEW, speculate=False) for p in PROMPTS]
    granted, sent_granted, _, held = serve(target, tokenizer, requests, run_ahead_rounds=4)
    monkeypatch.setattr(TargetClient, "run_grant", lambda self, session: 0)
    ended, sent_ended, _, _ = serve(target, tokenizer, requests, run_ahead_rounds=4)
    for prompt, a, b in zip(PROMPTS, granted, ended):
        assert a.token_ids == b.token_ids == reference_greedy(target, chat_ids(tokenizer, prompt), MAX_NEW)
    # Ending at its count, a run of 4 leaves about one round in five to the coordinator (8
    # per request here); topped up, ideally only the first. A grant that arrives after its
    # run has ended costs a round, so the bound leaves room for a few.
    assert sent_ended >= 3 * (MAX_NEW // 5 - 1), sent_ended
    assert sent_granted <= sent_ended // 2, (sent_granted, sent_ended)
    assert held == (0, 0)


def test_the_run_changes_one_steps_verdicts_bring_go_as_one_message(target, tokenizer):
    """The requests a step's verdicts wake each top their runs up: their RunChanges reach
    the worker together, in fewer messages than changes."""
    requests = [make_request(p, max_new_tokens=MAX_NEW, speculate=False) for p in PROMPTS * 2]

    async def scenario():
        async with running_stack(target, tokenizer, run_ahead_rounds=4) as stack:
            runs = stack.target_servicer.runs
            seen = {"messages": 0, "changes": 0}
            step = runs.step

            async def counted(request, context, stream):
                if request is not None and request.run_changes:
                    seen["messages"] += 1
                    seen["changes"] += len(request.run_changes)
                return await step(request, context, stream)

            runs.step = counted
            async with Client(stack.address) as client:
                results = await asyncio.gather(*(client.complete(r) for r in requests))
            return results, seen

    results, seen = run(scenario())
    for prompt, result in zip(PROMPTS * 2, results):
        assert result.token_ids == reference_greedy(target, chat_ids(tokenizer, prompt), MAX_NEW)
    # Six runs of 4, each topped up every 2 rounds over 40 rounds: ~20 changes per request.
    assert seen["changes"] >= 6 * 10, seen
    assert seen["messages"] <= seen["changes"] // 2, seen


def test_seeded_sampling_runs_ahead_as_it_runs_without(target, tokenizer):
    requests = [make_request(p, max_new_tokens=MAX_NEW, k=4, temperature=0.8, top_k=20, seed=7 + i)
                for i, p in enumerate(PROMPTS)]
    head = make_head(target)
    ahead_results, _, ahead, _ = serve(target, tokenizer, requests, head=head, run_ahead_rounds=8)
    plain, _, _, _ = serve(target, tokenizer, requests, head=head, run_ahead_rounds=0)
    assert ahead > 0
    assert [r.token_ids for r in ahead_results] == [r.token_ids for r in plain]


def test_a_stop_string_ends_the_run(target, tokenizer):
    reference = reference_greedy(target, chat_ids(tokenizer, PROMPTS[0]), MAX_NEW)
    text = tokenizer.decode(reference[12:16])
    assert text.strip()
    request = make_request(PROMPTS[0], max_new_tokens=MAX_NEW, k=4, stop=[text.strip()])
    results, _, ahead, held = serve(target, tokenizer, [request], head=make_head(target), run_ahead_rounds=1000)
    plain, _, _, _ = serve(target, tokenizer, [request], head=make_head(target), run_ahead_rounds=0)
    assert results[0].finish_reason == "FINISH_REASON_STOP"
    assert results[0].token_ids == plain[0].token_ids and results[0].text == plain[0].text
    assert len(results[0].token_ids) < MAX_NEW
    assert held == (0, 0)  # every run ended, every session released


def test_a_broken_stream_ends_the_run_and_the_request_goes_on(target, tokenizer):
    prompt = PROMPTS[1]

    async def scenario():
        async with running_stack(target, tokenizer, target_head=make_head(target), target_options=ALWAYS,
                                 run_ahead_rounds=1000) as stack:
            client_side = stack.coordinator_servicer.runner.target
            worker = stack.target_servicer
            async with Client(stack.address) as client:
                began = time.perf_counter()
                task = asyncio.create_task(client.complete(make_request(prompt, max_new_tokens=MAX_NEW, k=4)))
                # Requests of one round, which never run ahead, beside it.
                short = [asyncio.create_task(client.complete(make_request(p, max_new_tokens=1))) for p in PROMPTS]
                while not len(worker.runs):  # the first round answered, the run going on
                    await asyncio.sleep(0.001)
                for stream in list(client_side._streams.values()):
                    await stream.close()  # as a broken connection would
                result = await task
                await asyncio.gather(*short)
                elapsed = time.perf_counter() - began
            await stack.coordinator_servicer.runner.drain()
            return result, len(worker.runs), len(worker.store), elapsed

    result, runs, sessions, elapsed = run(scenario())
    assert result.token_ids == reference_greedy(target, chat_ids(tokenizer, prompt), MAX_NEW)
    assert (runs, sessions) == (0, 0)
    assert elapsed < 10  # no round was waited for past the stream's end (the deadline is 30 s)


def test_a_run_that_sends_nothing_is_waited_for_no_longer_than_the_deadline(target, tokenizer):
    prompt, max_new = PROMPTS[0], 6

    async def scenario():
        async with running_stack(target, tokenizer, run_ahead_rounds=1000) as stack:
            client_side = stack.coordinator_servicer.runner.target
            client_side.call_timeout_s = 0.3
            runs = stack.target_servicer.runs
            answers = runs._answers

            def silent(request, *args):  # the rounds run ahead are never answered
                return [r for r in answers(request, *args) if not r.continued]

            runs._answers = silent
            async with Client(stack.address) as client:
                began = time.perf_counter()
                result = await client.complete(make_request(prompt, max_new_tokens=max_new, speculate=False))
                return result, time.perf_counter() - began

    result, elapsed = run(scenario())
    assert result.token_ids == reference_greedy(target, chat_ids(tokenizer, prompt), max_new)
    # Every round after the first waited 0.3 s for the run, then went from the coordinator.
    assert 0.3 * (max_new - 1) <= elapsed < 10


def test_verdicts_already_here_go_in_one_response(target, tokenizer, monkeypatch):
    """A coordinator that falls behind the worker's run (here: 30 ms of its own per response)
    commits every verdict already arrived and writes them as one response."""
    from coordinator.workers import TargetClient

    next_ahead = TargetClient.next_ahead

    async def slow(self, session, committed, wait=True):
        if wait:
            await asyncio.sleep(0.03)
        return await next_ahead(self, session, committed, wait)

    monkeypatch.setattr(TargetClient, "next_ahead", slow)
    prompt = PROMPTS[2]

    async def scenario():
        async with running_stack(target, tokenizer, run_ahead_rounds=1000) as stack:
            ttft = metrics.TTFT._sum.get(), sum(b.get() for b in metrics.TTFT._buckets)
            async with Client(stack.address) as client:
                responses = [r async for r in client.stream(make_request(prompt, max_new_tokens=MAX_NEW,
                                                                           speculate=False))]
            observed = sum(b.get() for b in metrics.TTFT._buckets) - ttft[1]
            return responses, observed

    responses, observed = run(scenario())
    tokens = [t for r in responses for t in r.token_ids]
    assert tokens == reference_greedy(target, chat_ids(tokenizer, prompt), MAX_NEW)
    assert len(responses) < MAX_NEW / 2  # rounds of one token each, several per response
    assert responses[0].request_id and responses[-1].stats.rounds == MAX_NEW
    assert observed == 1  # time to first token: once per request


# --- the worker's side, without gRPC --------------------------------------------------------

def verdict(accepted: int, next_token: int, next_drafts=(), extra=()) -> Verdict:
    return Verdict(accepted=accepted, next_token=next_token, cached_len=0, compute_s=0.0,
                   next_drafts=tuple(next_drafts), extra=tuple(extra))


def test_next_round_continues_what_the_verdict_commits():
    last = Round("s", 3, [7, 8], [20, 21, 22], GREEDY, draft_next=3)
    following, room = next_round(last, verdict(2, 30, next_drafts=[40, 41, 42], extra=[31]), 10, frozenset())
    assert following == Round("s", 5, [20, 21, 30, 31], [40, 41, 42], GREEDY, draft_next=3)
    assert room == 6
    # Drafts never past the room; the round that uses it up has no successor.
    following, room = next_round(last, verdict(0, 30, next_drafts=[40, 41, 42]), 3, frozenset())
    assert following.drafts == [40] and room == 2
    assert next_round(last, verdict(3, 30), 4, frozenset())[0] is None
    # A stop token committed ends the run, even mid-block.
    assert next_round(last, verdict(2, 30, next_drafts=[40]), 100, frozenset({21}))[0] is None
    assert next_round(last, verdict(0, 30, next_drafts=[40]), 100, frozenset({21}))[0] is not None


class FakeModel:
    """A step function that accepts every draft and commits token 100 + position."""

    def __init__(self):
        self.steps: list[list[Round]] = []
        self.fail = False

    async def run(self, rounds):
        self.steps.append(rounds)
        if self.fail:
            raise Unavailable("the model thread stalled")
        results = [verdict(len(r.drafts), 100 + r.start + len(r.tokens) + len(r.drafts), next_drafts=[1, 2])
                   for r in rounds]
        return BatchOutcome(results=results, step_s=0.001, rows=sum(len(r.tokens) + len(r.drafts) for r in rounds))


def make_runs(model: FakeModel) -> RunsAhead:
    def parse(request):
        return [Round(r.delta.session_id, r.delta.start, list(r.delta.tokens), list(r.draft_tokens), GREEDY,
                      draft_next=r.draft_next) for r in request.rounds]

    def result(outcome_result, request_id):
        if isinstance(outcome_result, BaseException):
            return target_pb2.VerifyResponse(error=common_pb2.RoundError(code=14, message=str(outcome_result)))
        return target_pb2.VerifyResponse(verdict=target_pb2.Verdict(accepted=outcome_result.accepted,
                                                                    next_token=outcome_result.next_token,
                                                                    next_drafts=outcome_result.next_drafts))

    def answer(requests, results, outcome):
        return target_pb2.VerifyBatchResponse(results=[result(r, "") for r in results], step_s=outcome.step_s)

    return RunsAhead(parse, model.run, answer, result, max_batch_rounds=2)


def asked(*sessions: str, run_ahead: int = 3, room: int = 100) -> target_pb2.VerifyBatchRequest:
    request = target_pb2.VerifyBatchRequest(step_id=1)
    for session in sessions:
        request.rounds.add(delta=common_pb2.SessionDelta(session_id=session, start=0, tokens=[5, 6]),
                           draft_tokens=[1, 2], draft_next=2, run_ahead=run_ahead, token_room=room)
    return request


def test_a_run_goes_on_until_its_count_and_answers_each_round():
    model, stream = FakeModel(), object()
    runs = make_runs(model)

    async def scenario():
        first = await runs.step(asked("a", run_ahead=2), None, stream)
        assert first[0].results[0].verdict.run_id != 0 and runs.waiting(stream)
        second = await runs.step(None, None, stream)
        third = await runs.step(None, None, stream)
        return first, second, third

    first, second, third = run(scenario())
    run_id = first[0].results[0].verdict.run_id
    assert [len(r) for r in (first, second, third)] == [1, 1, 1]
    (item,), (last,) = second[0].continued, third[0].continued
    # Each round continues the committed sequence: start 0 + [5, 6] + drafts [1, 2] + next 104.
    assert model.steps[1] == [Round("a", 2, [1, 2, 104], [1, 2], GREEDY, draft_next=2)]
    assert (item.session_id, item.context_len, list(item.draft_tokens), item.run_id) == ("a", 5, [1, 2], run_id)
    assert item.drafted_with == 2  # the k its drafts answer: the round before it asked for 2
    assert item.result.verdict.run_id == run_id  # another follows
    assert last.result.verdict.run_id == 0 and last.context_len == 8  # the count is used up
    assert not runs.waiting(stream) and len(runs) == 0


def test_a_change_applies_to_the_runs_next_round_and_only_to_its_run():
    model, stream = FakeModel(), object()
    runs = make_runs(model)

    async def scenario():
        first = await runs.step(asked("a"), None, stream)
        run_id = first[0].results[0].verdict.run_id
        change = target_pb2.VerifyBatchRequest(step_id=2, run_changes=[
            target_pb2.RunChange(session_id="a", run_id=run_id + 1, draft_next=7),  # another run: ignored
            target_pb2.RunChange(session_id="a", run_id=run_id, draft_next=0)])
        return await runs.step(change, None, stream)

    answer, continued = run(scenario())
    # The change is answered (empty), and the run it changed takes the same turn's step.
    assert not answer.results and not answer.continued and answer.step_s == 0
    assert len(model.steps) == 2 and model.steps[1][0].draft_next == 0
    (item,) = continued.continued
    assert item.session_id == "a" and continued.step_id == 0
    # The step's figures go with the runs' message, as for any step of runs alone.
    assert continued.step_s > 0 and continued.ahead_rounds == 1 and continued.rows == 3 + 2


def test_a_change_for_no_waiting_run_is_answered_without_a_step():
    model, stream = FakeModel(), object()
    runs = make_runs(model)
    change = target_pb2.VerifyBatchRequest(step_id=2, run_changes=[
        target_pb2.RunChange(session_id="gone", run_id=1, draft_next=3)])
    (answer,) = run(runs.step(change, None, stream))
    assert not answer.results and not answer.continued and not model.steps


def test_a_failed_step_a_change_started_answers_the_change_and_ends_the_runs():
    model, stream = FakeModel(), object()
    runs = make_runs(model)

    async def scenario():
        first = await runs.step(asked("a"), None, stream)
        model.fail = True
        return await runs.step(target_pb2.VerifyBatchRequest(step_id=2, run_changes=[target_pb2.RunChange(
            session_id="a", run_id=first[0].results[0].verdict.run_id, draft_next=1)]), None, stream)

    answer, ended = run(scenario())
    assert answer.error_code == 0 and not answer.continued  # the change was made; the step is the runs'
    assert [(i.session_id, i.result.WhichOneof("result")) for i in ended.continued] == [("a", "error")]
    assert len(runs) == 0


def test_more_rounds_extend_a_run_and_its_price_goes_to_its_next_round():
    model, stream = FakeModel(), object()
    runs = make_runs(model)

    async def scenario():
        first = await runs.step(asked("a", run_ahead=1), None, stream)
        run_id = first[0].results[0].verdict.run_id
        answers = [(await runs.step(target_pb2.VerifyBatchRequest(step_id=2, run_changes=[target_pb2.RunChange(
            session_id="a", run_id=run_id, draft_next=3, min_draft_prob=0.25, more_rounds=2)]), None, stream))[1:]]
        while runs.waiting(stream):
            answers.append(await runs.step(None, None, stream))
        return answers

    answers = run(scenario())
    # One round granted by the request, two by the change: three run (the first in the change's
    # turn), the last ends the run.
    assert len(answers) == 3 and len(model.steps) == 4
    assert [a[0].continued[0].result.verdict.run_id != 0 for a in answers] == [True, True, False]
    assert [(r[0].draft_next, r[0].min_draft_prob) for r in model.steps[1:]] == [(3, 0.25)] * 3
    assert len(runs) == 0


def test_a_coordinator_round_release_or_stream_end_ends_a_run():
    model, stream = FakeModel(), object()
    runs = make_runs(model)

    async def scenario():
        await runs.step(asked("a", "b"), None, stream)
        assert len(runs) == 2
        # The coordinator's own round for "a" supersedes its run: only "b" runs ahead with it.
        await runs.step(asked("a", run_ahead=0), None, stream)
        assert [r.session_id for r in model.steps[-1]] == ["a", "b"] and model.steps[-1][0].start == 0
        runs.end("b")  # Release
        assert len(runs) == 0
        await runs.step(asked("c"), None, stream)
        runs.close(stream)
        assert len(runs) == 0 and not runs.waiting(stream)

    run(scenario())


def test_a_step_takes_runs_up_to_its_round_limit_the_longest_waiting_first():
    model, stream = FakeModel(), object()
    runs = make_runs(model)

    async def scenario():
        await runs.step(asked("a", "b", run_ahead=10), None, stream)
        await runs.step(asked("c", run_ahead=10), None, stream)  # the limit is 2: "b" waits
        assert [r.session_id for r in model.steps[-1]] == ["c", "a"]
        for _ in range(3):
            await runs.step(None, None, stream)
        return [[r.session_id for r in step] for step in model.steps[2:]]

    assert run(scenario()) == [["b", "c"], ["a", "b"], ["c", "a"]]
    assert len(runs) == 3


def test_each_step_reports_the_rounds_it_ran_ahead_once():
    model, stream = FakeModel(), object()
    runs = make_runs(model)

    async def scenario():
        await runs.step(asked("a", "b"), None, stream)
        mixed = await runs.step(asked("c", run_ahead=0), None, stream)  # "a" runs beside "c"
        alone = await runs.step(None, None, stream)  # "b" and "a"
        return mixed, alone

    (answer, continued), (only,) = run(scenario())
    assert (answer.ahead_rounds, answer.ahead_drafts, answer.ahead_drafting, answer.ahead_head_rounds) == (1, 2, 1, 1)
    assert answer.step_s > 0 and continued.step_s == 0 and len(continued.continued) == 1
    assert only.step_id == 0 and only.step_s > 0 and only.rows == 2 * (3 + 2)
    assert (only.ahead_rounds, only.ahead_drafts, only.ahead_drafting) == (2, 4, 2)


def test_a_step_failing_after_its_forward_ends_its_runs_with_the_error():
    model, stream = FakeModel(), object()
    runs = make_runs(model)

    async def scenario():
        await runs.step(asked("a"), None, stream)
        runs._answer = lambda *args: 1 / 0  # building the step's answer fails
        return await runs.step(asked("b"), None, stream)

    own, ended = run(scenario())
    assert own.error_code != 0 and "ZeroDivisionError" in own.error_message
    assert [(i.session_id, i.result.WhichOneof("result")) for i in ended.continued] == [("a", "error")]
    assert len(runs) == 0


def test_a_failed_step_fails_its_own_answer_and_ends_its_runs_with_the_error():
    model, stream = FakeModel(), object()
    runs = make_runs(model)

    async def scenario():
        await runs.step(asked("a"), None, stream)
        model.fail = True
        return await runs.step(asked("b"), None, stream)

    own, ended = run(scenario())
    assert own.error_code == 14 and "stalled" in own.error_message
    (item,) = ended.continued
    assert item.session_id == "a" and item.result.WhichOneof("result") == "error"
    assert len(runs) == 0


@pytest.mark.parametrize("value", ["-1", "x"])
def test_run_ahead_must_be_a_count(value, capsys):
    from specdec.cli import main

    with pytest.raises(SystemExit):
        main(["serve", "coordinator", "--target-addr", "127.0.0.1:1", "--tokenizer", "t", "--run-ahead", value])
    assert "is not a count" in capsys.readouterr().err


@pytest.mark.parametrize("where", ["head on the target", "head on the draft worker"])
def test_a_pause_of_drafting_reaches_every_round_on_the_replica(target, tokenizer, monkeypatch, where):
    """When a replica's step cost model pauses drafting (coordinator.adaptive.StepCostModel:
    drafting under load), requests there stop drafting within a few steps —
    running ahead or not, drafting on the target or on a draft worker — resume after the
    pause, and the output is still the target's alone."""
    from coordinator import adaptive

    def always(self, *args):
        self.asked, self.probing = 4, False
        return 4

    monkeypatch.setattr(adaptive.AdaptiveK, "next_k", always)
    monkeypatch.setattr(adaptive, "PAUSE_EVERY", 6)
    monkeypatch.setattr(adaptive, "PAUSE_MIN_DRAFTS", 1.0)
    steps = []  # (steps of its pause left when the step came, draft rows in it)
    observe = adaptive.StepCostModel.observe

    def observed(self, rows, seconds, rounds, drafts=0, *args):
        steps.append((self.pause_left, drafts))
        observe(self, rows, seconds, rounds, drafts, *args)

    monkeypatch.setattr(adaptive.StepCostModel, "observe", observed)
    head = make_head(target)
    options = ({"target_head": head, "target_options": ALWAYS} if where.endswith("target")
               else {"draft": head, "draft_options": ALWAYS})

    async def scenario():
        async with running_stack(target, tokenizer, **options) as stack:
            before = metrics.DRAFT_PAUSES._value.get()
            async with Client(stack.address) as client:
                results = await asyncio.gather(*(client.complete(make_request(p, max_new_tokens=MAX_NEW, k=4))
                                                 for p in PROMPTS))
            return results, metrics.DRAFT_PAUSES._value.get() - before

    results, pauses = run(scenario())
    for prompt, result in zip(PROMPTS, results):
        assert result.token_ids == reference_greedy(target, chat_ids(tokenizer, prompt), MAX_NEW)
    assert pauses >= 1
    late = [drafts for left, drafts in steps if 0 < left <= adaptive.PAUSE_STEPS - 4]
    assert late and set(late) == {0}, steps  # the pause reached every round after its first steps
    assert sum(drafts for left, drafts in steps if not left) > 0  # and drafting went on outside it
