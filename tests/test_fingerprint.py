"""Same model or refuse: every worker reports a fingerprint of the weights it serves
(specdec.models.weights_fingerprint), the coordinator pins the first target's and the first
draft's, and a replica serving other weights is never given a round."""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest
import torch
from prometheus_client import REGISTRY

from coordinator import service as coordinator_service
from coordinator.pool import resolve_dns
from coordinator.workers import DraftClient, TargetClient
from specdec import eagle
from specdec.config import CoordinatorConfig, ServerConfig
from specdec.models import NGRAM, fingerprint_config, load_model, weights_dtype, weights_fingerprint
from specdec.v1 import common_pb2, draft_pb2_grpc, target_pb2_grpc
from tests.factories import make_tiny_model, save_model_dir
from tests.harness import LOOPBACK, reference_greedy, run, running_cluster, start_draft, start_target
from tests.test_eagle_services import make_head
from tests.test_replicas import MAX_NEW, complete_all, record_sessions
from tests.test_services import PROMPTS, chat_ids, other_draft, target, tokenizer  # noqa: F401 (fixtures)


def refusals(role: str, reason: str) -> float:
    return REGISTRY.get_sample_value("specdec_replicas_refused_total", {"role": role, "reason": reason}) or 0.0


def fingerprint(model) -> str:
    return weights_fingerprint(model, fingerprint_config(model))


@pytest.fixture(scope="module")
def expected(target, tokenizer):
    return {p: reference_greedy(target, chat_ids(tokenizer, p), MAX_NEW) for p in PROMPTS}


@pytest.fixture(scope="module")
def reseeded(tokenizer):
    """The target's architecture and tokenizer, initialised with another seed."""
    return make_tiny_model(tokenizer, seed=7, layers=2)


# --------------------------------------------------------------------- the fingerprint


@pytest.fixture(scope="module")
def saved_target(target, tokenizer, tmp_path_factory):
    return save_model_dir(tmp_path_factory.mktemp("target"), target, tokenizer)


def test_the_same_model_loaded_twice_has_the_same_fingerprint(saved_target):
    first, _ = load_model(str(saved_target))
    second, _ = load_model(str(saved_target))
    assert fingerprint(first) == fingerprint(second)
    assert len(fingerprint(first)) == 64 and weights_dtype(first) == "float32"


def test_another_dtype_has_another_fingerprint(saved_target):
    full, _ = load_model(str(saved_target))
    half, _ = load_model(str(saved_target), dtype=torch.bfloat16)
    assert weights_dtype(half) == "bfloat16"
    assert fingerprint(full) != fingerprint(half)


def test_other_weights_with_the_same_tokenizer_have_another_fingerprint(target, reseeded):
    assert fingerprint(target) != fingerprint(reseeded)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_element_of_a_large_tensor_changed_by_its_last_bit_changes_the_fingerprint(dtype):
    """Large tensors are checksummed, not hashed byte for byte: every element still counts,
    wherever it is (first row, a middle row, the partial last row)."""
    torch.manual_seed(0)
    module = torch.nn.Linear(300, 301, bias=False).to(dtype)  # 90,300 elements: rows of 65,536 and a tail
    base = weights_fingerprint(module, {})
    flat = module.weight.data.view(-1)
    ints = flat.view(torch.int16 if dtype == torch.bfloat16 else torch.int32)
    for index in (0, 12_345, 65_535, 65_536, flat.numel() - 1):
        ints[index] ^= 1
        assert weights_fingerprint(module, {}) != base, index
        ints[index] ^= 1
    assert weights_fingerprint(module, {}) == base


def test_swapping_two_elements_of_a_large_tensor_changes_the_fingerprint():
    torch.manual_seed(0)
    module = torch.nn.Linear(300, 301, bias=False)
    base = weights_fingerprint(module, {})
    flat = module.weight.data.view(-1)
    flat[[10, 40_000]] = flat[[40_000, 10]]
    assert weights_fingerprint(module, {}) != base


def test_the_config_is_in_the_fingerprint_but_where_it_was_loaded_from_is_not(target):
    config = fingerprint_config(target)
    assert weights_fingerprint(target, config) != weights_fingerprint(target, {**config, "rms_norm_eps": 0.5})
    loaded_from = target.config._name_or_path
    target.config._name_or_path = "/somewhere/else"
    try:
        assert weights_fingerprint(target, fingerprint_config(target)) == weights_fingerprint(target, config)
    finally:
        target.config._name_or_path = loaded_from


def test_heads_with_other_weights_have_other_fingerprints(target):
    assert eagle.fingerprint(make_head(target, seed=0)) == eagle.fingerprint(make_head(target, seed=0))
    assert eagle.fingerprint(make_head(target, seed=0)) != eagle.fingerprint(make_head(target, seed=1))


def test_workers_report_their_weights(target, other_draft, tokenizer):
    head = make_head(target)

    async def scenario():
        servers = [await start_target(target, tokenizer, head=head), await start_draft(other_draft, tokenizer),
                   await start_draft(NGRAM), await start_draft(make_head(target), tokenizer)]
        stubs = [target_pb2_grpc.TargetWorkerStub] + [draft_pb2_grpc.DraftWorkerStub] * 3
        try:
            infos = []
            for (server, _), stub in zip(servers, stubs):
                async with grpc.aio.insecure_channel(server.address) as channel:
                    infos.append(await stub(channel).GetInfo(common_pb2.WorkerInfoRequest(), timeout=10))
            return infos
        finally:
            for server, _ in servers:
                await server.stop(grace=0)

    with_head, model_draft, ngram, head_draft = run(scenario())
    assert (with_head.fingerprint, with_head.dtype) == (fingerprint(target), "float32")
    assert with_head.head_fingerprint == eagle.fingerprint(head)
    assert model_draft.fingerprint == fingerprint(other_draft)
    assert head_draft.fingerprint == eagle.fingerprint(head)
    assert ngram.fingerprint and ngram.fingerprint not in (model_draft.fingerprint, head_draft.fingerprint)


# --------------------------------------------------------------------- the coordinator


def test_a_target_replica_with_other_weights_is_refused(target, reseeded, other_draft, tokenizer, expected, caplog):
    assert [reference_greedy(reseeded, chat_ids(tokenizer, p), MAX_NEW) for p in PROMPTS] != \
        [expected[p] for p in PROMPTS], "the two models must answer differently for this test to mean anything"
    answer: list[str] = []

    async def resolver(host: str, port: int) -> list[str]:
        return list(answer) if host == "target.specdec.test" else await resolve_dns(host, port)

    async def full():
        first = await start_target(target, tokenizer, host="127.0.0.2")
        other = await start_target(reseeded, tokenizer, host="127.0.0.3")
        answer.append(first[0].address)
        try:
            async with running_cluster(target, tokenizer, other_draft, ["127.0.0.4"], resolver=resolver,
                                       target_spec="target.specdec.test:1") as cluster:
                answer.append(other[0].address)  # a later replica, with the same tokenizer
                await asyncio.sleep(1.0)  # a few resolves and health polls
                pool = cluster.servicer.runner.target.pool
                served_first, served_other = record_sessions(first[1]), record_sessions(other[1])
                results = await complete_all(cluster.address, PROMPTS)
                return pool.replicas[other[0].address].admitted, served_first, served_other, results, other[0].address
        finally:
            await first[0].stop(grace=0)
            await other[0].stop(grace=0)

    before = refusals("target", "weights")
    with caplog.at_level(logging.WARNING, logger="coordinator.workers"):
        admitted, served_first, served_other, results, address = run(full())
    assert admitted is False and served_other == []
    assert len(set(served_first)) == len(PROMPTS)
    assert [r.token_ids for r in results] == [expected[p] for p in PROMPTS]
    assert refusals("target", "weights") == before + 1
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(address in w and fingerprint(target) in w and fingerprint(reseeded) in w for w in warnings), warnings


def test_a_target_restarted_at_its_address_with_other_weights_is_refused(target, reseeded, other_draft, tokenizer,
                                                                          expected):
    """A replica is admitted again whenever it comes back: a pod restarted on the same
    address with other weights is a new replica, not the one admitted before."""
    hosts = ["127.0.0.2", "127.0.0.3"]

    async def scenario():
        async with running_cluster(target, tokenizer, other_draft, hosts) as cluster:
            server, _ = cluster.targets[0]
            await server.stop(grace=0)
            await asyncio.sleep(0.5)  # health polls every 0.2 s in the cluster harness
            cluster.targets[0] = await start_target(reseeded, tokenizer, port=server.port, host=hosts[0])
            await asyncio.sleep(1.0)
            served = record_sessions(cluster.targets[0][1])
            results = await complete_all(cluster.address, PROMPTS)
            return cluster.servicer.runner.target.pool.replicas[server.address].admitted, served, results

    before = refusals("target", "weights")
    admitted, served, results = run(scenario())
    assert admitted is False and served == []
    assert refusals("target", "weights") == before + 1
    assert [r.token_ids for r in results] == [expected[p] for p in PROMPTS]


def test_a_draft_replica_with_other_weights_is_refused(target, other_draft, tokenizer, expected, monkeypatch):
    from coordinator.adaptive import AdaptiveK

    # Draft every round, so that the admitted draft replica is asked.
    monkeypatch.setattr(AdaptiveK, "next_k", lambda self, *args: self.k_max)
    stranger = make_tiny_model(tokenizer, seed=2, layers=1, hidden=32)  # other_draft's shape, other weights
    assert fingerprint(stranger) != fingerprint(other_draft)

    async def full():
        target_server, _ = await start_target(target, tokenizer)
        drafts = [await start_draft(other_draft, tokenizer, host="127.0.0.2"),
                  await start_draft(stranger, tokenizer, host="127.0.0.3")]
        asked = [count_calls(servicer.proposer) for _, servicer in drafts]
        config = CoordinatorConfig(
            target_addr=target_server.address, draft_addr=",".join(server.address for server, _ in drafts),
            tokenizer="unused: given in memory", server=ServerConfig(host=LOOPBACK, port=0, grace_period_s=1.0),
            worker_timeout_s=30.0, retry_backoff_s=0.05, health_interval_s=0.2, resolve_interval_s=0.2)
        servicer = None
        try:
            servicer = await coordinator_service.connect(config, tokenizer=tokenizer, startup_timeout_s=10.0)
            coordinator = await coordinator_service.serve(config, servicer)
            try:
                results = await complete_all(coordinator.address, PROMPTS)
            finally:
                await coordinator.stop(grace=0)
            pool = servicer.runner.draft.pool
            return [pool.replicas[server.address].admitted for server, _ in drafts], [len(c) for c in asked], results
        finally:
            if servicer is not None:
                await servicer.runner.drain()
                await servicer.runner.target.close()
                await servicer.runner.draft.close()
            for server, _ in [(target_server, None), *drafts]:
                await server.stop(grace=0)

    before = refusals("draft", "weights")
    admitted, asked, results = run(full())
    assert admitted == [True, False]
    assert asked[0] > 0 and asked[1] == 0
    assert refusals("draft", "weights") == before + 1
    assert [r.token_ids for r in results] == [expected[p] for p in PROMPTS]


def count_calls(proposer) -> list:
    """Wraps a draft's propose_batch so that each call is recorded."""
    calls: list = []
    propose_batch = proposer.propose_batch

    def counting(requests):
        calls.append(len(requests))
        return propose_batch(requests)

    proposer.propose_batch = counting
    return calls


def client(kind: str):
    cls = {"target": TargetClient, "draft": DraftClient}[kind]
    return cls("127.0.0.1:1", timeout_s=1.0, retries=0, backoff_s=0.1, max_message_bytes=1 << 20)


def test_the_first_replica_admitted_pins_the_weights_when_none_were_pinned_at_start():
    drafts = client("draft")
    before = refusals("draft", "weights")
    assert drafts._same_weights("a:1", common_pb2.WorkerInfo(fingerprint="f1"))
    assert not drafts._same_weights("b:1", common_pb2.WorkerInfo(fingerprint="f2"))
    assert not drafts._same_weights("c:1", common_pb2.WorkerInfo())  # a worker that reports none
    assert drafts._same_weights("d:1", common_pb2.WorkerInfo(fingerprint="f1"))
    assert refusals("draft", "weights") == before + 2


def test_a_targets_head_is_pinned_apart_from_its_weights():
    targets = client("target")
    targets.pin_weights(common_pb2.WorkerInfo(fingerprint="t", head="h", head_fingerprint="h1"))
    before = refusals("target", "head_weights")
    assert targets._same_weights("a:1", common_pb2.WorkerInfo(fingerprint="t"))  # no head: a mixed fleet
    assert targets._same_weights("b:1", common_pb2.WorkerInfo(fingerprint="t", head="h", head_fingerprint="h1"))
    assert not targets._same_weights("c:1", common_pb2.WorkerInfo(fingerprint="t", head="h", head_fingerprint="h2"))
    assert refusals("target", "head_weights") == before + 1
