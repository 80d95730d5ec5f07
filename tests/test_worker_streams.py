"""Steps on one long-lived stream per worker replica (VerifyStream / ProposeStream): the output
is the target's own, a failed or late step leaves the stream and the other steps alone, a
worker that stops mid-stream answers what it runs and its sessions move on, and a worker
without the streams gets unary calls."""

from __future__ import annotations

import asyncio
import contextlib
import threading

import grpc
import pytest

from coordinator import service as coordinator_service
from coordinator.step_stream import StepStream
from draft_worker import service as draft_service
from specdec.config import CoordinatorConfig, ServerConfig
from specdec.models import NGRAM
from specdec.serving import start_server
from specdec.v1 import common_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
from target_worker import service as target_service
from tests.harness import (
    LOOPBACK, reference_greedy, run, running_cluster, running_stack, start_draft, start_target, worker_config,
)
from tests.test_services import PROMPTS, chat_ids, other_draft, target, tokenizer  # noqa: F401 (fixtures)

MAX_NEW = 32
HOSTS = ["127.0.0.2", "127.0.0.3"]


@pytest.fixture(scope="module")
def expected(target, tokenizer):
    return {p: reference_greedy(target, chat_ids(tokenizer, p), MAX_NEW) for p in PROMPTS}


async def complete_all(address: str, prompts, **kwargs):
    from specdec.client import Client, make_request

    async with Client(address) as client:
        return await asyncio.gather(*(client.complete(make_request(p, max_new_tokens=MAX_NEW, k=4, **kwargs))
                                      for p in prompts))


def make_step(session_id: str, tokens: list[int], start: int = 0, rounds: int = 1) -> target_pb2.VerifyBatchRequest:
    """A VerifyBatch step of `rounds` greedy rounds, each a session of its own (session_id-i)."""
    return target_pb2.VerifyBatchRequest(rounds=[
        target_pb2.VerifyRequest(delta=common_pb2.SessionDelta(session_id=f"{session_id}-{i}", start=start,
                                                               tokens=tokens))
        for i in range(rounds)])


def hold_steps(servicer, after: int = 0) -> tuple[threading.Event, threading.Event]:
    """Makes the target's batched step after the next `after` wait (on its model thread) for
    `go`; `entered` is set once it waits. Every other step runs at once."""
    entered, go = threading.Event(), threading.Event()
    verify = servicer.verifier.verify_batch
    steps = [0]

    def held(rounds):
        steps[0] += 1
        if steps[0] == after + 1:
            entered.set()
            go.wait(timeout=30)
        return verify(rounds)

    servicer.verifier.verify_batch = held
    return entered, go


@contextlib.asynccontextmanager
async def stream_to(server):
    channel = grpc.aio.insecure_channel(server.address)
    stub = target_pb2_grpc.TargetWorkerStub(channel)
    stream = StepStream(stub.VerifyStream, f"target {server.address}", channel)
    try:
        yield stream
    finally:
        await stream.close()
        await channel.close()


# ---------------------------------------------------------------------------------------
# Through the services


def streams_of(stack) -> dict[str, list]:
    runner = stack.coordinator_servicer.runner
    return {kind: list(client._streams.values()) for kind, client in (("target", runner.target),
                                                                        ("draft", runner.draft))}


@pytest.fixture(scope="module")
def through_streams(target, other_draft, tokenizer):
    """(results, the coordinator's step streams) with streams, and results with unary steps."""
    async def scenario(streams: bool):
        async with running_stack(target, tokenizer, draft=other_draft, worker_streams=streams) as stack:
            results = await complete_all(stack.address, PROMPTS)
            return results, streams_of(stack)

    return run(scenario(True)), run(scenario(False))[0]


def test_greedy_output_through_streams_equals_the_target_alone(through_streams, expected):
    (results, _), _ = through_streams
    assert [r.token_ids for r in results] == [expected[p] for p in PROMPTS]


def test_greedy_output_through_streams_equals_unary_steps(through_streams):
    (results, _), unary = through_streams
    assert [r.token_ids for r in results] == [r.token_ids for r in unary]
    assert sum(r.stats["proposed"] for r in results) > 0


def test_every_step_to_a_replica_shares_one_stream(through_streams):
    (_, streams), _ = through_streams
    for kind in ("target", "draft"):
        assert [s.opened for s in streams[kind]] == [1], kind
        assert not streams[kind][0].unsupported


def test_unary_steps_open_no_stream(target, tokenizer):
    async def scenario():
        async with running_stack(target, tokenizer, draft=NGRAM, worker_streams=False) as stack:
            await complete_all(stack.address, PROMPTS[:1])
            return streams_of(stack)

    assert run(scenario()) == {"target": [], "draft": []}


# ---------------------------------------------------------------------------------------
# One stream, many steps


def test_a_failed_step_does_not_end_its_stream(target, tokenizer):
    prompt = chat_ids(tokenizer, PROMPTS[0])

    async def scenario():
        server, _ = await start_target(target, tokenizer, max_batch_rounds=2)
        try:
            async with stream_to(server) as stream:
                outcomes = await asyncio.gather(stream.step(make_step("too-many", prompt, rounds=3), 30),
                                                stream.step(make_step("fine", prompt), 30),
                                                return_exceptions=True)
                after = await stream.step(make_step("after", prompt), 30)
                return outcomes, after, stream.opened
        finally:
            await server.stop(grace=0)

    (refused, answered), after, opened = run(scenario())
    assert isinstance(refused, grpc.aio.AioRpcError) and refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "exceeds the limit of 2" in refused.details()
    assert answered.results[0].WhichOneof("result") == "verdict"
    assert after.results[0].WhichOneof("result") == "verdict"
    assert opened == 1


def test_a_late_step_fails_alone_and_its_answer_is_dropped(target, tokenizer):
    prompt = chat_ids(tokenizer, PROMPTS[0])

    async def scenario():
        server, servicer = await start_target(target, tokenizer)
        entered, go = hold_steps(servicer)
        try:
            async with stream_to(server) as stream:
                late = asyncio.ensure_future(stream.step(make_step("late", prompt), 0.2))
                assert await asyncio.to_thread(entered.wait, 10)
                patient = asyncio.ensure_future(stream.step(make_step("patient", prompt), 30))
                late_error = await asyncio.gather(late, return_exceptions=True)
                go.set()  # the late step's answer arrives now, after its deadline
                answer = await patient
                after = await stream.step(make_step("after", prompt), 30)
                return late_error[0], answer, after, stream.opened
        finally:
            go.set()
            await server.stop(grace=0)

    late_error, answer, after, opened = run(scenario())
    assert isinstance(late_error, grpc.aio.AioRpcError) and late_error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert answer.results[0].verdict.cached_len == len(chat_ids(tokenizer, PROMPTS[0]))
    assert answer.step_id == 2 and after.step_id == 3
    assert opened == 1


def test_a_draining_worker_answers_the_running_step_then_ends_the_stream(target, tokenizer):
    prompt = chat_ids(tokenizer, PROMPTS[0])

    async def scenario():
        server, servicer = await start_target(target, tokenizer)
        entered, go = hold_steps(servicer)
        loop = asyncio.get_running_loop()
        try:
            async with stream_to(server) as stream:
                running = asyncio.ensure_future(stream.step(make_step("running", prompt), 30))
                assert await asyncio.to_thread(entered.wait, 10)
                began = loop.time()
                stopping = asyncio.ensure_future(server.stop(grace=20))
                await asyncio.sleep(0.2)
                go.set()
                answer = await running
                await stopping
                stopped_after = loop.time() - began
                after = await asyncio.gather(stream.step(make_step("after", prompt), 5), return_exceptions=True)
                return answer, stopped_after, after[0]
        finally:
            go.set()
            await server.stop(grace=0)

    answer, stopped_after, after = run(scenario())
    assert answer.results[0].WhichOneof("result") == "verdict"
    assert stopped_after < 10, "the drain waited for its grace instead of the running step"
    assert isinstance(after, grpc.aio.AioRpcError) and after.code() == grpc.StatusCode.UNAVAILABLE


def test_a_worker_stopped_mid_stream_fails_its_steps_over_and_the_output_stays_exact(target, other_draft,
                                                                                     tokenizer, expected):
    async def scenario():
        async with running_cluster(target, tokenizer, other_draft, HOSTS) as cluster:
            # Past its sessions' first steps (a session moved then has a cache to rebuild).
            holds = [hold_steps(servicer, after=3) for _, servicer in cluster.targets]
            task = asyncio.create_task(complete_all(cluster.address, PROMPTS))
            # Whichever replica's held step starts first is stopped while it runs.
            while not any(entered.is_set() for entered, _ in holds):
                await asyncio.sleep(0.01)
            held = next(i for i, (entered, _) in enumerate(holds) if entered.is_set())
            await cluster.targets[held][0].stop(grace=0)
            for _, go in holds:
                go.set()
            return await task

    results = run(scenario())
    assert [r.token_ids for r in results] == [expected[p] for p in PROMPTS]
    assert sum(r.stats["resyncs"] for r in results) >= 1, "no session had to move"


# ---------------------------------------------------------------------------------------
# Workers that predate the streams


def without_method(add_to_server, servicer, service: str, method: str):
    """Registers `servicer` as a worker built before `method` existed would: the server answers
    UNIMPLEMENTED to it."""
    class Capture:
        def add_generic_rpc_handlers(self, handlers):
            pass

        def add_registered_method_handlers(self, name, handlers):
            self.handlers = dict(handlers)

    capture = Capture()
    add_to_server(servicer, capture)
    del capture.handlers[method]

    def register(server):
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, capture.handlers),))

    return register


@contextlib.asynccontextmanager
async def running_old_workers(target_model, tokenizer):
    """A target and an n-gram draft worker without VerifyStream / ProposeStream, and a coordinator."""
    config = worker_config("tiny-target")
    servicer = target_service.build_servicer(config, target_model, tokenizer)
    target_server = await start_server(
        config.server, without_method(target_pb2_grpc.add_TargetWorkerServicer_to_server, servicer,
                                      target_service.SERVICE_NAME, "VerifyStream"),
        [target_service.SERVICE_NAME], on_stop=servicer.thread.shutdown)
    draft_config = worker_config(NGRAM)
    draft_servicer = draft_service.build_servicer(draft_config)
    draft_server = await start_server(
        draft_config.server, without_method(draft_pb2_grpc.add_DraftWorkerServicer_to_server, draft_servicer,
                                            draft_service.SERVICE_NAME, "ProposeStream"),
        [draft_service.SERVICE_NAME], on_stop=draft_servicer.thread.shutdown)
    coordinator = None
    try:
        config = CoordinatorConfig(target_addr=target_server.address, draft_addr=draft_server.address,
                                   tokenizer="unused: given in memory",
                                   server=ServerConfig(host=LOOPBACK, port=0, grace_period_s=1.0),
                                   worker_timeout_s=30.0, retry_backoff_s=0.05)
        coordinator_servicer = await coordinator_service.connect(config, tokenizer=tokenizer, startup_timeout_s=10.0)
        coordinator = await coordinator_service.serve(config, coordinator_servicer)
        yield coordinator, coordinator_servicer
    finally:
        if coordinator is not None:
            await coordinator.stop(grace=0)
            await coordinator_servicer.runner.drain()
            await coordinator_servicer.runner.target.close()
            await coordinator_servicer.runner.draft.close()
        await draft_server.stop(grace=0)
        await target_server.stop(grace=0)


def test_workers_without_streams_get_unary_steps_and_the_same_output(target, tokenizer, expected):
    async def scenario():
        async with running_old_workers(target, tokenizer) as (coordinator, servicer):
            first = await complete_all(coordinator.address, PROMPTS)
            second = await complete_all(coordinator.address, PROMPTS[:1])
            runner = servicer.runner
            return first + second, {kind: [(s.unsupported, s.opened) for s in client._streams.values()]
                                    for kind, client in (("target", runner.target), ("draft", runner.draft))}

    results, streams = run(scenario())
    assert [r.token_ids for r in results] == [expected[p] for p in PROMPTS + PROMPTS[:1]]
    assert sum(r.stats["proposed"] for r in results) > 0, "the draft worker's unary steps were not used"
    # Asked once, then unary for good.
    assert streams == {"target": [(True, 1)], "draft": [(True, 1)]}
