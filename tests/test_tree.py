"""Alternatives scored as tree leaves (specdec.ragged tree blocks, target_worker.verify): a
tree block scores every branch exactly as a forward pass over that branch alone would; the
verifier commits an alternative and the target's token after it only where the chain was
cut at the alternative's depth and the target chose it; through the services, a head whose
alternatives are often the target's choice gives more tokens per round and the output is
still the target's alone, token for token."""

from __future__ import annotations

import asyncio

import pytest
import torch

from specdec import distill
from specdec.client import Client, make_request
from specdec.cpu_fast import serving_lm
from specdec.ragged import check_tree
from tests.harness import reference_greedy, run, running_stack
from tests.test_batching import cpu_only, fresh_sessions, tokens
# The tiny target and tokenizer fixtures, a random head for it, and the option that has it
# draft what is asked.
from tests.test_eagle_services import ALWAYS, make_head, target, tokenizer  # noqa: F401

MAX_NEW = 24
PROMPTS = ["Explain how tides work.", "Write a haiku about rain.", "def add(a, b):"]


def plain_logits(target, ids: list[int], last: int) -> torch.Tensor:
    with torch.no_grad():
        return target(torch.tensor([ids])).logits[0, -last:].float()


def close(actual, expected):
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


@cpu_only
def test_one_session_tree_runs_packed_and_trees_need_the_packed_forward(target):
    lm = serving_lm(target)
    context = tokens(12, 3)
    session = fresh_sessions(lm, [context[:-1]])
    out = lm.feed_batch(session, [context[-1:] + [40, 41, 50]], [4], parents=[[-1, 0, 1, 0]])[0]
    close(out[3], plain_logits(target, context + [50], 1)[0])
    plain = serving_lm(target, False)  # stock attention: no packed forward
    assert not plain.batches_in_one_pass
    with pytest.raises(ValueError, match="packed forward"):
        plain.feed_batch(fresh_sessions(plain, [context]), [[1, 2]], [2], parents=[[-1, 0]])


def test_a_tree_names_only_earlier_parents():
    check_tree([-1, 0, 1, 0, 2])
    for bad in ([0], [-1, 1], [-1, 0, 5], [-2]):
        with pytest.raises(ValueError, match="parent"):
            check_tree(bad)


def oracle(head, target, tokenizer, prompts, wrong_at: int = 1):
    """Makes the head on the target worker draft, for any context on the way to a prompt's
    greedy answer, the answer's next 3 tokens with the one at depth `wrong_at` replaced by a
    wrong token, the right one as that depth's alternative, and a wrong alternative at depth
    0 (the chain is right there, so it must never be used). The head's own chain still runs
    first, so its state moves as it would."""
    answers = []
    for text in prompts:
        ids = distill.chat_ids(tokenizer, text)
        answers.append(ids + reference_greedy(target, ids, MAX_NEW + 4))
    original = head.drafter.propose_tree
    vocab = target.config.vocab_size
    calls = []

    def propose_tree(synced, k, features=None):
        result = original(synced, k, features)
        context = list(synced.context)
        for full in answers:
            if full[:len(context)] == context and len(full) >= len(context) + 3 and k >= 3:
                truth = full[len(context):len(context) + 3]
                chain = list(truth)
                chain[wrong_at] = (truth[wrong_at] + 1) % vocab
                calls.append(context)
                return chain, [(0, (truth[0] + 2) % vocab), (wrong_at, truth[wrong_at])]
        return result

    head.drafter.propose_tree = propose_tree
    return calls


@cpu_only
@pytest.mark.parametrize("options", [{}, {"batching": False}], ids=["batched", "unbatched"])
def test_alternatives_the_target_chose_are_committed_and_output_is_the_targets(target, tokenizer, options):
    async def scenario():
        async with running_stack(target, tokenizer, target_head=make_head(target), target_options=ALWAYS,
                                 **options) as stack:
            calls = oracle(stack.target_servicer.verifier.head, target, tokenizer, PROMPTS)
            async with Client(stack.address) as client:
                concurrent = await asyncio.gather(*[client.complete(make_request(p, max_new_tokens=MAX_NEW, k=4))
                                                    for p in PROMPTS])
            return concurrent, calls

    results, calls = run(scenario())
    assert calls
    for text, result in zip(PROMPTS, results):
        assert result.token_ids == reference_greedy(target, distill.chat_ids(tokenizer, text), MAX_NEW), text
        stats = result.stats
        # Rounds on the oracle's drafts commit 1 chain token, the alternative and the token after it.
        assert stats["alternative_tokens"] >= 2 * 3, stats
        assert stats["tokens_per_round"] > 2.5, stats
        # α stays the chain's: the alternatives are neither proposed nor accepted draft tokens.
        assert stats["accepted"] < stats["proposed"]


@cpu_only
def test_sampled_rounds_and_switched_off_alternatives_run_the_chain_alone(target, tokenizer):
    request = dict(max_new_tokens=MAX_NEW, k=4, temperature=0.9, top_p=0.95, seed=7)

    async def scenario(min_alt_prob, sample):
        async with running_stack(target, tokenizer, target_head=make_head(target),
                                 target_options={**ALWAYS, "min_alt_prob": min_alt_prob}) as stack:
            calls = oracle(stack.target_servicer.verifier.head, target, tokenizer, PROMPTS)
            async with Client(stack.address) as client:
                results = [await client.complete(make_request(p, **(request if sample else
                                                                     {"max_new_tokens": MAX_NEW, "k": 4})))
                           for p in PROMPTS]
            return results, calls

    sampled, _ = run(scenario(0.05, True))
    assert all(r.stats["alternative_tokens"] == 0 for r in sampled)
    greedy, _ = run(scenario(1.0, False))
    for text, result in zip(PROMPTS, greedy):
        assert result.token_ids == reference_greedy(target, distill.chat_ids(tokenizer, text), MAX_NEW), text
