"""The head drafting for many sessions at once (specdec.eagle.batched) over either storage —
its own paged pool (specdec.eagle.paged) or buffered caches — one head forward per draft
depth over every session, and the verifier's one host read per step.

What the batched head drafts is what the one-session head (EagleDrafter.propose_tree)
drafts for each session alone — chains, alternatives, the n-gram copy and the early stop —
over rounds that roll its draft entries back; its pool gives blocks back; a pool too small
drops drafts, never output; and host reads are counted where a GPU would stall on them."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

from specdec.eagle.batched import BatchedDrafter, BufferedHead
from specdec.eagle.paged import PagedHead, head_pool_blocks
from specdec.eagle.policy import EagleDrafter, Features
from specdec.runtime.load import serving_lm
from specdec.sampling import Sampling
from specdec.sessions import Resync, Session, SessionStore, SyncedContext, common_prefix_len
from target_worker.head import load_inline_head
from target_worker.verify import Round, Verifier
from tests.factories import make_tiny_model, make_tiny_tokenizer
from tests.harness import reference_greedy
from tests.test_eagle_services import hidden_states, make_head

torch.set_num_threads(2)


@pytest.fixture(scope="module")
def target():
    return make_tiny_model(make_tiny_tokenizer(), seed=0)


def contexts_for(target, count: int, rounds: int) -> list[list[list[int]]]:
    """Per session, the committed context at each round: a prompt, then the target's greedy
    continuation growing by 1–3 tokens a round (as accepted blocks would)."""
    out = []
    for s in range(count):
        prompt = [(7 * s + 3 * i) % 100 + 5 for i in range(4 + 3 * s)]
        full = prompt + reference_greedy(target, prompt, 3 * rounds)
        ends, end = [], len(prompt)
        for r in range(rounds):
            ends.append(end)
            end += 1 + (s + r) % 3
        out.append([full[:e] for e in ends])
    return out


def one_session(drafter: EagleDrafter, session: Session, context: list[int], features: Features, k: int):
    return drafter.propose_tree(SyncedContext(session, context, common_prefix_len(session.ids, context)), k, features)


@pytest.mark.parametrize("policy", [dict(min_chain_prob=0.0, min_alt_prob=0.0, lookup_ngram=0),
                                    dict(min_chain_prob=0.002, min_alt_prob=0.001, lookup_ngram=0),
                                    dict(min_chain_prob=0.0, min_alt_prob=1.0, lookup_ngram=2)],
                         ids=["every-depth", "early-stop", "ngram-copy"])
@pytest.mark.parametrize("paged", [True, False], ids=["paged", "buffered"])
def test_the_batched_head_drafts_what_each_session_alone_drafts(target, policy, paged):
    head = make_head(target)
    alone = EagleDrafter("alone", copy.deepcopy(head), **policy)
    # Paged: 5 sessions over a batch limit of 3, two head forwards per depth.
    storage = PagedHead(head, 64, block_size=4, max_batch=3) if paged else BufferedHead(head)
    batched = BatchedDrafter(EagleDrafter("batched", head, **policy), storage)
    count, rounds = 5, 4
    contexts = contexts_for(target, count, rounds)
    ks = [1, 3, 5, 2, 4]
    alone_sessions = [Session(f"a{i}") for i in range(count)]
    batched_sessions = [Session(f"b{i}") for i in range(count)]
    drafted = 0
    for r in range(rounds):
        features = [Features.from_rows(0, hidden_states(target, contexts[s][r])[:-1]) for s in range(count)]
        expected = [one_session(alone, alone_sessions[s], contexts[s][r], features[s], ks[s]) for s in range(count)]
        synced = [SyncedContext(batched_sessions[s], contexts[s][r],
                                common_prefix_len(batched_sessions[s].ids, contexts[s][r])) for s in range(count)]
        got = batched.propose_tree(synced, ks, features)
        assert got == expected, f"round {r}"
        drafted += sum(len(chain) for chain, _ in got)
        for s in range(count):  # the head's cache holds what the one-session head's holds
            assert batched_sessions[s].ids == alone_sessions[s].ids
            assert batched_sessions[s].ids[:len(contexts[s][r])] == contexts[s][r]
    assert drafted > 0
    for session in batched_sessions:
        batched.forget(session)
    assert not paged or storage.in_use() == 0


def test_missing_features_ask_for_a_resync_from_the_first_missing_position(target):
    head = make_head(target)
    batched = BatchedDrafter(EagleDrafter("h", head), BufferedHead(head))
    context = list(range(5, 25))
    rows = hidden_states(target, context)[:-1]
    session = Session("s")
    got = batched.propose_tree([SyncedContext(session, context, 0)], [3], [Features.from_rows(4, rows[4:])])
    assert got == [Resync(cached_len=0)]


def test_a_full_head_pool_drops_that_sessions_drafts_not_the_others(target):
    head = make_head(target)
    # Block size 4, 6 usable blocks: a 12-token session with k = 4 takes 4 of them, so the
    # second such session cannot fit.
    batched = BatchedDrafter(EagleDrafter("h", head, min_chain_prob=0.0), PagedHead(head, 7, block_size=4))
    contexts = [list(range(5, 17)), list(range(30, 42))]
    features = [Features.from_rows(0, hidden_states(target, c)[:-1]) for c in contexts]
    sessions = [Session("a"), Session("b")]
    got = batched.propose_tree([SyncedContext(s, c, 0) for s, c in zip(sessions, contexts)], [4, 4], features)
    assert len(got[0][0]) == 4 and got[1] == Resync(cached_len=0)
    batched.forget(sessions[1])
    assert batched.storage.in_use() == len(sessions[0].cache.block_table)


def test_head_pool_blocks_cover_the_targets_tokens_and_each_sessions_draft():
    assert head_pool_blocks(1600, 10, 8, 16) == 100 + 10 * 2 + 1
    assert head_pool_blocks(1601, 1, 16, 16) == 101 + 3 + 1


@contextlib.contextmanager
def host_reads(monkeypatch, outside=()):
    """Counts tensor → Python reads (tolist, item, int, float, bool) made while the block
    runs, except inside the functions `outside` names as (object, attribute)."""
    counts = {"reads": 0, "inside": 0}
    for name in ("tolist", "item", "__int__", "__float__", "__bool__", "__index__"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, **kwargs):
            if not counts["inside"]:
                counts["reads"] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    for owner, attribute in outside:
        inner = getattr(owner, attribute)

        def uncounted(*args, _inner=inner, **kwargs):
            counts["inside"] += 1
            try:
                return _inner(*args, **kwargs)
            finally:
                counts["inside"] -= 1

        monkeypatch.setattr(owner, attribute, uncounted)
    yield counts
    monkeypatch.undo()


def test_a_verification_step_reads_the_host_once(target, monkeypatch):
    # Greedy and sampled rounds, with and without drafts, decided in one read of all results.
    lm = serving_lm(target, False)
    verifier = Verifier(lm, SessionStore(8, 1 << 30, lm.bytes_per_token), 8)
    prompts = {f"s{i}": list(range(5 + i, 20 + 2 * i)) for i in range(4)}
    verifier.verify_batch([Round(name, 0, ids, []) for name, ids in prompts.items()])
    sampled = Sampling(temperature=0.8, top_k=0, top_p=1.0, seed=3)
    rounds = [Round(name, len(ids), [1 + i], [2, 3, 4][:i], sampled if i % 2 else Sampling())
              for i, (name, ids) in enumerate(prompts.items())]
    # The CPU reference attention and warp check read index values on the host (a GPU's
    # kernels do not): they are not the decision's reads.
    from target_worker.kernels import ops

    outside = [(type(lm), "feed_batch"), (ops, "warp_probs")]
    with host_reads(monkeypatch, outside) as counts:
        outcome = verifier.verify_batch(rounds)
    assert all(not isinstance(r, BaseException) for r in outcome.results)
    assert counts["reads"] == 1


@pytest.mark.parametrize("paged", [True, False], ids=["paged", "buffered"])
def test_head_drafting_reads_the_host_once_per_depth(target, monkeypatch, paged):
    head = make_head(target)
    storage = PagedHead(head, 64, block_size=4) if paged else BufferedHead(head)
    batched = BatchedDrafter(EagleDrafter("h", head, min_chain_prob=0.0, lookup_ngram=0), storage)
    contexts = [list(range(5, 17)), list(range(30, 39)), list(range(50, 70))]
    features = [Features.from_rows(0, hidden_states(target, c)[:-1]) for c in contexts]
    sessions = [Session(str(i)) for i in range(3)]
    k = 5
    # The CPU reference attention reads its index vectors on the host (a GPU kernel does not).
    with host_reads(monkeypatch, [(storage, "attention")] if paged else []) as counts:
        got = batched.propose_tree([SyncedContext(s, c, 0) for s, c in zip(sessions, contexts)], [k] * 3, features)
    assert all(len(chain) == k for chain, _ in got)
    assert counts["reads"] == k  # one per depth, whatever the number of sessions


def test_an_inline_head_gives_its_blocks_back_when_the_store_drops_a_session(target):
    lm = serving_lm(target, False, "paged", max_cache_bytes=1 << 24)
    inline = load_inline_head(None, target, make_head(target), fast=False, min_chain_prob=0.0)
    store = SessionStore(2, 1 << 30, lm.bytes_per_token)
    verifier = Verifier(lm, store, 8, inline)
    assert isinstance(inline.batched.storage, PagedHead)  # beside a paged target
    blocks = inline.batched.storage.cache.blocks
    for name in ("a", "b", "c"):  # the third evicts the first (2 sessions at most)
        verdict = verifier.verify(name, 0, list(range(5, 40)), [], draft_next=4)
        assert len(verdict.next_drafts) == 4
    held = sum(len(store.get(n).head.session.cache.block_table) for n in ("b", "c"))
    assert blocks.in_use == held > 0
    store.release("b")
    store.release("c")
    assert blocks.in_use == 0


@pytest.mark.parametrize("paged", [True, False], ids=["paged", "buffered"])
def test_a_sessions_floor_cuts_its_chain_and_alternatives_as_that_policy_would(target, paged):
    """The caller's per-session floor (VerifyRequest.min_draft_prob) raises both cuts for that
    session alone: each session drafts what a one-session drafter whose cuts are the higher
    of its own and the floor drafts, in the same batch as sessions without a floor."""
    head = make_head(target)
    alone_head = copy.deepcopy(head)
    base = dict(min_chain_prob=0.0, min_alt_prob=0.0, lookup_ngram=0)
    storage = PagedHead(head, 64, block_size=4, max_batch=3) if paged else BufferedHead(head)
    batched = BatchedDrafter(EagleDrafter("batched", head, **base), storage)
    count, rounds, k = 5, 4, 4
    floors = [0.0, 0.002, 2.0, 0.0015, 0.0]
    alone = [EagleDrafter("alone", alone_head, min_chain_prob=f, min_alt_prob=f, lookup_ngram=0) for f in floors]
    contexts = contexts_for(target, count, rounds)
    alone_sessions = [Session(f"a{i}") for i in range(count)]
    batched_sessions = [Session(f"b{i}") for i in range(count)]
    lengths = [[] for _ in range(count)]
    for r in range(rounds):
        features = [Features.from_rows(0, hidden_states(target, contexts[s][r])[:-1]) for s in range(count)]
        expected = [one_session(alone[s], alone_sessions[s], contexts[s][r], features[s], k) for s in range(count)]
        synced = [SyncedContext(batched_sessions[s], contexts[s][r],
                                common_prefix_len(batched_sessions[s].ids, contexts[s][r])) for s in range(count)]
        got = batched.propose_tree(synced, [k] * count, features, floors)
        assert got == expected, f"round {r}"
        for s, (chain, _) in enumerate(got):
            lengths[s].append(len(chain))
    assert lengths[0] == [k] * rounds and lengths[4] == [k] * rounds  # no floor, no cut
    assert lengths[2] == [0] * rounds  # a floor above 1: nothing is worth drafting
    assert min(lengths[1] + lengths[3]) < k  # the small floors cut some chain short
