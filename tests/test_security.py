"""Transport security, authentication, limits and observability, with real certificates made
in the test and real servers on loopback."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import socket
import ssl
import subprocess
import sys
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from coordinator import service as coordinator_service
from draft_worker import service as draft_service
from specdec import logs
from specdec.client import Client, make_request
from specdec.config import CoordinatorConfig, ServerConfig, WorkerConfig
from specdec.errors import FailedPrecondition
from specdec.metrics import serve_metrics
from specdec.serving import start_server
from specdec.security.tls import ClientTLS, ServerTLS, make_dev_certs
from specdec.v1 import common_pb2, target_pb2_grpc
from target_worker import service as target_service
from tests.harness import reference_greedy, run, running_stack
from tests.test_services import PROMPTS, chat_ids, other_draft, target, tokenizer  # noqa: F401 (fixtures)

MAX_NEW = 16


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    out = tmp_path_factory.mktemp("certs")
    make_dev_certs(out, ["specdec.test"])
    return out


def server_tls(certs, mutual: bool) -> ServerTLS:
    return ServerTLS(certs / "server.pem", certs / "server.key", certs / "ca.pem" if mutual else None)


async def tls_stack(certs, target_model, tokenizer, token_file=None, **limits):
    """Workers demand client certificates (mTLS); the coordinator serves TLS."""
    def worker(name):
        return WorkerConfig(model=name, server=ServerConfig(host="127.0.0.1", port=0, tls=server_tls(certs, True)))

    target_config = worker("tiny-target")
    target = await target_service.serve(target_config,
                                        target_service.build_servicer(target_config, target_model, tokenizer))
    draft_config = worker("ngram")
    draft = await draft_service.serve(draft_config, draft_service.build_servicer(draft_config))
    config = CoordinatorConfig(
        target_addr=f"localhost:{target.port}", draft_addr=f"localhost:{draft.port}", tokenizer="in memory",
        server=ServerConfig(host="127.0.0.1", port=0, tls=server_tls(certs, False)),
        worker_tls=ClientTLS(certs / "ca.pem", certs / "client.pem", certs / "client.key"),
        auth_token_file=token_file, **limits)
    servicer = await coordinator_service.connect(config, tokenizer=tokenizer, startup_timeout_s=10)
    coordinator = await coordinator_service.serve(config, servicer)
    return coordinator, target, draft, servicer


async def stop_all(servers, servicer):
    await servicer.runner.drain()
    await servicer.runner.target.close()
    await servicer.runner.draft.close()
    for server in servers:
        await server.stop(grace=0)


@pytest.fixture(scope="module")
def tls_result(certs, target, tokenizer):
    """A request from a TLS client through a coordinator whose workers demand mTLS."""
    async def scenario():
        coordinator, target_server, draft, servicer = await tls_stack(certs, target, tokenizer)
        try:
            async with Client(f"localhost:{coordinator.port}", tls=ClientTLS(certs / "ca.pem")) as client:
                return await client.complete(make_request(PROMPTS[1], max_new_tokens=MAX_NEW))
        finally:
            await stop_all([coordinator, draft, target_server], servicer)

    return run(scenario())


def test_a_tls_client_gets_the_targets_output_through_mtls_workers(tls_result, target, tokenizer):
    assert tls_result.token_ids == reference_greedy(target, chat_ids(tokenizer, PROMPTS[1]), MAX_NEW)


def test_the_draft_worker_is_reached_over_mtls(tls_result):
    assert tls_result.stats["proposed"] > 0


@pytest.fixture(scope="module")
def https_replies(certs, target, tokenizer):
    """The HTTP API of a TLS coordinator: a chat completion over HTTPS verified against the
    CA, and the same request over plaintext HTTP."""
    import httpx

    async def scenario():
        coordinator, target_server, draft, servicer = await tls_stack(certs, target, tokenizer, http_port=0)
        port = coordinator.companions[0].port
        body = {"model": "tiny-target", "messages": [{"role": "user", "content": PROMPTS[1]}],
                "max_tokens": MAX_NEW, "temperature": 0, "return_token_ids": True}
        try:
            verify = ssl.create_default_context(cafile=str(certs / "ca.pem"))
            async with httpx.AsyncClient(verify=verify, timeout=60) as http:
                secure = await http.post(f"https://localhost:{port}/v1/chat/completions", json=body)
            async with httpx.AsyncClient(timeout=10) as http:
                try:
                    plain = await http.post(f"http://localhost:{port}/v1/chat/completions", json=body)
                except httpx.HTTPError as exc:
                    plain = exc
            return coordinator.companions[0].url, secure, plain
        finally:
            await stop_all([coordinator, draft, target_server], servicer)

    return run(scenario())


def test_the_http_api_serves_tls_with_the_coordinators_certificate(https_replies, target, tokenizer):
    url, secure, _ = https_replies
    assert url.startswith("https://")
    assert secure.status_code == 200, secure.text
    assert secure.json()["choices"][0]["token_ids"] == reference_greedy(target, chat_ids(tokenizer, PROMPTS[1]),
                                                                        MAX_NEW)


def test_the_tls_http_api_answers_no_plaintext(https_replies):
    _, _, plain = https_replies
    assert not (hasattr(plain, "status_code") and plain.status_code == 200)


@pytest.mark.parametrize("peer", ["no client certificate", "plaintext"])
def test_a_worker_refuses_a_peer_without_a_valid_client_certificate(peer, certs, target, tokenizer):
    async def scenario():
        config = WorkerConfig(model="tiny", server=ServerConfig(host="127.0.0.1", port=0, tls=server_tls(certs, True)))
        server = await target_service.serve(config, target_service.build_servicer(config, target, tokenizer))
        try:
            address = f"localhost:{server.port}"
            if peer == "plaintext":
                channel = grpc.aio.insecure_channel(address)
            else:
                channel = grpc.aio.secure_channel(address, ClientTLS(certs / "ca.pem").credentials())
            async with channel:
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await target_pb2_grpc.TargetWorkerStub(channel).GetInfo(common_pb2.WorkerInfoRequest(), timeout=5)
                return caught.value.code()
        finally:
            await server.stop(grace=0)

    assert run(scenario()) == grpc.StatusCode.UNAVAILABLE


async def start_plaintext_off_loopback(insecure: bool) -> None:
    server = await start_server(ServerConfig(host="0.0.0.0", port=0, insecure=insecure), lambda s: None, ["x"])
    await server.stop(grace=0)


def test_plaintext_off_loopback_needs_insecure():
    with pytest.raises(FailedPrecondition, match="--insecure"):
        run(start_plaintext_off_loopback(False))


def test_plaintext_off_loopback_is_logged(caplog):
    with caplog.at_level(logging.WARNING):
        run(start_plaintext_off_loopback(True))
    assert any("INSECURE" in r.getMessage() for r in caplog.records)


@pytest.fixture(scope="module")
def bearer_outcomes(certs, target, tokenizer, tmp_path_factory):
    """({attempt: status code}, health status) from one coordinator with a token file: requests
    with no, a wrong and a listed token; the file rotated in place; old and new tokens after;
    then a health check without a token."""
    token_file = tmp_path_factory.mktemp("bearer") / "tokens"
    token_file.write_text("# tokens\nalpha\nbeta\n")

    async def scenario():
        coordinator, target_server, draft, servicer = await tls_stack(certs, target, tokenizer, token_file)
        address, ca = f"localhost:{coordinator.port}", ClientTLS(certs / "ca.pem")
        codes = {}

        async def attempt(name, token):
            async with Client(address, tls=ca, token=token) as client:
                try:
                    await client.complete(make_request(PROMPTS[0], max_new_tokens=4))
                    codes[name] = grpc.StatusCode.OK
                except grpc.aio.AioRpcError as exc:
                    codes[name] = exc.code()

        try:
            for name, token in (("missing", None), ("wrong", "gamma"), ("right", "beta")):
                await attempt(name, token)
            token_file.write_text("gamma\n")  # rotate: no restart
            os.utime(token_file, ns=(1, 2))  # a distinct mtime even within one clock tick
            for name, token in (("old after rotation", "beta"), ("new after rotation", "gamma")):
                await attempt(name, token)
            async with grpc.aio.secure_channel(address, ca.credentials()) as channel:
                health = await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service="specdec.v1.Coordinator"), timeout=5)
            return codes, health.status
        finally:
            await stop_all([coordinator, draft, target_server], servicer)

    return run(scenario())


def test_a_request_without_a_bearer_token_is_unauthenticated(bearer_outcomes):
    codes, _ = bearer_outcomes
    assert codes["missing"] == grpc.StatusCode.UNAUTHENTICATED


def test_a_wrong_bearer_token_is_unauthenticated(bearer_outcomes):
    codes, _ = bearer_outcomes
    assert codes["wrong"] == grpc.StatusCode.UNAUTHENTICATED


def test_a_listed_bearer_token_is_accepted(bearer_outcomes):
    codes, _ = bearer_outcomes
    assert codes["right"] == grpc.StatusCode.OK


def test_a_token_rotated_out_of_the_file_is_unauthenticated_without_a_restart(bearer_outcomes):
    codes, _ = bearer_outcomes
    assert codes["old after rotation"] == grpc.StatusCode.UNAUTHENTICATED


def test_a_token_rotated_into_the_file_is_accepted_without_a_restart(bearer_outcomes):
    codes, _ = bearer_outcomes
    assert codes["new after rotation"] == grpc.StatusCode.OK


def test_health_is_served_without_a_bearer_token(bearer_outcomes):
    _, health = bearer_outcomes
    assert health == health_pb2.HealthCheckResponse.SERVING


def test_streams_beyond_the_per_client_limit_get_resource_exhausted(target, tokenizer):
    from tests.test_services import Gate

    async def scenario():
        async with running_stack(target, tokenizer, draft="ngram", max_streams_per_client=1) as stack:
            gate = Gate(stack.target_servicer.verifier.verify_batch, at_call=2)
            stack.target_servicer.verifier.verify_batch = gate
            async with Client(stack.address) as client:
                first = asyncio.create_task(client.complete(make_request(PROMPTS[0], max_new_tokens=MAX_NEW)))
                assert await asyncio.to_thread(gate.entered.wait, 30)
                call = client.stream(make_request(PROMPTS[1], max_new_tokens=4))
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    async for _ in call:
                        pass
                trailing = dict(await call.trailing_metadata() or ())
                gate.release.set()
                return caught.value, trailing, await first

    error, trailing, first = run(scenario())
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "retry" in error.details()
    assert trailing.get("retry-after-s") == "1"
    assert trailing.get("grpc-retry-pushback-ms") == "1000"
    assert first.token_ids == reference_greedy(target, chat_ids(tokenizer, PROMPTS[0]), MAX_NEW)


def test_without_authentication_a_new_token_does_not_dodge_the_per_client_limit(target, tokenizer):
    """Tokens nothing checks are not identities: two random tokens from one address are one
    client."""
    from tests.test_services import Gate

    async def scenario():
        async with running_stack(target, tokenizer, draft="ngram", max_streams_per_client=1) as stack:
            gate = Gate(stack.target_servicer.verifier.verify_batch, at_call=2)
            stack.target_servicer.verifier.verify_batch = gate
            async with Client(stack.address, token="random-1") as first_client, \
                    Client(stack.address, token="random-2") as second_client:
                first = asyncio.create_task(first_client.complete(make_request(PROMPTS[0], max_new_tokens=MAX_NEW)))
                assert await asyncio.to_thread(gate.entered.wait, 30)
                try:
                    with pytest.raises(grpc.aio.AioRpcError) as caught:
                        await second_client.complete(make_request(PROMPTS[1], max_new_tokens=4))
                finally:
                    gate.release.set()
                await first
                return caught.value

    assert run(scenario()).code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_evicted_sessions_are_rebuilt_not_lost(target, tokenizer):
    async def scenario():
        async with running_stack(target, tokenizer, draft="ngram") as stack:
            store = stack.target_servicer.store
            store.max_cache_bytes = store.bytes_per_token * 60  # room for about one session
            async with Client(stack.address) as client:
                results = await asyncio.gather(*(client.complete(make_request(p, max_new_tokens=24))
                                                 for p in PROMPTS))
            return results, store.evictions

    results, evictions = run(scenario())
    assert evictions > 0
    assert sum(r.stats["resyncs"] for r in results) > 0
    for prompt, result in zip(PROMPTS, results):
        assert result.token_ids == reference_greedy(target, chat_ids(tokenizer, prompt), 24)


def test_request_id_travels_from_client_to_both_workers(target, tokenizer, caplog):
    async def scenario():
        async with running_stack(target, tokenizer, draft=target) as stack:
            async with Client(stack.address) as client:
                with caplog.at_level(logging.DEBUG):
                    await client.complete(make_request(PROMPTS[0], max_new_tokens=6), request_id="trace-42")

    run(scenario())
    by_logger = {}
    for record in caplog.records:
        if getattr(record, "request_id", "") == "trace-42":
            by_logger.setdefault(record.name, []).append(record)
    assert {"coordinator.service", "target_worker.service", "draft_worker.service"} <= set(by_logger)
    line = logs.JsonFormatter("target").format(by_logger["target_worker.service"][0])
    assert '"request_id": "trace-42"' in line and line.startswith("{")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


METRICS_PORT = _free_port()


def _scrape() -> dict[str, float]:
    body = urllib.request.urlopen(f"http://127.0.0.1:{METRICS_PORT}/metrics", timeout=10).read().decode()
    values = {}
    for line in body.splitlines():
        match = re.match(r"^(specdec_[^ ]+) ([0-9.e+-]+)$", line)
        if match:
            values[match.group(1)] = float(match.group(2))
    return values


def test_metrics_scraped_from_the_endpoint_match_the_requests_made(target, tokenizer):
    serve_metrics(METRICS_PORT, "127.0.0.1")

    async def scenario():
        async with running_stack(target, tokenizer, draft=target) as stack:
            before = _scrape()
            async with Client(stack.address) as client:
                results = [await client.complete(make_request(p, max_new_tokens=MAX_NEW, k=3)) for p in PROMPTS]
                with pytest.raises(grpc.aio.AioRpcError):
                    await client.complete(make_request(PROMPTS[0], max_new_tokens=0))
            return before, _scrape(), results

    before, after, results = run(scenario())

    def delta(name):
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert delta("specdec_generated_tokens_total") == sum(len(r.token_ids) for r in results)
    assert delta("specdec_rounds_total") == sum(r.stats["rounds"] for r in results)
    assert delta("specdec_proposed_tokens_total") == sum(r.stats["proposed"] for r in results)
    assert delta("specdec_accepted_tokens_total") == sum(r.stats["accepted"] for r in results)
    assert delta('specdec_coordinator_requests_total{status="OK"}') == len(results)
    assert delta('specdec_coordinator_requests_total{status="INVALID_ARGUMENT"}') == 1
    positions = range(16)
    assert sum(delta(f'specdec_position_proposed_total{{position="{i}"}}') for i in positions) == sum(
        r.stats["proposed"] for r in results)
    assert sum(delta(f'specdec_position_accepted_total{{position="{i}"}}') for i in positions) == sum(
        r.stats["accepted"] for r in results)
    assert delta("specdec_accepted_length_count") == sum(r.stats["rounds"] for r in results)
    # Rounds reach the target in batched steps: every round is counted in some step.
    assert delta('specdec_worker_batch_rounds_sum{kind="target"}') >= sum(r.stats["rounds"] for r in results)
    assert 1 <= delta('specdec_worker_request_seconds_count{kind="target",method="VerifyBatch"}') <= sum(
        r.stats["rounds"] for r in results)
    assert after['specdec_worker_sessions{kind="target"}'] >= 0


@pytest.fixture(scope="module")
def cli_token_runs(tmp_path_factory, target, tokenizer) -> dict[str, subprocess.CompletedProcess]:
    """`specdec generate` against one `specdec up --auth-token-file`: with a wrong token, none,
    the right one by --token, and the right one by SPECDEC_TOKEN."""
    from tests.factories import save_model_dir
    from tests.test_cli import start_up

    root = tmp_path_factory.mktemp("cli-token")
    model_dir = save_model_dir(root / "model", target, tokenizer)
    token_file = root / "tokens"
    token_file.write_text("s3cret\n")
    port = _free_port()
    proc, _ = start_up("--port", str(port), "--target", str(model_dir), "--draft", "ngram",
                       "--auth-token-file", str(token_file))
    try:
        def generate(*extra, env=None):
            return subprocess.run([sys.executable, "-m", "specdec", "generate", "--addr", f"127.0.0.1:{port}",
                                   "--max-new-tokens", "4", "--json", *extra, "hi"], capture_output=True, text=True,
                                  timeout=120, env={**os.environ, **(env or {})})

        return {
            "wrong": generate("--token", "nope"),
            "missing": generate(),
            "flag": generate("--token", "s3cret"),
            "env": generate(env={"SPECDEC_TOKEN": "s3cret"}),
        }
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_cli_fails_with_a_message_on_a_wrong_token(cli_token_runs):
    wrong = cli_token_runs["wrong"]
    assert wrong.returncode != 0 and wrong.stderr.startswith("UNAUTHENTICATED: invalid bearer token")


def test_cli_fails_with_a_message_on_a_missing_token(cli_token_runs):
    missing = cli_token_runs["missing"]
    assert missing.returncode != 0 and missing.stderr.startswith("UNAUTHENTICATED: missing bearer token")


def test_cli_sends_the_token_flag(cli_token_runs):
    flag = cli_token_runs["flag"]
    assert flag.returncode == 0, flag.stderr


def test_cli_sends_the_token_from_the_environment(cli_token_runs):
    env = cli_token_runs["env"]
    assert env.returncode == 0, env.stderr
