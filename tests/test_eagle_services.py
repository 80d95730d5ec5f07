"""A feature-level head (specdec.eagle) through the three services: the target returns its
hidden states with each verdict, the coordinator forwards them, the head drafts from them,
and the output is still the target's alone — also with chunked prefill, batching off, a
draft worker restart (features resent), and sampling. The features the drafter receives
are checked against the target's own hidden states, position by position."""

from __future__ import annotations

import asyncio

import pytest
import torch

from coordinator.workers import FeatureLog
from specdec import eagle
from specdec.train.teacher import chat_ids
from specdec.client import Client, make_request
from specdec.errors import FailedPrecondition
from specdec.sessions import SessionStore
from target_worker.verify import Verifier
from tests.factories import make_tiny_model, make_tiny_tokenizer
from tests.harness import reference_greedy, run, running_stack

MAX_NEW = 24
# A random head is never confident in its chains, which the draft worker would cut to nothing
# (WorkerConfig.min_chain_prob): these tests have it draft what the coordinator asks.
ALWAYS = {"min_chain_prob": 0.0}
PROMPTS = ["Explain how tides work.", "Write a haiku about rain.", "def add(a, b):"]


@pytest.fixture(scope="module")
def tokenizer():
    return make_tiny_tokenizer()


@pytest.fixture(scope="module")
def target(tokenizer):
    return make_tiny_model(tokenizer, seed=0)


def make_head(target, seed: int = 0) -> eagle.EagleHead:
    torch.manual_seed(seed)
    vocab = torch.arange(0, target.config.vocab_size, 2)
    head = eagle.build(eagle.new_config(target, "tiny-target", len(vocab)), target, vocab)
    return head.eval()


def hidden_states(target, ids: list[int]) -> torch.Tensor:
    """The target's final hidden states of a whole sequence, [len, H] float16, on the CPU (where
    features arrive from the wire), whatever device the target runs on."""
    with torch.inference_mode():
        out = target.model(input_ids=torch.tensor([ids], device=target.device)).last_hidden_state[0]
    return out.to(torch.float16).cpu()


def recording(drafter):
    """Wraps the drafter's propose_batch to record (context, features covering it)."""
    seen = []
    original = drafter.propose_batch

    def propose_batch(synced, ks, features=None, min_probs=None):
        for s, f in zip(synced, features or [None] * len(synced)):
            seen.append((list(s.context), f))
        return original(synced, ks, features, min_probs)

    drafter.propose_batch = propose_batch
    return seen


def check_features(target, seen) -> int:
    """Each Propose's features are the target's hidden states at their positions."""
    checked = 0
    for context, features in seen:
        assert features is not None
        truth = hidden_states(target, context)
        rows = features.rows
        assert features.start + len(rows) == len(context) - 1  # up to the last committed but one
        torch.testing.assert_close(rows.float().cpu(), truth[features.start:len(context) - 1].float(), atol=2e-2, rtol=1e-2)
        checked += len(rows)
    return checked


def test_verifier_returns_the_committed_positions_features(target):
    from specdec.runtime.load import serving_lm

    lm = serving_lm(target)
    verifier = Verifier(lm, SessionStore(8, 1 << 30, lm.bytes_per_token), 8)
    prompt = list(range(5, 25))
    first = verifier.verify("s", 0, prompt, [], features=True)
    assert first.feature_start == 0 and len(first.features) == 2 * 64 * len(prompt)
    committed = prompt + [first.next_token]
    truth = hidden_states(target, committed + [7, 8, 9])
    got = torch.frombuffer(bytearray(first.features), dtype=torch.float16).view(-1, 64)
    torch.testing.assert_close(got.float(), truth[:len(prompt)].float(), atol=2e-2, rtol=1e-2)
    # A block whose first draft is the target's own choice and the rest are not.
    own = reference_greedy(target, committed, 1)[0]
    second = verifier.verify("s", len(prompt), [first.next_token], [own, 3, 3], features=True)
    assert second.accepted >= 1
    assert second.feature_start == len(prompt)
    got = torch.frombuffer(bytearray(second.features), dtype=torch.float16).view(-1, 64)
    assert len(got) == 1 + second.accepted  # the fed committed token, then the accepted drafts
    truth = hidden_states(target, committed + [own, 3, 3])
    torch.testing.assert_close(got.float(), truth[len(prompt):len(prompt) + len(got)].float(), atol=2e-2, rtol=1e-2)
    plain = verifier.verify("t", 0, prompt, [])
    assert plain.features == b""


def test_feature_log_keeps_positions_in_order():
    log = FeatureLog(2)
    log.put(0, bytes(range(12)))  # 3 rows of 4 bytes
    assert log.count == 3 and log.rows(1, 3) == bytes(range(4, 12))
    log.put(2, bytes([9] * 8))  # positions 2, 3: replaces 2 and extends
    assert log.count == 4 and log.rows(2, 4) == bytes([9] * 8)
    log.put(7, bytes(4))  # a gap: dropped
    assert log.count == 4


@pytest.mark.parametrize("options", [{}, {"batching": False}, {"prefill_chunk_tokens": 8}],
                         ids=["batched", "unbatched", "chunked-prefill"])
def test_head_through_the_services_is_token_identical(target, tokenizer, options):
    head = make_head(target)

    async def scenario():
        async with running_stack(target, tokenizer, draft=head, draft_options=ALWAYS, **options) as stack:
            seen = recording(stack.draft_servicer.proposer.drafter)
            async with Client(stack.address) as client:
                results = [await client.complete(make_request(p, max_new_tokens=MAX_NEW, k=4)) for p in PROMPTS]
            return results, seen

    results, seen = run(scenario())
    for text, result in zip(PROMPTS, results):
        assert result.token_ids == reference_greedy(target, chat_ids(tokenizer, text), MAX_NEW), text
        assert result.stats["resyncs"] == 0
    assert sum(r.stats["proposed"] for r in results) > 0
    assert check_features(target, seen) > 0


def test_a_restarted_draft_worker_gets_the_features_resent(target, tokenizer, monkeypatch):
    from coordinator.adaptive import AdaptiveK
    from tests.test_services import Gate

    # Draft every round (a random head would get paused by the adaptive controller, and
    # the rounds after the restart must reach the new worker).
    monkeypatch.setattr(AdaptiveK, "next_k", lambda self, *args: self.k_max)
    head = make_head(target)
    prompt, max_new = PROMPTS[0], 64

    async def scenario():
        async with running_stack(target, tokenizer, draft=head, draft_options=ALWAYS) as stack:
            # Hold the target mid-request, restart the draft worker, let the request go on.
            gate = Gate(stack.target_servicer.verifier.verify_batch, at_call=4)
            stack.target_servicer.verifier.verify_batch = gate
            async with Client(stack.address) as client:
                task = asyncio.create_task(client.complete(make_request(prompt, max_new_tokens=max_new, k=4)))
                assert await asyncio.to_thread(gate.entered.wait, 30)
                await stack.restart_draft(head, tokenizer, **ALWAYS)
                seen = recording(stack.draft_servicer.proposer.drafter)
                gate.release.set()
                result = await task
            return result, seen

    result, seen = run(scenario())
    assert result.token_ids == reference_greedy(target, chat_ids(tokenizer, prompt), max_new)
    assert result.stats["resyncs"] >= 1
    assert any(f is not None and f.start == 0 for _, f in seen)  # rebuilt from position 0
    assert check_features(target, seen) > 0


def test_sampling_with_a_head_matches_sampling_without(target, tokenizer):
    head = make_head(target)
    request = dict(max_new_tokens=MAX_NEW, k=4, temperature=0.9, top_p=0.95, seed=1234)

    async def scenario(draft):
        async with running_stack(target, tokenizer, draft=draft, draft_options=ALWAYS if draft else None) as stack:
            async with Client(stack.address) as client:
                return [await client.complete(make_request(p, **request)) for p in PROMPTS]

    with_head = run(scenario(head))
    alone = run(scenario(None))
    assert [r.token_ids for r in with_head] == [r.token_ids for r in alone]


def test_a_head_for_another_target_is_refused(target, tokenizer):
    other = make_tiny_model(tokenizer, seed=1, hidden=32)
    head = make_head(other)

    async def scenario():
        async with running_stack(target, tokenizer, draft=head):
            pass

    with pytest.raises(FailedPrecondition, match="width 32"):
        run(scenario())


def test_a_head_on_the_draft_worker_takes_the_price_of_a_row(target, tokenizer):
    """ProposeRequest.min_draft_prob through a real draft worker serving a head: a price that
    is not a finite number >= 0 fails its own round with INVALID_ARGUMENT, 0 drafts what the
    worker's own cut allows, above 1 nothing (no token is that sure)."""
    import grpc

    from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc
    from tests.harness import start_draft

    prompt = chat_ids(tokenizer, PROMPTS[0])
    features = hidden_states(target, prompt)[:len(prompt) - 1].numpy().tobytes()
    prices = [float("nan"), -0.5, float("inf"), 0.0, 1.5]

    async def scenario():
        server, _ = await start_draft(make_head(target), tokenizer, **ALWAYS)
        try:
            async with grpc.aio.insecure_channel(server.address) as channel:
                stub = draft_pb2_grpc.DraftWorkerStub(channel)
                batch = await stub.ProposeBatch(draft_pb2.ProposeBatchRequest(rounds=[
                    draft_pb2.ProposeRequest(delta=common_pb2.SessionDelta(session_id=f"s{i}", start=0, tokens=prompt),
                                             k=4, feature_start=0, features=features, min_draft_prob=price)
                    for i, price in enumerate(prices)]), timeout=60)
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.Propose(draft_pb2.ProposeRequest(
                        delta=common_pb2.SessionDelta(session_id="alone", start=0, tokens=prompt), k=4,
                        feature_start=0, features=features, min_draft_prob=-1.0), timeout=60)
                return batch, refused.value
        finally:
            await server.stop(grace=0)

    batch, refused = run(scenario())
    for item in batch.results[:3]:
        assert item.WhichOneof("result") == "error"
        assert item.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "min_draft_prob" in item.error.message
    assert len(batch.results[3].block.tokens) == 4
    assert batch.results[4].WhichOneof("result") == "block" and len(batch.results[4].block.tokens) == 0
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT and "min_draft_prob" in refused.details()


def test_the_coordinator_sends_its_price_of_a_row_with_every_propose(target, tokenizer, monkeypatch):
    """Through the services with a head on the draft worker: each Propose carries the
    coordinator's price of a draft row (RoundRunner._draft_price); priced above 1 the head
    drafts nothing, and the output is the target's alone either way."""
    from coordinator.rounds import RoundRunner

    head = make_head(target)
    prompt = PROMPTS[1]

    def serve(price: float):
        monkeypatch.setattr(RoundRunner, "_draft_price", lambda self, gen: price)

        async def scenario():
            async with running_stack(target, tokenizer, draft=head, draft_options=ALWAYS) as stack:
                proposer = stack.draft_servicer.proposer
                prices = []
                original = proposer.propose_batch

                def propose_batch(requests):
                    prices.extend(r.min_draft_prob for r in requests)
                    return original(requests)

                proposer.propose_batch = propose_batch
                async with Client(stack.address) as client:
                    result = await client.complete(make_request(prompt, max_new_tokens=MAX_NEW, k=4))
                return result, prices

        return run(scenario())

    cheap, cheap_prices = serve(0.0)
    dear, dear_prices = serve(1.5)
    expected = reference_greedy(target, chat_ids(tokenizer, prompt), MAX_NEW)
    assert cheap.token_ids == dear.token_ids == expected
    assert cheap_prices and set(cheap_prices) == {0.0} and cheap.stats["proposed"] > 0
    assert dear_prices and set(dear_prices) == {1.5} and dear.stats["proposed"] == 0
