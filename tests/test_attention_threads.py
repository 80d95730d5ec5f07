"""A batched step's per-session attention calls run on one thread or the intra-op pool, as
timed in whole steps, compared in pairs (specdec.runtime.attention_threads): the mode moves the
output by float32 rounding only, a class takes the other mode once it is measurably faster
beside the chosen one, a steady drift in step times switches nothing, and the thread count
is always given back."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

from specdec.runtime import attention_threads
from specdec.runtime.attention_threads import (
    EARLY_PERIOD, EXPLORE_PERIOD, MARGIN, MIN_PAIRS, POOL, SERIAL, AttentionThreads, batched_step,
)
from specdec.runtime.load import serving_lm
from specdec.runtime.paged import KVShape
from tests.factories import TEST_DEVICE
from tests.test_batching import fresh_sessions, tokens
from tests.test_services import target, tokenizer  # noqa: F401 (fixtures)


@pytest.fixture
def two_threads():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def qkv(n: int = 1, keys: int = 40, heads: int = 6, kv_heads: int = 2, d: int = 16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, heads, n, d, generator=g), torch.randn(1, kv_heads, keys, d, generator=g),
            torch.randn(1, kv_heads, keys, d, generator=g))


def run_step(chooser: AttentionThreads, cost: dict[int, float], calls: int = 4, keys: int = 40) -> int:
    """One step of `calls` decode calls, each taking cost[mode] seconds on the chooser's
    clock (the whole step's time, as the step would take it); returns the step's mode."""
    q, k, v = qkv(keys=keys)
    chooser.step(k.shape[1] * q.shape[2] * keys * q.shape[3])  # KV heads × queries × keys × head dim
    mode = chooser.current[1]
    for _ in range(calls):
        assert torch.get_num_threads() == 2
        chooser.sdpa(q, k, v, enable_gqa=True)
    chooser.clock.now += calls * cost[mode]
    chooser.end_step()
    return mode


def steps(chooser: AttentionThreads, cost: dict[int, float], n: int, **kwargs) -> list[int]:
    return [run_step(chooser, cost, **kwargs) for _ in range(n)]


@pytest.mark.parametrize("n, keys, masked", [(1, 1, False), (1, 37, False), (1, 700, False), (5, 260, True),
                                              (3, 3, True)])
def test_one_thread_or_the_pool_differ_by_float_rounding_only(two_threads, n, keys, masked):
    q, k, v = qkv(n=n, keys=keys, seed=keys)
    mask = None
    if masked:  # the causal mask of a block of n new tokens on top of keys - n cached ones
        mask = torch.arange(keys)[None, :] <= torch.arange(keys - n, keys)[:, None]
    outs = {}
    for mode in (SERIAL, POOL):
        chooser = AttentionThreads()
        chooser.current = (chooser.work_class(1.0), mode)
        outs[mode] = chooser.sdpa(q, k, v, attn_mask=mask, enable_gqa=True)
        assert torch.get_num_threads() == 2
    # A single query's keys are split by the thread count: the same sums in another order.
    torch.testing.assert_close(outs[SERIAL], outs[POOL], rtol=1e-5, atol=1e-6)
    assert torch.equal(outs[POOL], F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True))


def test_a_class_takes_one_thread_once_it_measures_faster_beside_the_pool(two_threads):
    chooser = AttentionThreads(clock=Clock())
    cost = {SERIAL: 2e-5, POOL: 5e-5}
    # The pool first (SDPA's own way); every EARLY_PERIOD-th step tries one thread, and the
    # step after it completes the pair; after MIN_PAIRS pairs the class switches.
    first = steps(chooser, cost, EARLY_PERIOD * MIN_PAIRS + 1)
    tried = [i + 1 for i, mode in enumerate(first) if mode == SERIAL]
    assert tried == [EARLY_PERIOD * (j + 1) for j in range(MIN_PAIRS)]
    assert steps(chooser, cost, EARLY_PERIOD - 2) == [SERIAL] * (EARLY_PERIOD - 2)
    # From the new mode the pool is tried as the other, early, then once per EXPLORE_PERIOD.
    later = steps(chooser, cost, EARLY_PERIOD * MIN_PAIRS + 2 * EXPLORE_PERIOD)
    assert MIN_PAIRS + 1 <= later.count(POOL) <= MIN_PAIRS + 3
    assert later[-EXPLORE_PERIOD:].count(POOL) == 1
    assert chooser.classes[chooser.work_class(2 * 40 * 16)].mode == SERIAL
    # Another class (a long context) where the pool is faster keeps the pool, with its own record.
    long_cost = {SERIAL: 9e-4, POOL: 3e-4}
    long_steps = steps(chooser, long_cost, 4 * EXPLORE_PERIOD, keys=4000)
    assert long_steps.count(SERIAL) <= MIN_PAIRS + 4
    assert chooser.classes[chooser.work_class(2 * 4000 * 16)].mode == POOL
    assert run_step(chooser, cost) == SERIAL
    chosen = chooser.chosen()
    assert chosen[chooser.work_class(2 * 40 * 16) + attention_threads.MIN_CLASS].startswith("one thread")
    assert chosen[chooser.work_class(2 * 4000 * 16) + attention_threads.MIN_CLASS].startswith("pool")


def test_a_mode_faster_by_less_than_the_margin_is_not_taken(two_threads):
    close = AttentionThreads(clock=Clock())
    assert steps(close, {SERIAL: (1 - MARGIN / 2) * 5e-5, POOL: 5e-5}, 200)[-EXPLORE_PERIOD:].count(SERIAL) <= 1
    assert close.classes[close.work_class(2 * 40 * 16)].mode == POOL
    clear = AttentionThreads(clock=Clock())
    steps(clear, {SERIAL: (1 - 2 * MARGIN) * 5e-5, POOL: 5e-5}, EARLY_PERIOD * MIN_PAIRS + 1)
    assert clear.classes[clear.work_class(2 * 40 * 16)].mode == SERIAL


class Drifting(dict):
    """Costs that fall 6% a step whatever the mode (the machine's other load going away)."""

    def __init__(self, serial_s: float, pool_s: float) -> None:
        super().__init__({SERIAL: serial_s, POOL: pool_s})

    def grow(self) -> None:
        for mode in self:
            self[mode] *= 0.94


def test_a_steady_drift_switches_nothing(two_threads):
    # Equal modes under a drift: an explored step is compared with the steps just before and
    # after it, so the drift cancels (compared with the step before alone, every explored
    # step would look 6% cheaper, past the margin, and the class would switch).
    chooser = AttentionThreads(clock=Clock())
    cost = Drifting(5e-5, 5e-5)
    for _ in range(6 * EXPLORE_PERIOD):
        run_step(chooser, cost)
        cost.grow()
    cls = chooser.classes[chooser.work_class(2 * 40 * 16)]
    assert cls.mode == POOL and cls.pairs > MIN_PAIRS and cls.ratio == pytest.approx(1.0, abs=0.01)


def test_a_change_in_the_machine_is_followed(two_threads):
    chooser = AttentionThreads(clock=Clock())
    cost = {SERIAL: 2e-5, POOL: 5e-5}
    steps(chooser, cost, 2 * EXPLORE_PERIOD)
    assert chooser.classes[chooser.work_class(2 * 40 * 16)].mode == SERIAL
    # Say another process now leaves the pool's cores alone: the pool gets faster, and the
    # class follows within a few of its explored steps.
    cost = {SERIAL: 6e-5, POOL: 3e-5}
    later = steps(chooser, cost, (MIN_PAIRS + 2) * EXPLORE_PERIOD)
    assert chooser.classes[chooser.work_class(2 * 40 * 16)].mode == POOL
    assert later[-EXPLORE_PERIOD:].count(SERIAL) <= 1


def test_the_thread_count_is_given_back_after_a_failed_call(two_threads):
    chooser = AttentionThreads()
    chooser.current = (0, SERIAL)
    q, k, v = qkv()
    with pytest.raises(RuntimeError):
        chooser.sdpa(q, k[:, :, :, :8], v)  # head dims that do not match
    assert torch.get_num_threads() == 2


def test_a_call_outside_a_step_runs_on_the_pool_and_one_thread_is_left_alone():
    chooser = AttentionThreads(clock=Clock())
    q, k, v = qkv()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        chooser.sdpa(q, k, v, enable_gqa=True)  # no step: the pool, nothing counted
        assert chooser._step.calls == 0
        torch.set_num_threads(1)
        chooser.step(1e5)
        chooser.sdpa(q, k, v, enable_gqa=True)  # one thread: nothing to choose, nothing timed
        chooser.end_step()
    finally:
        torch.set_num_threads(threads)
    assert all(cls.before is None and cls.other is None for cls in chooser.classes)


def test_steps_on_two_threads_are_kept_apart(two_threads):
    chooser = AttentionThreads(clock=Clock())
    chooser.step(2 * 40 * 16)
    mine = chooser.current
    seen = []

    def other_model_thread() -> None:
        seen.append(chooser.current)  # no step of its own yet
        chooser.step(2 * 4000 * 16)
        chooser.sdpa(*qkv(keys=4000), enable_gqa=True)
        chooser.end_step()

    thread = threading.Thread(target=other_model_thread)
    thread.start()
    thread.join()
    assert seen == [None] and chooser.current == mine
    chooser.sdpa(*qkv(), enable_gqa=True)
    chooser.end_step()
    assert chooser.current is None
    assert chooser.classes[chooser.work_class(2 * 40 * 16)].before is not None
    assert chooser.classes[chooser.work_class(2 * 4000 * 16)].before is not None


class Forced(AttentionThreads):
    def __init__(self, mode: int) -> None:
        super().__init__()
        self.forced, self.works = mode, []

    def step(self, work_per_call: float) -> None:
        self.works.append(work_per_call)
        super().step(work_per_call)
        self.current = (self.current[0], self.forced)


@pytest.mark.skipif(TEST_DEVICE != "cpu", reason="the packed forward is the CPU fast path's")
def test_a_packed_step_gives_the_same_tokens_in_either_mode(target, two_threads, monkeypatch):  # noqa: F811
    lm = serving_lm(target)
    assert lm.batches_in_one_pass
    contexts = [tokens(n, seed=n) for n in (0, 9, 40, 75)]
    new = [tokens(n, seed=50 + n) for n in (4, 1, 5, 1)]
    keep = [4, 1, 5, 1]
    results = {}
    for mode in (SERIAL, POOL):
        forced = Forced(mode)
        monkeypatch.setattr(attention_threads, "ATTENTION", forced)
        results[mode] = lm.feed_batch(fresh_sessions(lm, contexts), new, keep)
        assert forced.works  # the packed forward announced its step
    for a, b in zip(results[SERIAL], results[POOL]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4 * float(a.abs().max()))
        assert torch.equal(a.argmax(-1), b.argmax(-1))
    # The step's work is the mean over its sessions of queries × keys × KV heads × head dim.
    shape = KVShape.of(target.config)
    per_key = shape.kv_heads * shape.head_dim
    expected = per_key * sum(n * (len(c) + n) for c, n in zip(contexts, (4, 1, 5, 1))) / 4
    assert forced.works[-1] == pytest.approx(expected)


def test_a_failed_forward_ends_its_step_untimed(monkeypatch, two_threads):
    chooser = AttentionThreads(clock=Clock())
    monkeypatch.setattr(attention_threads, "ATTENTION", chooser)
    q, k, v = qkv()
    with pytest.raises(ValueError):
        with batched_step(4, 8, [1, 2], [10, 20]):
            chooser.sdpa(q, k, v, enable_gqa=True)
            raise ValueError("the forward failed")
    assert chooser.current is None
    assert all(cls.before is None and cls.other is None for cls in chooser.classes)
