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


def test_a_flood_past_the_limits_is_refused_cleanly_and_the_service_recovers(target, tokenizer):
    expected = {p: reference_greedy(target, chat_ids(tokenizer, p), MAX_NEW) for p in PROMPTS}

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
                sessions = (len(stack.target_servicer.store), len(stack.draft_servicer.store))
                await stack.coordinator_servicer.runner.drain()
                sessions_after_drain = (len(stack.target_servicer.store), len(stack.draft_servicer.store))
                return waves, peak_rss, after, sessions, sessions_after_drain, stack.coordinator_servicer.active

    waves, peak_rss, after, _, sessions, active = run(scenario())
    for wave in waves:
        refused = [r for r in wave if isinstance(r, grpc.aio.AioRpcError)]
        served = [(i, r) for i, r in enumerate(wave) if not isinstance(r, grpc.aio.AioRpcError)]
        assert refused and served
        assert {e.code() for e in refused} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
        assert all("retry" in e.details() for e in refused)
        for i, result in served:
            assert result.token_ids == expected[PROMPTS[i % 4]]
    # Bounded: the later waves need no more memory than the first (within 64 MiB).
    assert peak_rss[-1] - peak_rss[0] < 64 * 1024
    assert not isinstance(after, grpc.aio.AioRpcError) and after.token_ids == expected[PROMPTS[0]]
    assert sessions == (0, 0) and active == 0


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


def test_a_deadline_ends_the_request_and_frees_its_sessions(target, tokenizer):
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

    code, healthy, sessions = run(scenario())
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert healthy.token_ids == reference_greedy(target, chat_ids(tokenizer, PROMPTS[1]), MAX_NEW)
    assert sessions == (0, 0)
