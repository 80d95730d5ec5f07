"""Adaptive speculation: how many tokens to draft in a request's next round.

Drafting pays only when drafts are accepted: a rejected block costs its verification (on
CPU, verifying 4 extra tokens costs ~1.2–2× a plain step) and gains nothing. So k follows
the request's own record — up by one after a fully accepted block, down by one after a
fully rejected one — and when the running acceptance rate falls below OFF_BELOW, the
request stops drafting and only probes every PROBE_EVERY rounds, in case the text turns
into something the drafter can predict (a quote, a list, code). Output never depends on k:
the target decides every token.
"""

from __future__ import annotations

from dataclasses import dataclass

# Running acceptance under which drafting pauses (an exponential moving average).
OFF_BELOW = 0.15
# While paused, draft once every PROBE_EVERY rounds.
PROBE_EVERY = 4
# Weight of the latest round in the moving average.
EMA_WEIGHT = 0.3


@dataclass
class AdaptiveK:
    k_max: int
    k: int = 0
    acceptance: float = 1.0  # optimistic start: every request gets to try
    paused_rounds: int = 0

    def __post_init__(self) -> None:
        self.k = self.k or self.k_max

    def next_k(self) -> int:
        """Draft tokens for the next round (0: decode this round with the target alone)."""
        if self.acceptance >= OFF_BELOW:
            return self.k
        self.paused_rounds += 1
        return self.k if self.paused_rounds % PROBE_EVERY == 0 else 0

    def update(self, proposed: int, accepted: int) -> None:
        if proposed == 0:
            return
        rate = accepted / proposed
        self.acceptance = (1 - EMA_WEIGHT) * self.acceptance + EMA_WEIGHT * rate
        if accepted == proposed:
            self.k = min(self.k_max, self.k + 1)
        elif accepted == 0:
            self.k = max(1, self.k - 1)
        if self.acceptance >= OFF_BELOW:
            self.paused_rounds = 0
