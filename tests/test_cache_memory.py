"""What a worker's cache budget counts (`--max-cache-mb`, `specdec_worker_cache_bytes`): the
bytes the sessions' caches keep allocated — a buffered CPU cache's whole capacity, a cropped
cache's uncropped storage, a head's state — not tokens × bytes_per_token. Each expectation
below is computed here from the session's own cache object, storage by storage."""

from __future__ import annotations

import asyncio

import pytest
import torch
from prometheus_client import REGISTRY

from draft_worker.drafters.ngram import NgramDrafter
from specdec.client import Client, make_request
from specdec.runtime.cpu import KV_BLOCK_TOKENS, BufferedLayer
from specdec.runtime.load import serving_lm
from specdec.runtime.paged import PagedSession
from specdec.ngram import ID_BYTES
from specdec.sessions import Session, SessionStore, SyncedContext
from target_worker.head import load_inline_head
from target_worker.verify import Round, Verifier
from tests.factories import TEST_DEVICE, make_tiny_model, make_tiny_tokenizer
from tests.harness import reference_greedy, run, running_stack
from tests.test_eagle_services import make_head
from tests.test_services import chat_ids

PROMPT = list(range(5, 25))
cpu_only = pytest.mark.skipif(TEST_DEVICE != "cpu", reason="the buffered KV cache is the CPU fast path's")
# The buffered caches, whatever SPECDEC_KV_CACHE says (a paged pool is tested in test_paged_serving).
BUFFERED = {"kv_cache": "buffered"}


@pytest.fixture(scope="module")
def tokenizer():
    return make_tiny_tokenizer()


@pytest.fixture(scope="module")
def target(tokenizer):
    return make_tiny_model(tokenizer, seed=0)


@pytest.fixture(scope="module")
def draft(tokenizer):
    return make_tiny_model(tokenizer, seed=1, layers=1, hidden=32)


def storage_of(*objects) -> int:
    """Bytes of the distinct storages behind the tensors of `objects`: tensors, transformers
    caches (their layers' tensors) or any object (its tensor attributes), each storage once."""
    storages = {}

    def add(tensor):
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()

    for obj in objects:
        if obj is None:
            continue
        if isinstance(obj, torch.Tensor):
            add(obj)
            continue
        for part in getattr(obj, "layers", None) or [obj]:
            for value in vars(part).values():
                if isinstance(value, torch.Tensor):
                    add(value)
    return sum(storages.values())


def head_truth(session: Session, inline=None) -> int:
    """What a head's state holds: its buffered cache's storage or its blocks of the head's
    pool (counted from the block table and the pool's own tensors), and the storage of its
    pending features."""
    head = session.head
    if head is None:
        return 0
    cache, kv = head.session.cache, 0
    if isinstance(cache, PagedSession):
        keys = inline.batched.storage.pool.keys  # [1, num_blocks, block_size, kv_heads, d]
        kv = len(cache.block_table) * 2 * keys[0, 0].numel() * keys.element_size()
    elif cache is not None:
        kv = storage_of(cache)  # a buffered head cache's tensors
    copying = head.session.copying  # its copies' n-gram index (an estimate)
    return kv + storage_of(head.rows) + (copying.held_bytes() if copying is not None else 0)


def truth(session: Session, inline=None) -> int:
    """What `session` holds: its KV cache, and a head's blocks and pending features."""
    return storage_of(session.cache) + head_truth(session, inline)


def store_truth(store: SessionStore, session_ids, inline=None) -> int:
    return sum(truth(store.get(s), inline) for s in session_ids if store.get(s) is not None)


def verifier_for(model, fast: bool = True, head=None, max_sessions: int = 8, budget: int = 1 << 30,
                 **store_options) -> Verifier:
    lm = serving_lm(model, fast)
    return Verifier(lm, SessionStore(max_sessions, budget, lm.bytes_per_token, **store_options), 8, head)


@cpu_only
def test_a_short_session_holds_its_buffers_not_its_tokens(target):
    verifier = verifier_for(target)
    store, per_token = verifier.store, verifier.lm.bytes_per_token
    verifier.verify("s", 0, [5, 6, 7], [])
    session = store.get("s")
    assert any(isinstance(layer, BufferedLayer) for layer in session.cache.layers)  # the CPU fast path
    assert store.cache_bytes() == truth(session) == KV_BLOCK_TOKENS * per_token
    assert store.cache_bytes() > 50 * len(session.ids) * per_token  # 3 tokens hold a whole block


@pytest.mark.parametrize("fast", [pytest.param(True, marks=cpu_only, id="buffered"), pytest.param(False, id="as-is")])
def test_a_rollback_keeps_the_account(target, fast):
    verifier = verifier_for(target, fast)
    store, per_token = verifier.store, verifier.lm.bytes_per_token
    first = verifier.verify("s", 0, PROMPT, [])
    committed = PROMPT + [first.next_token]
    own, after = reference_greedy(target, committed, 2)
    wrong = (after + 1) % target.config.vocab_size
    drafts = [own, wrong, wrong]
    second = verifier.verify("s", len(PROMPT), [first.next_token], drafts)
    assert second.accepted == 1 and second.next_token == after
    session = store.get("s")
    assert len(session.ids) == len(committed) + 1  # the rejected drafts were cropped
    assert store.cache_bytes() == truth(session)
    if fast:
        assert store.cache_bytes() == KV_BLOCK_TOKENS * per_token
    else:
        # The crop narrowed views: the storage of every fed position is still held ...
        assert store.cache_bytes() == (len(committed) + len(drafts)) * per_token
        # ... until the next step copies the kept ones into a new one.
        third = verifier.verify("s", len(committed), [own, after], [])  # the accepted draft is reused
        assert third.cached_len == len(committed) + 2
        assert store.cache_bytes() == truth(session) == (len(committed) + 2) * per_token


@cpu_only
def test_the_account_follows_a_buffer_that_grows(tokenizer):
    model = make_tiny_model(tokenizer, seed=0, max_positions=4 * KV_BLOCK_TOKENS)
    verifier = verifier_for(model)
    store, per_token = verifier.store, verifier.lm.bytes_per_token
    prompt = [5 + i % 300 for i in range(KV_BLOCK_TOKENS - 6)]
    first = verifier.verify("s", 0, prompt, [])
    assert store.cache_bytes() == KV_BLOCK_TOKENS * per_token
    verifier.verify("s", len(prompt), [first.next_token] + list(range(5, 15)), [])  # past the first block
    session = store.get("s")
    assert len(session.ids) > KV_BLOCK_TOKENS
    assert store.cache_bytes() == truth(session) == 2 * KV_BLOCK_TOKENS * per_token


def test_a_failed_step_counts_nothing_for_the_caches_it_dropped(target):
    verifier = verifier_for(target)
    store = verifier.store
    for name in "ab":
        verifier.verify(name, 0, PROMPT, [])
    assert store.cache_bytes() == store_truth(store, "ab") > 0
    model = verifier.lm.model

    def out_of_memory(*args, **kwargs):
        raise RuntimeError("out of memory")

    model.forward = out_of_memory
    try:
        outcome = verifier.verify_batch([Round("a", len(PROMPT), [5], []), Round("b", len(PROMPT), [6], [])])
    finally:
        del model.forward
    assert all(isinstance(result, RuntimeError) for result in outcome.results)
    assert "a" in store and "b" in store  # kept, their caches dropped: the next round resyncs
    assert store.cache_bytes() == store_truth(store, "ab") == 0


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_release_eviction_and_expiry_subtract_what_was_added(target):
    clock = Clock()
    verifier = verifier_for(target, fast=False, max_sessions=3, ttl_s=10.0, clock=clock)
    store = verifier.store
    lengths = {"a": 5, "b": 9, "c": 14, "d": 7}
    for name in "abc":
        verifier.verify(name, 0, PROMPT[:lengths[name]], [])
    assert store.cache_bytes() == store_truth(store, "abc") > 0
    verifier.verify("d", 0, PROMPT[:lengths["d"]], [])  # a fourth session: "a" is evicted
    assert "a" not in store and store.evictions == 1
    assert store.cache_bytes() == store_truth(store, "bcd")
    assert store.release("b")
    assert store.cache_bytes() == store_truth(store, "cd")
    clock.now += 8
    verifier.verify("c", lengths["c"], [5], [])
    clock.now += 3  # "d" idle for 11 s, "c" for 3
    assert store.expire() == 1 and "d" not in store
    assert store.cache_bytes() == store_truth(store, "c") > 0
    assert store.release("c")
    assert store.cache_bytes() == 0 and len(store) == 0


@cpu_only
def test_the_byte_budget_evicts_on_what_is_held(target):
    verifier = verifier_for(target)
    capacity = KV_BLOCK_TOKENS * verifier.lm.bytes_per_token
    store = verifier.store
    store.max_cache_bytes = capacity * 3 // 2
    assert 2 * len(PROMPT) * verifier.lm.bytes_per_token <= store.max_cache_bytes  # as tokens, both fit
    verifier.verify("x", 0, PROMPT, [])
    verifier.verify("y", 0, PROMPT, [])
    assert "x" not in store and "y" in store and store.evictions == 1
    assert store.cache_bytes() == truth(store.get("y")) == capacity
    store.release("y")
    assert store.cache_bytes() == 0


def test_a_head_on_the_target_worker_is_counted(target):
    inline = load_inline_head(None, target, make_head(target), min_chain_prob=0.0)
    verifier = verifier_for(target, head=inline)
    store = verifier.store
    first = verifier.verify("s", 0, PROMPT, [], draft_next=4)
    session = store.get("s")
    assert session.head is not None and len(first.next_drafts) == 4
    head_bytes = head_truth(session, inline)
    assert head_bytes > storage_of(session.head.rows) > 0
    assert store.cache_bytes() == storage_of(session.cache) + head_bytes == truth(session, inline)
    assert store.cache_bytes() == verifier.lm.held_bytes(session) + inline.held_bytes(session)
    second = verifier.verify("s", len(PROMPT), [first.next_token], list(first.next_drafts), draft_next=4)
    assert second.cached_len > len(PROMPT)
    assert store.cache_bytes() == truth(session, inline)
    store.release("s")
    assert store.cache_bytes() == 0


def test_a_float16_targets_head_keeps_only_its_own_features(tokenizer):
    # In float16 the features the head records need no conversion: they must still be copied
    # out of the step's states, or every session's head would keep the whole step's alive.
    target = make_tiny_model(tokenizer, seed=0).half()
    inline = load_inline_head(None, target, make_head(target).half(), min_chain_prob=0.0)
    verifier = verifier_for(target, head=inline)
    prompts = {f"s{i}": list(range(5 + i, 25 + i)) for i in range(3)}
    outcome = verifier.verify_batch([Round(name, 0, ids, [], draft_next=4) for name, ids in prompts.items()])
    assert all(len(result.next_drafts) == 4 for result in outcome.results)
    for name, ids in prompts.items():
        rows = verifier.store.get(name).head.rows
        assert storage_of(rows) <= len(ids) * inline.feature_size * 2, name
    assert verifier.store.cache_bytes() == store_truth(verifier.store, prompts, inline)


def test_an_ngram_session_holds_its_ids_and_its_index():
    session = Session("s", ids=list(range(40)))
    assert NgramDrafter.held_bytes(session) == 40 * ID_BYTES
    drafter = NgramDrafter()
    drafter.propose(SyncedContext(session, list(range(40)), 40), 4)
    assert NgramDrafter.held_bytes(session) == 40 * ID_BYTES + session.cache.held_bytes() > 40 * ID_BYTES


SHORT_PROMPTS = [f"{word} number {i}." for i, word in enumerate(
    ["Hello", "Tides", "Rain", "Cats", "Code", "Mats", "Foxes", "Dogs"])]
SHORT_NEW = 8


def gauge(kind: str) -> float:
    return REGISTRY.get_sample_value("specdec_worker_cache_bytes", {"kind": kind})


@cpu_only
def test_a_worker_budget_holds_fewer_short_sessions_than_tokens_would(target, draft, tokenizer):
    """Many short requests at once through gRPC, with a target and a draft-model worker whose
    budgets hold three and a half of a session's buffers: after every step each worker's
    account equals what its sessions hold and stays within the budget, so it keeps at most
    three sessions where counting tokens would have kept all eight."""
    target_capacity = KV_BLOCK_TOKENS * serving_lm(target).bytes_per_token
    draft_capacity = KV_BLOCK_TOKENS * serving_lm(draft).bytes_per_token
    budgets = {"target": target_capacity * 7 // 2, "draft": draft_capacity * 7 // 2}
    longest = max(len(chat_ids(tokenizer, p)) for p in SHORT_PROMPTS) + SHORT_NEW + 8
    # Counted in tokens, every session would fit in either budget at once.
    assert len(SHORT_PROMPTS) * longest * serving_lm(target).bytes_per_token <= budgets["target"]
    assert len(SHORT_PROMPTS) * longest * serving_lm(draft).bytes_per_token <= budgets["draft"]
    steps = {"target": [], "draft": []}
    seen = {"target": set(), "draft": set()}

    def watched(kind, store, step, session_ids):
        def call(batch):
            outcome = step(batch)
            seen[kind].update(session_ids(batch))
            steps[kind].append((store.cache_bytes(), store_truth(store, seen[kind]), len(store)))
            return outcome
        return call

    async def scenario():
        async with running_stack(target, tokenizer, draft=draft,
                                 target_options={"max_cache_bytes": budgets["target"], **BUFFERED},
                                 draft_options={"max_cache_bytes": budgets["draft"], **BUFFERED}) as stack:
            verifier, proposer = stack.target_servicer.verifier, stack.draft_servicer.proposer
            verifier.verify_batch = watched("target", verifier.store, verifier.verify_batch,
                                            lambda rounds: [r.session_id for r in rounds])
            proposer.propose_batch = watched("draft", proposer.store, proposer.propose_batch,
                                             lambda requests: [r.session_id for r in requests])
            async with Client(stack.address) as client:
                results = await asyncio.gather(*(client.complete(make_request(p, max_new_tokens=SHORT_NEW))
                                                 for p in SHORT_PROMPTS))
            await stack.coordinator_servicer.runner.drain()
            stores = {"target": verifier.store, "draft": proposer.store}
            left = {kind: await thread.run(lambda s=store: (s.cache_bytes(), len(s)))
                    for kind, store, thread in [("target", verifier.store, stack.target_servicer.thread),
                                                ("draft", proposer.store, stack.draft_servicer.thread)]}
            return results, {kind: store.evictions for kind, store in stores.items()}, left, \
                {kind: gauge(kind) for kind in stores}

    results, evictions, left, gauges = run(scenario())
    for prompt, result in zip(SHORT_PROMPTS, results):
        assert result.token_ids == reference_greedy(target, chat_ids(tokenizer, prompt), SHORT_NEW), prompt
    for kind in ("target", "draft"):
        assert steps[kind] and evictions[kind] > 0, kind
        for accounted, held, sessions in steps[kind]:
            assert accounted == held <= budgets[kind], kind
            assert sessions <= 3, kind
        assert left[kind] == (0, 0), kind  # every session released: nothing counted
        assert gauges[kind] == 0, kind  # and the gauge says so
