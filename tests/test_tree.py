"""Alternatives scored as tree leaves (specdec.runtime.tree blocks, target_worker.verify): a
tree block scores every branch exactly as a forward pass over that branch alone would; the
verifier commits an alternative and the target's token after it only where the chain was
cut at the alternative's depth and the target chose it; through the services, a head whose
alternatives are often the target's choice gives more tokens per round and the output is
still the target's alone, token for token, greedy and seeded-sampled."""

from __future__ import annotations

import asyncio

import pytest
import torch
from prometheus_client import REGISTRY

from specdec.train.teacher import chat_ids
from specdec.client import Client, make_request
from specdec.runtime.load import serving_lm
from specdec.runtime.paged_lm import PagedCausalLM
from specdec.runtime.tree import check_tree
from specdec.sessions import Resync
from tests.harness import reference_greedy, reference_sample, run, running_stack
from tests.factories import TEST_DEVICE
from tests.test_batching import cpu_only, fresh_sessions, tokens
# The tiny target and tokenizer fixtures, a random head for it, and the option that has it
# draft what is asked.
from tests.test_eagle_services import ALWAYS, make_head, target, tokenizer  # noqa: F401
from tests.test_inline_head import per_session

MAX_NEW = 24
PROMPTS = ["Explain how tides work.", "Write a haiku about rain.", "def add(a, b):"]


def plain_logits(target, ids: list[int], last: int) -> torch.Tensor:
    """The model alone over the whole sequence: the last `last` positions' logits, on the CPU."""
    with torch.no_grad():
        return target(torch.tensor([ids], device=target.device)).logits[0, -last:].float().cpu()


def close(actual, expected):
    actual = actual.cpu()
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4 * float(expected.abs().max()))
    assert torch.equal(actual.argmax(-1), expected.argmax(-1))


@cpu_only
def test_a_tree_block_scores_each_branch_as_that_branch_alone(target):
    lm = serving_lm(target)
    context, chain = tokens(30, 1), [11, 12, 13]
    # Fed: the last committed token, the chain, then alternatives at depths 0 and 2.
    fed = context[-1:] + chain + [21, 23]
    parents = [-1, 0, 1, 2, 0, 2]
    other_context, other_fed = tokens(17, 2), [5, 6, 7]
    sessions = fresh_sessions(lm, [context[:-1], other_context])
    out = lm.feed_batch(sessions, [fed, other_fed], [len(fed), 2], parents=[parents, None])
    full = plain_logits(target, context + chain, len(chain) + 1)
    close(out[0][:4], full)  # the chain's rows: as a chain alone
    close(out[0][4], plain_logits(target, context + [21], 1)[0])  # depth 0: after the context
    close(out[0][5], plain_logits(target, context + chain[:2] + [23], 1)[0])  # depth 2: after chain[:2]
    close(out[1], plain_logits(target, other_context + other_fed, 2))  # the other session: untouched
    # The leaves entered the cache after the chain; cropping them leaves a cache that continues right.
    lm.crop(sessions[0], len(context) + 2)
    again = lm.feed_batch(sessions[:1], [[23, 9]], [2])[0]
    close(again, plain_logits(target, context + chain[:2] + [23, 9], 2))


@pytest.mark.parametrize("fast", [True, False], ids=["packed", "stock-attention"])
def test_one_session_trees_run_packed_or_with_a_custom_mask(target, fast):
    # Packed: the CPU fast path's forward; stock attention (sdpa, as a GPU serves the model):
    # one session at a time with an additive 4D mask and explicit positions.
    if fast and TEST_DEVICE != "cpu":
        pytest.skip("the packed forward is the CPU fast path's")
    lm = serving_lm(target, fast)
    assert lm.runs_trees and lm.batches_in_one_pass == fast
    context, chain = tokens(12, 3), [40, 41]
    sessions = fresh_sessions(lm, [context[:-1], tokens(9, 4)])
    out = lm.feed_batch(sessions, [context[-1:] + chain + [50, 51], [7, 8]], [5, 1],
                        parents=[[-1, 0, 1, 0, 1], None])
    close(out[0][:3].cpu(), plain_logits(target, context + chain, 3))
    close(out[0][3].cpu(), plain_logits(target, context + [50], 1)[0])
    close(out[0][4].cpu(), plain_logits(target, context + chain[:1] + [51], 1)[0])
    close(out[1].cpu(), plain_logits(target, tokens(9, 4) + [7, 8], 1))
    lm.crop(sessions[0], len(context) + 1)
    again = lm.feed(sessions[0], [51, 3], 2)
    close(again.cpu(), plain_logits(target, context + chain[:1] + [51, 3], 2))


def test_a_model_whose_attention_takes_no_mask_runs_no_trees(tokenizer):
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                           sliding_window=16)
    lm = serving_lm(MistralForCausalLM(config).eval())
    assert not lm.runs_trees
    with pytest.raises(ValueError, match="custom mask"):
        lm.feed_batch(fresh_sessions(lm, [tokens(5, 1)]), [[1, 2]], [2], parents=[[-1, 0]])


def test_a_tree_names_only_earlier_parents():
    check_tree([-1, 0, 1, 0, 2])
    for bad in ([0], [-1, 1], [-1, 0, 5], [-2]):
        with pytest.raises(ValueError, match="parent"):
            check_tree(bad)


def oracle(head, target, tokenizer, prompts, wrong_at: int = 1, answer=None):
    """Makes the head on the target worker draft, for any context on the way to a prompt's
    answer (greedy, or answer(prompt ids, n)), the answer's next 3 tokens with the one at
    depth `wrong_at` replaced by a wrong token, the right one as that depth's alternative,
    and a wrong alternative at depth 0 (the chain is right there, so it must never be used).
    The head's own chain still runs first, so its state moves as it would."""
    answer = answer or (lambda ids, n: reference_greedy(target, ids, n))
    answers = []
    for text in prompts:
        ids = chat_ids(tokenizer, text)
        answers.append(ids + answer(ids, MAX_NEW + 4))
    vocab = target.config.vocab_size
    calls = []

    def propose_tree(synced, k, features, result):
        context = list(synced.context)
        for full in answers:
            if full[:len(context)] == context and len(full) >= len(context) + 3 and k >= 3:
                truth = full[len(context):len(context) + 3]
                chain = list(truth)
                chain[wrong_at] = (truth[wrong_at] + 1) % vocab
                calls.append(context)
                return chain, [(0, (truth[0] + 2) % vocab), (wrong_at, truth[wrong_at])]
        return result

    per_session(head, propose_tree)
    return calls


@pytest.fixture(scope="module", params=[({}, {}), ({"batching": False}, {}), ({}, {"cpu_fast_path": False})],
                ids=["batched", "unbatched", "stock-attention"])
def greedy_oracle_run(request, target, tokenizer):
    """Greedy requests whose blocks the oracle head makes wrong at one depth, with the right
    token as that depth's alternative: (results, oracle calls, counter delta, packed forward on)."""
    options, target_options = request.param

    async def scenario():
        async with running_stack(target, tokenizer, target_head=make_head(target),
                                 target_options={**ALWAYS, **target_options}, **options) as stack:
            lm = stack.target_servicer.verifier.lm
            packed, paged = lm.batches_in_one_pass, isinstance(lm, PagedCausalLM)
            calls = oracle(stack.target_servicer.verifier.head, target, tokenizer, PROMPTS)
            async with Client(stack.address) as client:
                concurrent = await asyncio.gather(*[client.complete(make_request(p, max_new_tokens=MAX_NEW, k=4))
                                                    for p in PROMPTS])
            return concurrent, calls, packed, paged

    before = REGISTRY.get_sample_value("specdec_alternative_tokens_total") or 0.0
    results, calls, packed, paged = run(scenario())
    after = REGISTRY.get_sample_value("specdec_alternative_tokens_total")
    # One forward per step: the paged pool always, the buffered caches on the CPU fast path.
    return results, calls, after - before, packed == (paged or (TEST_DEVICE == "cpu" and not target_options))


def test_greedy_output_with_alternatives_is_the_targets(greedy_oracle_run, target, tokenizer):
    results, calls, _, _ = greedy_oracle_run
    assert calls
    for text, result in zip(PROMPTS, results):
        assert result.token_ids == reference_greedy(target, chat_ids(tokenizer, text), MAX_NEW), text


def test_alternatives_the_target_chose_are_committed(greedy_oracle_run):
    results, _, _, _ = greedy_oracle_run
    for result in results:
        stats = result.stats
        # Rounds on the oracle's drafts commit 1 chain token, the alternative and the token after it.
        assert stats["alternative_tokens"] >= 2 * 3, stats
        assert stats["tokens_per_round"] > 2.5, stats
        # α stays the chain's: the alternatives are neither proposed nor accepted draft tokens.
        assert stats["accepted"] < stats["proposed"]


def test_the_alternative_tokens_counter_moves_by_what_requests_report(greedy_oracle_run):
    results, _, moved, _ = greedy_oracle_run
    assert moved == sum(r.stats["alternative_tokens"] for r in results)


def test_the_packed_forward_runs_exactly_where_expected(greedy_oracle_run):
    assert greedy_oracle_run[3]


@pytest.fixture(scope="module")
def sampled_oracle_run(target, tokenizer):
    """Seeded sampled requests whose alternatives name the target's own draws: its draw at the
    cut is the alternative, and the draw after it comes from the leaf."""
    params = dict(temperature=0.9, top_p=0.95, seed=7)

    def sample(ids, n):
        return reference_sample(target, ids, n, params["temperature"], top_p=params["top_p"], seed=params["seed"])

    async def scenario():
        async with running_stack(target, tokenizer, target_head=make_head(target), target_options=ALWAYS) as stack:
            calls = oracle(stack.target_servicer.verifier.head, target, tokenizer, PROMPTS, answer=sample)
            async with Client(stack.address) as client:
                results = [await client.complete(make_request(p, max_new_tokens=MAX_NEW, k=4, **params))
                           for p in PROMPTS]
            return results, calls

    results, calls = run(scenario())
    return results, calls, sample


def test_sampled_output_with_alternatives_is_the_targets_sampling(sampled_oracle_run, tokenizer):
    results, calls, sample = sampled_oracle_run
    assert calls
    for text, result in zip(PROMPTS, results):
        assert result.token_ids == sample(chat_ids(tokenizer, text), MAX_NEW), text


def test_sampled_alternatives_that_are_the_targets_draw_are_committed(sampled_oracle_run):
    results, _, _ = sampled_oracle_run
    for result in results:
        assert result.stats["alternative_tokens"] >= 2 * 3, result.stats
        assert result.stats["tokens_per_round"] > 2.5, result.stats


@pytest.mark.parametrize("min_alt_prob", [0.0, 1.0], ids=["every-depth", "off"])
def test_a_random_heads_own_alternatives_leave_the_output_alone(target, tokenizer, min_alt_prob, monkeypatch):
    # The head's real alternatives (at every depth at 0, none at 1), nearly all wrong here;
    # the head's own cuts alone, without the coordinator's price of a row.
    from coordinator.rounds import RoundRunner

    monkeypatch.setattr(RoundRunner, "_draft_price", lambda self, gen: 0.0)

    async def scenario():
        async with running_stack(target, tokenizer, target_head=make_head(target),
                                 target_options={**ALWAYS, "min_alt_prob": min_alt_prob}) as stack:
            head = stack.target_servicer.verifier.head
            head.drafter.lookup_ngram = 0  # every chain the head's own (a copied one has no alternatives)
            proposed = []

            def propose_tree(synced, k, features, result):
                if not isinstance(result, Resync):
                    proposed.append(result)
                return result

            per_session(head, propose_tree)
            async with Client(stack.address) as client:
                results = [await client.complete(make_request(p, max_new_tokens=MAX_NEW, k=4)) for p in PROMPTS]
            return results, proposed

    results, proposed = run(scenario())
    for text, result in zip(PROMPTS, results):
        assert result.token_ids == reference_greedy(target, chat_ids(tokenizer, text), MAX_NEW), text
    chains = [(chain, alternatives) for chain, alternatives in proposed if chain]
    assert chains
    if min_alt_prob == 0.0:
        # Every depth of every chain has one, and none names the chain's own token there.
        assert all([d for d, _ in alternatives] == list(range(len(chain))) for chain, alternatives in chains)
        assert all(chain[d] != t for chain, alternatives in chains for d, t in alternatives)
    else:
        assert all(not alternatives for _, alternatives in chains)
        assert all(r.stats["alternative_tokens"] == 0 for r in results)
