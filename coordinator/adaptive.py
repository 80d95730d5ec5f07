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

Under load both prices change, and both are measured, not assumed. Rounds of many requests
share one batched verification step (coordinator.scheduler): a draft token adds a row to the
step and delays every one of its B requests by t_draft, i.e. B·t_draft / t(step) steps —
`StepCostModel` fits t_draft from the measured times of steps with and without drafts (the
step time is far from linear in rows). And the step waits for a drafting request's Propose
round, so every request in it waits too: the Propose round's measured time, shared among
the requests drafting in the step. As B grows, fewer and shorter blocks pay, and at high
load speculation stops where it would lower throughput (the known failure of speculative
decoding at large batch sizes: Liu et al. 2024, "Optimizing Speculative Decoding for Serving
LLMs Using Goodput", arXiv 2406.14066) and resumes when the load falls. Under load the
draft rows of a step follow its rounds, which leaves the fit blind to a row's own cost; the
model then pauses drafting on the replica for a few steps now and then, to see what the same
load costs without drafts. Probes get rarer as
they get dearer (PROBE_BUDGET), and a new request starts from the drafter's recent
acceptance over all requests (`DrafterRecord`), not from a fixed belief.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from specdec.speedup import expected_tokens

# One-request costs in target steps, from `specdec bench` on the CPU fast path (figures in
# benchmarks/results/NOTES.md): a Propose round trip, and each draft token a verification
# carries. Under load the measured estimates below replace them.
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
# Memory of the drafter-wide record that new requests start from (~50 drafting rounds).
RECORD_DECAY = 0.98
# Memory of the round-time estimates (~20 rounds); rounds timed before they are trusted; a
# Propose dearer than this many Verify rounds is treated as this dear.
ROUND_TIME_DECAY = 0.95
MIN_ROUNDS_TIMED = 8
MAX_PROPOSE_COST = 2.0
# While paused, draft PROBE_K tokens once every PROBE_EVERY rounds (a cheap probe: a failed
# one costs PROPOSE_COST + PROBE_K·DRAFT_TOKEN_COST), and never so often that failed probes
# cost more than PROBE_BUDGET of the rounds' time — under load a probe is dear (every
# request in the step waits for it) and comes correspondingly rarely.
PROBE_EVERY = 4
MAX_PROBE_EVERY = 16
PROBE_K = 2
PROBE_BUDGET = 0.035


class DrafterRecord:
    """The drafter's recent acceptance over all requests (decayed per drafting round): a new
    request starts from it instead of a fixed belief, so on text the drafter cannot predict
    new requests do not each pay a few full blocks to find out, and on text it predicts
    well they draft from the first round."""

    def __init__(self) -> None:
        self.accepted = PRIOR_ALPHA * PRIOR_TRIALS
        self.tried = PRIOR_TRIALS

    @property
    def alpha(self) -> float:
        return self.accepted / self.tried

    def update(self, proposed: int, accepted: int) -> None:
        if proposed:
            self.accepted = RECORD_DECAY * self.accepted + accepted
            self.tried = RECORD_DECAY * self.tried + accepted + (1 if accepted < proposed else 0)

    def start(self, k_max: int) -> AdaptiveK:
        """A request's own record, starting at the drafter's recent acceptance."""
        return AdaptiveK(k_max=k_max, accepted=self.alpha * PRIOR_TRIALS, tried=PRIOR_TRIALS)


class RoundTimes:
    """Decayed mean duration of one kind of worker round as the coordinator sees it (queue
    wait, batched step and transfer)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.count = 0

    def observe(self, seconds: float) -> None:
        self.count += 1
        self.seconds = seconds if self.count == 1 else ROUND_TIME_DECAY * self.seconds + (1 - ROUND_TIME_DECAY) * seconds


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

    def best_k(self, draft_token_cost: float = DRAFT_TOKEN_COST, propose_cost: float = PROPOSE_COST) -> int:
        """The k in 0..k_max with the most expected tokens per unit of cost (0: drafting
        does not pay), a draft token costing draft_token_cost target steps and asking the
        drafter propose_cost."""
        best, best_rate = 0, 1.0
        for k in range(1, self.k_max + 1):
            tokens = 1 + self.hit_rate * (expected_tokens(self.alpha, k) - 1)
            cost = 1 + propose_cost + self.hit_rate * k * draft_token_cost
            if tokens / cost > best_rate:
                best, best_rate = k, tokens / cost
        return best

    def next_k(self, draft_token_cost: float = DRAFT_TOKEN_COST, propose_cost: float = PROPOSE_COST) -> int:
        """Draft tokens for the next round (0: decode this round with the target alone)."""
        k = self.best_k(draft_token_cost, propose_cost)
        self.probing = False
        if k > 0:
            self.paused_rounds = 0
            self.probe_every = PROBE_EVERY
        else:
            self.paused_rounds += 1
            probe_cost = propose_cost + min(PROBE_K, self.k_max) * draft_token_cost
            if self.paused_rounds >= max(self.probe_every, probe_cost / PROBE_BUDGET):
                k, self.probing, self.paused_rounds = min(PROBE_K, self.k_max), True, 0
        self.asked = k
        return k

    def update(self, proposed: int, accepted: int, asked: tuple[int, bool] | None = None) -> None:
        """Records a round: `proposed` draft tokens of which the target accepted `accepted`.
        `asked`: (k, probing) of the next_k call those drafts answered, when that was not the
        last one (a head on the target worker drafts a round ahead: coordinator.rounds)."""
        if asked is not None:
            self.asked, self.probing = asked
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


# The cost model's memory: the last STEP_WINDOW decode steps, weighted STEP_DECAY per step
# of age (~20 steps). A step is a decode step when it carries at most DECODE_ROWS_PER_ROUND
# committed rows per round (no prefill chunk in it).
STEP_WINDOW = 64
STEP_DECAY = 0.95
# The load a price is for: the median of the last USUAL_STEPS decode steps. When requests
# finish, the few left see their price fall within a few steps, not after half the window.
USUAL_STEPS = 5
DECODE_ROWS_PER_ROUND = 2
# The draft-row slope's prior: as if PRIOR_DRAFT_ROWS2 (draft rows², weighted) of steps had
# shown each draft row costing DRAFT_TOKEN_COST of the step — right at one request, and
# pessimistic under load until steps with and without drafts show otherwise. The per-round
# slope gets a weak pull towards zero only so that it is defined when every step has the
# same number of rounds.
PRIOR_DRAFT_ROWS2 = 4.0
ROUNDS_RIDGE = 1e-3
# Beyond this the estimate is not trusted further (a draft token is never worth it there).
MAX_DRAFT_TOKEN_COST = 4.0
# Under load nearly every step carries draft rows in proportion to its rounds, and whatever
# else drifts over time (contexts grow, prompts arrive, the price itself moves the drafting)
# drifts with them: a fit over the window cannot tell a row's cost from a round's. So while
# the usual step has at least two rounds and PAUSE_MIN_DRAFTS draft rows, drafting on the
# replica pauses for PAUSE_STEPS decode steps once every PAUSE_EVERY steps (the first one or two
# still carry the drafts decided before), and the row's cost is measured from the pause and
# the PAUSE_STEPS decode steps before and after it — the same load, a few steps apart: a
# controlled comparison. Each pause's figure enters a mean decayed by PAIRED_DECAY per pause.
PAUSE_MIN_DRAFTS = 4.0
PAUSE_STEPS = 8
PAUSE_EVERY = 96
PAIRED_DECAY = 0.5
# A pause also compares what the replica delivers, tokens per second of step, drafting (the
# steps around it, each round committing τ) and not (its own steps, one token a round). The
# price of a row is a model of that; where the comparison finds drafting delivering less,
# the model missed a cost, and every row's price is multiplied by PRICE_STEP more (up to
# MAX_PRICE_SCALE); where drafting delivers more than GAIN_MARGIN above, the multiplier is
# divided by PRICE_STEP again (down to 1). A multiplier halves after PRICE_RETRY_STEPS decode
# steps without a verdict, so a replica that stopped drafting tries again later.
PRICE_STEP = 2.0
MAX_PRICE_SCALE = 16.0
GAIN_MARGIN = 0.03
PRICE_RETRY_STEPS = 512


class StepCostModel:
    """What a draft token costs on one target replica, from the times of its batched decode
    steps: t = t₀ + t_round·rounds + t_draft·draft rows, fitted by decayed least squares
    (the draft slope shrunk towards the one-request prior). Measured rather than assumed
    because step time is far from linear in rows: flat while a step reads weights, steep once
    it computes, with a cost per session (its attention, its cache) on top (step timings in
    benchmarks/results/NOTES.md). With B rounds in the usual step (the median of the last
    USUAL_STEPS: the fit remembers ~20 steps, the price follows the load as it changes),
    `draft_token_cost()` = (1 + (B − 1)·τ)·t_draft / t(usual) in units of a step, τ the
    tokens a round commits on this replica (decayed mean): a draft token delays every
    request in the step by t_draft, its own (which it pays for with its chance of being
    accepted) and the B − 1 others, each of which would have committed τ tokens per step in
    that time — so it pays iff it adds more to the step's tokens than it takes from the
    others (with τ = 1 the price would under-count every request that drafts well); never
    below DRAFT_TOKEN_COST. A head on the
    target worker drafts inside the step: its time is taken out before the fit (`head_s`)
    and priced on its own (`head_cost`) — steps that verify drafts are mostly steps whose
    rounds ask for the next ones, so left in, the head's time would be fitted as the draft
    rows' and paid twice; it is added back to t(usual) as its mean per step. The fit runs
    when a figure is read, at most once per step observed: `observe` is on every step's path,
    and with speculation off nothing reads the figures.

    Under load the window cannot separate a draft row's cost from a round's (PAUSE_STEPS
    above), so the model pauses drafting on its replica now and then (`paused`): for a few
    steps every request there decodes without drafts, and those steps against the ones just
    before and after give t_draft by a controlled comparison, which then replaces the
    window's slope.
    The pauses are what the measurement costs: PAUSE_STEPS of every PAUSE_EVERY steps while
    drafting under load, none at one request or while nobody drafts.

    A pause is also a direct test of the price: the replica's tokens per second of step with
    drafting (the steps around the pause) against without (the pause). Whatever the model
    leaves out — a cost outside the fitted rows, a τ that the drafts do not reach — shows
    there; where drafting delivered less, `price_scale` multiplies every row's price until
    only what pays is drafted, or nothing (PRICE_STEP above). Speculation under load is thus
    held to what it measurably gives, not to what the model predicts."""

    def __init__(self) -> None:
        # rounds, drafts, seconds without the head's drafting, seconds
        self.steps: deque[tuple[int, int, float, float]] = deque(maxlen=STEP_WINDOW)
        self.rounds = 1.0  # rounds in the usual decode step (the median of the last USUAL_STEPS)
        self.drafts = 0.0  # draft rows in the usual decode step
        self.drafting = 0.0  # decayed share of rounds that carry drafts
        self._step_s = 0.0  # the usual decode step's duration
        self._cost = DRAFT_TOKEN_COST
        self._stale = False  # steps observed since the last fit
        # A head on the target worker: its drafting time per step that asked it, and the
        # decayed share of a step's rounds that asked.
        self.head = RoundTimes()
        self.head_asking = 0.0
        self.head_per_step = 0.0  # decayed mean of the head's drafting time per decode step
        self.tokens_per_round = 1.0  # τ: decayed per step, from the rounds' verdicts
        self._round_tokens = [0, 0]  # tokens and rounds recorded since the last step
        self._tokens_seen = False  # τ has been measured (before: the prior 1)
        self.pause_left = 0  # decode steps the current pause of drafting lasts still
        self.since_pause = 0  # steps observed since the last pause began (or since the first)
        self.pauses = 0
        self._pause_wanted = False  # the last fit found drafting under load
        # Decode steps (step, rounds, drafts, seconds without the head's drafting, seconds) of the
        # current pause and the PAUSE_STEPS before and after it; the decayed mean of the
        # paired figures (s per draft row) and its weight.
        self._pair: list[tuple[int, int, int, float, float]] = []
        self._after_left = 0  # decode steps after the pause still to be taken into its measurement
        self.paired = 0.0
        self.paired_weight = 0.0
        self.paired_rounds = 0.0  # the usual step's rounds when the last pause was measured
        self._pause_rounds = 0.0  # the usual step's rounds when the current pause began
        self._decode_steps = 0  # decode steps observed: the pause measurement's time axis
        self.price_scale = 1.0  # what the pauses' tokens per second found the price missing
        self._scaled_at = 0  # the decode step of the last verdict on the price
        # The last verdicts (drafting's tokens/s over the pause's) and how many there were.
        self.verdicts: deque[float] = deque(maxlen=32)
        self.verdict_count = 0

    def observe(self, rows: int, seconds: float, rounds: int, drafts: int = 0, drafting: int = 0,
                head_s: float = 0.0) -> None:
        """A step: its rows, duration, rounds, draft rows, rounds with drafts, and the part
        of its duration a head on the worker spent drafting the next rounds."""
        if rows <= 0 or seconds <= 0 or rounds <= 0:
            return
        self.since_pause += 1
        if rows - drafts > DECODE_ROWS_PER_ROUND * rounds:
            return  # a prefill chunk: neither fitted nor counted in a pause
        self._decode_steps += 1
        in_pause = self.pause_left > 0
        if (self.pause_left or self._after_left) and rounds < self._pause_rounds / 2:
            self.pause_left = self._after_left = 0  # the load it was to measure is gone
            self._pair = []
        if self.pause_left or self._after_left:
            self._pair.append((self._decode_steps, rounds, drafts, seconds - min(max(0.0, head_s), seconds), seconds))
            if self.pause_left:
                self.pause_left -= 1
                self._after_left = 0 if self.pause_left else PAUSE_STEPS
            else:
                self._after_left -= 1
                if not self._after_left:
                    self._measure_pause()
        tokens, counted = self._round_tokens
        self._round_tokens = [0, 0]
        if counted and not in_pause:  # paused rounds commit one token each: not what drafting ones do
            mean = tokens / counted
            self.tokens_per_round = mean if not self._tokens_seen else \
                STEP_DECAY * self.tokens_per_round + (1 - STEP_DECAY) * mean
            self._tokens_seen = True
        share = drafting / rounds
        head_s = min(max(0.0, head_s), seconds)
        if not self.steps:
            self.drafting, self.head_per_step = share, head_s
        else:
            self.drafting = STEP_DECAY * self.drafting + (1 - STEP_DECAY) * share
            self.head_per_step = STEP_DECAY * self.head_per_step + (1 - STEP_DECAY) * head_s
        self.steps.append((rounds, drafts, seconds - head_s, seconds))
        if self.price_scale > 1 and self._decode_steps - self._scaled_at >= PRICE_RETRY_STEPS:
            self.price_scale = max(1.0, self.price_scale / PRICE_STEP)
            self._scaled_at = self._decode_steps
        self._stale = True

    def observe_round(self, tokens: int) -> None:
        """A round on this replica committed `tokens` (its accepted drafts, the target's
        next token and any alternative's)."""
        self._round_tokens[0] += tokens
        self._round_tokens[1] += 1

    def observe_head(self, seconds: float, rounds: int, asking: int) -> None:
        """A step in which `asking` of its `rounds` asked the head on the target worker for
        their next blocks, which took it `seconds` of the step."""
        if asking <= 0 or rounds <= 0:
            return
        self.head.observe(seconds)
        share = asking / rounds
        self.head_asking = share if self.head.count == 1 else \
            STEP_DECAY * self.head_asking + (1 - STEP_DECAY) * share

    def head_cost(self) -> float:
        """What asking the head on the target worker for a block costs, in steps: its
        drafting time lengthens the step every round in it waits for, shared among the
        rounds that asked (as a Propose round is, `propose_cost`)."""
        if self.head.count < MIN_ROUNDS_TIMED or self.step_s <= 0:
            return PROPOSE_COST
        waiting = self.rounds / max(1.0, self.head_asking * self.rounds)
        return min(MAX_PROPOSE_COST, max(PROPOSE_COST, self.head.seconds * waiting / self.step_s))

    def _refit(self) -> None:
        self._stale = False
        recent = sorted(list(self.steps)[-USUAL_STEPS:])
        usual = recent[len(recent) // 2]
        self.rounds, self.drafts = float(usual[0]), float(usual[1])
        base, per_draft = self.fit()
        self._step_s = base + self.head_per_step
        waiting = 1 + (self.rounds - 1) * self.tokens_per_round
        cost = self.price_scale * waiting * per_draft / self._step_s if self._step_s > 0 else MAX_DRAFT_TOKEN_COST
        self._cost = min(MAX_DRAFT_TOKEN_COST, max(DRAFT_TOKEN_COST, cost))
        self._pause_wanted = self.rounds >= 2 and self.drafts >= PAUSE_MIN_DRAFTS

    def _measure_pause(self) -> None:
        """The row's cost from the pause just measured: least squares over the decode steps
        of the pause and the PAUSE_STEPS before and after it, t − t_round·rounds = a +
        t_draft·drafts + drift·step (t_round from the window's fit: the rounds barely differ
        within a few steps; the drift takes out what changes steadily meanwhile, as contexts
        grow)."""
        pair, self._pair = self._pair, []
        data = np.array(pair, dtype=np.float64).reshape(-1, 5)
        drafts = data[:, 2]
        if not (drafts == 0).any() or (drafts > 0).sum() < 2:
            return  # the pause did not reach the steps, or nothing was drafted around it
        self._judge_price(data)
        data = data[:, :4]
        x = np.column_stack([np.ones(len(data)), drafts, data[:, 0] - data[0, 0]])
        y = data[:, 3] - self._fit_rounds() * data[:, 1]
        slope = float(np.linalg.lstsq(x, y, rcond=None)[0][1])
        self.paired = (PAIRED_DECAY * self.paired_weight * self.paired + max(0.0, slope)) / \
            (PAIRED_DECAY * self.paired_weight + 1)
        self.paired_weight = PAIRED_DECAY * self.paired_weight + 1
        self.paired_rounds = self._pause_rounds
        self._stale = True

    def _judge_price(self, data: np.ndarray) -> None:
        """Tokens per second of step (the head's drafting included) of the drafting steps
        around a pause, each round committing τ, against the pause's steps without drafts,
        one token a round; moves `price_scale` by the verdict. Not before τ is measured."""
        if not self._tokens_seen:
            return
        drafting, plain = data[data[:, 2] > 0], data[data[:, 2] == 0]
        with_drafts = self.tokens_per_round * drafting[:, 1].sum() / drafting[:, 4].sum()
        without = plain[:, 1].sum() / plain[:, 4].sum()
        ratio = with_drafts / without
        self.verdicts.append(ratio)
        self.verdict_count += 1
        if ratio < 1:
            self.price_scale = min(MAX_PRICE_SCALE, self.price_scale * PRICE_STEP)
        elif ratio > 1 + GAIN_MARGIN:
            self.price_scale = max(1.0, self.price_scale / PRICE_STEP)
        self._scaled_at = self._decode_steps

    @property
    def paused(self) -> bool:
        """Whether requests on this replica should decode without drafts now. A pause begins
        when a figure is read and the last fit found drafting under load (at most once every
        PAUSE_EVERY steps, and not while the last one is still measured), and lasts
        PAUSE_STEPS decode steps — or ends when the load falls below half of what it was."""
        if self._stale:
            self._refit()
        if not (self.pause_left or self._after_left) and self._pause_wanted and self.since_pause >= PAUSE_EVERY:
            self.pause_left, self.since_pause, self._pause_wanted = PAUSE_STEPS, 0, False
            self._pause_rounds = self.rounds
            before = list(self.steps)[-PAUSE_STEPS:]
            self._pair = [(self._decode_steps - len(before) + 1 + i, *step) for i, step in enumerate(before)]
            self.pauses += 1
        return self.pause_left > 0

    def fit(self) -> tuple[float, float]:
        """(t(usual step) without the head's drafting, t_draft) in seconds; (1,
        DRAFT_TOKEN_COST) in units of a step before any step."""
        if not self.steps:
            return 1.0, DRAFT_TOKEN_COST
        t0, per_round, per_draft = self._solve()
        usual = float(t0 + per_round * self.rounds + per_draft * self.drafts)
        return max(usual, 1e-6), per_draft

    def _fit_rounds(self) -> float:
        return self._solve()[1] if self.steps else 0.0

    def _solve(self) -> tuple[float, float, float]:
        """(t₀, t_round, t_draft) over the window. Once pauses have measured t_draft, it is
        theirs and the window fits t₀ and t_round alone — while the load is near the one
        they measured it at (at least half its rounds; below, the window's own slope)."""
        data = np.array(self.steps, dtype=np.float64)[::-1]  # newest first
        weights = STEP_DECAY ** np.arange(len(data))
        if self.paired_weight > 0 and self.rounds >= self.paired_rounds / 2:
            x = np.column_stack([np.ones(len(data)), data[:, 0]])
            y = data[:, 2] - self.paired * data[:, 1]
            xtx = (x * weights[:, None]).T @ x
            xtx[1, 1] += ROUNDS_RIDGE * xtx[0, 0]
            t0, per_round = np.linalg.solve(xtx, (x * weights[:, None]).T @ y)
            return float(t0), float(per_round), self.paired
        x = np.column_stack([np.ones(len(data)), data[:, 0], data[:, 1]])
        y = data[:, 2]
        xtx = (x * weights[:, None]).T @ x
        xty = (x * weights[:, None]).T @ y
        mean_t = float(weights @ y / weights.sum())
        xtx[1, 1] += ROUNDS_RIDGE * xtx[0, 0]
        xtx[2, 2] += PRIOR_DRAFT_ROWS2
        xty[2] += PRIOR_DRAFT_ROWS2 * DRAFT_TOKEN_COST * mean_t
        t0, per_round, per_draft = np.linalg.solve(xtx, xty)
        return float(t0), float(per_round), max(0.0, float(per_draft))

    @property
    def step_s(self) -> float:
        """The usual decode step's duration, in seconds (0 before any)."""
        if self._stale:
            self._refit()
        return self._step_s

    def draft_token_cost(self) -> float:
        if self._stale:
            self._refit()
        return self._cost

    def propose_cost(self, propose: RoundTimes) -> float:
        """What asking the drafter costs, in steps. A drafting request reaches the next
        target step a Propose round later, and the step waits for it (coordinator.scheduler
        gathers), so every request in the step waits too — shared among the requests that
        draft in it. At one request that is the Propose round's own share of a step; at B
        requests of which one drafts it is B times that."""
        if propose.count < MIN_ROUNDS_TIMED or self.step_s <= 0:
            return PROPOSE_COST
        waiting = self.rounds / max(1.0, self.drafting * self.rounds)
        return min(MAX_PROPOSE_COST, max(PROPOSE_COST, propose.seconds * waiting / self.step_s))
