"""Adaptive speculation: how many tokens to draft in a request's next round.

A round that drafts k tokens is worth, in expectation, (1 − α^(k+1)) / (1 − α) tokens for a
cost of 1 + PROPOSE_COST + k·DRAFT_TOKEN_COST target steps (Leviathan et al. 2023, arXiv
2211.17192, §3.3, with the verification cost measured rather than taken as one step); a
round without drafts is worth one token for one step. So each round drafts the k in 0..k_max
that maximises tokens per unit of cost, under the request's own record:

- α, the per-token acceptance, from draft tokens tried and accepted, both decayed by DECAY
  per round so the estimate follows the text (a quote, then free prose, then a list). A
  block cut at its first rejection tried accepted + 1 tokens; a fully accepted block tried
  all of them.
- how often the drafter proposes anything at all (an n-gram drafter finds no match in fresh
  prose; a round that asks and gets nothing still pays the Propose call).

When no k pays, the request stops drafting and probes with PROBE_K tokens every PROBE_EVERY
rounds, in case the text turns into something the drafter can predict; accepted probes raise
α and drafting resumes. Each failed probe doubles the wait before the next (up to
MAX_PROBE_EVERY), so a request whose text the drafter cannot predict pays almost nothing for
asking. Output never depends on k: the target decides every token.

Under load the price of a draft token changes. Rounds of many requests share one batched
verification step (coordinator.scheduler), and a step over R tokens takes about t₀ + t_row·R:
nearly flat in R while the step reads weights (one request, a few rows), linear once it
computes (many requests, many rows). A draft token then delays every one of the B requests
in the step by t_row, which in steps of one request is B·t_row / t(R) — the externality
`StepCostModel` estimates from the steps' measured times. As B grows, fewer and shorter
blocks pay, and at high load speculation stops where it would lower throughput (the known
failure of speculative decoding at large batch sizes: Liu et al. 2024, "Optimizing
Speculative Decoding for Serving LLMs Using Goodput", arXiv 2406.14066) and resumes when the
load falls.
"""

from __future__ import annotations

from dataclasses import dataclass

# Costs in target steps, measured on the CPU fast path (SmolLM2-135M, 2 cores, 60–230-token
# contexts, `specdec bench`): a Propose round trip ~5% of a step; a 5-token verification
# 1.13–1.23 steps, i.e. ~4.5% per draft token.
PROPOSE_COST = 0.05
DRAFT_TOKEN_COST = 0.045
# Every request starts believing in its drafter enough to draft k_max: PRIOR_TRIALS tokens at
# PRIOR_ALPHA (two failed blocks bring it below the break-even).
PRIOR_ALPHA = 0.6
PRIOR_TRIALS = 2.0
# Weight of the past in the acceptance record, per drafting round (~10 rounds of memory),
# and in the record of whether the drafter proposes anything (~3 rounds: a drafter that
# finds nothing stops being asked soon).
DECAY = 0.9
HIT_DECAY = 0.7
# While paused, draft PROBE_K tokens once every PROBE_EVERY rounds (a cheap probe: a failed
# one costs PROPOSE_COST + PROBE_K·DRAFT_TOKEN_COST).
PROBE_EVERY = 4
MAX_PROBE_EVERY = 16
PROBE_K = 2


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a round commits with k drafts at per-token acceptance alpha (bonus included)."""
    return k + 1.0 if alpha >= 1.0 else (1 - alpha ** (k + 1)) / (1 - alpha)


@dataclass
class AdaptiveK:
    k_max: int
    accepted: float = PRIOR_ALPHA * PRIOR_TRIALS  # decayed draft tokens accepted
    tried: float = PRIOR_TRIALS  # decayed draft tokens the target got to judge
    hit_rate: float = 1.0  # decayed share of asking rounds in which the drafter proposed something
    paused_rounds: int = 0
    probe_every: int = PROBE_EVERY  # doubles after each failed probe
    asked: int = 0  # k returned by the last next_k
    probing: bool = False  # the last next_k was a probe

    @property
    def alpha(self) -> float:
        return self.accepted / self.tried if self.tried > 0 else 0.0

    def best_k(self, draft_token_cost: float = DRAFT_TOKEN_COST) -> int:
        """The k in 0..k_max with the most expected tokens per unit of cost (0: drafting
        does not pay), a draft token costing draft_token_cost target steps."""
        best, best_rate = 0, 1.0
        for k in range(1, self.k_max + 1):
            tokens = 1 + self.hit_rate * (expected_tokens(self.alpha, k) - 1)
            cost = 1 + PROPOSE_COST + self.hit_rate * k * draft_token_cost
            if tokens / cost > best_rate:
                best, best_rate = k, tokens / cost
        return best

    def next_k(self, draft_token_cost: float = DRAFT_TOKEN_COST) -> int:
        """Draft tokens for the next round (0: decode this round with the target alone)."""
        k = self.best_k(draft_token_cost)
        self.probing = False
        if k > 0:
            self.paused_rounds = 0
            self.probe_every = PROBE_EVERY
        else:
            self.paused_rounds += 1
            if self.paused_rounds >= self.probe_every:
                k, self.probing, self.paused_rounds = min(PROBE_K, self.k_max), True, 0
        self.asked = k
        return k

    def update(self, proposed: int, accepted: int) -> None:
        """Records a round: `proposed` draft tokens of which the target accepted `accepted`."""
        asked, self.asked = self.asked, 0
        if asked == 0 and proposed == 0:  # a target-only round: nothing learnt
            return
        if self.probing and accepted == 0:
            self.probe_every = min(MAX_PROBE_EVERY, 2 * self.probe_every)
        self.hit_rate = HIT_DECAY * self.hit_rate + (1 - HIT_DECAY) * (1.0 if proposed else 0.0)
        if proposed == 0:
            return
        tried = accepted + (1 if accepted < proposed else 0)
        self.accepted = DECAY * self.accepted + accepted
        self.tried = DECAY * self.tried + tried


# The cost model's memory, per step (~20 steps), and its prior: PRIOR_STEPS pseudo-steps
# consistent with DRAFT_TOKEN_COST at one request (t_row / t(1) = DRAFT_TOKEN_COST).
STEP_DECAY = 0.95
PRIOR_STEPS = 4.0
# Beyond this the estimate is not trusted further (a draft token is never worth it there).
MAX_DRAFT_TOKEN_COST = 4.0


class StepCostModel:
    """t(R) = t₀ + t_row·R for one target replica's batched steps, fitted by decayed least
    squares on (rows, seconds) of the steps it ran, plus the recent mean rounds per step
    B and rows per step R̄; `draft_token_cost()` = B·t_row / t(R̄) in units of a step,
    never below DRAFT_TOKEN_COST (the one-request cost measured by the bench)."""

    def __init__(self) -> None:
        # Decayed sums for the regression of seconds on rows; the prior sits at rows 1 and
        # 5 with times in units where t(1) = 1.
        self._w = self._x = self._y = self._xx = self._xy = 0.0
        for rows in (1.0, 5.0):
            self._add(rows, 1.0 + DRAFT_TOKEN_COST * (rows - 1), PRIOR_STEPS / 2)
        self.rounds = 1.0  # decayed mean rounds per step
        self.rows = 1.0  # decayed mean rows per step
        self.scaled = False  # whether real steps have replaced the unit-less prior's scale

    def _add(self, x: float, y: float, weight: float) -> None:
        self._w += weight
        self._x += weight * x
        self._y += weight * y
        self._xx += weight * x * x
        self._xy += weight * x * y

    def observe(self, rows: int, seconds: float, rounds: int) -> None:
        if rows <= 0 or seconds <= 0:
            return
        if not self.scaled:
            # Rescale the prior to this replica's step time so it weighs as a shape only.
            scale = seconds / (1.0 + DRAFT_TOKEN_COST * (rows - 1))
            self._y *= scale
            self._xy *= scale
            self.scaled = True
        for name in ("_w", "_x", "_y", "_xx", "_xy"):
            setattr(self, name, getattr(self, name) * STEP_DECAY)
        self._add(float(rows), seconds, 1.0)
        self.rounds = STEP_DECAY * self.rounds + (1 - STEP_DECAY) * rounds
        self.rows = STEP_DECAY * self.rows + (1 - STEP_DECAY) * rows

    def fit(self) -> tuple[float, float]:
        """(t₀, t_row) in seconds (in prior units before any step)."""
        mean_x, mean_y = self._x / self._w, self._y / self._w
        var = self._xx / self._w - mean_x * mean_x
        slope = (self._xy / self._w - mean_x * mean_y) / var if var > 1e-9 else 0.0
        slope = max(slope, 0.0)
        return max(mean_y - slope * mean_x, 1e-6), slope

    def draft_token_cost(self) -> float:
        base, per_row = self.fit()
        cost = self.rounds * per_row / (base + per_row * self.rows)
        return min(MAX_DRAFT_TOKEN_COST, max(DRAFT_TOKEN_COST, cost))
