"""The three services on loopback with tiny random models: greedy output equals the target
alone, token for token, for every drafter; workers are caches; bad input is refused
cleanly; sessions are freed."""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest

from specdec.client import Client, make_request
from specdec.errors import FailedPrecondition
from specdec.models import NGRAM
from tests.factories import make_tiny_model, make_tiny_tokenizer
from tests.harness import reference_greedy, run, running_stack

PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Summarise: the cat sat on the mat and slept. The cat sat on the mat.",
    "def add(a, b):\n    return a + b",
    "Héllo wörld — naïve café 🙂",
]
MAX_NEW = 40


@pytest.fixture(scope="module")
def tokenizer():
    return make_tiny_tokenizer()


@pytest.fixture(scope="module")
def target(tokenizer):
    return make_tiny_model(tokenizer, seed=0, layers=2)


@pytest.fixture(scope="module")
def other_draft(tokenizer):
    return make_tiny_model(tokenizer, seed=1, layers=1, hidden=32)


def chat_ids(tokenizer, prompt: str) -> list[int]:
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
    return list(rendered["input_ids"])


async def generate_all(address: str, prompts, tokenizer, **kwargs):
    async with Client(address) as client:
        return [await client.complete(make_request(p, max_new_tokens=MAX_NEW, **kwargs)) for p in prompts]


def assert_equals_target(results, prompts, target, tokenizer):
    for prompt, result in zip(prompts, results):
        expected = reference_greedy(target, chat_ids(tokenizer, prompt), MAX_NEW)
        assert result.token_ids == expected, prompt


@pytest.mark.parametrize("drafter", ["other-model", "target-itself", NGRAM])
def test_greedy_output_equals_target_alone(drafter, target, other_draft, tokenizer):
    draft = {"other-model": other_draft, "target-itself": target, NGRAM: NGRAM}[drafter]

    async def scenario():
        async with running_stack(target, tokenizer, draft=draft) as stack:
            return await generate_all(stack.address, PROMPTS, tokenizer, k=4)

    results = run(scenario())
    assert_equals_target(results, PROMPTS, target, tokenizer)
    proposed = sum(r.stats["proposed"] for r in results)
    assert proposed > 0
    if drafter == "target-itself":
        assert all(r.stats["acceptance_rate"] == 1.0 for r in results)
        assert all(r.stats["tokens_per_round"] > 4.0 for r in results)


def test_no_speculation_equals_target_alone(target, other_draft, tokenizer):
    async def scenario():
        async with running_stack(target, tokenizer, draft=other_draft) as stack:
            return await generate_all(stack.address, PROMPTS, tokenizer, speculate=False)

    results = run(scenario())
    assert_equals_target(results, PROMPTS, target, tokenizer)
    assert all(r.stats["proposed"] == 0 and r.stats["rounds"] == MAX_NEW for r in results)


def test_streamed_text_is_the_decoded_tokens(target, tokenizer):
    async def scenario():
        async with running_stack(target, tokenizer, draft=target) as stack:
            return await generate_all(stack.address, PROMPTS, tokenizer)

    for result in run(scenario()):
        assert result.text == tokenizer.decode(result.token_ids, skip_special_tokens=True)


@pytest.fixture(scope="module")
def eos_run(target, tokenizer):
    """(the target's free run, the token pretended to be its EOS, the served result with it)"""
    prompt = PROMPTS[0]
    free_run = reference_greedy(target, chat_ids(tokenizer, prompt), MAX_NEW)
    eos = free_run[7]  # pretend the 8th generated token is the model's EOS
    target.generation_config.eos_token_id = eos
    try:
        async def scenario():
            async with running_stack(target, tokenizer, draft=target) as stack:
                return (await generate_all(stack.address, [prompt], tokenizer))[0]

        result = run(scenario())
    finally:
        target.generation_config.eos_token_id = tokenizer.eos_token_id
    return free_run, eos, result


def test_generation_stops_at_eos_with_eos_as_the_last_token(eos_run):
    free_run, eos, result = eos_run
    assert result.token_ids == free_run[:free_run.index(eos) + 1]


def test_generation_stopped_at_eos_reports_finish_reason_eos(eos_run):
    _, _, result = eos_run
    assert result.finish_reason == "FINISH_REASON_EOS"


def test_stop_string_cuts_the_text(target, tokenizer):
    prompt = PROMPTS[1]
    full = tokenizer.decode(reference_greedy(target, chat_ids(tokenizer, prompt), MAX_NEW), skip_special_tokens=True)
    stop = full[10:13]
    assert stop and full.find(stop) >= 0

    async def scenario():
        async with running_stack(target, tokenizer, draft=target) as stack:
            return (await generate_all(stack.address, [prompt], tokenizer, stop=[stop]))[0]

    result = run(scenario())
    assert result.finish_reason == "FINISH_REASON_STOP"
    assert result.text == full[:full.find(stop)]


def test_stop_string_cuts_token_ids_the_same_with_and_without_speculation(target, tokenizer):
    """The ids end with the token whose text completed the stop string, whatever the rounds
    committed beyond it: equal to the target alone cut there."""
    prompt = PROMPTS[1]
    reference = reference_greedy(target, chat_ids(tokenizer, prompt), MAX_NEW)
    full = tokenizer.decode(reference, skip_special_tokens=True)
    stop = full[10:13]

    async def scenario():
        async with running_stack(target, tokenizer, draft=target) as stack:
            return [(await generate_all(stack.address, [prompt], tokenizer, stop=[stop], k=8, speculate=speculate))[0]
                    for speculate in (True, False)]

    speculated, alone = run(scenario())
    assert speculated.stats["tokens_per_round"] > 1  # rounds committed several tokens at once
    assert speculated.token_ids == alone.token_ids
    assert speculated.stats["generated_tokens"] == alone.stats["generated_tokens"] == len(alone.token_ids)
    completing = next(n for n in range(1, len(reference) + 1)
                      if stop in tokenizer.decode(reference[:n], skip_special_tokens=True))
    assert alone.token_ids == reference[:completing]


def test_max_new_tokens_is_exact(target, tokenizer):
    async def scenario():
        async with running_stack(target, tokenizer, draft=target) as stack:
            async with Client(stack.address) as client:
                return await client.complete(make_request(PROMPTS[0], max_new_tokens=7, k=4))

    result = run(scenario())
    assert result.token_ids == reference_greedy(target, chat_ids(tokenizer, PROMPTS[0]), 7)
    assert result.finish_reason == "FINISH_REASON_LENGTH"


def test_steady_state_rounds_send_only_new_tokens(target, tokenizer):
    sent = []

    async def scenario():
        async with running_stack(target, tokenizer, draft=NGRAM) as stack:
            verify = stack.target_servicer.verifier.verify_batch

            def recording(rounds):
                sent.extend((r.start, len(r.tokens), len(r.drafts)) for r in rounds)
                return verify(rounds)

            stack.target_servicer.verifier.verify_batch = recording
            return (await generate_all(stack.address, [PROMPTS[1]], tokenizer))[0]

    result = run(scenario())
    prompt_len = len(chat_ids(tokenizer, PROMPTS[1]))
    assert sent[0] == (0, prompt_len, sent[0][2])
    # Every later round sends only the tokens committed by the round before: at most k + 1.
    assert all(start > 0 and n <= 5 for start, n, _ in sent[1:])
    assert len(sent) == result.stats["rounds"]


class Gate:
    """Blocks a worker's model thread at its Nth call until the test has done something."""

    def __init__(self, fn, at_call: int):
        self.fn, self.at_call, self.calls = fn, at_call, 0
        self.entered, self.release = threading.Event(), threading.Event()

    def __call__(self, *args):
        self.calls += 1
        if self.calls == self.at_call:
            self.entered.set()
            self.release.wait(timeout=30)
        return self.fn(*args)


@pytest.mark.parametrize("restarted", ["target", "draft"])
def test_worker_restart_mid_request_keeps_output(restarted, target, other_draft, tokenizer):
    async def scenario():
        async with running_stack(target, tokenizer, draft=other_draft) as stack:
            # Hold the *other* worker mid-round, restart this one, let the round go on.
            if restarted == "target":
                gate = Gate(stack.draft_servicer.proposer.propose_batch, at_call=4)
                stack.draft_servicer.proposer.propose_batch = gate
            else:
                gate = Gate(stack.target_servicer.verifier.verify_batch, at_call=4)
                stack.target_servicer.verifier.verify_batch = gate
            async with Client(stack.address) as client:
                task = asyncio.create_task(client.complete(make_request(PROMPTS[0], max_new_tokens=MAX_NEW, k=3)))
                assert await asyncio.to_thread(gate.entered.wait, 30)
                if restarted == "target":
                    await stack.restart_target(target, tokenizer)
                else:
                    await stack.restart_draft(other_draft, tokenizer)
                gate.release.set()
                result = await task
            fresh = stack.target_servicer if restarted == "target" else stack.draft_servicer
            return result, fresh.store.evictions, len(fresh.store)

    result, _, _ = run(scenario())
    assert result.token_ids == reference_greedy(target, chat_ids(tokenizer, PROMPTS[0]), MAX_NEW)
    assert result.stats["resyncs"] >= 1


def test_tokenizer_mismatch_is_refused_at_start(target, tokenizer):
    other_tokenizer = make_tiny_tokenizer(vocab_size=300)
    other = make_tiny_model(other_tokenizer, seed=2, layers=1, hidden=32)

    async def scenario():
        async with running_stack(target, tokenizer, draft=other, draft_tokenizer=other_tokenizer):
            pass

    with pytest.raises(FailedPrecondition, match="tokenizer mismatch: draft model .* 300 tokens .* 320 tokens"):
        run(scenario())


BAD_REQUESTS = {
    "no prompt": (dict(), "prompt"),
    "empty text": (dict(text=""), "prompt"),
    "max_new_tokens 0": (dict(max_new_tokens=0), "max_new_tokens"),
    "max_new_tokens over limit": (dict(max_new_tokens=10**6), "max_new_tokens"),
    "k 0": (dict(num_speculative_tokens=0), "num_speculative_tokens"),
    "k over limit": (dict(num_speculative_tokens=99), "num_speculative_tokens"),
    "prompt over context": (dict(token_ids=[5] * 300), "context"),
    "token id out of vocab": (dict(token_ids=[5, 10**6]), "token_ids"),
    "bad chat role": (dict(chat=[("robot", "hi")]), "role"),
    "empty stop string": (dict(stop=[""]), "stop"),
}


def build_bad(fields: dict):
    from specdec.v1 import coordinator_pb2

    request = coordinator_pb2.GenerateRequest(max_new_tokens=fields.get("max_new_tokens", 8))
    if "text" in fields:
        request.text = fields["text"]
    elif "token_ids" in fields:
        request.token_ids.ids.extend(fields["token_ids"])
    elif "chat" in fields:
        for role, content in fields["chat"]:
            request.chat.messages.add(role=role, content=content)
    elif fields:
        request.text = "hello"
    if "num_speculative_tokens" in fields:
        request.num_speculative_tokens = fields["num_speculative_tokens"]
    request.stop.extend(fields.get("stop", []))
    return request


@pytest.fixture(scope="module")
def bad_input_outcomes(target, tokenizer):
    """({name: (status code, details)} for each of BAD_REQUESTS, a good request's result after
    them all), from one stack."""
    async def scenario():
        outcomes = {}
        async with running_stack(target, tokenizer, draft=NGRAM) as stack:
            async with Client(stack.address) as client:
                for name, (fields, _) in BAD_REQUESTS.items():
                    with pytest.raises(grpc.aio.AioRpcError) as caught:
                        await client.complete(build_bad(fields))
                    outcomes[name] = (caught.value.code(), caught.value.details())
                good = await client.complete(make_request(PROMPTS[0], max_new_tokens=MAX_NEW))
        return outcomes, good

    return run(scenario())


@pytest.mark.parametrize("name", BAD_REQUESTS)
def test_bad_input_gets_invalid_argument(bad_input_outcomes, name):
    code, details = bad_input_outcomes[0][name]
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (name, code, details)


@pytest.mark.parametrize("name", BAD_REQUESTS)
def test_bad_input_refusal_names_the_offending_field(bad_input_outcomes, name):
    _, details = bad_input_outcomes[0][name]
    assert BAD_REQUESTS[name][1] in details, (name, details)


def test_service_stays_up_after_bad_input(bad_input_outcomes, target, tokenizer):
    _, good = bad_input_outcomes
    assert good.token_ids == reference_greedy(target, chat_ids(tokenizer, PROMPTS[0]), MAX_NEW)


def test_cancelled_request_frees_worker_sessions(target, other_draft, tokenizer):
    async def scenario():
        async with running_stack(target, tokenizer, draft=other_draft) as stack:
            gate = Gate(stack.target_servicer.verifier.verify_batch, at_call=3)
            stack.target_servicer.verifier.verify_batch = gate
            async with Client(stack.address) as client:
                call = client.stream(make_request(PROMPTS[0], max_new_tokens=MAX_NEW))
                first = await call.read()
                assert await asyncio.to_thread(gate.entered.wait, 30)
                held = (len(stack.target_servicer.store), len(stack.draft_servicer.store))
                call.cancel()
                gate.release.set()
                await asyncio.sleep(0.5)
                await stack.coordinator_servicer.runner.drain()
                return first, held, (len(stack.target_servicer.store), len(stack.draft_servicer.store))

    first, held, after = run(scenario())
    assert first.token_ids
    assert held == (1, 1)
    assert after == (0, 0)


def test_next_round_is_verified_before_the_client_takes_the_last_answer(target, tokenizer):
    # The coordinator queues a request's next round before handing the client this round's
    # answer, so the step carrying it runs while the answer is still being delivered; a
    # client that goes away then takes that round with it, and its sessions are freed.
    async def scenario():
        async with running_stack(target, tokenizer, draft=NGRAM) as stack:
            verifier = stack.target_servicer.verifier
            steps = [0]
            verify_batch = verifier.verify_batch

            def counted(*args):
                outcome = verify_batch(*args)
                steps[0] += 1
                return outcome

            verifier.verify_batch = counted
            responses = stack.coordinator_servicer.generate(make_request(PROMPTS[0], max_new_tokens=MAX_NEW), "c")
            first = await responses.__anext__()
            before = steps[0]  # the generator is suspended here: nothing ran since it yielded
            deadline = asyncio.get_running_loop().time() + 10
            while steps[0] == before and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.01)  # the next answer is not asked for
            after = steps[0]
            await responses.aclose()
            await stack.coordinator_servicer.runner.drain()
            return first, after > before, len(stack.target_servicer.store)

    first, ran_ahead, held = run(scenario())
    assert first.token_ids and not first.finish_reason
    assert ran_ahead
    assert held == 0


def test_finished_request_frees_worker_sessions(target, other_draft, tokenizer):
    async def scenario():
        async with running_stack(target, tokenizer, draft=other_draft) as stack:
            await generate_all(stack.address, PROMPTS[:2], tokenizer)
            await stack.coordinator_servicer.runner.drain()
            return len(stack.target_servicer.store), len(stack.draft_servicer.store)

    assert run(scenario()) == (0, 0)


@pytest.fixture(scope="module")
def health_and_reflection(target, tokenizer):
    """({(server, service): health status}, {server: services listed by reflection}) for the
    coordinator, target and draft of one stack."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    async def scenario():
        async with running_stack(target, tokenizer, draft=NGRAM) as stack:
            statuses, listed = {}, {}
            for name, server in (("coordinator", stack.coordinator), ("target", stack.target),
                                 ("draft", stack.draft)):
                async with grpc.aio.insecure_channel(server.address) as channel:
                    check = health_pb2_grpc.HealthStub(channel).Check
                    for service in ["", *server.service_names]:
                        reply = await check(health_pb2.HealthCheckRequest(service=service))
                        statuses[(name, service)] = reply.status
                    stream = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
                        iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
                    async for reply in stream:
                        listed[name] = {s.name for s in reply.list_services_response.service}
            return statuses, listed

    return run(scenario())


def test_health_reports_every_service_serving(health_and_reflection):
    statuses, _ = health_and_reflection
    assert set(statuses.values()) == {1}  # SERVING


@pytest.mark.parametrize(("server", "service"), [("coordinator", "specdec.v1.Coordinator"),
                                                 ("target", "specdec.v1.TargetWorker"),
                                                 ("draft", "specdec.v1.DraftWorker")])
def test_reflection_lists_the_servers_specdec_service(health_and_reflection, server, service):
    _, listed = health_and_reflection
    assert service in listed[server]


def test_reflection_lists_the_health_service_on_every_server(health_and_reflection):
    _, listed = health_and_reflection
    assert all("grpc.health.v1.Health" in names for names in listed.values())


@pytest.fixture(scope="module")
def graceful_stop(target, other_draft, tokenizer):
    """(the coordinator's health status while stopping, the in-flight request's result)"""
    async def scenario():
        async with running_stack(target, tokenizer, draft=other_draft) as stack:
            gate = Gate(stack.target_servicer.verifier.verify_batch, at_call=3)
            stack.target_servicer.verifier.verify_batch = gate
            async with Client(stack.address) as client:
                task = asyncio.create_task(client.complete(make_request(PROMPTS[0], max_new_tokens=MAX_NEW)))
                assert await asyncio.to_thread(gate.entered.wait, 30)
                stopping = asyncio.create_task(stack.coordinator.stop(grace=30))
                await asyncio.sleep(0.2)
                status = stack.coordinator.health._server_status[""]
                gate.release.set()
                result = await task
                await stopping
                return status, result

    return run(scenario())


def test_graceful_stop_reports_not_serving(graceful_stop):
    from grpc_health.v1 import health_pb2

    status, _ = graceful_stop
    assert status == health_pb2.HealthCheckResponse.NOT_SERVING


def test_graceful_stop_finishes_the_in_flight_request(graceful_stop, target, tokenizer):
    _, result = graceful_stop
    assert result.token_ids == reference_greedy(target, chat_ids(tokenizer, PROMPTS[0]), MAX_NEW)


def test_invalid_utf8_in_a_string_field_is_invalid_argument(target, tokenizer):
    from specdec.v1 import coordinator_pb2

    good = coordinator_pb2.GenerateRequest(text="hi", max_new_tokens=4, stop=["XY"]).SerializeToString()
    bad = good.replace(b"XY", b"\xff\xfe")  # same length: the framing stays valid

    async def scenario():
        async with running_stack(target, tokenizer, draft=NGRAM) as stack:
            async with grpc.aio.insecure_channel(stack.address) as channel:
                call = channel.unary_stream("/specdec.v1.Coordinator/Generate", request_serializer=lambda b: b,
                                            response_deserializer=coordinator_pb2.GenerateResponse.FromString)
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    async for _ in call(bad):
                        pass
                return caught.value

    error = run(scenario())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "UTF-8" in error.details()


def test_chat_template_refusal_is_invalid_argument(target, tokenizer):
    strict = make_tiny_tokenizer()
    strict.chat_template = ("{% if messages|length > 1 %}{{ raise_exception('roles must alternate') }}{% endif %}"
                            + strict.chat_template)
    from specdec.v1 import coordinator_pb2

    async def scenario():
        async with running_stack(target, strict, draft=NGRAM) as stack:
            async with Client(stack.address) as client:
                request = coordinator_pb2.GenerateRequest(max_new_tokens=4)
                request.chat.messages.add(role="user", content="a")
                request.chat.messages.add(role="user", content="b")
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await client.complete(request)
                return caught.value

    error = run(scenario())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "roles must alternate" in error.details()


def test_sliding_window_target_survives_rejected_drafts_past_its_window(tokenizer):
    """Gemma 3 keeps only a window of states in some layers; a rejected draft must still be
    rolled back there once the context is longer than the window."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    config = Gemma3TextConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=4, max_position_embeddings=256,
        layer_types=["sliding_attention", "full_attention"], bos_token_id=1, eos_token_id=2, pad_token_id=0)
    gemma = Gemma3ForCausalLM(config).eval()

    async def scenario():
        async with running_stack(gemma, tokenizer, draft=NGRAM) as stack:
            async with Client(stack.address) as client:
                return await client.complete(make_request(PROMPTS[0], max_new_tokens=30, k=3))

    result = run(scenario())
    assert result.stats["proposed"] > result.stats["accepted"], "the test needs rejected drafts"
    assert result.token_ids == reference_greedy(gemma, chat_ids(tokenizer, PROMPTS[0]), 30)


def test_a_worker_fault_restarts_the_session_instead_of_failing_the_request(target, tokenizer):
    async def scenario():
        async with running_stack(target, tokenizer, draft=NGRAM) as stack:
            verify = stack.target_servicer.verifier.verify_batch
            calls = [0]

            def faulty(*args):
                calls[0] += 1
                if calls[0] == 3:
                    raise RuntimeError("simulated replica fault (e.g. out of memory)")
                return verify(*args)

            stack.target_servicer.verifier.verify_batch = faulty
            async with Client(stack.address) as client:
                return await client.complete(make_request(PROMPTS[0], max_new_tokens=MAX_NEW))

    result = run(scenario())
    assert result.token_ids == reference_greedy(target, chat_ids(tokenizer, PROMPTS[0]), MAX_NEW)
