"""Backpressure and limits under load: a flood past the coordinator's limits gets
RESOURCE_EXHAUSTED (with a retry hint) while admitted requests complete correctly, memory
stays bounded, the service recovers; per-client rate limits; deadlines free sessions."""

from __future__ import annotations

import asyncio
import resource

import grpc
import pytest

from specdec.client import Client, make_request
from specdec.models import NGRAM
from tests.harness import reference_greedy, run, running_stack
from tests.test_services import PROMPTS, Gate, chat_ids, target, tokenizer  # noqa: F401 (fixtures)

MAX_NEW = 24


async def attempt(client: Client, prompt: str, **kwargs):
    try:
        return await client.complete(make_request(prompt, max_new_tokens=MAX_NEW, **kwargs))
    except grpc.aio.AioRpcError as exc:
        return exc


@pytest.fixture(scope="module")
def expected(target, tokenizer):
    return {p: reference_greedy(target, chat_ids(tokenizer, p), MAX_NEW) for p in PROMPTS}


@pytest.fixture(scope="module")
def flood(target, tokenizer):
    """(three waves of 40 concurrent requests at a coordinator admitting 4, the peak RSS after
    each, a request after the waves, (target, draft) sessions held once drained, requests the
    coordinator still counts active) from one stack."""
    async def scenario():
        async with running_stack(target, tokenizer, draft=NGRAM, max_concurrent_requests=4,
                                 max_streams_per_client=64) as stack:
            async with Client(stack.address) as client:
                peak_rss = []
                waves = []
                for _ in range(3):
                    waves.append(await asyncio.gather(*(attempt(client, PROMPTS[i % 4]) for i in range(40))))
                    peak_rss.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
                after = await attempt(client, PROMPTS[0])
                await stack.coordinator_servicer.runner.drain()
                sessions_after_drain = (len(stack.target_servicer.store), len(stack.draft_servicer.store))
                return waves, peak_rss, after, sessions_after_drain, stack.coordinator_servicer.active

    return run(scenario())


def refused(wave) -> list[grpc.aio.AioRpcError]:
    return [r for r in wave if isinstance(r, grpc.aio.AioRpcError)]


def served(wave) -> list:
    """(index in the wave, result) of each request that was not refused"""
    return [(i, r) for i, r in enumerate(wave) if not isinstance(r, grpc.aio.AioRpcError)]


WAVES = pytest.mark.parametrize("wave", range(3))


@WAVES
def test_a_flood_past_the_limits_gets_requests_refused(flood, wave):
    assert refused(flood[0][wave])


@WAVES
def test_a_flood_past_the_limits_still_serves_requests(flood, wave):
    assert served(flood[0][wave])


@WAVES
def test_refusals_are_resource_exhausted(flood, wave):
    assert {e.code() for e in refused(flood[0][wave])} == {grpc.StatusCode.RESOURCE_EXHAUSTED}


@WAVES
def test_refusals_say_to_retry(flood, wave):
    assert all("retry" in e.details() for e in refused(flood[0][wave]))


@WAVES
def test_requests_served_during_a_flood_equal_the_target(flood, expected, wave):
    for i, result in served(flood[0][wave]):
        assert result.token_ids == expected[PROMPTS[i % 4]]


def test_memory_stays_bounded_through_floods(flood):
    _, peak_rss, _, _, _ = flood
    # Bounded: the later waves need no more memory than the first (within 64 MiB).
    assert peak_rss[-1] - peak_rss[0] < 64 * 1024


def test_the_service_recovers_after_a_flood(flood, expected):
    _, _, after, _, _ = flood
    assert not isinstance(after, grpc.aio.AioRpcError) and after.token_ids == expected[PROMPTS[0]]


def test_a_flood_leaves_no_worker_session(flood):
    _, _, _, sessions, _ = flood
    assert sessions == (0, 0)


def test_a_flood_leaves_no_request_active(flood):
    _, _, _, _, active = flood
    assert active == 0


def test_per_client_rate_limit(target, tokenizer):
    async def scenario():
        async with running_stack(target, tokenizer, draft=NGRAM, rate_limit_per_client=2.0,
                                 rate_limit_wait_s=0.05) as stack:
            async with Client(stack.address) as client:
                burst = await asyncio.gather(*(attempt(client, PROMPTS[0]) for _ in range(6)))
                await asyncio.sleep(1.1)
                later = await attempt(client, PROMPTS[0])
                return burst, later

    burst, later = run(scenario())
    refused = [r for r in burst if isinstance(r, grpc.aio.AioRpcError)]
    assert 1 <= len(burst) - len(refused) <= 3
    assert refused and all(r.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "requests/s" in r.details()
                           for r in refused)
    assert not isinstance(later, grpc.aio.AioRpcError)


@pytest.fixture(scope="module")
def deadline_run(target, tokenizer):
    """(the status of a request whose 1 s deadline passes while its round is held, a request's
    result after it, (target, draft) sessions held once drained) from one stack."""
    async def scenario():
        async with running_stack(target, tokenizer, draft=target) as stack:
            gate = Gate(stack.target_servicer.verifier.verify_batch, at_call=2)
            stack.target_servicer.verifier.verify_batch = gate
            async with Client(stack.address) as client:
                task = asyncio.create_task(client.complete(make_request(PROMPTS[0], max_new_tokens=MAX_NEW),
                                                           timeout=1.0))
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await task
                gate.release.set()
                await asyncio.sleep(0.5)
                await stack.coordinator_servicer.runner.drain()
                healthy = await client.complete(make_request(PROMPTS[1], max_new_tokens=MAX_NEW))
                await stack.coordinator_servicer.runner.drain()
                return caught.value.code(), healthy, (len(stack.target_servicer.store),
                                                      len(stack.draft_servicer.store))

    return run(scenario())


def test_a_deadline_ends_the_request_with_deadline_exceeded(deadline_run):
    code, _, _ = deadline_run
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED


def test_the_service_serves_after_a_deadline(deadline_run, expected):
    _, healthy, _ = deadline_run
    assert healthy.token_ids == expected[PROMPTS[1]]


def test_a_deadline_frees_the_requests_sessions(deadline_run):
    _, _, sessions = deadline_run
    assert sessions == (0, 0)
