"""Sampling through the three services: a seeded request yields exactly the tokens the
target sampling alone yields (whatever the drafter, across restarts), and the sampled
continuations follow the target's distribution (chi-square)."""

from __future__ import annotations

import asyncio
from collections import Counter

import grpc
import pytest
import torch
from scipy import stats

from specdec.client import Client, make_request
from specdec.models import NGRAM
from target_worker.kernels.warp_ref import warp_probs_ref
from tests.factories import make_tiny_model, make_tiny_tokenizer
from tests.harness import reference_sample, run, running_stack
from tests.test_services import PROMPTS, Gate, chat_ids

MAX_NEW = 24
PARAMS = dict(temperature=0.9, top_k=40, top_p=0.95)
EOS = (2,)  # the tiny tokenizer's <|im_end|>, the models' generation_config eos


@pytest.fixture(scope="module")
def tokenizer():
    return make_tiny_tokenizer()


@pytest.fixture(scope="module")
def target(tokenizer):
    model = make_tiny_model(tokenizer, seed=0, layers=2)
    with torch.no_grad():  # flatter than the greedy tests' model, so sampling has choices
        model.lm_head.weight.mul_(0.25)
    return model


@pytest.fixture(scope="module")
def other_draft(tokenizer):
    return make_tiny_model(tokenizer, seed=1, layers=1, hidden=32)


@pytest.mark.parametrize("drafter", ["other-model", "target-itself", NGRAM, "none"])
def test_seeded_sampling_equals_target_sampling_alone(drafter, target, other_draft, tokenizer):
    draft = {"other-model": other_draft, "target-itself": target, NGRAM: NGRAM, "none": None}[drafter]
    seeds = [1, 2, 3]

    async def scenario():
        async with running_stack(target, tokenizer, draft=draft) as stack:
            async with Client(stack.address) as client:
                return [await client.complete(make_request(PROMPTS[i % 2], max_new_tokens=MAX_NEW, k=3, seed=seed,
                                                           **PARAMS))
                        for i, seed in enumerate(seeds)]

    results = run(scenario())
    for i, (seed, result) in enumerate(zip(seeds, results)):
        expected = reference_sample(target, chat_ids(tokenizer, PROMPTS[i % 2]), MAX_NEW, seed=seed, eos_ids=EOS, **PARAMS)
        assert result.token_ids == expected, seed
        assert result.stats["seed"] == seed
    assert len({tuple(r.token_ids) for r in results}) == len(seeds)  # seeds matter


def test_seeded_sampling_survives_a_target_restart(target, other_draft, tokenizer):
    async def scenario():
        async with running_stack(target, tokenizer, draft=other_draft) as stack:
            gate = Gate(stack.draft_servicer.proposer.propose_batch, at_call=3)
            stack.draft_servicer.proposer.propose_batch = gate
            async with Client(stack.address) as client:
                task = asyncio.create_task(client.complete(
                    make_request(PROMPTS[0], max_new_tokens=MAX_NEW, k=3, seed=77, **PARAMS)))
                assert await asyncio.to_thread(gate.entered.wait, 30)
                await stack.restart_target(target, tokenizer)
                gate.release.set()
                return await task

    result = run(scenario())
    assert result.stats["resyncs"] >= 1
    assert result.token_ids == reference_sample(target, chat_ids(tokenizer, PROMPTS[0]), MAX_NEW, seed=77, eos_ids=EOS, **PARAMS)


@pytest.mark.parametrize("field,value,needle", [
    ("temperature", -0.5, "temperature"),
    ("temperature", float("nan"), "temperature"),
    ("top_p", 0.0, "top_p"),
    ("top_p", 1.5, "top_p"),
    ("top_k", -1, "top_k"),
])
def test_out_of_range_sampling_parameters_are_invalid(field, value, needle, target, tokenizer):
    async def scenario():
        async with running_stack(target, tokenizer, draft=NGRAM) as stack:
            async with Client(stack.address) as client:
                request = make_request(PROMPTS[0], max_new_tokens=4, temperature=1.0)
                setattr(request, field, value)
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await client.complete(request)
                return caught.value

    error = run(scenario())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and needle in error.details()


def test_sampled_continuations_follow_the_target_distribution(target, tokenizer):
    """Two-token continuations of one prompt over many seeds, drafted by the target itself
    (so drafts are often accepted and the acceptance path carries the test), against the
    exact joint distribution p(t1) p(t2 | t1) of the warped target."""
    temperature, top_k, trials = 1.0, 3, 1500
    prompt_ids = chat_ids(tokenizer, PROMPTS[0])

    async def scenario():
        async with running_stack(target, tokenizer, draft=target) as stack:
            async with Client(stack.address) as client:
                results = []
                for seed in range(trials):
                    request = make_request(prompt_ids, max_new_tokens=2, k=2, seed=seed, temperature=temperature,
                                           top_k=top_k)
                    results.append(await client.complete(request))
                return results

    results = run(scenario())
    observed = Counter(tuple(r.token_ids) for r in results)
    assert sum(r.stats["accepted"] for r in results) > trials // 4  # drafts really were verified

    def warped(ids):
        with torch.inference_mode():
            logits = target(torch.tensor([ids], device=target.device)).logits[0, -1:].float().cpu()
        return warp_probs_ref(logits, torch.tensor([temperature]), torch.tensor([top_k]), torch.tensor([1.0]))[0]

    expected = {}
    first = warped(prompt_ids)
    for t1 in torch.nonzero(first).flatten().tolist():
        second = warped(prompt_ids + [t1])
        for t2 in torch.nonzero(second).flatten().tolist():
            expected[(t1, t2)] = float(first[t1] * second[t2]) * trials
    assert set(observed) <= set(expected), "sampled a token the warped target gives probability 0"
    cells = sorted(expected)
    f_obs = [observed.get(c, 0) for c in cells]
    f_exp = [expected[c] for c in cells]
    scale = sum(f_obs) / sum(f_exp)
    _, p_value = stats.chisquare(f_obs, [e * scale for e in f_exp])
    assert p_value > 1e-3, p_value
