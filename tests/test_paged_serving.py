"""The workers over the paged KV pool (--kv-cache paged), through real services on loopback:
token-identical to the target alone with a draft model, an n-gram drafter and a head on the
target (tree blocks); prefix hits; a pool too small for the load evicts and stays exact; the
cache bytes are the pool's blocks in use. (SPECDEC_KV_CACHE=paged runs every other service
suite over the pool too.)"""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest

from specdec.client import Client, make_request
from specdec.runtime.load import serving_lm
from specdec.runtime.paged import PoolExhausted
from specdec.runtime.paged_lm import PagedCausalLM
from specdec.sessions import Resync, SessionStore
from specdec.train.teacher import chat_ids
from tests.factories import make_tiny_model
from tests.harness import reference_greedy, run, running_cluster, running_stack
from target_worker.verify import Round, Verdict, Verifier
from tests.test_eagle_services import ALWAYS, make_head, target, tokenizer  # noqa: F401

PAGED = {"kv_cache": "paged"}
MAX_NEW = 20
PROMPTS = ["Explain how tides work.", "Write a haiku about rain.", "def add(a, b):", "List three colours."]


@pytest.fixture(scope="module")
def draft(tokenizer):
    return make_tiny_model(tokenizer, seed=1, layers=1, hidden=32)


def expected(target, tokenizer, prompt: str, max_new: int = MAX_NEW) -> list[int]:
    return reference_greedy(target, chat_ids(tokenizer, prompt), max_new)


async def complete_all(address: str, prompts: list[str], max_new: int = MAX_NEW, **request) -> list:
    async with Client(address) as client:
        return await asyncio.gather(*(client.complete(make_request(p, max_new_tokens=max_new, **request))
                                      for p in prompts))


@pytest.mark.parametrize("drafter", ["model", "ngram"])
def test_paged_workers_are_token_identical(target, tokenizer, draft, drafter):
    async def scenario():
        async with running_stack(target, tokenizer, draft=draft if drafter == "model" else "ngram",
                                 target_options=PAGED, draft_options=PAGED) as stack:
            assert isinstance(stack.target_servicer.verifier.lm, PagedCausalLM)
            return await complete_all(stack.address, PROMPTS, k=4)

    for prompt, result in zip(PROMPTS, run(scenario())):
        assert list(result.token_ids) == expected(target, tokenizer, prompt), prompt


def test_a_head_on_a_paged_target_verifies_trees_token_identical(target, tokenizer):
    async def scenario():
        async with running_stack(target, tokenizer, target_head=make_head(target),
                                 target_options={**ALWAYS, **PAGED}) as stack:
            verifier = stack.target_servicer.verifier
            assert isinstance(verifier.lm, PagedCausalLM) and verifier.lm.runs_trees
            return await complete_all(stack.address, PROMPTS, k=4)

    results = run(scenario())
    for prompt, result in zip(PROMPTS, results):
        assert list(result.token_ids) == expected(target, tokenizer, prompt), prompt
    assert sum(r.stats["proposed"] for r in results) > 0


@pytest.mark.parametrize("chunk", [256, 32], ids=["whole-prompt", "chunked-prefill"])
def test_a_shared_prefix_is_not_fed_again(target, tokenizer, chunk):
    system = "You are a careful assistant who answers briefly and precisely. " * 2  # ~120 tokens
    prompts = [system + "Explain how tides work.", system + "Write a haiku about rain."]

    async def scenario():
        async with running_stack(target, tokenizer, target_options=PAGED, prefill_chunk_tokens=chunk) as stack:
            lm = stack.target_servicer.verifier.lm
            first = (await complete_all(stack.address, prompts[:1], speculate=False))[0]
            hits_before = lm.prefix_hit_tokens
            second = (await complete_all(stack.address, prompts[1:], speculate=False))[0]
            return first, second, hits_before, lm.prefix_hit_tokens, lm.cache.block_size

    first, second, before, after, block = run(scenario())
    assert list(first.token_ids) == expected(target, tokenizer, prompts[0])
    assert list(second.token_ids) == expected(target, tokenizer, prompts[1])
    a, b = (chat_ids(tokenizer, p) for p in prompts)
    shared = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    # Every full shared block is reused; at most one token per prefill piece is fed again.
    pieces = -(-shared // chunk)
    assert after - before >= (shared // block) * block - pieces > 0


def test_a_pool_too_small_for_the_load_stays_exact(target, tokenizer, caplog):
    # Room for about two sessions' contexts: eight concurrent requests must take turns (a
    # round that does not fit is refused alone, and its request retries it).
    options = {**PAGED, "max_cache_bytes": 24 * target_block_bytes(target)}
    caplog.set_level(logging.INFO, logger="coordinator.workers")  # a busy replica is logged, not a fault

    async def scenario():
        async with running_stack(target, tokenizer, draft="ngram", target_options=options) as stack:
            return await complete_all(stack.address, PROMPTS * 2, k=2)

    results = run(scenario())
    for prompt, result in zip(PROMPTS * 2, results):
        assert list(result.token_ids) == expected(target, tokenizer, prompt), prompt
    assert "KV pool exhausted" in caplog.text


def test_idle_sessions_give_their_blocks_to_a_step_that_needs_them(target, tokenizer):
    lm = serving_lm(target, True, "paged", max_cache_bytes=8 * target_block_bytes(target))  # 7 usable
    store = SessionStore(64, 1 << 30, lm.bytes_per_token)
    lm.bind(store)
    verifier = Verifier(lm, store, 8)
    ids = [chat_ids(tokenizer, p) for p in PROMPTS]
    first = verifier.verify_batch([Round("a", 0, ids[0], []), Round("b", 0, ids[1], [])]).results
    assert all(isinstance(r, Verdict) for r in first) and store.evictions == 0
    # c needs more blocks than are free: a and b, idle, are evicted for it, oldest first.
    third = verifier.verify_batch([Round("c", 0, ids[2] + ids[3], [])]).results[0]
    assert isinstance(third, Verdict) and store.evictions >= 1 and "a" not in store
    assert store.cache_bytes() == lm.cache.blocks.in_use * lm.pool.block_bytes
    # a's next round finds its session gone and asks for the whole context again.
    again = verifier.verify_batch([Round("a", len(ids[0]), [first[0].next_token], [])]).results[0]
    assert isinstance(again, Resync) and again.cached_len == 0
    # A round bigger than the whole pool fails alone, RESOURCE_EXHAUSTED, and the pool is intact.
    huge = [token for prompt_ids in ids for token in prompt_ids] * 2
    assert len(huge) >= 200
    both = verifier.verify_batch([Round("d", 0, huge[:200], []), Round("e", 0, ids[1], [])]).results
    assert isinstance(both[0], PoolExhausted) and isinstance(both[1], Verdict)
    assert both[1].next_token == expected_next(target, ids[1])


def expected_next(model, ids: list[int]) -> int:
    return reference_greedy(model, ids, 1)[0]


def test_cache_bytes_are_the_pools_blocks_in_use(target, tokenizer):
    async def scenario():
        async with running_stack(target, tokenizer, target_options=PAGED) as stack:
            verifier = stack.target_servicer.verifier
            async with Client(stack.address) as client:
                stream = client.generate(make_request(PROMPTS[0], max_new_tokens=64))
                async for _ in stream:  # one message in: the session holds its blocks
                    held = verifier.store.cache_bytes()
                    in_use = verifier.lm.cache.blocks.in_use * verifier.lm.pool.block_bytes
                    break
                await stream.aclose()
            for _ in range(100):  # the release reaches the worker in the background
                if verifier.store.cache_bytes() == 0:
                    break
                await asyncio.sleep(0.05)
            return held, in_use, verifier.store.cache_bytes()

    held, in_use, after = run(scenario())
    assert held == in_use > 0
    assert after == 0


def target_block_bytes(model) -> int:
    from specdec.runtime.paged import DEFAULT_BLOCK_SIZE, KVShape, block_bytes

    return block_bytes(KVShape.of(model.config), DEFAULT_BLOCK_SIZE, next(model.parameters()).dtype)


def test_a_full_pool_refuses_the_request_without_failing_the_replica(target, tokenizer):
    # A prompt bigger than the whole pool of the only replica: the worker refuses each try
    # of its round alone (RESOURCE_EXHAUSTED, pool unchanged), the coordinator retries it
    # there and then tells the client RESOURCE_EXHAUSTED — and never takes the busy replica
    # out: the next request is served at once.
    options = {**PAGED, "max_cache_bytes": 8 * target_block_bytes(target)}  # 7 usable blocks
    short, long = PROMPTS[0], " ".join(PROMPTS * 3)  # within the context, not the pool
    assert len(chat_ids(tokenizer, long)) > 7 * 16

    async def scenario():
        async with running_stack(target, tokenizer, target_options=options, worker_retries=2,
                                 eject_after_failures=1) as stack:
            pool = stack.coordinator_servicer.runner.target.pool
            retried = counted("specdec_busy_rounds_total", kind="target", outcome="retried")
            async with Client(stack.address) as client:
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await client.complete(make_request(long, max_new_tokens=4))
                replica = next(iter(pool.replicas.values()))
                state = (replica.healthy, replica.failures, replica.ejected)
                served = await client.complete(make_request(short, max_new_tokens=MAX_NEW))
            return refused.value, state, served, counted("specdec_busy_rounds_total", kind="target",
                                                          outcome="retried") - retried

    error, (healthy, failures, ejected), served, retried = run(scenario())
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "busy" in error.details()
    assert healthy and failures == 0 and not ejected
    assert retried == 2  # its first try and first retry were retried there; the last failed
    assert list(served.token_ids) == expected(target, tokenizer, short)


def test_only_a_round_the_worker_refused_for_room_is_busy():
    # A worker's own refusal of one round (its RoundError, or an unbatched call it answered)
    # is load; a whole call over gRPC's message size, or a batched step failing as a whole,
    # is not, and stays a replica fault.
    from grpc.aio import AioRpcError, Metadata

    from coordinator.scheduler import RoundFailed
    from coordinator.workers import busy

    exhausted = grpc.StatusCode.RESOURCE_EXHAUSTED
    assert busy(RoundFailed(exhausted, "KV pool exhausted", refused=True))
    assert not busy(RoundFailed(exhausted, "the whole step failed"))
    assert not busy(RoundFailed(grpc.StatusCode.INTERNAL, "boom", refused=True))
    assert busy(AioRpcError(exhausted, Metadata(), Metadata(), details="KV pool exhausted"))
    assert not busy(AioRpcError(exhausted, Metadata(), Metadata(),
                                details="Received message larger than max (5000000 vs. 4194304)"))


def test_a_session_refused_by_a_full_replica_moves_to_another(target, tokenizer):
    # Two replicas, one whose pool cannot hold a long prompt: a request placed there is
    # refused (RESOURCE_EXHAUSTED) and moves to the other at once, exact; the full replica
    # is neither taken out nor ejected (one failure would eject it), and serves short ones.
    small = {**PAGED, "max_cache_bytes": 8 * target_block_bytes(target)}
    big = {**PAGED, "max_cache_bytes": 512 * target_block_bytes(target)}
    long = [" ".join(PROMPTS * 3) + f" ({i})" for i in range(4)]
    assert all(len(chat_ids(tokenizer, p)) > 7 * 16 for p in long)

    async def scenario():
        async with running_cluster(target, tokenizer, "ngram", ["127.0.0.2", "127.0.0.3"],
                                   target_options=[small, big], eject_after_failures=1,
                                   max_ejected_percent=50.0) as cluster:
            moved = counted("specdec_busy_rounds_total", kind="target", outcome="moved")
            outputs = await complete_all(cluster.address, long, k=2)
            shorts = await complete_all(cluster.address, PROMPTS, k=2)
            pool = cluster.servicer.runner.target.pool
            full = pool.replicas[cluster.targets[0][0].address]
            return (outputs, shorts, (full.healthy, full.failures, full.ejected),
                    counted("specdec_busy_rounds_total", kind="target", outcome="moved") - moved)

    outputs, shorts, (healthy, failures, ejected), moved = run(scenario())
    for prompt, result in zip(long, outputs):
        assert list(result.token_ids) == expected(target, tokenizer, prompt), prompt
    for prompt, result in zip(PROMPTS, shorts):
        assert list(result.token_ids) == expected(target, tokenizer, prompt), prompt
    assert moved >= 1  # least-loaded placement puts some of the four on the small one
    assert healthy and failures == 0 and not ejected


def test_a_draft_replica_too_full_for_a_prompt_leaves_the_target_alone_to_decode(target, tokenizer, draft):
    # A draft model over a pool that cannot hold the prompt: its Propose rounds come back
    # RESOURCE_EXHAUSTED; drafts are suggestions, so the request decodes with the target
    # alone, exact, and the draft replica is not taken out.
    small = {**PAGED, "max_cache_bytes": 8 * target_block_bytes(draft)}
    long = " ".join(PROMPTS * 3)
    assert len(chat_ids(tokenizer, long)) > 7 * 16

    async def scenario():
        async with running_stack(target, tokenizer, draft=draft, draft_options=small) as stack:
            skipped = counted("specdec_busy_rounds_total", kind="draft", outcome="skipped")
            [result] = await complete_all(stack.address, [long], k=2)
            replica = next(iter(stack.coordinator_servicer.runner.draft.pool.replicas.values()))
            return (result, counted("specdec_busy_rounds_total", kind="draft", outcome="skipped") - skipped,
                    (replica.healthy, replica.failures))

    result, skipped, (healthy, failures) = run(scenario())
    assert list(result.token_ids) == expected(target, tokenizer, long)
    assert skipped >= 1 and result.stats["proposed"] == 0
    assert healthy and failures == 0


def counted(name: str, **labels) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_a_head_with_many_sessions_on_the_pool_stays_exact(target, tokenizer):
    # Sixteen requests at once with a head proposing alternatives: a new session's prompt
    # (more tokens than a tree step holds per session) joins steps whose other sessions
    # carry tree leaves; those steps run without the leaves, the output is the target's.
    prompts = [f"{p} " * (1 + i % 4) for i, p in enumerate(PROMPTS * 4)][:16]
    options = {**PAGED, **ALWAYS, "min_alt_prob": 0.0}

    async def scenario():
        async with running_stack(target, tokenizer, target_head=make_head(target), target_options=options) as stack:
            return await asyncio.gather(*(complete_all(stack.address, [p], k=4) for p in prompts))

    results = run(scenario())
    for prompt, (result,) in zip(prompts, results):
        assert list(result.token_ids) == expected(target, tokenizer, prompt), prompt
    assert any(len(chat_ids(tokenizer, p)) > 64 for p in prompts)
