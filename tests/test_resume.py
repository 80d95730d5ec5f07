"""Resumable streams: a request whose stream broke, sent again with the tokens it already
received (resume_token_ids), goes on exactly where it broke — token ids and text, greedy and
sampled, every drafter, stop strings — on any coordinator replica; the Python client resumes
on its own when a coordinator drains or is killed."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import grpc
import pytest
import torch

from coordinator import service as coordinator_service
from specdec.client import NO_RESUME, Client, Resume, make_request
from specdec.config import CoordinatorConfig, ServerConfig
from specdec.models import NGRAM
from specdec.v1 import coordinator_pb2
from tests.factories import make_tiny_model, save_model_dir
from tests.harness import LOOPBACK, reference_greedy, reference_sample, run, running_stack
from tests.test_services import PROMPTS, Gate, chat_ids, other_draft, target, tokenizer  # noqa: F401 (fixtures)

MAX_NEW = 40
SAMPLING = dict(temperature=0.9, top_k=40, top_p=0.95)
EOS = (2,)  # the tiny tokenizer's <|im_end|>


@pytest.fixture(scope="module")
def flat_target(tokenizer):
    """Flatter logits than `target`, so sampling has choices."""
    model = make_tiny_model(tokenizer, seed=0, layers=2)
    with torch.no_grad():
        model.lm_head.weight.mul_(0.25)
    return model


async def messages(client: Client, request) -> list:
    return [response async for response in client.stream(request)]


def resumed_request(request, received: list[int], first) -> object:
    """The request again, as a client resumes it: the ids received, the first response's
    seed and request id."""
    again = type(request)()
    again.CopyFrom(request)
    again.resume_token_ids[:] = received
    if not request.HasField("seed"):
        again.seed = first.seed
    again.request_id = first.request_id
    return again


async def every_seam(client: Client, request) -> tuple[list, list[tuple[list, list]]]:
    """The uninterrupted stream, and for every message boundary of it the stream cut there
    and resumed: (messages before the cut, messages of the resumed stream)."""
    whole = await messages(client, request)
    seams = []
    for cut in range(1, len(whole)):
        received = [t for m in whole[:cut] for t in m.token_ids]
        seams.append((whole[:cut], await messages(client, resumed_request(request, received, whole[0]))))
    return whole, seams


def joined(stream) -> tuple[str, list[int], int]:
    return "".join(m.text for m in stream), [t for m in stream for t in m.token_ids], stream[-1].finish_reason


def assert_every_seam_continues_exactly(whole, seams):
    text, ids, finish = joined(whole)
    assert len(seams) >= 3  # the request streamed in several messages
    for before, after in seams:
        assert joined(before + after) == (text, ids, finish), len(before)
        assert after[-1].stats.generated_tokens == len(ids)
        assert after[-1].stats.prompt_tokens == whole[-1].stats.prompt_tokens


@pytest.mark.parametrize("drafter", ["other-model", NGRAM, "none"])
def test_a_greedy_stream_resumed_at_any_message_equals_the_uninterrupted_one(drafter, target, other_draft,
                                                                              tokenizer):
    draft = {"other-model": other_draft, NGRAM: NGRAM, "none": None}[drafter]

    async def scenario():
        async with running_stack(target, tokenizer, draft=draft) as stack:
            async with Client(stack.address) as client:
                # The multi-byte prompt: its continuation splits characters across tokens.
                return await every_seam(client, make_request(PROMPTS[3], max_new_tokens=MAX_NEW, k=3))

    whole, seams = run(scenario())
    assert_every_seam_continues_exactly(whole, seams)
    assert joined(whole)[1] == reference_greedy(target, chat_ids(tokenizer, PROMPTS[3]), MAX_NEW)
    assert whole[0].seed == 0 and whole[0].request_id
    assert all(not m.request_id for m in whole[1:])  # the first message only


@pytest.mark.parametrize("where", ["draft-worker", "target-worker"])
def test_a_stream_drafted_by_a_head_resumes_exactly(where, target, tokenizer):
    """A feature-level head (on the draft worker, or inline on the target): the resumed
    stream has no features yet and rebuilds them from the committed tokens."""
    from tests.test_eagle_services import make_head

    head = make_head(target)

    async def scenario():
        always = {"min_chain_prob": 0.0}  # a random head's chains would be cut to nothing
        options = dict(draft=head, draft_options=always) if where == "draft-worker" else \
            dict(target_head=head, target_options=always)
        async with running_stack(target, tokenizer, **options) as stack:
            async with Client(stack.address) as client:
                return await every_seam(client, make_request(PROMPTS[0], max_new_tokens=24, k=3))

    whole, seams = run(scenario())
    assert_every_seam_continues_exactly(whole, seams)
    assert joined(whole)[1] == reference_greedy(target, chat_ids(tokenizer, PROMPTS[0]), 24)


def test_a_stream_cut_before_its_stop_string_resumes_to_the_same_stop(target, other_draft, tokenizer):
    full = tokenizer.decode(reference_greedy(target, chat_ids(tokenizer, PROMPTS[1]), MAX_NEW),
                            skip_special_tokens=True)
    stop = full[20:23]

    async def scenario():
        async with running_stack(target, tokenizer, draft=other_draft) as stack:
            async with Client(stack.address) as client:
                return await every_seam(client, make_request(PROMPTS[1], max_new_tokens=MAX_NEW, k=2, stop=[stop]))

    whole, seams = run(scenario())
    assert whole[-1].finish_reason == 3  # FINISH_REASON_STOP
    assert joined(whole)[0] == full[:full.find(stop)]
    assert_every_seam_continues_exactly(whole, seams)


@pytest.mark.parametrize("seeded", [True, False])
def test_a_sampled_stream_resumes_with_its_seed(seeded, flat_target, other_draft, tokenizer):
    """Seeded or not: the first message reports the seed, and the resumed stream samples
    exactly the tokens the broken one would have."""
    async def scenario():
        async with running_stack(flat_target, tokenizer, draft=other_draft) as stack:
            async with Client(stack.address) as client:
                request = make_request(PROMPTS[0], max_new_tokens=MAX_NEW, k=3, seed=7 if seeded else None,
                                       **SAMPLING)
                # Unseeded, the server draws the seed: ~3% of seeds sample the end of sequence
                # within 4 tokens, too short a stream to cut at 3 seams; such a draw is redrawn.
                for _ in range(10):
                    whole, seams = await every_seam(client, request)
                    if seeded or len(seams) >= 3:
                        return whole, seams
                return whole, seams

    whole, seams = run(scenario())
    assert_every_seam_continues_exactly(whole, seams)
    seed = whole[0].seed
    assert seed == 7 if seeded else seed > 0
    expected = reference_sample(flat_target, chat_ids(tokenizer, PROMPTS[0]), MAX_NEW, seed=seed, eos_ids=EOS,
                                **SAMPLING)
    assert joined(whole)[1] == expected


BAD_RESUMES = {
    "nothing left": (dict(max_new_tokens=4), [5, 6, 7, 8], "nothing to generate"),
    "out of vocabulary": ({}, [5, 10**6], "outside the vocabulary"),
    "end of sequence": ({}, [5, 2, 6], "end-of-sequence"),
    "sampled without seed": (dict(temperature=0.8), [5, 6], "with its seed"),
}


@pytest.mark.parametrize("name", sorted(BAD_RESUMES))
def test_a_resume_that_cannot_continue_is_invalid(name, target, tokenizer):
    fields, ids, needle = BAD_RESUMES[name]

    async def scenario():
        async with running_stack(target, tokenizer, draft=NGRAM) as stack:
            async with Client(stack.address) as client:
                request = make_request(PROMPTS[0], **{"max_new_tokens": MAX_NEW, **fields})
                request.resume_token_ids[:] = ids
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await client.complete(request)
                return caught.value

    error = run(scenario())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "resume_token_ids" in error.details() and needle in error.details()


def test_a_resume_whose_text_holds_a_stop_string_is_invalid(target, tokenizer):
    ids = reference_greedy(target, chat_ids(tokenizer, PROMPTS[1]), 20)
    text = tokenizer.decode(ids, skip_special_tokens=True)

    async def scenario():
        async with running_stack(target, tokenizer, draft=NGRAM) as stack:
            async with Client(stack.address) as client:
                request = make_request(PROMPTS[1], max_new_tokens=MAX_NEW, stop=[text[5:8]])
                request.resume_token_ids[:] = ids
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await client.complete(request)
                return caught.value

    error = run(scenario())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "stop string" in error.details()


async def second_coordinator(stack, tokenizer):
    """Another coordinator replica over the same workers."""
    config = CoordinatorConfig(target_addr=stack.target.address, draft_addr=stack.draft.address,
                               tokenizer="unused: given in memory",
                               server=ServerConfig(host=LOOPBACK, port=0, grace_period_s=1.0),
                               worker_timeout_s=30.0, retry_backoff_s=0.05)
    servicer = await coordinator_service.connect(config, tokenizer=tokenizer, startup_timeout_s=10.0)
    return await coordinator_service.serve(config, servicer), servicer


async def close_coordinator(server, servicer) -> None:
    await server.stop(grace=0)
    await servicer.runner.drain()
    await servicer.runner.target.close()
    await servicer.runner.draft.close()


def both(first: str, second: str) -> str:
    """A channel target over two coordinator replicas (pick_first: the first while it is up)."""
    return "ipv4:" + ",".join(a.replace("localhost", "127.0.0.1") for a in (first, second))


def test_a_drained_coordinator_ends_its_streams_and_the_client_resumes_on_another(target, other_draft,
                                                                                    tokenizer):
    """A drain gives streams its grace period, then ends the rest with UNAVAILABLE; the
    client resumes on the other replica, and the text and ids are the uninterrupted ones."""
    async def scenario():
        async with running_stack(target, tokenizer, draft=other_draft) as stack:
            other, other_servicer = await second_coordinator(stack, tokenizer)
            try:
                gate = Gate(stack.target_servicer.verifier.verify_batch, at_call=4)
                stack.target_servicer.verifier.verify_batch = gate
                async with Client(both(stack.address, other.address)) as client:
                    task = asyncio.create_task(client.complete(make_request(PROMPTS[3], max_new_tokens=MAX_NEW, k=2)))
                    assert await asyncio.to_thread(gate.entered.wait, 30)
                    began = time.monotonic()
                    stopping = asyncio.create_task(stack.coordinator.stop(grace=1.0))
                    await asyncio.sleep(1.5)  # the stream outlives the grace period
                    gate.release.set()
                    result = await task
                    await stopping
                    return result, time.monotonic() - began, other_servicer.runner.drafter_record
            finally:
                await close_coordinator(other, other_servicer)

    result, elapsed, _ = run(scenario())
    expected = reference_greedy(target, chat_ids(tokenizer, PROMPTS[3]), MAX_NEW)
    assert result.token_ids == expected
    assert result.text == tokenizer.decode(expected, skip_special_tokens=True)
    assert result.stats["resumes"] == 1
    assert result.stats["generated_tokens"] == MAX_NEW
    assert elapsed < 10


def test_without_resume_a_drained_stream_fails_unavailable(target, other_draft, tokenizer):
    async def scenario():
        async with running_stack(target, tokenizer, draft=other_draft) as stack:
            gate = Gate(stack.target_servicer.verifier.verify_batch, at_call=4)
            stack.target_servicer.verifier.verify_batch = gate
            async with Client(stack.address) as client:
                task = asyncio.create_task(client.complete(make_request(PROMPTS[0], max_new_tokens=MAX_NEW),
                                                           resume=NO_RESUME))
                assert await asyncio.to_thread(gate.entered.wait, 30)
                stopping = asyncio.create_task(stack.coordinator.stop(grace=0.5))
                await asyncio.sleep(1.0)
                gate.release.set()
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await task
                await stopping
                return caught.value

    error = run(scenario())
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert "resume" in error.details()


def test_a_killed_coordinator_process_loses_no_stream(target, other_draft, tokenizer, tmp_path):
    """SIGKILL of a coordinator process mid-stream: the client resumes on another replica
    and the output is the uninterrupted one, sampled included."""
    tokenizer_dir = save_model_dir(tmp_path / "tiny", target, tokenizer)

    async def scenario():
        async with running_stack(target, tokenizer, draft=other_draft) as stack:
            other, other_servicer = await second_coordinator(stack, tokenizer)
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            process = subprocess.Popen(
                [sys.executable, "-m", "specdec", "serve", "coordinator", "--port", "0", "--http-port", "0",
                 "--insecure", "--target-addr", stack.target.address, "--draft-addr", stack.draft.address,
                 "--tokenizer", str(tokenizer_dir), "--rate-limit", "0"],
                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            try:
                address = await asyncio.to_thread(listening_address, process)
                gate = Gate(stack.target_servicer.verifier.verify_batch, at_call=3)
                stack.target_servicer.verifier.verify_batch = gate
                async with Client(both(address, other.address)) as client:
                    request = make_request(PROMPTS[2], max_new_tokens=MAX_NEW, k=3, seed=11, **SAMPLING)
                    task = asyncio.create_task(client.complete(request, resume=Resume(backoff_s=0.05)))
                    assert await asyncio.to_thread(gate.entered.wait, 30)
                    process.send_signal(signal.SIGKILL)
                    await asyncio.to_thread(process.wait, 30)
                    gate.release.set()
                    return await task
            finally:
                if process.poll() is None:
                    process.kill()
                    process.wait()
                await close_coordinator(other, other_servicer)

    result = run(scenario())
    expected = reference_sample(target, chat_ids(tokenizer, PROMPTS[2]), MAX_NEW, seed=11, eos_ids=EOS, **SAMPLING)
    assert result.token_ids == expected
    assert result.stats["resumes"] == 1


def listening_address(process: subprocess.Popen) -> str:
    """The coordinator's gRPC address from its start-up line."""
    deadline = time.monotonic() + 120
    lines = []
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            break
        lines.append(line)
        if "listening on" in line and "coordinator" in line.lower():
            return line.rsplit(" ", 1)[-1].strip()
    raise AssertionError("the coordinator did not start:\n" + "".join(lines))


def test_a_stream_that_breaks_after_its_last_message_is_complete():
    """The coordinator wrote the finishing message, then died before the stream's status: the
    client has the whole answer and resumes nothing (a resume would be refused: nothing is
    left to generate)."""
    from specdec.v1 import coordinator_pb2_grpc

    calls = []

    class Finished(coordinator_pb2_grpc.CoordinatorServicer):
        async def Generate(self, request, context):
            calls.append(list(request.resume_token_ids))
            yield coordinator_pb2.GenerateResponse(token_ids=[5, 6], text="ab", request_id="r")
            yield coordinator_pb2.GenerateResponse(token_ids=[7], text="c",
                                                   finish_reason=coordinator_pb2.FINISH_REASON_LENGTH)
            await context.abort(grpc.StatusCode.UNAVAILABLE, "killed after its last message")

    async def scenario():
        server = grpc.aio.server()
        coordinator_pb2_grpc.add_CoordinatorServicer_to_server(Finished(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with Client(f"127.0.0.1:{port}") as client:
                return await client.complete(make_request("hi", max_new_tokens=3))
        finally:
            await server.stop(grace=0)

    result = run(scenario())
    assert result.token_ids == [5, 6, 7] and result.text == "abc"
    assert result.finish_reason == "FINISH_REASON_LENGTH" and calls == [[]]
