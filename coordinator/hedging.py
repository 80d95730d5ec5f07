"""Hedged target rounds: when a target replica holds a round past the tail of the pool's
recent round latencies, the same round goes to a second replica and the first answer wins.

A replica can be slow without failing (a grey failure: a noisy neighbour, a throttled
device, a model thread wedged but not yet reported by its watchdog). Nothing else in the
coordinator acts on that: outlier ejection counts failed calls, and a slow call is not one.
A hedged request, deferred until the first has been outstanding longer than a high
percentile of the expected latency of its class, cuts such a tail for a small, bounded
amount of extra work (Dean & Barroso, "The Tail at Scale", CACM 56(2), 2013).

Why a round may be sent twice: the coordinator owns the committed tokens and a worker's KV
cache is only an optimisation (coordinator.workers), so any target replica can serve any
round after a resync from the committed tokens; every replica serves the pinned weights,
greedy verification takes the argmax and seeded sampling draws from (seed, position) alone
(specdec.philox). Both replicas therefore give the same verdict, and whichever answers
first, the output is the target's own. The session then lives on the replica that answered;
the other one's copy of the session is released in the background.

Granularity. The target is called in batched steps (coordinator.scheduler): one VerifyBatch
carries the rounds of many sessions and cannot be recalled once sent. So a hedge is per
session round within a step: the round is queued a second time on another replica's
batcher, and the loser's place is cancelled — a round still queued leaves its queue unsent;
one whose step is already running is left to run unheard, and the loser's session is
released only once no step in flight there carries it (StepBatcher.settled). With batching
off the loser's call itself is cancelled. Each call a round makes (the resend after a
resync, a retry) starts its own timer, but a round — each prefill chunk is one — is hedged
at most once.

The delay is the `HedgePolicy.percentile` of the pool's recent latencies of calls of the
same class (`round_class`: rounds that carry a long run of tokens — prefill chunks, resyncs
— are far slower than decoding rounds and have their own window), times `factor`, never
below `min_s`; until a class has HEDGE_MIN_SAMPLES latencies, its rounds are not hedged.
A call's latency runs from its submission to its answer (queueing behind the step in flight
included), and for a hedged call to the first answer, so hedges that win keep the tail they
cut out of the next delays.

Bounds: at most one hedge per round; at most `max_share` of the pool's last
HEDGE_BUDGET_ROUNDS calls hedged (a fleet that is slow as a whole is not sent every round
twice: its percentile rises with it, and until it has, the budget holds); no hedge without a
second serving replica (healthy and not ejected); none for a request whose deadline leaves
less than the delay itself, as a fresh call would most likely not answer in time.

What a hedge costs: the second replica rebuilds the session's cache from the committed
tokens (the resync path), so a hedge of a round deep into a long request costs a prefill of
its whole context there. That is why hedging is off unless asked for.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

# Latencies kept per round class, and how many a class needs before its rounds are hedged
# (a 95th percentile of fewer is mostly noise).
HEDGE_WINDOW_CALLS = 512
HEDGE_MIN_SAMPLES = 20
# The window of calls over which `HedgePolicy.max_share` bounds the hedges.
HEDGE_BUDGET_ROUNDS = 1000
# A call carrying more tokens than this (committed tokens the replica lacks plus drafts) is
# in the "long" class: a prefill chunk or a resync, not a decoding round.
LONG_ROUND_TOKENS = 64


@dataclass(frozen=True)
class HedgePolicy:
    """When a target round is sent to a second replica (see the module docstring)."""

    percentile: float = 0.0
    """The percentile of the pool's recent latencies of the round's class the delay starts
    from, in (0, 100]; 0: hedging off."""
    factor: float = 1.0
    """The delay is the percentile times this."""
    min_s: float = 0.05
    """The shortest delay, in seconds."""
    max_share: float = 0.1
    """Most hedged calls among the pool's last HEDGE_BUDGET_ROUNDS calls, as a share."""

    def __post_init__(self):
        if not 0 <= self.percentile <= 100:
            raise ValueError(f"--hedge-percentile must be 0 (off) or in (0, 100], not {self.percentile:g}")
        if not self.factor > 0 or math.isinf(self.factor):
            raise ValueError(f"--hedge-factor must be above 0, not {self.factor:g}")
        if not self.min_s >= 0 or math.isinf(self.min_s):
            raise ValueError(f"--hedge-min-s must be 0 or more seconds, not {self.min_s:g}")
        if not 0 <= self.max_share <= 1:
            raise ValueError(f"--hedge-max-share must be in 0..1, not {self.max_share:g}")

    @property
    def enabled(self) -> bool:
        return self.percentile > 0 and self.max_share > 0


def round_class(tokens: int) -> str:
    """The latency class of a call carrying `tokens` tokens."""
    return "long" if tokens > LONG_ROUND_TOKENS else "short"


class LatencyWindow:
    """The last HEDGE_WINDOW_CALLS latencies of one class, and their percentiles."""

    def __init__(self, size: int = HEDGE_WINDOW_CALLS):
        self._samples: deque[float] = deque(maxlen=size)
        self._sorted: list[float] | None = None

    def __len__(self) -> int:
        return len(self._samples)

    def observe(self, seconds: float) -> None:
        self._samples.append(seconds)
        self._sorted = None

    def percentile(self, p: float) -> float:
        """The nearest-rank p-th percentile (0 < p <= 100) of a non-empty window."""
        if self._sorted is None:
            self._sorted = sorted(self._samples)
        rank = max(1, math.ceil(p / 100 * len(self._sorted)))
        return self._sorted[rank - 1]


class Hedger:
    """One target pool's hedging state: its recent latencies per round class and its hedge
    budget. Invariant: among the last HEDGE_BUDGET_ROUNDS calls counted (`count_call`), at
    most max_share × their number were granted a hedge (`grant`)."""

    def __init__(self, policy: HedgePolicy, budget_rounds: int = HEDGE_BUDGET_ROUNDS):
        self.policy = policy
        self.budget_rounds = budget_rounds
        self._windows = {name: LatencyWindow() for name in ("short", "long")}
        self.calls = 0  # calls counted, ever
        self.hedges = 0  # hedges granted, ever
        self._granted: deque[int] = deque()  # the call number of each hedge still in the window

    def delay(self, tokens: int) -> float | None:
        """How long a call carrying `tokens` tokens may go unanswered before it is hedged;
        None: not hedged (hedging off, or too few latencies of its class yet)."""
        if not self.policy.enabled:
            return None
        window = self._windows[round_class(tokens)]
        if len(window) < HEDGE_MIN_SAMPLES:
            return None
        return max(self.policy.min_s, self.policy.factor * window.percentile(self.policy.percentile))

    def observe(self, tokens: int, seconds: float) -> None:
        """An answered call's latency (for a hedged one, to its first answer)."""
        self._windows[round_class(tokens)].observe(seconds)

    def count_call(self) -> None:
        """A call a round made: one more in the budget's window."""
        self.calls += 1
        while self._granted and self._granted[0] <= self.calls - self.budget_rounds:
            self._granted.popleft()

    def grant(self) -> bool:
        """Whether the budget allows one more hedge now; if so, it is counted."""
        window = min(self.calls, self.budget_rounds)
        if len(self._granted) + 1 > self.policy.max_share * window:
            return False
        self._granted.append(self.calls)
        self.hedges += 1
        return True
