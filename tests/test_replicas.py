"""Many replicas of each worker kind on loopback hosts (127.0.0.2, 127.0.0.3, ...):
sessions stick to the replica holding their cache, new ones spread, replicas that die or
drain are taken out and their sessions move without changing any output, and the bounds
hold when a whole kind is gone."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest

from coordinator.pool import WorkerPool, parse_endpoints, resolve_dns
from specdec.client import Client, make_request
from tests.factories import make_tiny_model, make_tiny_tokenizer
from tests.harness import reference_greedy, run, running_cluster, start_target
from tests.test_services import PROMPTS, chat_ids, other_draft, target, tokenizer  # noqa: F401 (fixtures)

HOSTS = ["127.0.0.2", "127.0.0.3"]
MAX_NEW = 48


@pytest.fixture(scope="module")
def draft(other_draft):
    return other_draft


@pytest.fixture(scope="module")
def expected(target, tokenizer):
    return {p: reference_greedy(target, chat_ids(tokenizer, p), MAX_NEW) for p in PROMPTS}


def record_sessions(servicer) -> list[str]:
    """Wraps a target's verify so every call's session id is recorded."""
    seen: list[str] = []
    verify = servicer.verifier.verify_batch

    def recording(rounds):
        seen.extend(r.session_id for r in rounds)
        return verify(rounds)

    servicer.verifier.verify_batch = recording
    return seen


async def complete_all(address: str, prompts, **kwargs):
    async with Client(address) as client:
        return await asyncio.gather(*(client.complete(make_request(p, max_new_tokens=MAX_NEW, k=3, **kwargs))
                                      for p in prompts))


@pytest.fixture(scope="module")
def two_replica_run(target, draft, tokenizer):
    """(the session ids each of two target replicas verified, the results of PROMPTS sent at
    once) through one cluster."""
    async def scenario():
        async with running_cluster(target, tokenizer, draft, HOSTS) as cluster:
            seen = [record_sessions(servicer) for _, servicer in cluster.targets]
            results = await complete_all(cluster.address, PROMPTS)
            return seen, results

    return run(scenario())


def test_output_through_many_replicas_equals_the_target(two_replica_run, expected):
    _, results = two_replica_run
    assert [r.token_ids for r in results] == [expected[p] for p in PROMPTS]


def test_new_sessions_spread_over_every_replica(two_replica_run):
    seen, _ = two_replica_run
    per_replica = [set(s) for s in seen]
    assert all(per_replica), f"a replica got no session: {per_replica}"


def test_a_sessions_rounds_stick_to_one_replica(two_replica_run):
    seen, _ = two_replica_run
    per_replica = [set(s) for s in seen]
    assert not per_replica[0] & per_replica[1], "a session's rounds went to two replicas"


def test_each_request_is_one_session_on_the_replicas(two_replica_run):
    seen, _ = two_replica_run
    per_replica = [set(s) for s in seen]
    assert len(per_replica[0] | per_replica[1]) == len(PROMPTS)


def test_killing_a_target_and_a_draft_replica_mid_generation_keeps_every_output(target, draft, tokenizer,
                                                                                expected):
    go = threading.Event()
    paused = threading.Event()

    async def scenario():
        async with running_cluster(target, tokenizer, draft, HOSTS) as cluster:
            calls = [0]
            for _, servicer in cluster.targets:
                verify = servicer.verifier.verify_batch

                def held(*args, _verify=verify):
                    calls[0] += 1
                    if calls[0] > 2 * len(PROMPTS):  # every request is mid-generation by now
                        paused.set()
                        go.wait(timeout=30)
                    return _verify(*args)

                servicer.verifier.verify_batch = held
            task = asyncio.create_task(complete_all(cluster.address, PROMPTS * 2))
            assert await asyncio.to_thread(paused.wait, 30)
            await cluster.targets[0][0].stop(grace=0)
            await cluster.drafts[0][0].stop(grace=0)
            go.set()
            return await task

    results = run(scenario())
    assert [r.token_ids for r in results] == [expected[p] for p in PROMPTS * 2]
    assert sum(r.stats["resyncs"] for r in results) >= 1, "no session had to move"


@pytest.fixture(scope="module")
def drafts_down_and_back(target, draft, tokenizer):
    """(results with every draft replica stopped, the seconds they took, results once one
    draft replica is back) through one cluster."""
    from tests.harness import start_draft

    async def scenario():
        async with running_cluster(target, tokenizer, draft, HOSTS) as cluster:
            ports = [server.port for server, _ in cluster.drafts]
            for server, _ in cluster.drafts:
                await server.stop(grace=0)
            began = time.perf_counter()
            without = await complete_all(cluster.address, PROMPTS[:2])
            without_s = time.perf_counter() - began
            cluster.drafts = [await start_draft(draft, tokenizer, port=ports[0], host=HOSTS[0])]
            await asyncio.sleep(1.0)  # a few health polls
            back = await complete_all(cluster.address, PROMPTS[:2])
            return without, without_s, back

    return run(scenario())


def test_all_drafts_down_gives_exact_target_only_output(drafts_down_and_back, expected):
    without, _, _ = drafts_down_and_back
    assert [r.token_ids for r in without] == [expected[p] for p in PROMPTS[:2]]


def test_all_drafts_down_does_not_stall_requests(drafts_down_and_back):
    _, without_s, _ = drafts_down_and_back
    assert without_s < 20


def test_output_after_a_draft_returns_equals_the_target(drafts_down_and_back, expected):
    _, _, back = drafts_down_and_back
    assert [r.token_ids for r in back] == [expected[p] for p in PROMPTS[:2]]


def test_speculation_resumes_when_a_draft_returns(drafts_down_and_back):
    _, _, back = drafts_down_and_back
    assert sum(r.stats["proposed"] for r in back) > 0, "speculation did not resume"


def test_all_targets_down_fails_unavailable_within_the_bound(target, draft, tokenizer):
    async def scenario():
        async with running_cluster(target, tokenizer, draft, HOSTS) as cluster:
            for server, _ in cluster.targets:
                await server.stop(grace=0)
            began = time.perf_counter()
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await complete_all(cluster.address, PROMPTS[:1])
            return caught.value, time.perf_counter() - began

    error, elapsed = run(scenario())
    assert error.code() == grpc.StatusCode.UNAVAILABLE and "target workers unavailable" in error.details()
    # retries=5, back-off 0.05 s doubling: 1.55 s of sleeping plus fast connection failures.
    assert elapsed < 5.0


def test_names_are_re_resolved_as_replicas_come_and_go(target, draft, tokenizer, expected):
    """A name that resolves to many addresses, whose answer changes (what a headless
    Service does as pods come and go). The DNS answers are the only thing simulated."""
    answer: list[str] = []

    async def resolver(host: str, port: int) -> list[str]:
        if host == "target.specdec.test":
            return list(answer)
        return await resolve_dns(host, port)

    async def full():
        extra = await start_target(target, tokenizer, host="127.0.0.4")
        try:
            first_server, _ = extra
            answer.append(first_server.address)
            async with running_cluster(target, tokenizer, draft, HOSTS, resolver=resolver,
                                       target_spec="target.specdec.test:1") as cluster:
                pool = cluster.servicer.runner.target.pool
                before = set(pool.replicas)
                answer[:] = [t[0].address for t in cluster.targets]  # pods replaced
                await asyncio.sleep(1.0)
                after = set(pool.replicas)
                results = await complete_all(cluster.address, PROMPTS)
                return first_server.address, before, after, [t[0].address for t in cluster.targets], results
        finally:
            await extra[0].stop(grace=0)

    first, before, after, new_addresses, results = run(full())
    assert before == {first}
    assert after == set(new_addresses)
    assert [r.token_ids for r in results] == [expected[p] for p in PROMPTS]


def test_a_replica_serving_another_vocabulary_is_never_used(target, draft, tokenizer, expected):
    other_tokenizer = make_tiny_tokenizer(vocab_size=300)
    stranger = make_tiny_model(other_tokenizer, seed=5)
    answer: list[str] = []

    async def resolver(host: str, port: int) -> list[str]:
        return list(answer) if host == "target.specdec.test" else await resolve_dns(host, port)

    async def full():
        good = await start_target(target, tokenizer, host="127.0.0.2")
        bad = await start_target(stranger, other_tokenizer, host="127.0.0.3")
        answer.append(good[0].address)
        try:
            async with running_cluster(target, tokenizer, draft, ["127.0.0.4"], resolver=resolver,
                                       target_spec="target.specdec.test:1") as cluster:
                answer.append(bad[0].address)
                await asyncio.sleep(1.0)
                pool = cluster.servicer.runner.target.pool
                seen = record_sessions(bad[1])
                results = await complete_all(cluster.address, PROMPTS)
                return pool.replicas[bad[0].address].admitted, seen, results
        finally:
            await good[0].stop(grace=0)
            await bad[0].stop(grace=0)

    admitted, seen, results = run(full())
    assert admitted is False and seen == []
    assert [r.token_ids for r in results] == [expected[p] for p in PROMPTS]


def test_endpoint_lists_parse():
    assert parse_endpoints("a:1, b:2") == [("a", 1), ("b", 2)]
    assert parse_endpoints("[::1]:50052") == [("::1", 50052)]


def test_an_endpoint_without_a_port_is_refused():
    with pytest.raises(ValueError, match="host:port"):
        parse_endpoints("no-port")


def test_localhost_resolves():
    assert "127.0.0.1:50052" in run(resolve_dns("localhost", 50052))


def test_a_draining_replica_gets_no_new_sessions(target, draft, tokenizer, expected):
    async def scenario():
        async with running_cluster(target, tokenizer, draft, HOSTS) as cluster:
            server, servicer = cluster.targets[0]
            await server.health.enter_graceful_shutdown()  # what SIGTERM does first
            await asyncio.sleep(0.6)  # health polls every 0.2 s in the cluster harness
            seen = record_sessions(servicer)
            results = await complete_all(cluster.address, PROMPTS)
            return seen, results

    seen, results = run(scenario())
    assert seen == []
    assert [r.token_ids for r in results] == [expected[p] for p in PROMPTS]
