"""How many threads the per-session attention calls of a batched CPU step get: the intra-op
pool, or one.

A batched step on CPU attends session by session (specdec.runtime.packed: one SDPA call per
session and layer, each over that session's own cache). At a decoding step's single query
over a few hundred keys a call is little work, and SDPA's CPU kernel still splits it over
the intra-op pool (by batch × heads, with no grain size): the fork and join then cost more
than the split saves, while over thousands of keys the split pays. Where the two cross
depends on the CPU (its cores, whether they are SMT siblings, what else runs on them) and
shows only in whole steps: a call timed alone, or each call timed in the step, ranks the
modes wrongly, because a mode also changes the ops around the calls (the pool's threads
spin after a call, beside the model thread's own small ops, and sleep during a one-thread
call, so the next linear wakes them). The figures are in benchmarks/results/NOTES.md.

So the choice is made from whole steps, compared in pairs. A batched step is classed by the
mean work of its calls (queries × keys × KV heads × head dim — the keys and values a call
reads, times its queries — in powers of two) and runs all
of them in its class's mode, at first the pool (SDPA's own behaviour). Every EXPLORE_PERIOD-th
step of a class (every EARLY_PERIOD-th until it has MIN_PAIRS comparisons) runs in the other
mode, and its time per call is compared with that of the steps of the class just before and
just after it, in the chosen mode: the same load, a few steps apart. The decayed mean of
those ratios decides: once the other mode is faster by MARGIN, the class switches, and the
comparison starts over from the new mode. A pair that finds the other mode faster brings the
next one forward to EARLY_PERIOD, so a change in the machine is followed within a few dozen
steps. The cost: the slower mode for one step in
EXPLORE_PERIOD of each class, ~3%.

The mode changes float rounding only, as the batch's row count already does for the packed
linears (specdec.runtime.cpu): for a single query SDPA's CPU kernel splits the keys by the
thread count, so the same sums are added in another order (differences of ~1e-7 relative;
a test bounds them and checks the argmax of a packed step is the same in both modes). Only
CPU tensors are affected; with one intra-op thread there is nothing to choose.

The record is the process's (the choice is the machine's, per amount of work); the step in
progress is the calling thread's (`StepState`). The thread count is process-wide in torch,
so a call run on one thread lowers it for the call's duration (restored after, also on an
error). A worker runs its models on one thread (specdec.serving.ModelThread); a torch op
another thread ran meanwhile would run on one thread too, which moves its rounding only.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# Work classes: log2(queries × keys × KV heads × head dim) of a step's mean call, capped.
MIN_CLASS = 10
MAX_CLASS = 30
# One step in EXPLORE_PERIOD of a class runs in the mode not chosen; one in EARLY_PERIOD
# until the class has MIN_PAIRS comparisons in its current mode.
EXPLORE_PERIOD = 32
EARLY_PERIOD = 4
MIN_PAIRS = 3
# Weight of the past in the mean ratio (other mode / chosen mode, time per call), per pair.
DECAY = 0.5
# The other mode is taken once the mean ratio is below 1 − MARGIN.
MARGIN = 0.05
SERIAL, POOL = 0, 1


@dataclass
class WorkClass:
    mode: int = POOL  # the chosen mode
    steps: int = 0  # steps of the class seen
    ratio: float = 1.0  # decayed mean of other / chosen seconds per call, over pairs
    pairs: int = 0  # comparisons since the class took its mode
    last: float = 1.0  # the last pair's ratio
    before: float | None = None  # seconds per call of its last step in the chosen mode
    other: float | None = None  # seconds per call of its explored step, awaiting the step after


class StepState(threading.local):
    """The step in progress on the calling thread: its (class, mode), when it began, its
    attention calls so far. Per thread, so that two models stepping on two threads of one
    process (a target and a draft model in one test process) keep their steps apart."""

    current: tuple[int, int] | None = None
    began: float = 0.0
    calls: int = 0


class AttentionThreads:
    """The per-class record and choice. A batched step announces itself (`step`) with the
    mean work of its calls, which sets one mode for all of them; `end_step` times it (the
    whole step, from `step` on) into its class. `sdpa` is F.scaled_dot_product_attention run
    in the step's mode; a call outside a step runs on the pool. `clock` returns seconds
    (tests pass their own)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.classes = [WorkClass() for _ in range(MAX_CLASS - MIN_CLASS + 1)]
        self._step = StepState()

    @property
    def current(self) -> tuple[int, int] | None:
        """(class, mode) of the calling thread's step in progress, if any."""
        return self._step.current

    @current.setter
    def current(self, value: tuple[int, int] | None) -> None:
        self._step.current = value

    @staticmethod
    def work_class(work: float) -> int:
        """queries × keys × KV heads × head dim of a call -> the index of its work class."""
        return min(MAX_CLASS, max(MIN_CLASS, math.ceil(math.log2(max(work, 1.0))))) - MIN_CLASS

    def step(self, work_per_call: float) -> None:
        """A batched step begins whose attention calls do this much work on average: the
        mode of all its calls."""
        index = self.work_class(work_per_call)
        cls = self.classes[index]
        cls.steps += 1
        doubt = cls.pairs < MIN_PAIRS or cls.last < 1 - MARGIN
        period = EARLY_PERIOD if doubt else EXPLORE_PERIOD
        explore = cls.steps % period == 0 and cls.before is not None and cls.other is None
        state = self._step
        state.current = (index, 1 - cls.mode if explore else cls.mode)
        state.calls = 0
        state.began = self.clock()

    def end_step(self) -> None:
        """The step is over: its time per attention call goes into its class's record."""
        state = self._step
        if state.current is None:
            return
        (index, mode), state.current = state.current, None
        if state.calls:
            self.record(index, mode, (self.clock() - state.began) / state.calls)

    def record(self, index: int, mode: int, seconds: float) -> None:
        """A step of class `index` ran in `mode`, `seconds` per attention call."""
        cls = self.classes[index]
        if mode != cls.mode:
            cls.other = seconds
            return
        if cls.other is not None and cls.before is not None:  # the pair is complete
            sample = cls.other / (0.5 * (cls.before + seconds))
            cls.ratio = sample if cls.pairs == 0 else DECAY * cls.ratio + (1 - DECAY) * sample
            cls.last = sample
            cls.pairs += 1
            cls.other = None
            if cls.pairs >= MIN_PAIRS and cls.ratio < 1 - MARGIN:
                cls.mode, cls.pairs, cls.ratio, cls.last, cls.before = 1 - cls.mode, 0, 1.0, 1.0, None
                return
        cls.before = seconds

    def chosen(self) -> dict[int, str]:
        """Per work class seen (as log2 of the work): the mode chosen and the mean ratio."""
        return {index + MIN_CLASS: f"{'one thread' if cls.mode == SERIAL else 'pool'} "
                                   f"(other/chosen {cls.ratio:.3f} over {cls.pairs} pairs)"
                for index, cls in enumerate(self.classes) if cls.steps}

    def sdpa(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kwargs) -> torch.Tensor:
        """F.scaled_dot_product_attention(query, key, value, **kwargs), on one thread or the
        pool as the step in progress runs."""
        state = self._step
        threads = torch.get_num_threads()
        if state.current is None or threads <= 1 or query.device.type != "cpu":
            return F.scaled_dot_product_attention(query, key, value, **kwargs)
        state.calls += 1
        if state.current[1] != SERIAL:
            return F.scaled_dot_product_attention(query, key, value, **kwargs)
        torch.set_num_threads(1)
        try:
            return F.scaled_dot_product_attention(query, key, value, **kwargs)
        finally:
            torch.set_num_threads(threads)


# The process's record: the target's batched steps and a head's share it (the choice is the
# machine's, per amount of work, whichever model the call is for).
ATTENTION = AttentionThreads()


@contextlib.contextmanager
def batched_step(kv_heads: int, head_dim: int, queries: list[int], keys: list[int]):
    """ATTENTION's step around a batched forward whose session i attends with queries[i]
    queries over keys[i] keys, of `kv_heads` KV heads of `head_dim`. A forward that fails is
    not timed."""
    calls = max(1, len(queries))
    ATTENTION.step(kv_heads * head_dim * sum(q * k for q, k in zip(queries, keys)) / calls)
    try:
        yield
    except BaseException:
        ATTENTION.current = None
        raise
    ATTENTION.end_step()


def sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kwargs) -> torch.Tensor:
    """ATTENTION.sdpa: a batched step's per-session attention call."""
    return ATTENTION.sdpa(query, key, value, **kwargs)
