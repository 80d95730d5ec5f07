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

    def best_k(self) -> int:
        """The k in 0..k_max with the most expected tokens per unit of cost (0: drafting
        does not pay)."""
        best, best_rate = 0, 1.0
        for k in range(1, self.k_max + 1):
            tokens = 1 + self.hit_rate * (expected_tokens(self.alpha, k) - 1)
            cost = 1 + PROPOSE_COST + self.hit_rate * k * DRAFT_TOKEN_COST
            if tokens / cost > best_rate:
                best, best_rate = k, tokens / cost
        return best

    def next_k(self) -> int:
        """Draft tokens for the next round (0: decode this round with the target alone)."""
        k = self.best_k()
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
