"""The OpenAI-compatible HTTP API, driven by the official `openai` SDK (sync and async,
streamed and not) against real services on loopback: the same tokens as gRPC, OpenAI's
error shapes with the statuses clients expect, and a disconnect that frees the workers."""

from __future__ import annotations

import asyncio
import json

import grpc
import httpx
import openai
import pytest

from specdec.client import Client, make_request
from tests.harness import reference_greedy, run, running_stack
from tests.test_services import PROMPTS, Gate, chat_ids, target, tokenizer  # noqa: F401 (fixtures)

MAX_NEW = 24
TOKEN = "alpha"
OTHER_TOKEN = "beta"
MODEL = "tiny-target"
SAMPLING = dict(temperature=0.8, top_p=0.9, seed=1234)


@pytest.fixture(scope="module")
def stack(target, tokenizer):
    """One stack for the module: the target drafting for itself (so every round speculates),
    the HTTP API on a free port, two tokens, one stream per client at a time."""
    manager = running_stack(target, tokenizer, draft=target, http_port=0, auth_tokens_env=f"{TOKEN},{OTHER_TOKEN}",
                            max_streams_per_client=1)
    running = run(manager.__aenter__())
    yield running
    run(manager.__aexit__(None, None, None))


def base_url(stack) -> str:
    return stack.coordinator.companions[0].url + "/v1"


def sync_client(stack, token: str = TOKEN) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url(stack), api_key=token, max_retries=0, timeout=60)


def async_client(stack, token: str = TOKEN) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url(stack), api_key=token, max_retries=0, timeout=60)


def grpc_complete(stack, request):
    async def call():
        async with Client(stack.address, token=TOKEN) as client:
            return await client.complete(request)

    return run(call())


def in_thread(fn, *args):
    """A blocking SDK call while the services' event loop runs."""
    return run(asyncio.to_thread(fn, *args))


def whole_reply(reply):
    """(text, token ids, finish_reason, usage) of a non-streamed chat completion."""
    choice = reply.choices[0]
    return choice.message.content, choice.model_extra["token_ids"], choice.finish_reason, reply.usage


class Streamed:
    """The same four, gathered from streamed chunks."""

    def __init__(self):
        self.text, self.ids, self.finish, self.usage = "", [], None, None

    def add(self, chunk) -> None:
        if chunk.usage is not None:
            self.usage = chunk.usage
        for choice in chunk.choices:
            self.text += choice.delta.content or ""
            self.ids += choice.model_extra.get("token_ids") or []
            self.finish = choice.finish_reason or self.finish

    def result(self):
        return self.text, self.ids, self.finish, self.usage


def chat_args(prompt: str, stream: bool, params: dict) -> dict:
    extra = dict(stream=True, stream_options={"include_usage": True}) if stream else {}
    return dict(model=MODEL, messages=[{"role": "user", "content": prompt}], extra_body={"return_token_ids": True},
                **extra, **params)


def chat_sync(stack, prompt: str, stream: bool, **params):
    """(text, token ids, finish_reason, usage) of a chat completion, sync SDK."""
    def call():
        reply = sync_client(stack).chat.completions.create(**chat_args(prompt, stream, params))
        if not stream:
            return whole_reply(reply)
        gathered = Streamed()
        for chunk in reply:
            gathered.add(chunk)
        return gathered.result()

    return in_thread(call)


def chat_async(stack, prompt: str, stream: bool, **params):
    """The same through the async SDK."""
    async def call():
        async with async_client(stack) as client:
            reply = await client.chat.completions.create(**chat_args(prompt, stream, params))
            if not stream:
                return whole_reply(reply)
            gathered = Streamed()
            async for chunk in reply:
                gathered.add(chunk)
            return gathered.result()

    return run(call())


MODES = {"sync": chat_sync, "async": chat_async}


@pytest.fixture(scope="module")
def greedy_grpc(stack, target, tokenizer):
    """{prompt: gRPC Completion}, each checked against the target alone."""
    results = {}
    for prompt in PROMPTS:
        result = grpc_complete(stack, make_request(prompt, max_new_tokens=MAX_NEW))
        assert result.token_ids == reference_greedy(target, chat_ids(tokenizer, prompt), MAX_NEW)
        results[prompt] = result
    return results


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("mode", sorted(MODES))
def test_greedy_chat_over_http_equals_grpc_token_for_token(stack, greedy_grpc, mode, stream):
    for prompt in PROMPTS:
        text, ids, _, _ = MODES[mode](stack, prompt, stream, temperature=0, max_tokens=MAX_NEW)
        assert ids == greedy_grpc[prompt].token_ids, prompt
        assert text == greedy_grpc[prompt].text, prompt


@pytest.mark.parametrize("mode", sorted(MODES))
def test_streamed_deltas_concatenate_to_the_whole_text(stack, mode):
    for prompt in PROMPTS:
        whole = MODES[mode](stack, prompt, False, temperature=0, max_tokens=MAX_NEW)
        streamed = MODES[mode](stack, prompt, True, temperature=0, max_tokens=MAX_NEW)
        assert streamed[0] == whole[0] and streamed[1] == whole[1], prompt


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_seeded_sampling_equals_grpc(stack, stream):
    for prompt in PROMPTS[:2]:
        expected = grpc_complete(stack, make_request(prompt, max_new_tokens=MAX_NEW, **SAMPLING))
        text, ids, _, _ = chat_async(stack, prompt, stream, max_tokens=MAX_NEW, **SAMPLING)
        assert ids == expected.token_ids and text == expected.text, prompt


def test_unset_temperature_samples_as_openai_does(stack):
    """OpenAI's default temperature is 1: a request that sets none samples (seeded here)."""
    prompt = PROMPTS[0]
    expected = grpc_complete(stack, make_request(prompt, max_new_tokens=MAX_NEW, temperature=1.0, seed=5))
    _, ids, _, _ = chat_async(stack, prompt, False, max_tokens=MAX_NEW, seed=5)
    assert ids == expected.token_ids


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_usage_counts_prompt_and_completion_tokens(stack, tokenizer, stream):
    prompt = PROMPTS[1]
    _, ids, finish, usage = chat_sync(stack, prompt, stream, temperature=0, max_tokens=MAX_NEW)
    assert usage.prompt_tokens == len(chat_ids(tokenizer, prompt))
    assert usage.completion_tokens == len(ids) == MAX_NEW
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert finish == "length"


def test_stop_string_ends_the_text_with_finish_reason_stop(stack, greedy_grpc):
    prompt = PROMPTS[0]
    whole = greedy_grpc[prompt].text
    stop = whole[len(whole) // 2:len(whole) // 2 + 2]
    text, _, finish, _ = chat_sync(stack, prompt, True, temperature=0, max_tokens=MAX_NEW, stop=[stop])
    assert finish == "stop"
    assert text == whole[:whole.index(stop)]


def test_completions_take_text_and_token_ids(stack, tokenizer):
    prompt = "The quick brown fox"
    ids = list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    by_text = grpc_complete(stack, make_request(prompt, raw=True, max_new_tokens=MAX_NEW))

    async def call():
        client = async_client(stack)
        texts = []
        for given in (prompt, ids, [ids]):
            reply = await client.completions.create(model=MODEL, prompt=given, max_tokens=MAX_NEW, temperature=0,
                                                    extra_body={"return_token_ids": True})
            texts.append((reply.choices[0].text, reply.choices[0].model_extra["token_ids"], reply.object))
        streamed = ""
        async for chunk in await client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_NEW,
                                                           temperature=0, stream=True):
            streamed += chunk.choices[0].text if chunk.choices else ""
        await client.close()
        return texts, streamed

    texts, streamed = run(call())
    for text, token_ids, kind in texts:
        assert (text, token_ids, kind) == (by_text.text, by_text.token_ids, "text_completion")
    assert streamed == by_text.text


def test_completions_default_to_sixteen_tokens(stack):
    reply = in_thread(lambda: sync_client(stack).completions.create(model=MODEL, prompt="Once upon", temperature=0))
    assert reply.usage.completion_tokens == 16 or reply.choices[0].finish_reason == "stop"


def test_the_specdec_extension_reports_speculation(stack):
    reply = in_thread(lambda: sync_client(stack).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPTS[1]}], temperature=0, max_tokens=MAX_NEW))
    stats = reply.model_extra["specdec"]
    assert stats["rounds"] >= 1 and stats["proposed"] > 0
    assert stats["generated_tokens"] == reply.usage.completion_tokens
    assert {"acceptance_rate", "tokens_per_round", "resyncs"} <= set(stats)


def test_models_lists_the_target_and_its_context(stack, target):
    listed = in_thread(lambda: sync_client(stack).models.list())
    assert [m.id for m in listed.data] == [MODEL]
    assert listed.data[0].model_extra["max_model_len"] == target.config.max_position_embeddings


def test_health_answers_without_a_token(stack):
    reply = run(httpx.AsyncClient().get(stack.coordinator.companions[0].url + "/health"))
    assert reply.status_code == 200 and reply.json() == {"status": "ok"}


def test_metrics_carry_the_vllm_speculative_names(stack):
    url = stack.coordinator.companions[0].url + "/metrics"

    def value(text: str, name: str) -> float:
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name + "{") and f'model_name="{MODEL}"' in line)

    async def scenario():
        async with httpx.AsyncClient() as http:
            before = (await http.get(url)).text
            result = await Client(stack.address, token=TOKEN).complete(make_request(PROMPTS[2],
                                                                                     max_new_tokens=MAX_NEW))
            after = (await http.get(url)).text
        return before, result, after

    before, result, after = run(scenario())
    names = {"vllm:spec_decode_num_draft_tokens_total": result.stats["proposed"],
             "vllm:spec_decode_num_accepted_tokens_total": result.stats["accepted"],
             "vllm:generation_tokens_total": len(result.token_ids)}
    for name, expected in names.items():
        assert value(after, name) - value(before, name) == expected, name
    drafts = value(after, "vllm:spec_decode_num_drafts_total") - value(before, "vllm:spec_decode_num_drafts_total")
    assert 0 < drafts <= result.stats["rounds"]
    per_pos = (value(after, "vllm:spec_decode_num_accepted_tokens_per_pos_total")
               - value(before, "vllm:spec_decode_num_accepted_tokens_per_pos_total"))
    assert per_pos == result.stats["accepted"]


# --- errors ---------------------------------------------------------------------------

def chat_body(**fields) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}


REFUSED = {
    "n": chat_body(n=2),
    "tools": chat_body(tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}]),
    "logprobs": chat_body(logprobs=True),
    "response_format": chat_body(response_format={"type": "json_object"}),
    "presence_penalty": chat_body(presence_penalty=0.5),
    "max_tokens": chat_body(max_tokens=0),
    "temperature": chat_body(temperature=-1),
    "messages": chat_body(messages=[{"role": "tool", "content": "x", "tool_call_id": "1"}]),
    "image": chat_body(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
    "stop": chat_body(stop=[""]),
    "stream_options": chat_body(stream_options={"include_usage": True}),
    "unknown": chat_body(guided_json={}),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_unsupported_or_bad_fields_get_400_naming_them(stack, name):
    reply = run(httpx.AsyncClient().post(base_url(stack) + "/chat/completions", json=REFUSED[name],
                                         headers={"authorization": f"Bearer {TOKEN}"}))
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    key = {"image": "messages", "unknown": "guided_json"}.get(name, name)
    assert key in error["message"], error


def test_the_sdk_raises_bad_request_for_a_batch_prompt(stack):
    with pytest.raises(openai.BadRequestError, match="one prompt per request"):
        in_thread(lambda: sync_client(stack).completions.create(model=MODEL, prompt=["a", "b"], max_tokens=2))


def test_invalid_json_gets_400(stack):
    reply = run(httpx.AsyncClient().post(base_url(stack) + "/chat/completions", content=b"{not json",
                                         headers={"authorization": f"Bearer {TOKEN}",
                                                  "content-type": "application/json"}))
    assert reply.status_code == 400 and "JSON" in reply.json()["error"]["message"]


def test_a_prompt_beyond_the_context_gets_400_context_length_exceeded(stack, target):
    long = list(range(5, 5 + target.config.max_position_embeddings))
    with pytest.raises(openai.BadRequestError) as caught:
        in_thread(lambda: sync_client(stack).completions.create(model=MODEL, prompt=long, max_tokens=2))
    assert caught.value.code == "context_length_exceeded"


@pytest.mark.parametrize("token", [None, "wrong"], ids=["missing", "wrong"])
def test_missing_or_wrong_token_gets_401(stack, token):
    headers = {} if token is None else {"authorization": f"Bearer {token}"}
    reply = run(httpx.AsyncClient().post(base_url(stack) + "/chat/completions", json=chat_body(), headers=headers))
    assert reply.status_code == 401
    assert reply.json()["error"]["code"] == "invalid_api_key"


def test_the_sdk_raises_authentication_error_for_a_wrong_key(stack):
    with pytest.raises(openai.AuthenticationError):
        in_thread(lambda: sync_client(stack, "wrong").models.list())


def test_unknown_model_gets_404(stack):
    with pytest.raises(openai.NotFoundError) as caught:
        in_thread(lambda: sync_client(stack).chat.completions.create(
            model="gpt-4o", messages=[{"role": "user", "content": "hi"}], max_tokens=2))
    assert caught.value.code == "model_not_found"


def test_unknown_route_gets_404_in_openai_shape(stack):
    reply = run(httpx.AsyncClient().get(base_url(stack) + "/embeddings"))
    assert reply.status_code == 404 and reply.json()["error"]["code"] == "not_found"


def test_a_body_over_the_limit_gets_413(stack):
    big = "x" * (stack.coordinator.config.max_message_bytes + 1)
    reply = run(httpx.AsyncClient().post(base_url(stack) + "/completions", json={"model": MODEL, "prompt": big},
                                         headers={"authorization": f"Bearer {TOKEN}"}))
    assert reply.status_code == 413


def test_streams_beyond_the_per_client_limit_get_429_with_retry_after(stack, target, tokenizer):
    async def scenario():
        gate = Gate(stack.target_servicer.verifier.verify_batch, at_call=2)
        stack.target_servicer.verifier.verify_batch = gate
        client = async_client(stack, OTHER_TOKEN)
        try:
            first = asyncio.create_task(client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": PROMPTS[0]}], temperature=0, max_tokens=MAX_NEW,
                extra_body={"return_token_ids": True}))
            assert await asyncio.to_thread(gate.entered.wait, 30)
            async with httpx.AsyncClient(timeout=60) as http:
                refused = await http.post(base_url(stack) + "/chat/completions", json=chat_body(),
                                          headers={"authorization": f"Bearer {OTHER_TOKEN}"})
                other_client = asyncio.create_task(http.post(base_url(stack) + "/chat/completions",
                                                             json=chat_body(temperature=0),
                                                             headers={"authorization": f"Bearer {TOKEN}"}))
                await asyncio.sleep(0.2)
                gate.release.set()
                other_client = await other_client
        finally:
            gate.release.set()
            stack.target_servicer.verifier.verify_batch = gate.fn
        return refused, other_client, await first

    refused, other_client, first = run(scenario())
    assert refused.status_code == 429
    assert refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert other_client.status_code == 200  # the limit is per client
    # Nothing already accepted is lost.
    assert first.choices[0].model_extra["token_ids"] == reference_greedy(target, chat_ids(tokenizer, PROMPTS[0]),
                                                                         MAX_NEW)


def test_past_its_deadline_a_request_gets_504(stack):
    async def scenario():
        await stack.coordinator_servicer.runner.drain()
        gate = Gate(stack.target_servicer.verifier.verify_batch, at_call=1)  # the request's first step waits
        stack.target_servicer.verifier.verify_batch = gate
        try:
            async with httpx.AsyncClient() as http:
                return await http.post(base_url(stack) + "/chat/completions", json=chat_body(max_tokens=MAX_NEW),
                                       headers={"authorization": f"Bearer {TOKEN}", "x-request-timeout": "0.5"})
        finally:
            gate.release.set()
            stack.target_servicer.verifier.verify_batch = gate.fn

    reply = run(scenario())
    assert reply.status_code == 504, reply.text
    assert reply.json()["error"]["code"] == "deadline_exceeded"


def test_a_disconnect_mid_stream_frees_the_worker_sessions(stack):
    async def scenario():
        await stack.coordinator_servicer.runner.drain()
        gate = Gate(stack.target_servicer.verifier.verify_batch, at_call=3)
        stack.target_servicer.verifier.verify_batch = gate
        client = async_client(stack)
        try:
            stream = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": PROMPTS[0]}], temperature=0, max_tokens=MAX_NEW,
                stream=True)
            chunks = [await anext(stream)]
            assert await asyncio.to_thread(gate.entered.wait, 30)
            held = (len(stack.target_servicer.store), len(stack.draft_servicer.store),
                    stack.coordinator_servicer.active)
            await stream.close()
        finally:
            gate.release.set()
            stack.target_servicer.verifier.verify_batch = gate.fn
        for _ in range(100):
            await asyncio.sleep(0.05)
            await stack.coordinator_servicer.runner.drain()
            after = (len(stack.target_servicer.store), len(stack.draft_servicer.store),
                     stack.coordinator_servicer.active)
            if after == (0, 0, 0):
                break
        await client.close()
        return chunks, held, after

    chunks, held, after = run(scenario())
    assert chunks[0].choices[0].delta.role == "assistant"
    assert held == (1, 1, 1)
    assert after == (0, 0, 0)


def test_a_disconnect_before_a_whole_answer_frees_the_worker_sessions(stack):
    """Not streamed: the client gives up (its timeout) while the request runs; the server
    notices the closed connection and cancels the request."""
    from specdec import metrics

    cancelled = metrics.REQUESTS.labels("CANCELLED")

    async def scenario():
        await stack.coordinator_servicer.runner.drain()
        before = cancelled._value.get()
        gate = Gate(stack.target_servicer.verifier.verify_batch, at_call=3)
        stack.target_servicer.verifier.verify_batch = gate
        try:
            async with httpx.AsyncClient() as http:
                request = asyncio.create_task(http.post(
                    base_url(stack) + "/chat/completions", json=chat_body(max_tokens=MAX_NEW, temperature=0),
                    headers={"authorization": f"Bearer {TOKEN}"}))
                assert await asyncio.to_thread(gate.entered.wait, 30)
                held = (len(stack.target_servicer.store), stack.coordinator_servicer.active)
                request.cancel()  # closes the connection
                await asyncio.gather(request, return_exceptions=True)
        finally:
            gate.release.set()
            stack.target_servicer.verifier.verify_batch = gate.fn
        for _ in range(100):
            await asyncio.sleep(0.05)
            await stack.coordinator_servicer.runner.drain()
            after = (len(stack.target_servicer.store), stack.coordinator_servicer.active)
            if after == (0, 0):
                break
        return held, after, cancelled._value.get() - before

    held, after, newly_cancelled = run(scenario())
    assert held == (1, 1)
    assert after == (0, 0)
    assert newly_cancelled == 1  # cancelled, not run to its end


def test_with_no_target_serving_a_request_gets_503(target, tokenizer):
    async def scenario():
        async with running_stack(target, tokenizer, draft="ngram", http_port=0, worker_retries=1,
                                 health_interval_s=0.1) as stack:
            await stack.target.stop(grace=0)
            async with httpx.AsyncClient() as http:
                for _ in range(50):
                    health = await http.get(stack.coordinator.companions[0].url + "/health")
                    if health.status_code == 503:
                        break
                    await asyncio.sleep(0.1)
                reply = await http.post(base_url(stack) + "/chat/completions", json=chat_body())
            return health, reply

    health, reply = run(scenario())
    assert health.status_code == 503
    assert reply.status_code == 503, reply.text
    assert reply.json()["error"]["type"] == "service_unavailable"


def test_an_error_after_the_stream_started_arrives_as_an_event(target, tokenizer):
    """Once the 200 and the first tokens are out, a failure travels as an SSE event with
    OpenAI's error object, which the SDK raises."""
    async def scenario():
        async with running_stack(target, tokenizer, draft="ngram", http_port=0, worker_retries=1) as stack:
            gate = Gate(stack.target_servicer.verifier.verify_batch, at_call=3)
            stack.target_servicer.verifier.verify_batch = gate
            client = async_client(stack)
            stream = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": PROMPTS[0]}], temperature=0, max_tokens=MAX_NEW,
                stream=True)
            assert await asyncio.to_thread(gate.entered.wait, 30)
            stopping = asyncio.create_task(stack.target.stop(grace=0))
            gate.release.set()
            await stopping
            with pytest.raises(openai.APIError) as caught:
                async for _ in stream:
                    pass
            await client.close()
            return caught.value

    error = run(scenario())
    assert "target" in str(error.message).lower() or "unavailable" in str(error.message).lower()


def test_a_busy_http_port_fails_the_start_naming_the_flag(stack):
    import subprocess
    import sys

    busy = stack.coordinator.companions[0].port
    result = subprocess.run([sys.executable, "-m", "specdec", "serve", "coordinator", "--port", "0",
                             "--http-port", str(busy), "--target-addr", "127.0.0.1:1"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "--http-port" in result.stderr + result.stdout
    assert "Traceback" not in result.stderr


def test_grpc_and_http_share_one_admission(stack):
    """The per-client stream limit counts a client's streams over both APIs."""
    async def scenario():
        gate = Gate(stack.target_servicer.verifier.verify_batch, at_call=2)
        stack.target_servicer.verifier.verify_batch = gate
        try:
            async with Client(stack.address, token=OTHER_TOKEN) as client:
                held = asyncio.create_task(client.complete(make_request(PROMPTS[0], max_new_tokens=MAX_NEW)))
                assert await asyncio.to_thread(gate.entered.wait, 30)
                async with httpx.AsyncClient() as http:
                    refused = await http.post(base_url(stack) + "/chat/completions", json=chat_body(),
                                              headers={"authorization": f"Bearer {OTHER_TOKEN}"})
                gate.release.set()
                await held
        finally:
            gate.release.set()
            stack.target_servicer.verifier.verify_batch = gate.fn
        return refused

    assert run(scenario()).status_code == 429


def test_sse_ends_with_done(stack):
    async def scenario():
        async with httpx.AsyncClient() as http:
            async with http.stream("POST", base_url(stack) + "/chat/completions",
                                   json=chat_body(stream=True, temperature=0),
                                   headers={"authorization": f"Bearer {TOKEN}"}) as reply:
                return reply.status_code, reply.headers["content-type"], [line async for line in reply.aiter_lines()
                                                                           if line.startswith("data:")]

    status, content_type, lines = run(scenario())
    assert status == 200 and content_type.startswith("text/event-stream")
    assert lines[-1] == "data: [DONE]"
    final = json.loads(lines[-2][len("data: "):])
    assert final["choices"][0]["finish_reason"] in ("stop", "length") and "specdec" in final


def test_grpc_status_mapping_covers_the_client_visible_codes():
    from coordinator.openai_api.errors import STATUS

    assert {STATUS[c][0] for c in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAUTHENTICATED,
                                   grpc.StatusCode.NOT_FOUND, grpc.StatusCode.RESOURCE_EXHAUSTED,
                                   grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)} == \
        {400, 401, 404, 429, 503, 504}
