"""Continuous batching: the ragged packed forward equals each session alone, batched worker
calls decide each round as it would be decided alone, the coordinator's steps carry many
requests at once, and 16 concurrent requests give exactly what each gives alone (greedy:
the target alone; seeded sampling: its own solo run)."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest
import torch

from coordinator import adaptive
from coordinator.adaptive import DRAFT_TOKEN_COST, PROPOSE_COST, AdaptiveK, DrafterRecord, RoundTimes, StepCostModel
from coordinator.scheduler import RoundFailed, StepBatcher
from draft_worker.drafters.model import ModelDrafter
from draft_worker.propose import Proposer, Request
from specdec.client import Client, make_request
from specdec.runtime.load import serving_lm
from specdec.errors import InvalidArgument
from specdec.runtime.compat import cache_kwarg
from specdec.runtime.lm import CausalLM
from specdec.models import NGRAM
from specdec.runtime.packed import supports_packed
from specdec.sampling import Sampling
from specdec.sessions import Resync, Session, SessionStore
from target_worker.verify import Round, Verdict, Verifier
from tests.factories import TEST_DEVICE, make_tiny_model
from tests.harness import reference_greedy, reference_sample, run, running_stack
from tests.test_services import PROMPTS, chat_ids, other_draft, target, tokenizer  # noqa: F401 (fixtures)

MAX_NEW = 32


def tokens(n: int, seed: int, vocab: int = 300) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def fresh_sessions(lm, contexts: list[list[int]]) -> list[Session]:
    sessions = []
    for i, context in enumerate(contexts):
        session = Session(f"s{i}")
        session.cache, session.ids = lm._new_cache(), []
        if context:
            lm.feed(session, context, 1)
        sessions.append(session)
    return sessions


# ---------------------------------------------------------------------------------------
# The packed forward


# The packed forward runs with the CPU fast path's attention function (specdec.runtime.cpu); on
# a GPU the model is served as it is and batched rounds run one session at a time.
cpu_only = pytest.mark.skipif(TEST_DEVICE != "cpu", reason="the packed forward is the CPU fast path's")


@cpu_only
def test_packed_forward_equals_each_session_alone(target):
    lm = serving_lm(target)
    assert lm.batches_in_one_pass
    # Ragged on every axis: cache lengths 0..70 (0: a session's very first round), 1..6 new
    # tokens, logits of 1..all of them.
    contexts = [tokens(n, seed=n) for n in (0, 7, 33, 70, 12)]
    new = [tokens(n, seed=100 + n) for n in (5, 1, 6, 3, 1)]
    keep = [5, 1, 2, 3, 1]
    alone = [lm.feed(s, t, k) for s, t, k in zip(fresh_sessions(lm, contexts), new, keep)]
    batched_sessions = fresh_sessions(lm, contexts)
    batched = lm.feed_batch(batched_sessions, new, keep)
    for a, b in zip(alone, batched):
        assert a.shape == b.shape
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4 * float(a.abs().max()))
        assert torch.equal(a.argmax(-1), b.argmax(-1))
    # The caches grew exactly as alone: the next step on each still agrees.
    for session, context, t in zip(batched_sessions, contexts, new):
        assert session.ids == context + t and session.cache.get_seq_length() == len(context) + len(t)
    again = lm.feed_batch(batched_sessions, [[5]] * len(new), [1] * len(new))
    with torch.no_grad():
        reference = [target(torch.tensor([c + t + [5]])).logits[0, -1:].float() for c, t in zip(contexts, new)]
    for a, b in zip(reference, again):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4 * float(a.abs().max()))


def rolled_back_sessions(lm) -> list[Session]:
    """Two sessions fed 20 and 30 tokens, then cropped to 15 as rejected drafts are dropped."""
    sessions = fresh_sessions(lm, [tokens(20, 1), tokens(30, 2)])
    for s in sessions:
        lm.crop(s, 15)  # rejected drafts dropped
    return sessions


@cpu_only
def test_packed_forward_after_rollback_equals_the_target(target):
    lm = serving_lm(target)
    out = lm.feed_batch(rolled_back_sessions(lm), [[7, 8], [9]], [2, 1])
    with torch.no_grad():
        expected = target(torch.tensor([tokens(20, 1)[:15] + [7, 8]])).logits[0, -2:].float()
    torch.testing.assert_close(out[0], expected, rtol=1e-4, atol=1e-4 * float(expected.abs().max()))


@cpu_only
def test_a_failed_packed_forward_forgets_the_batch(target):
    lm = serving_lm(target)
    sessions = rolled_back_sessions(lm)
    with pytest.raises(IndexError):
        lm.feed_batch(sessions, [[7], [10 ** 6]], [1, 1])  # an id past the embedding
    assert all(s.cache is None and s.ids == [] for s in sessions)  # rebuilt on the next round


@cpu_only
def test_sliding_window_models_fall_back_to_one_session_at_a_time(tokenizer):
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                           sliding_window=16)
    model = MistralForCausalLM(config).eval()
    lm = serving_lm(model)
    assert "sliding window" in supports_packed(lm.model) and not lm.batches_in_one_pass
    contexts = [tokens(30, 3), tokens(5, 4)]
    alone = [lm.feed(s, [9, 10], 2) for s in fresh_sessions(lm, contexts)]
    batched = lm.feed_batch(fresh_sessions(lm, contexts), [[9, 10], [9, 10]], [2, 2])
    for a, b in zip(alone, batched):
        torch.testing.assert_close(a, b)


# ---------------------------------------------------------------------------------------
# Batched worker calls


class PastKeyValuesModel(torch.nn.Module):
    """A causal LM as transformers 5 releases before the `cache` keyword run one: its forward
    takes the KV cache as past_key_values (and swallows unknown keywords)."""

    def __init__(self, model):
        super().__init__()
        self.inner = model
        self.config = model.config

    def forward(self, input_ids=None, past_key_values=None, use_cache=None, logits_to_keep=0, **kwargs):
        return self.inner(input_ids=input_ids, use_cache=use_cache, logits_to_keep=logits_to_keep,
                          **{cache_kwarg(self.inner): past_key_values}, **kwargs)


def test_a_model_that_takes_its_cache_as_past_key_values_keeps_it(target):
    """The cache goes by the keyword the model's forward names: by another, it would be
    dropped silently and every round after the first fail ("cache and ids out of step")."""
    older, plain = CausalLM(PastKeyValuesModel(target)), CausalLM(target)
    assert cache_kwarg(older.model) == "past_key_values"
    context, more = tokens(20, 11), tokens(3, 12)
    results = []
    for lm in (older, plain):
        session = fresh_sessions(lm, [context])[0]
        results.append(lm.feed(session, more, 3))
        assert session.cache.get_seq_length() == len(session.ids) == 23
    torch.testing.assert_close(results[0], results[1])


@pytest.fixture(scope="module")
def mixed_verify_batch(target):
    """(what a verifier decides for the three good rounds sent one by one, the outcome of one
    verify_batch of them with three bad rounds: outside the vocabulary, a session the worker
    never saw, the same session twice)"""
    def verifier():
        lm = serving_lm(target)
        return Verifier(lm, SessionStore(64, 1 << 30, lm.bytes_per_token), max_draft_tokens=8)

    greedy_drafts = reference_greedy(target, tokens(25, 5), 4)
    rounds = [
        Round("a", 0, tokens(25, 5), greedy_drafts[:3] + [1]),  # 3 accepted then a wrong one
        Round("b", 0, tokens(12, 6), []),  # a plain step
        Round("c", 0, tokens(40, 7), tokens(4, 8), Sampling(temperature=0.8, top_k=0, top_p=1.0, seed=3)),
        Round("d", 0, tokens(10, 9), [999_999]),  # outside the vocabulary
        Round("e", 4, tokens(3, 10), []),  # a session this worker never saw
        Round("b", 0, tokens(12, 6), []),  # the same session twice in one step
    ]
    alone = verifier()
    expected = []
    for r in rounds[:3]:
        expected.append(alone.verify(r.session_id, r.start, r.tokens, r.drafts, r.sampling))
    return expected, verifier().verify_batch(rounds)


def test_verify_batch_decides_each_round_as_alone(mixed_verify_batch):
    expected, outcome = mixed_verify_batch
    got = outcome.results
    assert [(v.accepted, v.next_token, v.cached_len) for v in got[:3]] == [
        (v.accepted, v.next_token, v.cached_len) for v in expected]


def test_verify_batch_accepts_the_drafts_the_target_agrees_with(mixed_verify_batch):
    _, outcome = mixed_verify_batch
    first = outcome.results[0]
    assert first.accepted == 3 and isinstance(first, Verdict)


def test_verify_batch_refuses_a_round_outside_the_vocabulary_alone(mixed_verify_batch):
    _, outcome = mixed_verify_batch
    error = outcome.results[3]
    assert isinstance(error, InvalidArgument) and "vocabulary" in str(error)


def test_verify_batch_asks_an_unknown_session_to_resync_alone(mixed_verify_batch):
    _, outcome = mixed_verify_batch
    resync = outcome.results[4]
    assert isinstance(resync, Resync) and resync.cached_len == 0


def test_verify_batch_refuses_a_second_round_of_one_session_alone(mixed_verify_batch):
    _, outcome = mixed_verify_batch
    error = outcome.results[5]
    assert isinstance(error, InvalidArgument) and "more than one round" in str(error)


def test_verify_batch_counts_only_the_rows_of_rounds_it_ran(mixed_verify_batch):
    _, outcome = mixed_verify_batch
    assert outcome.rows == 25 + 4 + 12 + 40 + 4


def test_propose_batch_equals_each_proposal_alone(target, other_draft):
    def proposer():
        lm = serving_lm(other_draft)
        return Proposer(ModelDrafter("d", lm), SessionStore(64, 1 << 30, lm.bytes_per_token), max_k=8)

    requests = [Request("a", 0, tokens(20, 1), 4), Request("b", 0, tokens(3, 2), 1), Request("c", 0, tokens(50, 3), 6),
                Request("d", 0, tokens(5, 4), 0)]
    alone = proposer()
    expected = [alone.propose(r.session_id, r.start, r.tokens, r.k).tokens for r in requests[:3]]
    got = proposer().propose_batch(requests).results
    assert [p.tokens for p in got[:3]] == expected and [len(t) for t in expected] == [4, 1, 6]
    assert isinstance(got[3], InvalidArgument)


# ---------------------------------------------------------------------------------------
# The coordinator's steps


class FakeResponse:
    def __init__(self, results):
        self.results = results


@pytest.fixture(scope="module")
def step_batcher_run():
    """(the rounds of each step sent, the results of r0..r4, the outcome of a round whose step
    fails) from one StepBatcher with a budget of 10 tokens and 3 rounds: r0 (4 tokens) in
    flight alone while r1 (4), r2 (4), r3 (1), r4 (30) and "gone" (1, cancelled while queued)
    queue."""
    async def scenario():
        steps: list[list[str]] = []
        release = asyncio.Event()

        async def send(requests, timeout_s):
            steps.append(list(requests))
            await release.wait()
            if "boom" in requests:
                raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "x")
            return FakeResponse([f"done {r}" for r in requests])

        batcher = StepBatcher("target", send, token_budget=10, max_rounds=3)
        first = asyncio.ensure_future(batcher.submit("r0", 4, 5.0))
        await asyncio.sleep(0.01)  # r0 is in flight alone; the rest queue behind it
        later = [asyncio.ensure_future(batcher.submit(f"r{i}", n, 5.0)) for i, n in ((1, 4), (2, 4), (3, 1), (4, 30))]
        cancelled = asyncio.ensure_future(batcher.submit("gone", 1, 5.0))
        await asyncio.sleep(0.01)
        cancelled.cancel()
        # Let the cancellation land before the steps go on: the fake worker answers without
        # yielding, so the batcher would otherwise run every queued step before it does.
        await asyncio.wait([cancelled])
        release.set()
        results = await asyncio.gather(first, *later)
        failing = await asyncio.gather(batcher.submit("boom", 1, 5.0), return_exceptions=True)
        return steps, results, failing

    return run(scenario())


def test_step_batcher_fills_steps_in_order_up_to_the_token_budget(step_batcher_run):
    steps, _, _ = step_batcher_run
    # Budget 10: r1 + r2 (8) fit, r3 would too (9) — then r4 (30) goes alone; "gone" never.
    assert steps[:3] == [["r0"], ["r1", "r2", "r3"], ["r4"]]


def test_step_batcher_never_sends_a_cancelled_round(step_batcher_run):
    steps, _, _ = step_batcher_run
    assert not any("gone" in step for step in steps)


def test_step_batcher_gives_each_round_its_own_result(step_batcher_run):
    _, results, _ = step_batcher_run
    assert results == [f"done r{i}" for i in range(5)]


def test_step_batcher_fails_the_rounds_of_a_failed_step_with_its_status(step_batcher_run):
    _, _, failing = step_batcher_run
    assert isinstance(failing[0], RoundFailed) and failing[0].code() == grpc.StatusCode.UNAVAILABLE


def test_a_cancelled_requests_release_waits_for_the_step_carrying_its_round():
    """A sent round is not recalled: the worker runs it (creating the session's cache) even
    when its request is cancelled meanwhile, so the release must come after the step's answer."""
    async def scenario():
        answer = asyncio.Event()
        order: list[str] = []

        async def send(requests, timeout_s):
            order.append("step sent")
            await answer.wait()
            order.append("step answered")
            return FakeResponse(list(requests))

        batcher = StepBatcher("target", send, token_budget=100, max_rounds=4)
        round_ = asyncio.ensure_future(batcher.submit("r", 1, 5.0, key="gen-1"))
        await asyncio.sleep(0.01)  # the step is in flight
        round_.cancel()
        await asyncio.sleep(0)

        async def release():
            await batcher.settled("gen-1")
            order.append("released")

        releasing = asyncio.ensure_future(release())
        await batcher.settled("other")  # a request with no round in the step need not wait
        await asyncio.sleep(0.02)
        waited = not releasing.done()
        answer.set()
        await asyncio.wait_for(releasing, 1.0)
        return waited, order

    waited, order = run(scenario())
    assert waited, "the release did not wait for the step in flight"
    assert order == ["step sent", "step answered", "released"]


def test_work_for_the_client_waits_for_the_step_carrying_the_next_rounds():
    """A request answered by a step queues its next round, then awaits gathered() before
    its work for the client: the next step leaves first, and a waiter cancelled meanwhile
    leaves the gathering alone."""
    async def scenario():
        order: list[str] = []

        async def send(requests, timeout_s):
            order.append(f"step {len(requests)}")
            await asyncio.sleep(0.005)
            return FakeResponse(list(requests))

        batcher = StepBatcher("target", send, token_budget=100, max_rounds=16, gather=True)
        assert await asyncio.wait_for(batcher.gathered(), 0.1) is None  # nothing gathered: at once

        async def request(key: str):
            ahead = asyncio.ensure_future(batcher.submit(key, 1, 5.0, key=key))
            for round_ in range(3):
                await ahead
                if round_ < 2:
                    ahead = asyncio.ensure_future(batcher.submit(key, 1, 5.0, key=key))
                    await batcher.gathered()
                else:
                    batcher.forget(key)
                order.append(f"client {key}")

        async def cancelled():
            await batcher.submit("x", 1, 5.0, key="x")
            waiter = asyncio.ensure_future(batcher.gathered())
            await asyncio.sleep(0)
            waiter.cancel()  # "x" is not back, and the step still waits for the others
            order.append("x gone")

        await asyncio.gather(*(request(k) for k in "abc"), cancelled())
        return order

    order = run(scenario())
    # The first step carries all four; "x" never comes back, so the gathering gives up on it.
    assert order[:2] == ["step 4", "x gone"]
    assert order[2:6] == ["step 3", "client a", "client b", "client c"]
    assert order[6:10] == ["step 3", "client a", "client b", "client c"]


@pytest.mark.parametrize("gather", [False, True])
def test_requests_answered_by_a_step_share_the_next_one_instead_of_leapfrogging(gather):
    async def scenario():
        steps: list[int] = []

        async def send(requests, timeout_s):
            steps.append(len(requests))
            await asyncio.sleep(0.02)  # the worker's step
            return FakeResponse(list(requests))

        batcher = StepBatcher("target", send, token_budget=100, max_rounds=16, gather=gather)

        async def request(key: str, delay: float):
            await asyncio.sleep(delay)
            for _ in range(8):
                await batcher.submit(key, 1, 5.0, key=key)
                await asyncio.sleep(0.001)  # commit, stream, decide the next round
            batcher.forget(key)

        # One request starts the first step alone; three arrive while it runs.
        await asyncio.gather(request("a", 0.0), *(request(k, 0.005) for k in "bcd"))
        return steps

    steps = run(scenario())
    if gather:
        # One cohort from the second step on; "a", a step ahead, is done before the last.
        assert steps == [1] + [4] * 7 + [3]
    else:
        assert steps[:4] == [1, 3, 1, 3]  # without gathering, two cohorts leapfrog each other


def test_asking_the_drafter_costs_more_when_a_whole_step_waits_for_it():
    propose = RoundTimes()
    for _ in range(10):
        propose.observe(0.003)
    alone, crowd, all_draft = StepCostModel(), StepCostModel(), StepCostModel()
    for step in range(40):
        alone.observe(1, 0.030, 1, 0, 0)
        crowd.observe(16, 0.050, 16, 0, 1 if step % 4 == 0 else 0)  # few of 16 requests draft
        all_draft.observe(32, 0.060, 16, 16, 16)
    assert alone.propose_cost(propose) == pytest.approx(0.1, rel=0.05)  # 3 ms of a 30 ms step
    assert crowd.propose_cost(propose) > 0.5  # 16 requests wait 3 ms for the one drafting
    assert all_draft.propose_cost(propose) == pytest.approx(0.003 / 0.060, rel=0.1)  # shared by all
    assert StepCostModel().propose_cost(propose) == PROPOSE_COST  # no step seen yet


def test_asking_the_head_on_the_target_costs_its_measured_drafting_time():
    alone, crowd, all_ask = StepCostModel(), StepCostModel(), StepCostModel()
    for step in range(40):
        alone.observe(1, 0.030, 1, 0, 0)
        alone.observe_head(0.003, 1, 1)
        crowd.observe(16, 0.050, 16, 0, 0)
        crowd.observe_head(0.003, 16, 1 if step % 4 == 0 else 0)  # few of 16 requests ask
        all_ask.observe(32, 0.060, 16, 16, 16)
        all_ask.observe_head(0.012, 16, 16)
    assert alone.head_cost() == pytest.approx(0.1, rel=0.05)  # 3 ms of a 30 ms step
    assert crowd.head_cost() > 0.5  # 16 requests wait 3 ms for the one asking
    assert all_ask.head_cost() == pytest.approx(0.012 / 0.060, rel=0.1)  # shared by all
    assert StepCostModel().head_cost() == PROPOSE_COST  # no step seen yet


def test_the_heads_drafting_time_is_not_fitted_as_the_draft_rows_cost():
    # 16 rounds; steps that verify d draft rows cost 100 ms + 1 ms per draft row to verify,
    # and their rounds asked the head for the next drafts, which took 2 ms per draft row.
    plain, with_head = StepCostModel(), StepCostModel()
    for step in range(60):
        drafts = (step % 5) * 8
        head_s = 0.002 * drafts
        plain.observe(16 + drafts, 0.100 + 0.001 * drafts, 16, drafts, drafts // 2)
        with_head.observe(16 + drafts, 0.100 + 0.001 * drafts + head_s, 16, drafts, drafts // 2, head_s)
        with_head.observe_head(head_s, 16, drafts // 2)
    base, per_draft = with_head.fit()
    assert per_draft == pytest.approx(0.001, rel=0.1)  # the verification's slope alone
    assert base == pytest.approx(plain.fit()[0], rel=0.02)
    # The usual step still lasts what the head adds to it, on the mean.
    assert with_head.step_s == pytest.approx(plain.step_s + with_head.head_per_step, rel=0.01)
    assert with_head.draft_token_cost() < plain.draft_token_cost() * 1.01
    # Left in, the head's time would have tripled the draft rows' price.
    double = StepCostModel()
    for step in range(60):
        drafts = (step % 5) * 8
        double.observe(16 + drafts, 0.100 + 0.003 * drafts, 16, drafts, drafts // 2)
    assert double.draft_token_cost() > 2.5 * with_head.draft_token_cost()


def load_steps(model: StepCostModel, steps: int, seed: int = 0, honour_pauses: bool = True) -> list[bool]:
    """Feeds `model` steps of a replica under load: 48–64 rounds, drafting 0.7 rows per round
    at first and 0.3 at the end (the price moves) while the step's other costs creep up (the
    contexts grow), so draft rows follow rounds and drift with time; each step costs 40 ms + 4
    ms per round + 1.6 ms per draft row + the drift, ±3% noise. A step decided while the
    model pauses drafting (read before each step, as the coordinator does per round) carries
    no drafts when `honour_pauses`. Returns, per step, whether it was paused."""
    rng = np.random.default_rng(seed)
    paused = []
    for step in range(steps):
        rounds = int(rng.integers(48, 65))
        paused.append(model.paused)
        share = 0.7 - 0.4 * step / steps
        drafts = 0 if paused[-1] and honour_pauses else int(round(rounds * share * rng.uniform(0.95, 1.05)))
        seconds = (0.040 + 0.004 * rounds + 0.0016 * drafts + 0.0004 * step) * rng.uniform(0.97, 1.03)
        model.observe(rounds + drafts, seconds, rounds, drafts, drafts // 2)
    return paused


def test_under_load_a_replica_pauses_drafting_to_price_a_row():
    """Draft rows that follow the rounds, and drift with the step's other costs, leave a
    fit over the window unable to price a row; pauses of a few steps without drafts, set
    against the steps just before them, measure it."""
    blind_errors = []
    for seed in range(4):
        model, blind = StepCostModel(), StepCostModel()
        paused = load_steps(model, 400, seed)
        load_steps(blind, 400, seed, honour_pauses=False)
        assert model.pauses >= 3 and blind.pauses >= 3  # both asked; one was heeded
        share = sum(paused) / len(paused)
        assert share <= adaptive.PAUSE_STEPS / adaptive.PAUSE_EVERY + 0.01
        assert model.paired_weight > 0 and blind.paired_weight == 0
        assert model.fit()[1] == pytest.approx(0.0016, rel=0.15)
        # The price of a row, in steps of the usual size: ~56 rounds waiting 1.6 ms each.
        assert model.draft_token_cost() == pytest.approx(model.rounds * 0.0016 / model.fit()[0], rel=0.15)
        blind_errors.append(abs(blind.fit()[1] / 0.0016 - 1))
    assert np.mean(blind_errors) > 0.3  # the window alone confuses the drift with the rows


def test_drafting_never_pauses_at_one_request_or_without_drafts():
    one, none = StepCostModel(), StepCostModel()
    for step in range(300):
        drafts = step % 5  # one request, drafting 0–4 tokens
        one.observe(1 + drafts, 0.025 + 0.0012 * drafts, 1, drafts, 1 if drafts else 0)
        none.observe(64, 0.300, 64, 0, 0)  # nobody drafts
        assert not (one.paused or none.paused)
    assert one.pauses == none.pauses == 0


def test_the_price_of_a_row_follows_the_load_down_within_a_few_steps():
    """When most requests finish, the few left are priced at their own load: the fit keeps
    its memory, the usual step is the last few."""
    model = StepCostModel()
    for step in range(60):
        drafts = (step * 7) % 20  # 16 requests; ~25 ms + 1.2 ms per row
        model.observe(16 + drafts, 0.025 + 0.0012 * (16 + drafts), 16, drafts, drafts // 2)
    crowded = model.draft_token_cost()
    for step in range(adaptive.USUAL_STEPS):
        drafts = step % 3  # two requests left
        model.observe(2 + drafts, 0.025 + 0.0012 * (2 + drafts), 2, drafts, min(drafts, 1))
    assert model.draft_token_cost() < crowded and model.rounds == 2
    assert model.draft_token_cost() == pytest.approx(2 * 0.0012 / (0.025 + 0.0012 * (2 + model.drafts)), rel=0.1)
    assert model.draft_token_cost() < crowded / 3


def test_a_row_is_priced_by_the_tokens_the_other_rounds_would_commit_meanwhile():
    """A draft row delays the B − 1 other rounds of the step, each of which commits τ tokens
    per step: the price scales with 1 + (B − 1)·τ, not with B."""
    def priced(tokens_per_round: float | None) -> StepCostModel:
        model = StepCostModel()
        for step in range(60):
            drafts = (step * 7) % 20  # 16 requests; ~25 ms + 1.2 ms per row
            model.observe(16 + drafts, 0.025 + 0.0012 * (16 + drafts), 16, drafts, drafts // 2)
            if tokens_per_round is not None:  # the step's verdicts come after it
                for _ in range(16):
                    model.observe_round(int(tokens_per_round))
        return model

    plain, drafting_well = priced(None), priced(2)
    assert drafting_well.tokens_per_round == pytest.approx(2.0)
    assert plain.tokens_per_round == 1.0
    assert drafting_well.draft_token_cost() == pytest.approx(plain.draft_token_cost() * (1 + 15 * 2) / 16, rel=0.01)
    one = StepCostModel()  # alone, nobody else waits: τ does not matter
    for step in range(60):
        one.observe_round(3)
        one.observe(1 + step % 5, 0.025 + 0.0012 * (1 + step % 5), 1, step % 5)
    assert one.draft_token_cost() == pytest.approx(DRAFT_TOKEN_COST, abs=0.01)


def test_a_pause_measures_only_the_load_it_began_under():
    """A pause ends when the load falls below half of what it was (its steps would not
    compare with the ones before); a figure measured under load is not applied once the
    load is gone; the one-token rounds of a pause do not count in τ."""
    model = StepCostModel()
    load_steps(model, adaptive.PAUSE_EVERY + 3 * adaptive.PAUSE_STEPS)  # one pause, measured
    assert model.paired_weight > 0
    measured = model.fit()[1]
    tokens = model.tokens_per_round = 1.8
    assert not model.paused  # (refits)
    model.since_pause = adaptive.PAUSE_EVERY
    assert model.paused
    for _ in range(2):
        for _ in range(56):
            model.observe_round(1)  # paused rounds commit their one token
        model.observe(56, 0.26, 56, 0, 0)
    assert model.tokens_per_round == tokens
    weight = model.paired_weight
    model.observe(3, 0.03, 3, 0, 0)  # most requests finished
    assert not model.paused and model.paired_weight == weight  # abandoned, nothing measured
    for step in range(30):  # one request left, drafting 0–4 tokens, 1.2 ms per row
        model.observe(1 + step % 5, 0.025 + 0.0012 * (step % 5), 1, step % 5)
    model.draft_token_cost()  # refits: the usual step has one round now
    assert model.rounds == 1 and model.fit()[1] != measured


def drafting_load(model: StepCostModel, steps: int, tokens_per_round: float, unseen_s: float, seed: int = 0) -> None:
    """A replica under load whose drafting rounds commit `tokens_per_round` each and whose
    steps with drafts cost `unseen_s` beyond their rows (a cost the model does not fit: it
    does not grow with the rows); the rounds draft 0.7 rows each unless the model pauses
    them, and fewer as the price rises. Rounds commit after their step, as the coordinator
    sees them."""
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        rounds = int(rng.integers(48, 65))
        paused = model.paused
        share = 0.0 if paused else 0.7 * min(1.0, 0.2 / max(model.draft_token_cost(), 1e-9))
        drafts = int(round(rounds * share * rng.uniform(0.95, 1.05)))
        seconds = (0.040 + 0.004 * rounds + 0.0016 * drafts + (unseen_s if drafts else 0.0)) * rng.uniform(0.97, 1.03)
        model.observe(rounds + drafts, seconds, rounds, drafts, drafts // 2)
        for _ in range(rounds):
            model.observe_round(1 if not drafts else int(rng.random() < tokens_per_round - 1) + 1)


def test_a_pause_that_finds_drafting_losing_raises_the_price_of_a_row():
    """The pauses compare tokens per second of step with and without drafts: where drafting
    delivers less than not drafting (here its steps carry a cost the rows do not explain
    and its rounds commit few extra tokens), every row's price is multiplied until drafting
    stops paying; where it delivers more, the price is the model's own."""
    for seed in range(3):
        losing, paying = StepCostModel(), StepCostModel()
        drafting_load(losing, 400, tokens_per_round=1.1, unseen_s=0.030, seed=seed)
        drafting_load(paying, 400, tokens_per_round=1.6, unseen_s=0.0, seed=seed)
        assert losing.verdicts and paying.verdicts
        assert all(v < 1 for v in losing.verdicts) and all(v > 1 + adaptive.GAIN_MARGIN for v in paying.verdicts)
        assert losing.price_scale >= adaptive.PRICE_STEP ** 2 and paying.price_scale == 1.0
        assert losing.draft_token_cost() > 2 * paying.draft_token_cost()


def test_a_raised_price_falls_back_after_steps_without_a_verdict():
    """A replica whose price was raised until nobody drafts gets no more pauses, so no
    more verdicts: the multiplier halves every PRICE_RETRY_STEPS decode steps, and drafting
    is tried again."""
    model = StepCostModel()
    drafting_load(model, 400, tokens_per_round=1.1, unseen_s=0.030)
    raised = model.price_scale
    assert raised > 1
    for _ in range(adaptive.PRICE_RETRY_STEPS):
        model.observe(56, 0.264, 56, 0, 0)  # nobody drafts
    assert model.price_scale == raised / adaptive.PRICE_STEP
    for _ in range(adaptive.PRICE_RETRY_STEPS * 8):
        model.observe(56, 0.264, 56, 0, 0)
    assert model.price_scale == 1.0


def test_new_requests_start_from_the_drafters_recent_acceptance():
    record = DrafterRecord()
    assert record.start(4).best_k() == 4  # an unknown drafter is trusted at first
    for _ in range(100):
        record.update(4, 0)  # nothing it proposes is accepted
    assert record.alpha < 0.05 and record.start(4).best_k() == 0
    for _ in range(100):
        record.update(4, 4)
    assert record.alpha > 0.95 and record.start(4).best_k() == 4


def test_draft_tokens_get_dearer_as_the_batch_grows():
    light, heavy = StepCostModel(), StepCostModel()
    for step in range(60):
        # ~25 ms + 1.2 ms per row: one request drafting 0–4 tokens, or 16 requests with 0–19
        # draft tokens among them.
        drafts = step % 5
        light.observe(1 + drafts, 0.025 + 0.0012 * (1 + drafts), 1, drafts)
        drafts = step % 20
        heavy.observe(16 + drafts, 0.025 + 0.0012 * (16 + drafts), 16, drafts)
        # Prefill chunks say nothing about draft tokens and are left out.
        heavy.observe(256, 1.0, 2, 0)
    assert light.draft_token_cost() == pytest.approx(DRAFT_TOKEN_COST, abs=0.01)
    assert heavy.draft_token_cost() == pytest.approx(16 * 0.0012 / (0.025 + 0.0012 * (16 + heavy.drafts)), rel=0.1)
    assert heavy.draft_token_cost() > 0.25
    # Steps that all look alike leave the slope at its prior: one request's measured cost.
    flat = StepCostModel()
    for _ in range(30):
        flat.observe(1, 0.03, 1, 0)
    assert flat.draft_token_cost() == pytest.approx(DRAFT_TOKEN_COST, rel=0.05)
    adaptive = AdaptiveK(k_max=4)
    adaptive.accepted, adaptive.tried = 0.3, 1.0  # α = 0.3: worth drafting alone, not in a crowd
    assert adaptive.best_k(light.draft_token_cost()) > 0
    assert adaptive.best_k(heavy.draft_token_cost()) == 0


# ---------------------------------------------------------------------------------------
# Through the services


GREEDY_PROMPTS = [PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)) for i in range(16)]


@pytest.fixture(scope="module")
def greedy_expected(target, tokenizer):
    return [reference_greedy(target, chat_ids(tokenizer, p), MAX_NEW) for p in GREEDY_PROMPTS]


@pytest.fixture(scope="module", params=["model", NGRAM])
def sixteen_greedy(request, target, other_draft, tokenizer):
    """(4 of the prompts sent one at a time, all 16 sent at once, the target steps those 16
    took) through one stack per drafter."""
    async def scenario():
        draft = other_draft if request.param == "model" else NGRAM
        async with running_stack(target, tokenizer, draft=draft, max_streams_per_client=32) as stack:
            async with Client(stack.address) as client:
                alone = [(await client.complete(make_request(p, max_new_tokens=MAX_NEW, k=3))).token_ids
                         for p in GREEDY_PROMPTS[:4]]
                batchers = stack.coordinator_servicer.runner.target._batchers.values()
                steps_before = sum(b.steps for b in batchers)
                together = await asyncio.gather(*(client.complete(make_request(p, max_new_tokens=MAX_NEW, k=3))
                                                  for p in GREEDY_PROMPTS))
                steps = sum(b.steps for b in batchers) - steps_before
            return alone, together, steps

    return run(scenario())


def test_sixteen_concurrent_greedy_requests_equal_the_target(sixteen_greedy, greedy_expected):
    _, together, _ = sixteen_greedy
    assert [r.token_ids for r in together] == greedy_expected


def test_greedy_requests_one_at_a_time_equal_the_target(sixteen_greedy, greedy_expected):
    alone, _, _ = sixteen_greedy
    assert alone == greedy_expected[:4]


def test_sixteen_concurrent_requests_share_target_steps(sixteen_greedy):
    _, together, steps = sixteen_greedy
    # Rounds shared steps: far fewer target steps than the 16 requests' rounds.
    assert steps < 0.5 * sum(r.stats["rounds"] for r in together)


def test_sixteen_concurrent_seeded_requests_equal_their_solo_runs(tokenizer):
    from tests.test_sampling_services import EOS, PARAMS

    model = make_tiny_model(tokenizer, seed=0, layers=2)
    with torch.no_grad():
        model.lm_head.weight.mul_(0.25)  # flat enough that sampling has choices
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(16)]
    seeds = list(range(100, 116))

    async def scenario():
        async with running_stack(model, tokenizer, draft=NGRAM, max_streams_per_client=32) as stack:
            async with Client(stack.address) as client:
                solo = [(await client.complete(make_request(p, max_new_tokens=MAX_NEW, k=3, seed=s, **PARAMS))).token_ids
                        for p, s in zip(prompts[:3], seeds[:3])]
                together = await asyncio.gather(*(
                    client.complete(make_request(p, max_new_tokens=MAX_NEW, k=3, seed=s, **PARAMS))
                    for p, s in zip(prompts, seeds)))
            return solo, [r.token_ids for r in together]

    solo, together = run(scenario())
    expected = [reference_sample(model, chat_ids(tokenizer, p), MAX_NEW, seed=s, eos_ids=EOS, **PARAMS)
                for p, s in zip(prompts, seeds)]
    assert together == expected
    assert solo == expected[:3]


def test_a_long_prompt_is_prefilled_in_chunks_between_other_requests_steps(target, tokenizer):
    long_prompt = " ".join(PROMPTS * 2)
    short = PROMPTS[0]

    async def scenario():
        async with running_stack(target, tokenizer, draft=NGRAM, prefill_chunk_tokens=32,
                                 max_streams_per_client=32) as stack:
            sent = []
            verify = stack.target_servicer.verifier.verify_batch

            def recording(rounds):
                sent.append([(r.session_id, r.start, len(r.tokens)) for r in rounds])
                return verify(rounds)

            stack.target_servicer.verifier.verify_batch = recording
            async with Client(stack.address) as client:
                results = await asyncio.gather(
                    client.complete(make_request(long_prompt, max_new_tokens=MAX_NEW)),
                    client.complete(make_request(short, max_new_tokens=MAX_NEW)))
            return sent, results

    sent, (long_result, short_result) = run(scenario())
    assert long_result.token_ids == reference_greedy(target, chat_ids(tokenizer, long_prompt), MAX_NEW)
    assert short_result.token_ids == reference_greedy(target, chat_ids(tokenizer, short), MAX_NEW)
    rounds = [r for step in sent for r in step]
    assert len(chat_ids(tokenizer, long_prompt)) > 3 * 32
    assert max(n for _, _, n in rounds) <= 32 + 1  # chunks (and the last piece), never the whole prompt
    long_session = rounds[0][0] if rounds[0][2] == 32 else next(s for s, _, n in rounds if n == 32)
    chunks = [(start, n) for s, start, n in rounds if s == long_session]
    assert chunks[0] == (0, 32) and chunks[1] == (32, 32)


def test_a_context_resent_after_its_session_was_lost_goes_in_chunks(target, tokenizer):
    # Mid-request the worker loses the long request's session (a restart, an eviction): it
    # asks for the whole context again, and that context comes back chunk by chunk, not as
    # one round that would make a step long for every request in it.
    long_prompt = " ".join(PROMPTS * 2)

    async def scenario():
        async with running_stack(target, tokenizer, draft=NGRAM, prefill_chunk_tokens=32) as stack:
            sent = []
            verifier = stack.target_servicer.verifier
            verify = verifier.verify_batch
            lost = []

            def losing(rounds):
                for r in rounds:
                    if not lost and r.start > 3 * 32 and len(sent) > 6:  # decoding, well past the prompt
                        lost.append(r.start)
                        verifier.store.release(r.session_id)
                sent.append([(r.start, len(r.tokens)) for r in rounds])
                return verify(rounds)

            verifier.verify_batch = losing
            async with Client(stack.address) as client:
                result = await client.complete(make_request(long_prompt, max_new_tokens=MAX_NEW))
            return sent, lost, result

    sent, lost, result = run(scenario())
    assert result.token_ids == reference_greedy(target, chat_ids(tokenizer, long_prompt), MAX_NEW)
    assert lost, "the session was never lost"
    rounds = [r for step in sent for r in step]
    resent = rounds[next(i for i, (start, _) in enumerate(rounds) if start == lost[0]) + 1:]
    assert resent[0] == (0, 32) and resent[1] == (32, 32)  # the whole context again, in chunks
    assert max(n for _, n in rounds) <= 32 + 1  # never more than a chunk (and the last piece)

