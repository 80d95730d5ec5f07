"""Steps padded for CUDA graphs (specdec.runtime.graphs): a step padded to its bucket gives the
unpadded step's logits, features and cache, through rollback and refeed; trees and steps past
the largest bucket run eagerly; a head's steps beside a padded target are padded too and draft
the same; the flag reaches the workers. On CPU the padded step runs
eagerly (capture=False); the capture itself is checked where SPECDEC_TEST_DEVICE=cuda (the GPU
check runs this file there)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest
import torch

from specdec.eagle.paged import PagedHead
from specdec.runtime.graphs import TOKEN_BUCKETS, GraphedForward
from specdec.runtime.load import serving_lm
from specdec.runtime.paged import PAD_BLOCK
from specdec.runtime.paged_attention import paged_attention_reference
from specdec.runtime.paged_lm import PagedCausalLM
from specdec.runtime.paged_step import StepLimits, StepRequest
from specdec.sessions import SessionStore
from target_worker.head import load_inline_head
from target_worker.kernels.ops import paged_attention
from target_worker.verify import Round, Verdict, Verifier
from tests.factories import TEST_DEVICE, make_tiny_model, make_tiny_tokenizer
from specdec import eagle

torch.set_num_threads(2)

CONTEXTS = (0, 1, 15, 16, 17, 255, 257)
MAX_POSITIONS = 512
LOGIT_TOLERANCE = 1e-4
ON_CUDA = TEST_DEVICE.startswith("cuda")


@pytest.fixture(scope="module")
def model():
    return make_tiny_model(make_tiny_tokenizer(), max_positions=MAX_POSITIONS)


class Served:
    """A PagedCausalLM and its store; graphs: None (eager), "padded" (the padded step run
    eagerly) or "captured" (CUDA graphs)."""

    def __init__(self, model, graphs: str | None):
        # The target worker's attention: the Triton kernel on CUDA, the reference on CPU.
        self.lm = PagedCausalLM(model, max_cache_bytes=64 << 20, attention=paged_attention,
                                namespace="tiny", max_batch=16, cuda_graphs=graphs == "captured")
        if graphs == "padded":
            self.lm.graphs = GraphedForward(self.lm.runner, self.lm.pool, self.lm.buffers.limits,
                                            capture=False)
        self.store = SessionStore(1024, 1 << 40, self.lm.bytes_per_token)
        self.lm.bind(self.store)
        self.sessions = {}

    def open(self, name: str, context: list[int]):
        synced = self.store.sync(name, 0, list(context))
        self.sessions[name] = synced.session
        return synced.session, self.lm.prepare(synced, reuse_prefix=False)

    def session_kv(self, session) -> list[torch.Tensor]:
        """Per layer, the K and V of the session's positions, in logical order."""
        paged, size = session.cache, self.lm.pool.block_size
        slots = torch.tensor([paged.block_table[p // size] * size + p % size for p in range(paged.length)])
        out = []
        for index in range(len(self.lm.runner.layers)):
            for pool in self.lm.pool.layer(index):
                out.append(pool.reshape(-1, *pool.shape[2:])[slots.to(pool.device)].float().cpu())
        return out


def token_ids(seed: int, n: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, 300, (n,), generator=generator).tolist()


def assert_same(got: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert g.shape == e.shape
        assert torch.equal(g.argmax(-1), e.argmax(-1))
        assert (g.float() - e.float()).abs().max().item() <= LOGIT_TOLERANCE


def run_steps(served: Served, features: bool = False) -> list:
    """Prefill of every context in one step, then two chain steps of 1..7 new tokens per
    session (a verification's), a rollback of each session to before the second, and a refeed
    of other tokens; every step's output."""
    outputs = []
    sessions, feeds = [], []
    for i, context in enumerate(CONTEXTS):
        session, feed = served.open(f"s{i}", token_ids(100 + i, context) or token_ids(150 + i, 1))
        sessions.append(session)
        feeds.append(feed)
    lm = served.lm
    aux = (0,) if features else ()
    outputs.append(lm.feed_batch(sessions, feeds, [1] * len(sessions), features=features, aux_layers=aux))
    for round_ in range(2):
        news = [token_ids(200 + 10 * round_ + i, 1 + i) for i in range(len(sessions))]
        outputs.append(lm.feed_batch(sessions, news, [len(t) for t in news], features=features, aux_layers=aux))
    for session, n in zip(sessions, range(1, len(sessions) + 1)):
        lm.crop(session, session.cache.length - n)
    news = [token_ids(300 + i, 1 + (i % 3)) for i in range(len(sessions))]
    outputs.append(lm.feed_batch(sessions, news, [len(t) for t in news], features=features, aux_layers=aux))
    return outputs


def flatten(outputs: list, features: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    logits, states = [], []
    for out in outputs:
        if features:
            logits += out[0]
            states += out[1]
        else:
            logits += out
    return logits, states


@pytest.mark.parametrize("features", [False, True])
def test_padded_steps_equal_unpadded_steps(model, features):
    eager, padded = Served(model, None), Served(model, "padded")
    expected = run_steps(eager, features)
    got = run_steps(padded, features)
    # The prefill (7 sessions, 562 tokens) and the steps of 28, 28 and 13 tokens were all padded.
    assert padded.lm.graphs.replays == 4
    assert 562 not in TOKEN_BUCKETS and 28 not in TOKEN_BUCKETS and 13 not in TOKEN_BUCKETS
    got_logits, got_states = flatten(got, features)
    expected_logits, expected_states = flatten(expected, features)
    assert_same(got_logits, expected_logits)
    for g, e in zip(got_states, expected_states):
        assert g.shape == e.shape and (g.float() - e.float()).abs().max().item() <= LOGIT_TOLERANCE
    for name, session in eager.sessions.items():
        other = padded.sessions[name]
        assert other.cache.block_table == session.cache.block_table
        assert other.cache.token_ids == session.cache.token_ids
        for g, e in zip(padded.session_kv(other), eager.session_kv(session)):
            assert (g - e).abs().max().item() <= LOGIT_TOLERANCE


def test_padding_writes_only_the_padding_block(model):
    """Outside PAD_BLOCK, a padded step leaves the pool as the unpadded step does."""
    eager, padded = Served(model, None), Served(model, "padded")
    for served in (eager, padded):
        with torch.no_grad():
            for layer in range(len(served.lm.runner.layers)):
                for pool in served.lm.pool.layer(layer):
                    pool.fill_(7.0)  # whatever a written slot gets, it is not this
        run_steps(served)
    for layer in range(len(eager.lm.runner.layers)):
        for e, p in zip(eager.lm.pool.layer(layer), padded.lm.pool.layer(layer)):
            keep = [b for b in range(e.shape[0]) if b != PAD_BLOCK]
            assert (e[keep].float() - p[keep].float()).abs().max().item() <= LOGIT_TOLERANCE


def test_trees_and_steps_past_the_largest_bucket_run_eagerly(model):
    padded = Served(model, "padded")
    lm = padded.lm
    assert lm.graphs.bucket(TOKEN_BUCKETS[-1] + 1, trees=False) is None
    assert lm.graphs.bucket(3, trees=True) is None
    # Padding past what the padding session's block table can address runs eagerly too.
    narrow = StepLimits(max_batch=4, max_tokens=128, max_blocks=2)
    assert GraphedForward(lm.runner, lm.pool, narrow, buckets=(1, 64), capture=False).bucket(10, False) is None
    assert GraphedForward(lm.runner, lm.pool, narrow, buckets=(1, 64), capture=False).bucket(40, False) == 64
    lm.graphs = GraphedForward(lm.runner, lm.pool, lm.buffers.limits, buckets=(1, 2, 4, 8), capture=False)
    session, feed = padded.open("long", token_ids(1, 9))
    lm.feed_batch([session], [feed], [1])
    assert lm.graphs.replays == 0
    lm.feed_batch([session], [token_ids(2, 4)], [4], parents=[[-1, 0, 0, 1]])
    assert lm.graphs.replays == 0
    lm.crop(session, session.cache.length - 4)
    lm.feed_batch([session], [token_ids(3, 3)], [3])
    assert lm.graphs.replays == 1


def test_a_failed_capture_turns_graphs_off_and_the_step_still_runs(model, monkeypatch, caplog):
    eager, padded = Served(model, None), Served(model, "padded")
    graphs = padded.lm.graphs
    graphs.capture = True  # as on CUDA, with a forward that cannot be captured

    def record(*args):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(graphs, "_record", record)
    with caplog.at_level(logging.WARNING, logger="specdec.runtime.graphs"):
        got = run_steps(padded)
    assert "CUDA graphs off: capturing a 640-token step failed" in caplog.text
    assert graphs.off is not None and graphs.replays == 1 and graphs.bucket(4, trees=False) is None
    assert_same(flatten(got, False)[0], flatten(run_steps(eager), False)[0])


def test_a_plan_refuses_a_padding_it_cannot_hold(model):
    padded = Served(model, "padded")
    lm = padded.lm
    session, feed = padded.open("a", token_ids(1, 5))
    lm.cache.reserve(session.cache, len(feed))
    with pytest.raises(ValueError, match="cannot be padded"):
        lm.buffers.plan(lm.cache, [StepRequest(session.cache, feed)], pad_to=4)
    with pytest.raises(ValueError, match="with a tree"):
        lm.buffers.plan(lm.cache, [StepRequest(session.cache, feed, parents=[-1, 0, 0, 1, 1])], pad_to=8)
    step = lm.buffers.plan(lm.cache, [StepRequest(session.cache, feed)], pad_to=8)
    assert step.input_ids.shape == (8,) and step.logit_rows.shape == (1,)  # the last token's logits only
    slots = lm.buffers.limits.max_batch + 1  # every session slot and the padding session
    assert step.context_lens.shape == (slots,) and step.block_tables.shape[0] == slots
    assert step.query_starts.tolist()[:2] == [0, 5] and step.query_starts.tolist()[-1] == 8
    assert step.block_tables[-1].eq(PAD_BLOCK).all()


def test_the_kernel_on_a_padded_step_equals_the_reference_on_the_step(model):
    """The Triton kernel (the interpreter on CPU) over a padded step's inputs: the real tokens'
    outputs are the reference's over the unpadded inputs."""
    from target_worker.kernels.paged_attention import paged_attention_triton

    served = Served(model, None)
    lm = served.lm
    sessions = []
    for i, context in enumerate((0, 17, 40)):
        session, feed = served.open(f"k{i}", token_ids(10 + i, context) or token_ids(20, 1))
        lm.feed_batch([session], [feed], [1])
        sessions.append(session)
    news = [token_ids(30 + i, n) for i, n in enumerate((1, 3, 2))]
    for session, tokens in zip(sessions, news):
        lm.cache.reserve(session.cache, len(tokens))
    requests = [StepRequest(s.cache, t, logits_to_keep=len(t)) for s, t in zip(sessions, news)]
    shape = lm.pool.shape
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(8, shape.kv_heads * 2, shape.head_dim, generator=generator).to(lm.pool.device)
    k_pool, v_pool = lm.pool.layer(0)
    exact = lm.buffers.plan(lm.cache, requests)
    expected = paged_attention_reference(q[:6], k_pool, v_pool, exact.block_tables, exact.context_lens,
                                         exact.query_starts, None)
    step = lm.buffers.plan(lm.cache, requests, pad_to=8)
    got = paged_attention_triton(q, k_pool, v_pool, step.block_tables, step.context_lens, step.query_starts)
    assert got.shape == q.shape
    assert (got[:6].float() - expected.float()).abs().max().item() <= LOGIT_TOLERANCE


@pytest.mark.skipif(ON_CUDA, reason="the CPU refusal")
def test_cuda_graphs_on_cpu_are_refused_with_a_reason(model, caplog):
    with caplog.at_level(logging.WARNING, logger="specdec.runtime.paged_lm"):
        served = Served(model, "captured")
    assert served.lm.graphs is None
    assert "CUDA graphs off: the model is on cpu" in caplog.text


@pytest.mark.skipif(not ON_CUDA, reason="CUDA graphs need a GPU (SPECDEC_TEST_DEVICE=cuda)")
@pytest.mark.parametrize("features", [False, True])
def test_captured_steps_equal_eager_steps(model, features):
    eager, captured = Served(model, None), Served(model, "captured")
    assert captured.lm.graphs is not None and captured.lm.graphs.capture
    expected = run_steps(eager, features)
    got = run_steps(captured, features)
    assert captured.lm.graphs.replays == 4 and captured.lm.graphs.captured
    assert_same(flatten(got, features)[0], flatten(expected, features)[0])


def test_the_flag_and_its_variable_reach_the_worker_config(monkeypatch):
    from specdec.cli import build_parser, flags

    monkeypatch.delenv("SPECDEC_CUDA_GRAPHS", raising=False)
    parse = lambda argv: flags.worker_config(build_parser().parse_args(argv), "x")  # noqa: E731
    assert not parse(["serve", "target"]).cuda_graphs
    assert parse(["serve", "target", "--cuda-graphs"]).cuda_graphs
    monkeypatch.setenv("SPECDEC_CUDA_GRAPHS", "1")  # read as the parser is built
    assert parse(["serve", "draft"]).cuda_graphs


def test_up_passes_cuda_graphs_to_the_draft_worker_it_spawns(monkeypatch):
    from specdec.cli import build_parser, up

    seen = []

    async def fake_exec(*command, **kwargs):
        seen.append(list(command))
        raise RuntimeError("stop here")

    monkeypatch.delenv("SPECDEC_CUDA_GRAPHS", raising=False)
    monkeypatch.setattr(asyncio, "create_subprocess_exec", fake_exec)
    for argv, present in ((["up", "--draft", "d"], False), (["up", "--draft", "d", "--cuda-graphs"], True)):
        args = build_parser().parse_args(argv)
        with pytest.raises(RuntimeError, match="stop here"):
            asyncio.run(up._start_draft(args, Path("/certs"), Path("/certs/ca.pem")))
        assert ("--cuda-graphs" in seen[-1]) == present


# --- the head's steps beside a graphed target ---------------------------------------------

def make_head(target) -> eagle.EagleHead:
    """An EAGLE-3-style head: it reads the target's final states and two layers' (so its
    inputs come at two widths: the target's features, then its own predictions)."""
    torch.manual_seed(0)
    vocab = torch.arange(0, target.config.vocab_size, 2)
    config = eagle.new_config(target, "tiny-target", len(vocab), aux_layers=(0, 1))
    head = eagle.build(config, target, vocab).eval()
    assert config.feature_size == 3 * config.hidden_size
    return head


def head_kv(storage: PagedHead, session) -> list[torch.Tensor]:
    size = storage.pool.block_size
    slots = torch.tensor([session.block_table[p // size] * size + p % size for p in range(session.length)])
    return [pool.reshape(-1, *pool.shape[2:])[slots.to(pool.device)].float().cpu() for pool in storage.pool.layer(0)]


def test_capturing_at_load_runs_every_bucket_and_leaves_the_pool_as_it_was(model):
    eager, padded = Served(model, None), Served(model, "padded")
    assert padded.lm.capture_graphs(40) == [1, 2, 4, 8, 16, 24, 32, 40]
    assert padded.lm.capture_graphs(41) == [1, 2, 4, 8, 16, 24, 32, 40, 48]
    assert padded.lm.graphs.replays == 17
    assert padded.lm.cache.blocks.in_use == 0
    assert padded.lm.capture_graphs(10 ** 6)[-1] == TOKEN_BUCKETS[-1]
    assert padded.lm.cache.blocks.in_use == 0
    expected, got = run_steps(eager), run_steps(padded)  # nothing the warm-up wrote is read
    assert_same(flatten(got, False)[0], flatten(expected, False)[0])
    head = PagedHead(make_head(model), 64, block_size=4, max_batch=4, graphs=False)
    widths = {head.head.config.feature_size, head.head.config.hidden_size}
    assert head.capture_graphs(10) == [1, 2, 4, 8, 16]
    assert head.graphs.replays == 5 * len(widths) and head.in_use() == 0  # at each feature width


def test_a_padded_head_step_equals_an_unpadded_one(model):
    head = make_head(model)
    eager = PagedHead(head, 256, block_size=4, max_batch=4)
    padded = PagedHead(head, 256, block_size=4, max_batch=4, graphs=False)
    generator = torch.Generator().manual_seed(5)
    contexts = [token_ids(400 + i, n) for i, n in enumerate((1, 6, 17))]
    width = head.config.feature_size
    steps = [(contexts, width), ([token_ids(500 + i, 1 + i) for i in range(3)], head.config.hidden_size),
             ([token_ids(600 + i, 3) for i in range(3)], head.config.hidden_size)]
    sessions = {id(s): [s.new_cache() for _ in contexts] for s in (eager, padded)}
    for tokens, width in steps:
        rows = torch.randn(sum(len(t) for t in tokens), width, generator=generator).to(torch.float16)
        got, expected = (s.step(sessions[id(s)], rows.to(head.fc.weight.device), tokens) for s in (padded, eager))
        assert got.shape == expected.shape == (rows.shape[0], head.config.hidden_size)
        assert (got.float() - expected.float()).abs().max().item() <= LOGIT_TOLERANCE
    # 24, 6 and 9 tokens, padded to 24, 8 and 16; the second width has its own static rows.
    assert padded.graphs.replays == 3 and sorted(padded._features) == sorted({head.config.feature_size,
                                                                              head.config.hidden_size})
    for g, e in zip(sessions[id(padded)], sessions[id(eager)]):
        assert g.block_table == e.block_table and g.length == e.length
        for a, b in zip(head_kv(padded, g), head_kv(eager, e)):
            assert (a - b).abs().max().item() <= LOGIT_TOLERANCE


@pytest.mark.parametrize("mode", ["padded", pytest.param("captured", marks=pytest.mark.skipif(
    not ON_CUDA, reason="CUDA graphs need a GPU (SPECDEC_TEST_DEVICE=cuda)"))])
def test_the_head_beside_a_padded_target_pads_its_steps_and_drafts_the_same(model, mode):
    """A Verifier with an inline head, its target steps padded (or replayed from CUDA graphs):
    the head's steps are padded (replayed) too, and every verdict over 6 rounds — accepted, next
    token, the next round's drafts — is the eager one."""

    def verifier(padded: bool) -> Verifier:
        lm = serving_lm(model, False, "paged", max_cache_bytes=1 << 24, attention=paged_attention,
                        cuda_graphs=padded and mode == "captured")
        if padded and mode == "padded":
            lm.graphs = GraphedForward(lm.runner, lm.pool, lm.buffers.limits, capture=False)
        inline = load_inline_head(None, model, make_head(model), fast=False, min_chain_prob=0.0, min_alt_prob=1.0)
        verifier = Verifier(lm, SessionStore(8, 1 << 30, lm.bytes_per_token), 8, inline)
        if padded:  # every size a batch of rounds can take was run (captured) at load
            up_to = lm.buffers.limits.max_batch * (8 + 1)
            sizes = [b for b in TOKEN_BUCKETS if b < up_to] + [min(b for b in TOKEN_BUCKETS if b >= up_to)]
            head = verifier.head.batched.storage
            widths = {head.head.config.feature_size, head.head.config.hidden_size}
            assert lm.graphs.replays == len(sizes) and head.graphs.replays == len(widths) * len(sizes)
            if mode == "captured":
                assert lm.graphs.captured == sizes and head.graphs.captured == sizes
            assert lm.cache.blocks.in_use == 0 and head.in_use() == 0
        return verifier

    runs = {}
    for padded in (False, True):
        v = verifier(padded)
        committed = {f"s{i}": token_ids(700 + i, 5 + 7 * i) for i in range(3)}
        # As the coordinator sends them: from what was committed when the last round was sent.
        sent, drafts, verdicts = dict.fromkeys(committed, 0), dict.fromkeys(committed, []), []
        for _ in range(6):
            rounds = [Round(name, sent[name], ids[sent[name]:], drafts[name], draft_next=4)
                      for name, ids in committed.items()]
            for name, verdict in zip(committed, v.verify_batch(rounds).results):
                assert isinstance(verdict, Verdict), verdict
                verdicts.append((verdict.accepted, verdict.next_token, verdict.cached_len, verdict.next_drafts,
                                 verdict.extra))
                sent[name] = len(committed[name])
                committed[name] += drafts[name][:verdict.accepted] + [verdict.next_token] + list(verdict.extra)
                drafts[name] = list(verdict.next_drafts)
        runs[padded] = verdicts
        if padded:
            assert v.lm.graphs.replays > 0 and v.head.batched.storage.graphs.replays > 0
            assert v.head.batched.storage.graphs.capture == (mode == "captured")
    assert runs[True] == runs[False]
    assert any(len(v[3]) for v in runs[True]) and any(v[0] for v in runs[True])  # drafted, and accepted
