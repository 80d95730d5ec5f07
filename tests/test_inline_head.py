"""A feature-level head run by the target worker itself (target_worker.head): it drafts each
next round in the verification step from the hidden states the target has just computed;
the output is still the target's alone — batched, unbatched, with chunked prefill, sampled,
and when the target loses the session mid-request. The features the head is fed are the
target's own hidden states, position by position."""

from __future__ import annotations

import asyncio

import pytest

from specdec.train.teacher import chat_ids
from specdec.client import Client, make_request
from specdec.errors import FailedPrecondition, InvalidArgument
from specdec.sessions import SessionStore
from target_worker.head import InlineHead
from target_worker.verify import Verifier
from tests.factories import make_tiny_model
from tests.harness import reference_greedy, run, running_stack
# The tiny target and tokenizer fixtures, a random head for it, the check that features are
# the target's hidden states, and the option that has a random head draft what is asked.
from tests.test_eagle_services import ALWAYS, check_features, make_head, target, tokenizer  # noqa: F401

MAX_NEW = 24
PROMPTS = ["Explain how tides work.", "Write a haiku about rain.", "def add(a, b):"]


def per_session(head: InlineHead, hook) -> None:
    """Wraps the head's batched drafting: hook(synced, k, features, result) sees each
    session's part of every batch and returns what that session gets instead."""
    original = head.propose

    def propose(synced, ks, features, min_probs=None):
        results = original(synced, ks, features, min_probs)
        return [hook(s, k, f, r) for s, k, f, r in zip(synced, ks, features, results)]

    head.propose = propose


def recording(head: InlineHead):
    """Records (context, features) of every draft the head makes on the target worker."""
    seen = []

    def record(synced, k, features, result):
        seen.append((list(synced.context), features))
        return result

    per_session(head, record)
    return seen


def served_with_head(target, tokenizer, head, **options):
    """PROMPTS through a stack whose target worker runs `head` (drafting at any confidence):
    the results, each checked token-identical to the target alone, and what the head saw."""

    async def scenario():
        async with running_stack(target, tokenizer, target_head=head, target_options=ALWAYS, **options) as stack:
            assert stack.draft is None  # no draft worker at all
            seen = recording(stack.target_servicer.verifier.head)
            async with Client(stack.address) as client:
                results = [await client.complete(make_request(p, max_new_tokens=MAX_NEW, k=4)) for p in PROMPTS]
            return results, seen

    results, seen = run(scenario())
    for text, result in zip(PROMPTS, results):
        assert result.token_ids == reference_greedy(target, chat_ids(tokenizer, text), MAX_NEW), text
    return results, seen


@pytest.mark.parametrize("options", [{}, {"batching": False}, {"prefill_chunk_tokens": 8}],
                         ids=["batched", "unbatched", "chunked-prefill"])
def test_a_head_on_the_target_is_token_identical(target, tokenizer, options, monkeypatch):
    from coordinator.adaptive import AdaptiveK

    # Draft every round: a random head's acceptance would soon have the controller stop
    # asking it, and each request is to exercise the head.
    monkeypatch.setattr(AdaptiveK, "next_k", lambda self, *args: self.k_max)
    results, seen = served_with_head(target, tokenizer, make_head(target), **options)
    for result in results:
        stats = result.stats
        assert stats["proposed"] > 0
        # Each block with a rejected token counts once; a block accepted whole does not.
        rejected = stats["proposed"] - stats["accepted"]
        assert (rejected > 0) <= (stats["rejected_blocks"] > 0)
        assert stats["rejected_blocks"] <= min(rejected, stats["rounds"])
    assert check_features(target, seen) > 0


def test_concurrent_requests_with_a_head_on_the_target(target, tokenizer):
    head = make_head(target, seed=1)

    async def scenario():
        async with running_stack(target, tokenizer, target_head=head, target_options=ALWAYS) as stack:
            async with Client(stack.address) as client:
                return await asyncio.gather(*[client.complete(make_request(p, max_new_tokens=MAX_NEW, k=3))
                                              for p in PROMPTS * 2])

    for text, result in zip(PROMPTS * 2, run(scenario())):
        assert result.token_ids == reference_greedy(target, chat_ids(tokenizer, text), MAX_NEW), text


def test_sampling_with_a_head_on_the_target_matches_sampling_without(target, tokenizer):
    head = make_head(target)
    request = dict(max_new_tokens=MAX_NEW, k=4, temperature=0.9, top_p=0.95, seed=1234)

    async def scenario(with_head):
        async with running_stack(target, tokenizer, target_head=head if with_head else None,
                                 target_options=ALWAYS) as stack:
            async with Client(stack.address) as client:
                return [await client.complete(make_request(p, **request)) for p in PROMPTS]

    with_head = run(scenario(True))
    alone = run(scenario(False))
    assert [r.token_ids for r in with_head] == [r.token_ids for r in alone]
    assert sum(r.stats["proposed"] for r in with_head) > 0


def test_a_session_lost_mid_request_rebuilds_the_head(target, tokenizer, monkeypatch):
    from coordinator.adaptive import AdaptiveK
    from tests.test_services import Gate

    monkeypatch.setattr(AdaptiveK, "next_k", lambda self, *args: self.k_max)  # draft every round
    head = make_head(target)
    prompt, max_new = PROMPTS[0], 48

    async def scenario():
        async with running_stack(target, tokenizer, target_head=head, target_options=ALWAYS) as stack:
            verifier = stack.target_servicer.verifier
            gate = Gate(verifier.verify_batch, at_call=5)
            verifier.verify_batch = gate
            async with Client(stack.address) as client:
                task = asyncio.create_task(client.complete(make_request(prompt, max_new_tokens=max_new, k=4)))
                assert await asyncio.to_thread(gate.entered.wait, 30)
                # The model thread waits in the gate: drop every session, as an eviction would.
                for session_id in list(verifier.store._sessions):
                    verifier.store.release(session_id)
                seen = recording(verifier.head)
                gate.release.set()
                result = await task
            return result, seen

    result, seen = run(scenario())
    assert result.token_ids == reference_greedy(target, chat_ids(tokenizer, prompt), max_new)
    assert result.stats["resyncs"] >= 1
    assert any(f.start == 0 for _, f in seen)  # the head was fed again from position 0
    assert check_features(target, seen) > 0


def test_draft_next_beyond_the_limit_is_invalid(target):
    from specdec.runtime.load import serving_lm
    from target_worker.head import load_inline_head

    lm = serving_lm(target)
    verifier = Verifier(lm, SessionStore(8, 1 << 30, lm.bytes_per_token), 4,
                        load_inline_head(None, target, make_head(target), min_chain_prob=0.0))
    with pytest.raises(InvalidArgument, match="draft_next"):
        verifier.verify("s", 0, list(range(5, 15)), [], draft_next=5)
    first = verifier.verify("s", 0, list(range(5, 15)), [], draft_next=4)
    assert len(first.next_drafts) == 4
    plain = Verifier(lm, SessionStore(8, 1 << 30, lm.bytes_per_token), 4)
    assert plain.verify("t", 0, list(range(5, 15)), [], draft_next=4).next_drafts == ()  # no head: none


def test_a_draft_price_that_is_not_a_finite_number_at_least_0_is_invalid(target, tokenizer):
    """VerifyRequest.min_draft_prob through a real target worker: a bad one fails its own
    round with INVALID_ARGUMENT, the step's other rounds are answered, and a price above 1
    gets no drafts (no token is that sure)."""
    import grpc

    from specdec.v1 import common_pb2, target_pb2, target_pb2_grpc
    from tests.harness import start_target

    prompt = chat_ids(tokenizer, PROMPTS[0])
    prices = [float("nan"), -0.5, float("inf"), 0.0, 1.5]

    async def scenario():
        server, _ = await start_target(target, tokenizer, head=make_head(target), **ALWAYS)
        try:
            async with grpc.aio.insecure_channel(server.address) as channel:
                stub = target_pb2_grpc.TargetWorkerStub(channel)
                return await stub.VerifyBatch(target_pb2.VerifyBatchRequest(rounds=[
                    target_pb2.VerifyRequest(delta=common_pb2.SessionDelta(session_id=f"s{i}", start=0, tokens=prompt),
                                             draft_next=4, min_draft_prob=price)
                    for i, price in enumerate(prices)]), timeout=60)
        finally:
            await server.stop(grace=0)

    answer = run(scenario())
    for item in answer.results[:3]:
        assert item.WhichOneof("result") == "error"
        assert item.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "min_draft_prob" in item.error.message
    free, dear = answer.results[3].verdict, answer.results[4].verdict
    assert len(free.next_drafts) > 0
    assert len(dear.next_drafts) == 0


def test_a_head_for_another_target_is_refused_at_start(target, tokenizer):
    other = make_tiny_model(tokenizer, seed=1, hidden=32)

    async def scenario():
        async with running_stack(target, tokenizer, target_head=make_head(other)):
            pass

    with pytest.raises(FailedPrecondition, match="width 32"):
        run(scenario())


def test_the_draft_worker_drafts_only_for_a_target_replica_without_a_head(target, tokenizer, monkeypatch):
    from coordinator.adaptive import AdaptiveK

    # Draft every round: whether the adaptive controller would pause depends on measured times.
    monkeypatch.setattr(AdaptiveK, "next_k", lambda self, *args: self.k_max)
    head = make_head(target)
    prompt = PROMPTS[1]

    async def scenario():
        async with running_stack(target, tokenizer, draft="ngram", target_head=head, target_options=ALWAYS) as stack:
            proposer = stack.draft_servicer.proposer
            calls = []
            original = proposer.propose_batch

            def propose_batch(*args, **kwargs):
                calls.append(1)
                return original(*args, **kwargs)

            proposer.propose_batch = propose_batch
            runner = stack.coordinator_servicer.runner
            async with Client(stack.address) as client:
                with_head = await client.complete(make_request(prompt, max_new_tokens=MAX_NEW, k=4))
                asked_with_head = len(calls)
                # The replica now reports no head (a pod rolled back to one without it).
                for address in list(runner.target.heads):
                    runner.target.heads[address] = ""
                without = await client.complete(make_request(prompt, max_new_tokens=MAX_NEW, k=4))
            return with_head, asked_with_head, without, len(calls)

    with_head, asked_with_head, without, asked = run(scenario())
    reference = reference_greedy(target, chat_ids(tokenizer, prompt), MAX_NEW)
    assert with_head.token_ids == reference and without.token_ids == reference
    assert with_head.stats["proposed"] > 0 and asked_with_head == 0
    assert asked > 0


# ----------------------------------------------------------------------------- aux layers


def aux_head(target, aux_layers=(0,), seed: int = 0):
    """A random head that also reads the outputs of target layers `aux_layers` (EAGLE-3
    style), with a non-zero aux projection so that those states change its drafts."""
    import torch

    from specdec import eagle

    torch.manual_seed(seed)
    vocab = torch.arange(0, target.config.vocab_size, 2)
    head = eagle.build(eagle.new_config(target, "tiny-target", len(vocab), aux_layers=aux_layers), target, vocab)
    torch.nn.init.normal_(head.aux_fc.weight, std=0.1)
    return head.eval()


def layer_output(target, ids: list[int], layer: int):
    """The residual stream after decoder layer `layer` over a whole sequence, [len, H], on the CPU."""
    import torch

    out = {}
    handle = target.model.layers[layer].register_forward_hook(
        lambda module, args, output: out.setdefault("h", output[0] if isinstance(output, tuple) else output))
    try:
        with torch.inference_mode():
            target.model(input_ids=torch.tensor([ids], device=target.device))
    finally:
        handle.remove()
    return out["h"][0].cpu()


def test_a_head_reading_aux_layers_on_the_target_is_token_identical(target, tokenizer):
    from tests.test_eagle_services import hidden_states

    hidden = target.config.hidden_size
    results, seen = served_with_head(target, tokenizer, aux_head(target))
    assert sum(r.stats["proposed"] for r in results) > 0
    checked = 0
    for context, features in seen:
        rows, end = features.rows.float(), len(context) - 1
        assert rows.shape[1] == 2 * hidden and features.start + len(rows) == end
        final = hidden_states(target, context)[features.start:end].float()
        layer0 = layer_output(target, context, 0)[features.start:end].float()
        # Committed positions bring the final hidden state, then layer 0's output.
        torch_close(rows[:, :hidden], final)
        torch_close(rows[:, hidden:], layer0)
        checked += len(rows)
    assert checked > 0


def torch_close(actual, expected):
    import torch

    torch.testing.assert_close(actual.cpu(), expected.cpu(), atol=2e-2, rtol=1e-2)  # features may be on a GPU


def test_a_head_reading_aux_layers_is_refused_by_a_draft_worker(target, tokenizer):
    async def scenario():
        async with running_stack(target, tokenizer, draft=aux_head(target)):
            pass

    with pytest.raises(FailedPrecondition, match="only the target worker has"):
        run(scenario())


def test_a_head_reading_layers_the_target_lacks_is_refused_at_start(target, tokenizer):
    head = aux_head(target)
    head.config.aux_layers = [5]  # the tiny target has 2 layers

    async def scenario():
        async with running_stack(target, tokenizer, target_head=head):
            pass

    with pytest.raises(FailedPrecondition, match=r"layers \[5\]"):
        run(scenario())


def test_recorded_features_are_the_target_rows_in_order_whatever_the_steps():
    """record() keeps the features of positions not yet fed to the head: appended step by
    step without copying what it holds, replaced from a rolled-back position, dropped at a
    gap; read back, they are the rows of every position from `start` on, and held_bytes
    counts them."""
    import torch

    from specdec.sessions import Session

    head = InlineHead.__new__(InlineHead)  # record() needs no model
    head.batched = None
    rows = torch.randn(40, 6).half()
    session = Session("s")
    head.record(session, 3, rows[3:5])
    assert session.head is None  # the head can only start from position 0
    head.record(session, 0, rows[:10].clone())
    kept = []
    for position in range(10, 30):  # a session that drafts nothing: one row a step
        piece = rows[position:position + 1].clone()
        kept.append(piece)
        head.record(session, position, piece)
    state = session.head
    assert state.length == 30 and all(any(p is k for p in state.pieces) for k in kept)  # none copied
    assert head.held_bytes(session) == 30 * 6 * 2
    assert torch.equal(state.rows, rows[:30]) and state.start == 0
    assert len(state.pieces) == 1  # joined once, when read
    again = rows[25:28] + 1  # positions 25.. rolled back and computed again
    head.record(session, 25, again)
    assert state.length == 28 and torch.equal(state.rows, torch.cat([rows[:25], again]))
    head.record(session, 28, rows[28:30])
    assert torch.equal(state.rows[26:], torch.cat([again[1:], rows[28:30]]))
    head.record(session, 35, rows[35:36])  # a gap: the head cannot be fed past it
    assert session.head is None


def test_a_copy_record_cuts_copies_at_the_price_of_a_row():
    """CopyRecord: per depth, the share of copies that reached it whose token there was
    accepted; a copy is cut where the product falls below the floor, never at floor 0."""
    from specdec.eagle.policy import COPY_PRIOR_RATE, CopyRecord

    record = CopyRecord()
    assert record.rate(0) == record.rate(5) == COPY_PRIOR_RATE
    assert record.reach(0.0, 4) == 4
    assert record.reach(COPY_PRIOR_RATE ** 2, 4) == 2  # 0.6 · 0.6 still pays, 0.6³ does not
    for _ in range(30):
        record.observe(4, 0)  # rejected at depth 0: deeper depths were never tried
    assert record.rate(0) < 0.05 and record.rate(1) == COPY_PRIOR_RATE
    assert record.reach(0.1, 4) == 0 and record.reach(0.0, 4) == 4
    for _ in range(30):
        record.observe(3, 3)  # all three right
    assert record.rate(0) > 0.9 and record.rate(2) > 0.9 and record.rate(3) == COPY_PRIOR_RATE
    assert record.reach(0.7, 4) == 3  # the untried fourth depth: the prior rate
    session = CopyRecord(record)  # a new session starts from its replica's rates
    assert session.rates() == pytest.approx(record.rates())
    session.observe(1, 0)
    assert session.rate(0) < record.rate(0)  # and weighs its own verdicts more


def test_copies_are_priced_by_how_far_they_are_accepted(target):
    """On the target worker the head drafts a copy (a repeated n-gram's continuation) cut by
    its record at the round's price: at price 0 the whole copy, as before; once copies are
    found wrong at their first token, none under a price — while the copy found for each
    context is still judged against what the context commits next, so copies that would
    have been right come back."""
    from specdec.eagle.policy import Copier, CopyRecord
    from specdec.ngram import lookup
    from specdec.runtime.load import serving_lm
    from target_worker.head import load_inline_head
    from target_worker.verify import Round

    lm = serving_lm(target)
    head = load_inline_head(None, target, make_head(target), min_chain_prob=0.0)
    verifier = Verifier(lm, SessionStore(16, 1 << 30, lm.bytes_per_token), 4, head)
    # A prompt after which the target's next token repeats a bigram: a copy is found.
    sequence = [5, 6, 7, 8, 9]
    for _ in range(80):  # the target alone, greedy
        sequence.append(verifier.verify("greedy", 0, sequence, []).next_token)
    end = next(i for i in range(6, len(sequence)) if any(sequence[j - 1:j + 1] == sequence[i - 1:i + 1]
                                                         for j in range(1, i - 1)))
    prompt = sequence[:end]

    def first_round(session_id: str, price: float):
        verdict = verifier.verify_batch([Round(session_id, 0, prompt, [], draft_next=4,
                                               min_draft_prob=price)]).results[0]
        copy = lookup(prompt + [verdict.next_token], 4, 3, head.drafter.lookup_ngram)
        return verdict, copy

    verdict, copy = first_round("free", 0.0)
    assert copy and list(verdict.next_drafts) == copy  # price 0: the copy, whole
    for _ in range(40):  # the replica has seen copies fail at their first token
        head.drafter.copies.observe(4, 0)
    verdict, copy = first_round("priced", 0.3)
    assert copy and list(verdict.next_drafts[:len(copy)]) != copy  # not the copy: the head's chain
    copier = verifier.store.get("priced").head.session.copying
    assert copier.candidate == tuple(copy)  # still judged when the context goes on
    tried = copier.record.tries[0]
    context = prompt + [verdict.next_token]
    follow = verifier.verify_batch([Round("priced", len(prompt), [verdict.next_token], list(verdict.next_drafts),
                                          draft_next=4, min_draft_prob=0.3)]).results[0]
    assert copier.record.tries[0] > tried  # judged against the committed tokens though never drafted
    assert follow.cached_len >= len(context)

    # Copies a session finds right bring its copies back under the price.
    record = CopyRecord()
    for _ in range(40):
        record.observe(4, 0)
    copier = Copier(2, record)
    text = [1, 2, 3, 4, 9]
    assert copier.copy(text + [1, 2], 3, 0.3) == []  # [3, 4, 9] found, priced out
    for _ in range(12):  # the context goes on as the copies said: each is judged right
        text = text + [1, 2, 3, 4, 9]
        assert copier.candidate == (3, 4, 9)
        copier.copy(text + [1, 2], 3, 0.3)
    assert copier.copy(text + [1, 2, 3, 4, 9, 1, 2], 3, 0.3) == [3, 4, 9]
    assert copier.record.rate(0) > record.rate(0)  # the replica's record learns too, from where it was
    # A context that does not continue the one the last copy was found for (a rollback, a
    # resync) judges nothing: the tokens after it say nothing about that copy.
    last = text + [1, 2, 3, 4, 9, 1, 2]
    tries = list(copier.record.tries)
    copier.copy([7] + last[1:] + list(copier.candidate), 3, 0.3)  # as if the copy were right
    assert copier.record.tries == tries
