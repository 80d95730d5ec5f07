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
from specdec.errors import FailedPrecondition, Unavailable
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


# --- workers behind a Service name: dialed by IP, certificates naming the Service -----------

SERVICE_NAMES = {"target": "target-worker.specdec.svc", "draft": "draft-worker.specdec.svc"}


def service_certificate(certs, out, name: str) -> ServerTLS:
    """A worker certificate from the test CA naming only `name` (no IP address, no
    localhost), as issued for a Kubernetes Service; the worker demands client certificates."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    ca = x509.load_pem_x509_certificate((certs / "ca.pem").read_bytes())
    ca_key = serialization.load_pem_private_key((certs / "ca.key").read_bytes(), password=None)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(ca.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    cert_path, key_path = out / f"{name}.pem", out / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return ServerTLS(cert_path, key_path, certs / "ca.pem")


@pytest.fixture(scope="module")
def service_named_outcomes(certs, target, tokenizer, tmp_path_factory):
    """mTLS workers whose certificates name only their Service, dialed at 127.0.0.1: the
    coordinator's start without a server-name override, and a request with one per kind."""
    out = tmp_path_factory.mktemp("service-certs")

    def worker(model: str, kind: str) -> WorkerConfig:
        return WorkerConfig(model=model, server=ServerConfig(host="127.0.0.1", port=0,
                                                             tls=service_certificate(certs, out, SERVICE_NAMES[kind])))

    def coordinator_config(target_port: int, draft_port: int, **names) -> CoordinatorConfig:
        return CoordinatorConfig(
            target_addr=f"127.0.0.1:{target_port}", draft_addr=f"127.0.0.1:{draft_port}", tokenizer="in memory",
            server=ServerConfig(host="127.0.0.1", port=0),
            worker_tls=ClientTLS(certs / "ca.pem", certs / "client.pem", certs / "client.key"), **names)

    async def scenario():
        target_config = worker("tiny-target", "target")
        target_server = await target_service.serve(
            target_config, target_service.build_servicer(target_config, target, tokenizer))
        draft_config = worker("ngram", "draft")
        draft_server = await draft_service.serve(draft_config, draft_service.build_servicer(draft_config))
        try:
            try:
                servicer = await coordinator_service.connect(
                    coordinator_config(target_server.port, draft_server.port), tokenizer=tokenizer,
                    startup_timeout_s=3)
            except Exception as exc:  # noqa: BLE001 - the outcome under test
                refused = exc
            else:
                await stop_all([], servicer)
                refused = None
            config = coordinator_config(target_server.port, draft_server.port,
                                        target_tls_server_name=SERVICE_NAMES["target"],
                                        draft_tls_server_name=SERVICE_NAMES["draft"])
            servicer = await coordinator_service.connect(config, tokenizer=tokenizer, startup_timeout_s=10)
            coordinator = await coordinator_service.serve(config, servicer)
            try:
                async with Client(coordinator.address) as client:
                    result = await client.complete(make_request(PROMPTS[1], max_new_tokens=MAX_NEW))
            finally:
                await stop_all([coordinator], servicer)
            return refused, result
        finally:
            for server in (draft_server, target_server):
                await server.stop(grace=0)

    return run(scenario())


def test_a_worker_certificate_naming_only_its_service_is_refused_at_its_ip(service_named_outcomes):
    refused, _ = service_named_outcomes
    assert isinstance(refused, Unavailable), refused
    message = str(refused)
    assert "certificate does not name 127.0.0.1" in message and "--target-tls-server-name" in message, message


def test_the_server_name_override_reaches_service_named_workers_by_ip(service_named_outcomes, target, tokenizer):
    _, result = service_named_outcomes
    assert result.token_ids == reference_greedy(target, chat_ids(tokenizer, PROMPTS[1]), MAX_NEW)
    assert result.stats["proposed"] > 0  # the draft worker was reached by its own name too


def test_a_server_name_without_worker_tls_is_refused():
    config = CoordinatorConfig(target_addr="127.0.0.1:1", draft_addr=None, tokenizer="x",
                               target_tls_server_name=SERVICE_NAMES["target"])
    with pytest.raises(FailedPrecondition, match="--worker-ca"):
        config.worker_channel_tls("target")


@pytest.mark.parametrize("argv, env, expected", [
    (["--worker-tls-server-name", "workers.specdec.svc"], {}, ("workers.specdec.svc", "workers.specdec.svc")),
    (["--worker-tls-server-name", "workers.specdec.svc", "--draft-tls-server-name", "d.specdec.svc"], {},
     ("workers.specdec.svc", "d.specdec.svc")),
    ([], {"SPECDEC_TARGET_TLS_SERVER_NAME": "t.specdec.svc", "SPECDEC_WORKER_TLS_SERVER_NAME": "w.specdec.svc"},
     ("t.specdec.svc", "w.specdec.svc")),
    ([], {}, (None, None)),
])
def test_serve_coordinator_reads_the_worker_server_names(argv, env, expected, monkeypatch):
    from specdec.cli import build_parser
    from specdec.cli.serve import coordinator_config

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    args = build_parser().parse_args(["serve", "coordinator", "--worker-ca", "ca.pem", *argv])
    config = coordinator_config(args)
    assert (config.target_tls_server_name, config.draft_tls_server_name) == expected
    assert config.worker_channel_tls("target").server_name == expected[0]


# --- the plaintext health port, for probes that cannot speak TLS ----------------------------


@pytest.fixture(scope="module")
def health_port_outcomes(certs, target, tokenizer):
    """An mTLS target worker with a health port, probed in plaintext as the kubelet does."""
    async def check(port: int, method: str = "Check"):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            try:
                if method == "GetInfo":
                    await target_pb2_grpc.TargetWorkerStub(channel).GetInfo(common_pb2.WorkerInfoRequest(), timeout=5)
                    return "answered"
                reply = await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service="specdec.v1.TargetWorker"), timeout=5)
                return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            except grpc.aio.AioRpcError as exc:
                return exc.code().name

    async def scenario():
        config = WorkerConfig(model="tiny", server=ServerConfig(host="127.0.0.1", port=0, health_port=0,
                                                                tls=server_tls(certs, True)))
        server = await target_service.serve(config, target_service.build_servicer(config, target, tokenizer))
        outcomes = {}
        try:
            outcomes["serving"] = await check(server.health_port)
            outcomes["other methods"] = await check(server.health_port, "GetInfo")
            outcomes["main port in plaintext"] = await check(server.port)
            await server.health.enter_graceful_shutdown()  # what stop() does first
            outcomes["draining"] = await check(server.health_port)
        finally:
            await server.stop(grace=0)
        outcomes["stopped"] = await check(server.health_port)
        return outcomes

    return run(scenario())


@pytest.mark.parametrize("case, expected", [
    ("serving", "SERVING"),
    ("other methods", "UNIMPLEMENTED"),
    ("main port in plaintext", "UNAVAILABLE"),
    ("draining", "NOT_SERVING"),
    ("stopped", "UNAVAILABLE"),
])
def test_the_health_port_answers_health_alone_in_plaintext(health_port_outcomes, case, expected):
    assert health_port_outcomes[case] == expected


def test_serve_reads_the_health_port(monkeypatch):
    from specdec.cli import build_parser
    from specdec.cli.flags import server_config

    parse = build_parser().parse_args
    assert server_config(parse(["serve", "target", "--health-port", "8081"])).health_port == 8081
    assert server_config(parse(["serve", "target"])).health_port is None
    monkeypatch.setenv("SPECDEC_HEALTH_PORT", "8082")  # read when the parser is built
    assert server_config(build_parser().parse_args(["serve", "coordinator"])).health_port == 8082


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
