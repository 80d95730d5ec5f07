"""A worker's upkeep (specdec.serving.start_worker_upkeep): sessions no round touches for
--session-ttl seconds are freed, and a later round of theirs resyncs with unchanged output;
a model thread that has work and finishes no step for --stall-timeout seconds turns the
worker's health NOT_SERVING (and its calls UNAVAILABLE) until a step finishes, so the
coordinator moves the requests to another replica long before the worker deadline."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import REGISTRY

from specdec.cli import build_parser
from specdec.cli.flags import worker_config
from specdec.client import Client, make_request
from specdec.models import NGRAM
from specdec.sessions import Resync, SessionStore, SyncedContext
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
from tests.harness import reference_greedy, run, running_cluster, running_stack, start_draft, start_target
from tests.test_services import PROMPTS, chat_ids, other_draft, target, tokenizer  # noqa: F401 (fixtures)

MAX_NEW = 40
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
TARGET_SERVICE = "specdec.v1.TargetWorker"


def sample(name: str, kind: str) -> float:
    return REGISTRY.get_sample_value(name, {"kind": kind}) or 0.0


def expired_total(kind: str) -> float:
    return sample("specdec_worker_sessions_expired_total", kind)


# --- the store and the flags -------------------------------------------------------------

class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_expire_frees_only_sessions_idle_past_the_ttl():
    clock = Clock()
    store = SessionStore(8, 1 << 30, 1, ttl_s=10.0, clock=clock)
    for name in ("idle", "busy"):
        store.sync(name, 0, [1, 2]).session.ids = [1, 2]  # the worker filled the cache
    clock.now += 8
    assert isinstance(store.sync("busy", 2, [3]), SyncedContext)
    clock.now += 3  # idle: 11 s since its round; busy: 3 s
    assert store.expire() == 1 and store.expirations == 1
    assert "idle" not in store and "busy" in store


def test_a_round_of_an_expired_session_asks_for_a_resync_from_zero():
    clock = Clock()
    store = SessionStore(8, 1 << 30, 1, ttl_s=10.0, clock=clock)
    store.sync("s", 0, [1, 2, 3]).session.ids = [1, 2, 3]
    clock.now += 11
    store.expire()
    assert store.sync("s", 3, [4]) == Resync(cached_len=0)


def test_a_ttl_of_zero_never_expires():
    clock = Clock()
    store = SessionStore(8, 1 << 30, 1, ttl_s=0.0, clock=clock)
    store.sync("s", 0, [1])
    clock.now += 1e9
    assert store.expire() == 0 and "s" in store


@pytest.mark.parametrize("service", ["target", "draft"])
def test_worker_flags_set_the_ttl_and_the_stall_timeout(service, monkeypatch):
    monkeypatch.setenv("SPECDEC_SESSION_TTL", "12.5")
    args = build_parser().parse_args(["serve", service, "--stall-timeout", "0"])
    config = worker_config(args, "m")
    assert (config.session_ttl_s, config.stall_timeout_s) == (12.5, 0.0)


@pytest.mark.parametrize("flag", ["--session-ttl", "--stall-timeout"])
@pytest.mark.parametrize("value", ["-1", "soon", "inf", "nan"])
def test_worker_flags_refuse_what_is_not_a_duration(flag, value, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "target", flag, value])
    assert "not a number of seconds" in capsys.readouterr().err


# --- session expiry on running workers ---------------------------------------------------

async def one_round(kind: str, channel, session_id: str, start: int, tokens: list[int]):
    delta = common_pb2.SessionDelta(session_id=session_id, start=start, tokens=tokens)
    if kind == "target":
        return await target_pb2_grpc.TargetWorkerStub(channel).Verify(target_pb2.VerifyRequest(delta=delta))
    return await draft_pb2_grpc.DraftWorkerStub(channel).Propose(draft_pb2.ProposeRequest(delta=delta, k=2))


async def active_sessions(kind: str, channel) -> int:
    stub = (target_pb2_grpc.TargetWorkerStub if kind == "target" else draft_pb2_grpc.DraftWorkerStub)(channel)
    return (await stub.GetInfo(common_pb2.WorkerInfoRequest())).active_sessions


@pytest.mark.parametrize("kind", ["target", "draft"])
def test_a_session_idle_past_the_ttl_is_freed_and_counted(kind, target, tokenizer):
    ttl = 0.5
    ids = chat_ids(tokenizer, PROMPTS[0])

    async def scenario():
        if kind == "target":
            server, servicer = await start_target(target, tokenizer, session_ttl_s=ttl)
        else:
            server, servicer = await start_draft(NGRAM, session_ttl_s=ttl)
        before = expired_total(kind)
        try:
            async with grpc.aio.insecure_channel(server.address) as channel:
                loop = asyncio.get_running_loop()
                began = loop.time()  # the round touches the session after this
                first = await one_round(kind, channel, "idle", 0, ids)
                held = await active_sessions(kind, channel)
                while await active_sessions(kind, channel) and loop.time() - began < 10:
                    await asyncio.sleep(0.05)
                freed_after = loop.time() - began
                later = await one_round(kind, channel, "idle", len(ids), [ids[-1]])
        finally:
            await server.stop(grace=0)
        return first, held, freed_after, later, servicer.store.expirations, expired_total(kind) - before

    first, held, freed_after, later, expirations, counted = run(scenario())
    assert first.WhichOneof("result") != "resync" and held == 1
    assert ttl <= freed_after < 5, f"freed after {freed_after:.2f} s"
    assert expirations == 1 and counted == 1
    # The coordinator's signal for a lost session, as after an eviction.
    assert later.WhichOneof("result") == "resync" and later.resync.cached_len == 0


def test_a_request_whose_rounds_keep_coming_outlives_a_shorter_ttl(target, tokenizer):
    ttl = 0.6

    async def scenario():
        async with running_stack(target, tokenizer, draft=NGRAM, target_options={"session_ttl_s": ttl}) as stack:
            verify = stack.target_servicer.verifier.verify_batch

            def slow(rounds):  # a slower model: the request takes many TTLs, a round far less than one
                time.sleep(0.05)
                return verify(rounds)

            stack.target_servicer.verifier.verify_batch = slow
            began = time.perf_counter()
            async with Client(stack.address) as client:
                result = await client.complete(make_request(PROMPTS[1], max_new_tokens=MAX_NEW))
            return result, time.perf_counter() - began, stack.target_servicer.store.expirations

    result, took, expirations = run(scenario())
    assert took > 2 * ttl, f"the request took {took:.2f} s: it must outlast the TTL"
    assert expirations == 0 and result.stats["resyncs"] == 0
    assert result.token_ids == reference_greedy(target, chat_ids(tokenizer, PROMPTS[1]), MAX_NEW)


def test_a_session_expired_while_the_coordinator_paused_resyncs_with_the_same_output(target, other_draft,
                                                                                      tokenizer):
    ttl = 0.3

    async def scenario():
        options = {"session_ttl_s": ttl}
        async with running_stack(target, tokenizer, draft=other_draft, target_options=options,
                                 draft_options=options) as stack:
            workers = stack.coordinator_servicer.runner.target
            verify = workers.verify
            calls = [0]

            async def pausing(*args, **kwargs):
                calls[0] += 1
                if calls[0] == 4:  # mid-request, the coordinator stalls for several TTLs
                    await asyncio.sleep(4 * ttl)
                return await verify(*args, **kwargs)

            workers.verify = pausing
            before = expired_total("target")
            async with Client(stack.address) as client:
                result = await client.complete(make_request(PROMPTS[0], max_new_tokens=MAX_NEW, k=3))
            return result, calls[0], stack.target_servicer.store.expirations, expired_total("target") - before

    result, rounds, expirations, counted = run(scenario())
    assert rounds > 4, "the request must go on after the pause"
    assert expirations >= 1 and counted >= 1
    assert result.stats["resyncs"] >= 1
    assert result.token_ids == reference_greedy(target, chat_ids(tokenizer, PROMPTS[0]), MAX_NEW)


# --- the model-thread watchdog -----------------------------------------------------------

def verify_batch(session_id: str, ids: list[int]) -> target_pb2.VerifyBatchRequest:
    delta = common_pb2.SessionDelta(session_id=session_id, start=0, tokens=ids)
    return target_pb2.VerifyBatchRequest(rounds=[target_pb2.VerifyRequest(delta=delta)])


def test_a_wedged_model_step_turns_health_not_serving_until_it_finishes(target, tokenizer):
    stall = 1.0
    entered, release = threading.Event(), threading.Event()
    ids = chat_ids(tokenizer, PROMPTS[0])

    async def scenario():
        server, servicer = await start_target(target, tokenizer, stall_timeout_s=stall)
        verify = servicer.verifier.verify_batch
        calls = [0]

        def wedging(rounds):
            calls[0] += 1
            if calls[0] == 1:
                entered.set()
                release.wait(timeout=60)
            return verify(rounds)

        seen = {}
        stalls_before = sample("specdec_worker_model_stalls_total", "target")
        try:
            async with grpc.aio.insecure_channel(server.address) as channel:
                stub = target_pb2_grpc.TargetWorkerStub(channel)
                health = health_pb2_grpc.HealthStub(channel)
                loop = asyncio.get_running_loop()

                async def statuses():
                    return tuple([(await health.Check(health_pb2.HealthCheckRequest(service=name))).status
                                  for name in ("", TARGET_SERVICE)])

                async def wait_for(status, within: float) -> float:
                    began = loop.time()
                    while await statuses() != (status, status) and loop.time() - began < within:
                        await asyncio.sleep(0.05)
                    return loop.time() - began

                servicer.verifier.verify_batch = wedging
                sent = loop.time()
                stuck = asyncio.ensure_future(stub.VerifyBatch(verify_batch("stuck", ids), timeout=30))
                queued = asyncio.ensure_future(stub.VerifyBatch(verify_batch("queued", ids), timeout=30))
                assert await asyncio.to_thread(entered.wait, 10)
                seen["early"] = await statuses()
                await wait_for(NOT_SERVING, 10)
                seen["not_serving_after"] = loop.time() - sent
                seen["stalled"] = await statuses()
                seen["gauge_stalled"] = sample("specdec_worker_model_stalled", "target")
                seen["in_flight"] = await asyncio.gather(stuck, queued, return_exceptions=True)
                seen["answered_after"] = loop.time() - sent
                try:
                    await stub.VerifyBatch(verify_batch("new", ids), timeout=30)
                except grpc.aio.AioRpcError as exc:
                    seen["new"] = exc.code()
                release.set()
                seen["serving_after"] = await wait_for(SERVING, 10)
                seen["recovered"] = await statuses()
                seen["gauge_recovered"] = sample("specdec_worker_model_stalled", "target")
                seen["after"] = await stub.VerifyBatch(verify_batch("after", ids), timeout=30)
        finally:
            release.set()
            await server.stop(grace=0)
        seen["stalls"] = sample("specdec_worker_model_stalls_total", "target") - stalls_before
        return seen

    seen = run(scenario())
    assert seen["early"] == (SERVING, SERVING)
    assert stall <= seen["not_serving_after"] < stall + 2.0, seen["not_serving_after"]
    assert seen["stalled"] == (NOT_SERVING, NOT_SERVING)
    assert seen["gauge_stalled"] == 1 and seen["stalls"] == 1
    # The calls waiting on the wedged thread are answered UNAVAILABLE, not at their deadline.
    assert all(isinstance(outcome, grpc.aio.AioRpcError) and outcome.code() == grpc.StatusCode.UNAVAILABLE
               for outcome in seen["in_flight"]), seen["in_flight"]
    assert seen["answered_after"] < stall + 2.0
    assert seen["new"] == grpc.StatusCode.UNAVAILABLE
    assert seen["serving_after"] < 2.0 and seen["recovered"] == (SERVING, SERVING)
    assert seen["gauge_recovered"] == 0
    assert seen["after"].results[0].WhichOneof("result") == "verdict"


HOSTS = ["127.0.0.2", "127.0.0.3"]
# The cluster harness gives worker calls a 30 s deadline: the wedged replica's requests must
# move long before it.
WORKER_DEADLINE_S = 30.0


def test_a_wedged_target_replica_hands_its_requests_to_the_other(target, tokenizer):
    stall = 1.0
    wedged, release = threading.Event(), threading.Event()

    async def scenario():
        async with running_cluster(target, tokenizer, NGRAM, HOSTS, target_options={"stall_timeout_s": stall}) as cluster:
            try:
                (first, servicer), _ = cluster.targets
                verify = servicer.verifier.verify_batch
                calls = [0]

                def wedging(rounds):
                    calls[0] += 1
                    if calls[0] == 3:  # its requests are mid-generation
                        wedged.set()
                        release.wait(timeout=60)
                    return verify(rounds)

                servicer.verifier.verify_batch = wedging
                began = time.perf_counter()
                async with Client(cluster.address) as client:
                    results = await asyncio.gather(*(
                        client.complete(make_request(p, max_new_tokens=MAX_NEW, k=3)) for p in PROMPTS))
                took = time.perf_counter() - began
                async with grpc.aio.insecure_channel(first.address) as channel:
                    status = (await health_pb2_grpc.HealthStub(channel).Check(
                        health_pb2.HealthCheckRequest(service=""))).status
                return results, took, wedged.is_set(), status
            finally:
                release.set()

    results, took, was_wedged, status = run(scenario())
    assert was_wedged and status == NOT_SERVING
    assert [r.token_ids for r in results] == [reference_greedy(target, chat_ids(tokenizer, p), MAX_NEW)
                                             for p in PROMPTS]
    assert sum(r.stats["resyncs"] for r in results) >= 1, "no session moved off the wedged replica"
    assert took < WORKER_DEADLINE_S / 2, f"the requests took {took:.1f} s"
