"""The paged KV cache (specdec.runtime.paged, paged_step, paged_llama) against the plain HF
forward: one packed step over many sessions, chains and trees, at contexts on both sides of
block boundaries; rollback, prefix caching, copy-on-write, eviction and exhaustion of the
block pool. Tiny float32 llama on CPU."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from specdec.errors import ResourceExhausted
from specdec.runtime.paged import (
    PAD_BLOCK,
    KVPool,
    PagedKVCache,
    PagedSession,
    PoolExhausted,
    block_bytes,
    pool_blocks,
)
from specdec.runtime.paged_attention import paged_attention_reference
from specdec.runtime.paged_llama import PagedLlama
from specdec.runtime.paged_step import StepBuffers, StepLimits, StepRequest
from tests.factories import make_tiny_model, make_tiny_tokenizer

torch.set_num_threads(2)

BLOCK = 16
# Contexts on both sides of block boundaries, and past the tiny model's default 256 positions.
CONTEXTS = (0, 1, 15, 16, 17, 255, 257)
MAX_NEW = 9
MAX_POSITIONS = 512
LOGIT_TOLERANCE = 1e-4
LIMITS = StepLimits(max_batch=16, max_tokens=4096, max_blocks=MAX_POSITIONS // BLOCK, max_query=16)


@pytest.fixture(scope="module")
def model():
    return make_tiny_model(make_tiny_tokenizer(), max_positions=MAX_POSITIONS)


@dataclass
class Rig:
    """A paged cache over the tiny model, and the steps a test drives through it."""

    model: torch.nn.Module
    cache: PagedKVCache
    buffers: StepBuffers
    paged: PagedLlama

    def step(self, requests: list[StepRequest]) -> list[torch.Tensor]:
        """Reserves, plans and runs one step; returns per session its kept logits. Commits nothing."""
        for r in requests:
            self.cache.reserve(r.session, len(r.tokens))
        inputs = self.buffers.plan(self.cache, requests)
        return self.paged.forward(self.cache.pool, inputs).logits

    def feed(self, session: PagedSession, tokens: list[int]) -> torch.Tensor:
        """A chain step of one session, committed; the logits of every token [n, V]."""
        logits = self.step([StepRequest(session, tokens, logits_to_keep=len(tokens))])[0]
        self.cache.commit(session, tokens)
        return logits


def make_rig(model, num_blocks: int = 256, namespace: str = "tiny") -> Rig:
    device = next(model.parameters()).device  # SPECDEC_TEST_DEVICE (the GPU check runs these on CUDA)
    pool = KVPool.for_model(model.config, num_blocks, BLOCK, device=device)
    return Rig(model, PagedKVCache(pool, namespace), StepBuffers(LIMITS, device),
               PagedLlama(model, paged_attention_reference))


def token_ids(seed: int, n: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, 300, (n,), generator=generator).tolist()


def random_tree(seed: int, n: int) -> list[int]:
    """Parents of an n-node tree, each node's parent an earlier node or -1 (several roots allowed)."""
    generator = torch.Generator().manual_seed(seed)
    return [int(torch.randint(-1, j, (1,), generator=generator)) for j in range(n)]


def path_to(parents: list[int], node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


@torch.inference_mode()
def hf_logits(model, ids: list[int]) -> torch.Tensor:
    return model(input_ids=torch.tensor([ids], device=model.device)).logits[0].float()  # [len(ids), V]


@torch.inference_mode()
def hf_tree_logits(model, context: list[int], tokens: list[int], parents: list[int]) -> torch.Tensor:
    """[n, V]: per node, the last logits of an HF forward of context + its root-to-node path.
    The paths run as one batch, padded on the right: a causal model's logits at a position
    do not depend on the tokens after it."""
    paths = [context + [tokens[j] for j in path_to(parents, node)] for node in range(len(tokens))]
    width = max(len(p) for p in paths)
    batch = torch.tensor([p + [0] * (width - len(p)) for p in paths], device=model.device)  # [n, width]
    logits = model(input_ids=batch).logits.float()  # [n, width, V]
    return torch.stack([logits[i, len(p) - 1] for i, p in enumerate(paths)])


def assert_same_logits(paged: torch.Tensor, expected: torch.Tensor) -> None:
    assert paged.shape == expected.shape
    assert torch.equal(paged.argmax(-1), expected.argmax(-1))
    assert (paged - expected).abs().max().item() <= LOGIT_TOLERANCE


def prefill(rig: Rig, sessions: list[PagedSession], contexts: list[list[int]]) -> None:
    """All sessions' contexts in one step (those with one), committed."""
    requests = [StepRequest(s, c) for s, c in zip(sessions, contexts) if c]
    if requests:
        rig.step(requests)
        for r in requests:
            rig.cache.commit(r.session, r.tokens)


@pytest.mark.parametrize("context", CONTEXTS)
def test_chain_step_equals_hf_forward(model, context):
    rig = make_rig(model)
    sessions = [PagedSession() for _ in range(MAX_NEW)]
    contexts = [token_ids(100 + i, context) for i in range(MAX_NEW)]
    prefill(rig, sessions, contexts)
    news = [token_ids(200 + i, n) for i, n in enumerate(range(1, MAX_NEW + 1))]
    logits = rig.step([StepRequest(s, t, logits_to_keep=len(t)) for s, t in zip(sessions, news)])
    for got, c, t in zip(logits, contexts, news):
        assert_same_logits(got, hf_logits(model, c + t)[-len(t):])


@pytest.mark.parametrize("context", CONTEXTS)
def test_tree_step_equals_hf_forward_of_each_path(model, context):
    rig = make_rig(model)
    sessions = [PagedSession() for _ in range(MAX_NEW)]
    contexts = [token_ids(300 + i, context) for i in range(MAX_NEW)]
    prefill(rig, sessions, contexts)
    trees = [random_tree(400 + n, n) for n in range(1, MAX_NEW + 1)]
    news = [token_ids(500 + n, n) for n in range(1, MAX_NEW + 1)]
    logits = rig.step([StepRequest(s, t, parents=p, logits_to_keep=len(t))
                       for s, t, p in zip(sessions, news, trees)])
    for got, c, t, parents in zip(logits, contexts, news, trees):
        assert_same_logits(got, hf_tree_logits(model, c, t, parents))


def test_sessions_of_different_lengths_share_one_step(model):
    rig = make_rig(model)
    sessions = [PagedSession() for _ in CONTEXTS]
    contexts = [token_ids(600 + i, c) for i, c in enumerate(CONTEXTS)]
    prefill(rig, sessions, contexts)
    news = [token_ids(700 + i, 1 + (3 * i) % MAX_NEW) for i in range(len(CONTEXTS))]
    tree = random_tree(7, len(news[2]))  # one tree among chains: the chains' mask rows are causal
    requests = [StepRequest(s, t, parents=tree if i == 2 else None, logits_to_keep=len(t))
                for i, (s, t) in enumerate(zip(sessions, news))]
    logits = rig.step(requests)
    for i, (got, c, t) in enumerate(zip(logits, contexts, news)):
        expected = hf_tree_logits(model, c, t, tree) if i == 2 else hf_logits(model, c + t)[-len(t):]
        assert_same_logits(got, expected)


def test_logits_to_keep_returns_the_last_rows(model):
    rig = make_rig(model)
    session, ids = PagedSession(), token_ids(1, 12)
    logits = rig.step([StepRequest(session, ids, logits_to_keep=3)])[0]
    assert_same_logits(logits, hf_logits(model, ids)[-3:])


def test_rollback_reuses_the_freed_blocks_and_equals_a_fresh_run(model):
    rig = make_rig(model)
    session, prompt = PagedSession(), token_ids(10, 30)
    rig.feed(session, prompt)
    drafts = token_ids(11, MAX_NEW)  # positions 30..38: into a third block
    rig.step([StepRequest(session, drafts, logits_to_keep=MAX_NEW)])
    draft_block = session.block_table[2]
    rig.cache.commit(session, drafts[:1])
    rig.cache.truncate(session, len(prompt) + 1)  # the rest is rejected
    assert len(session.block_table) == 2 and rig.cache.blocks.refcount(draft_block) == 0
    refeed = token_ids(12, 5)  # positions 31..35: needs a third block again
    logits = rig.feed(session, refeed)
    assert session.block_table[2] == draft_block
    assert_same_logits(logits, hf_logits(model, prompt + drafts[:1] + refeed)[-5:])


def test_truncate_into_own_named_block_unnames_it_and_rewrites_it_in_place(model):
    rig = make_rig(model)
    session, ids = PagedSession(), token_ids(20, 40)
    rig.feed(session, ids)
    named = session.block_table[1]
    assert rig.cache.blocks.hash_of(named) is not None
    rig.cache.truncate(session, 20)
    refeed = token_ids(21, 6)
    logits = rig.feed(session, refeed)
    assert session.block_table[1] == named and rig.cache.blocks.hash_of(named) is None
    assert_same_logits(logits, hf_logits(model, ids[:20] + refeed)[-6:])


def test_prefix_hit_shares_blocks_and_equals_a_cold_run(model):
    rig = make_rig(model)
    first, prompt = PagedSession(), token_ids(30, 40)
    rig.feed(first, prompt)
    shared = first.block_table[:2]
    before = [(rig.cache.pool.keys[:, b].clone(), rig.cache.pool.values[:, b].clone()) for b in shared]
    second, other = PagedSession(), prompt[:35] + token_ids(31, 7)
    assert rig.cache.match_prefix(second, other) == 2 * BLOCK
    assert second.block_table == shared and [rig.cache.blocks.refcount(b) for b in shared] == [2, 2]
    logits = rig.feed(second, other[2 * BLOCK:])
    assert_same_logits(logits, hf_logits(model, other)[2 * BLOCK:])
    for b, (keys, values) in zip(shared, before):
        assert torch.equal(rig.cache.pool.keys[:, b], keys) and torch.equal(rig.cache.pool.values[:, b], values)
    assert rig.cache.bytes_in_use == (len(set(first.block_table) | set(second.block_table))
                                      * rig.cache.pool.block_bytes)


def test_prefix_hit_after_release_takes_the_block_back_from_the_lru(model):
    rig = make_rig(model)
    first, prompt = PagedSession(), token_ids(40, 20)
    rig.feed(first, prompt)
    block = first.block_table[0]
    rig.cache.release(first)
    assert rig.cache.blocks.refcount(block) == 0 and rig.cache.blocks.cached == 1
    second = PagedSession()
    assert rig.cache.match_prefix(second, prompt) == BLOCK
    assert second.block_table == [block] and rig.cache.blocks.refcount(block) == 1 and rig.cache.blocks.cached == 0
    logits = rig.feed(second, prompt[BLOCK:])
    assert_same_logits(logits, hf_logits(model, prompt)[BLOCK:])


def test_prefix_hit_leaves_the_last_token_to_feed_and_never_crosses_namespaces(model):
    rig = make_rig(model)
    first, prompt = PagedSession(), token_ids(50, 2 * BLOCK)
    rig.feed(first, prompt)
    second = PagedSession()
    # Both blocks are taken, then one token rolled back: its logits are what a caller needs.
    assert rig.cache.match_prefix(second, prompt) == 2 * BLOCK - 1
    assert second.block_table == first.block_table[:2] and second.length == 2 * BLOCK - 1
    # Refeeding it writes into a copy of the shared block, never into the first session's.
    before = rig.cache.pool.keys[:, first.block_table[1]].clone()
    rig.feed(second, prompt[-1:])
    assert second.block_table[1] != first.block_table[1]
    assert torch.equal(rig.cache.pool.keys[:, first.block_table[1]], before)
    stranger = PagedKVCache(rig.cache.pool, "another model")
    stranger.blocks = rig.cache.blocks  # the same blocks, named under another namespace's chain
    assert stranger.match_prefix(PagedSession(), prompt + [1]) == 0


def test_copy_on_write_after_rollback_into_a_shared_block(model):
    rig = make_rig(model)
    first, prompt = PagedSession(), token_ids(60, 40)
    rig.feed(first, prompt)
    second = PagedSession()
    rig.cache.match_prefix(second, prompt)
    rig.feed(second, prompt[2 * BLOCK:])
    shared = first.block_table[1]
    assert second.block_table[1] == shared and rig.cache.blocks.refcount(shared) == 2
    keys, values = rig.cache.pool.keys[:, shared].clone(), rig.cache.pool.values[:, shared].clone()
    rig.cache.truncate(second, 20)  # back into the shared block
    refeed = token_ids(61, 6)
    logits = rig.feed(second, refeed)
    assert second.block_table[1] != shared and rig.cache.blocks.refcount(shared) == 1
    assert torch.equal(rig.cache.pool.keys[:, shared], keys) and torch.equal(rig.cache.pool.values[:, shared], values)
    assert_same_logits(logits, hf_logits(model, prompt[:20] + refeed)[-6:])
    more = token_ids(62, 3)  # the first session's cache is intact
    assert_same_logits(rig.feed(first, more), hf_logits(model, prompt + more)[-3:])


@pytest.mark.parametrize("context", (14, 17))
def test_compact_keeps_the_accepted_path(model, context):
    rig = make_rig(model)
    session, ids = PagedSession(), token_ids(70, context)
    rig.feed(session, ids)
    parents = [-1, 0, 0, 1, 2, 4, 3, 5, 5]  # path 0 → 2 → 4 → 5 → 8 crosses a block boundary
    nodes = token_ids(71, len(parents))
    rig.step([StepRequest(session, nodes, parents=parents, logits_to_keep=len(nodes))])
    kept = path_to(parents, 8)
    rig.cache.compact(session, context, kept)
    rig.cache.commit(session, [nodes[k] for k in kept])
    rig.cache.truncate(session, session.length)
    following = token_ids(72, 2)
    logits = rig.feed(session, following)
    assert_same_logits(logits, hf_logits(model, ids + [nodes[k] for k in kept] + following)[-2:])


def test_eviction_takes_the_least_recently_released_first(model):
    rig = make_rig(model, num_blocks=1 + 4)  # four usable blocks and the pad block
    cache = rig.cache
    older, newer = PagedSession(), PagedSession()
    for session, seed in ((older, 80), (newer, 81)):
        ids = token_ids(seed, 2 * BLOCK)
        cache.reserve(session, len(ids))
        cache.commit(session, ids)  # allocation alone: no forward needed
    older_blocks, newer_blocks = list(older.block_table), list(newer.block_table)
    cache.release(older)
    cache.release(newer)
    assert cache.blocks.cached == 4 and cache.bytes_in_use == 0
    taker = PagedSession()
    cache.reserve(taker, 3 * BLOCK)
    # The older session's blocks go first, and of those its tail before its prefix.
    assert taker.block_table == [older_blocks[1], older_blocks[0], newer_blocks[1]]
    assert cache.blocks.cached == 1 and cache.blocks.hash_of(newer_blocks[0]) is not None


def test_reserve_that_cannot_fit_raises_and_changes_nothing(model):
    rig = make_rig(model, num_blocks=1 + 4)
    cache = rig.cache
    holder, ids = PagedSession(), token_ids(90, 2 * BLOCK)
    cache.reserve(holder, len(ids))
    cache.commit(holder, ids)
    cached = PagedSession()
    cache.reserve(cached, BLOCK)
    cache.commit(cached, token_ids(91, BLOCK))
    cache.release(cached)  # one evictable block, one free: two available
    state, pool_keys = cache.blocks.state(), cache.pool.keys.clone()
    hungry = PagedSession()
    with pytest.raises(PoolExhausted) as raised:
        cache.reserve(hungry, 3 * BLOCK)
    assert isinstance(raised.value, ResourceExhausted)
    assert cache.blocks.state() == state and hungry == PagedSession()
    sharer = PagedSession()  # copy-on-write needs a block too
    cache.match_prefix(sharer, ids + [1])
    cache.truncate(sharer, 5)
    cache.reserve(PagedSession(), 2 * BLOCK)  # takes both available blocks
    state, table = cache.blocks.state(), list(sharer.block_table)
    with pytest.raises(PoolExhausted):
        cache.reserve(sharer, 1)
    assert cache.blocks.state() == state and sharer.block_table == table
    assert torch.equal(cache.pool.keys, pool_keys)


def test_bytes_in_use_is_blocks_in_use_times_block_bytes(model):
    rig = make_rig(model, num_blocks=32)
    cache, config = rig.cache, model.config
    head_dim = config.hidden_size // config.num_attention_heads
    expected = 2 * config.num_hidden_layers * BLOCK * config.num_key_value_heads * head_dim * 4
    assert cache.pool.block_bytes == expected == block_bytes(cache.pool.shape, BLOCK, torch.float32)
    assert cache.pool.nbytes == 32 * expected == cache.pool.keys.nbytes + cache.pool.values.nbytes
    session = PagedSession()
    cache.reserve(session, 40)
    assert cache.bytes_in_use == 3 * expected == cache.held_bytes(session)
    cache.truncate(session, 0)
    assert cache.bytes_in_use == 0
    assert pool_blocks(expected, "cpu", max_cache_bytes=10 * expected + 1) == 10


def test_step_buffers_keep_their_addresses_and_pad_past_the_step(model):
    rig = make_rig(model)
    session = PagedSession()
    rig.cache.reserve(session, 5)
    first = rig.buffers.plan(rig.cache, [StepRequest(session, token_ids(1, 5))])
    static = rig.buffers.static
    assert first.slot_mapping.data_ptr() == static["slot_mapping"].data_ptr()
    assert first.block_tables.dtype == first.context_lens.dtype == first.query_starts.dtype == torch.int32
    assert static["slot_mapping"][5:].eq(PAD_BLOCK * BLOCK).all()
    assert static["query_starts"][2:].eq(5).all() and static["context_lens"][1:].eq(0).all()
    assert first.tree_mask is None
    other = PagedSession()
    rig.cache.reserve(other, 2)
    second = rig.buffers.plan(rig.cache, [StepRequest(session, [1, 2], parents=[-1, 0]),
                                          StepRequest(other, [3, 4])])
    assert second.slot_mapping.data_ptr() == first.slot_mapping.data_ptr()
    assert second.tree_mask.shape == (2, LIMITS.max_query, LIMITS.max_query)
    assert second.tree_mask[1, :2, :2].tolist() == [[True, False], [True, True]]


def test_a_step_beyond_the_reserved_positions_is_refused(model):
    rig = make_rig(model)
    session = PagedSession()
    rig.cache.reserve(session, 2)  # one block: positions 0..BLOCK - 1
    with pytest.raises(ValueError, match="reserved"):
        rig.buffers.plan(rig.cache, [StepRequest(session, token_ids(2, BLOCK + 1))])


def test_features_are_the_final_norm_and_aux_layer_outputs(model):
    rig = make_rig(model)
    session, ids = PagedSession(), token_ids(3, 7)
    rig.cache.reserve(session, len(ids))
    inputs = rig.buffers.plan(rig.cache, [StepRequest(session, ids)])
    features = rig.paged.forward(rig.cache.pool, inputs, features=True, aux_layers=(0,)).features[0]
    captured = {}
    hooks = [model.model.norm.register_forward_hook(lambda m, a, out: captured.update(norm=out)),
             model.model.layers[0].register_forward_hook(
                 lambda m, a, out: captured.update(layer=out[0] if isinstance(out, tuple) else out))]
    try:
        hf_logits(model, ids)
    finally:
        for hook in hooks:
            hook.remove()
    expected = torch.cat([captured["norm"][0], captured["layer"][0]], -1)  # [7, 2H]
    assert features.shape == expected.shape
    assert (features - expected).abs().max().item() <= LOGIT_TOLERANCE


def tiny_config(config_class, **overrides):
    return config_class(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=MAX_POSITIONS,
                        **overrides)


def test_rope_scaling_is_the_models_own():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 32}
    scaled = LlamaForCausalLM(tiny_config(LlamaConfig, rope_scaling=llama3)).eval()
    assert scaled.model.rotary_emb.rope_type == "llama3"
    rig = make_rig(scaled)
    session, ids = PagedSession(), token_ids(4, 70)  # past the original 32 positions
    rig.feed(session, ids[:60])
    assert_same_logits(rig.feed(session, ids[60:]), hf_logits(scaled, ids)[60:])


def test_a_sliding_window_model_is_refused():
    from transformers import MistralConfig, MistralForCausalLM

    windowed = MistralForCausalLM(tiny_config(MistralConfig, sliding_window=16))
    with pytest.raises(ValueError, match="sliding window"):
        PagedLlama(windowed)
