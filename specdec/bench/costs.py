"""The cost model of speculative decoding (Leviathan et al. 2023, arXiv 2211.17192, §3.3–3.4)
and the measurements that feed it.

With per-token acceptance α, k draft tokens per round, a draft step costing c target steps
and a (k + 1)-token verification costing v target steps, the expected speedup over the
target alone is

    S = (1 − α^(k+1)) / ((1 − α) (k·c + v))

(the paper's Theorem 3.8 writes kc + 1, i.e. v = 1: verification as cheap as one step, which
holds on an accelerator but not on a CPU, so v is measured here). The numerator is the
expected tokens per round, the denominator the cost of a round in target steps.

Adaptive k drafts a different number of tokens each round (none while paused), so the bench
evaluates the same quantity on what happened: tokens generated over the rounds' cost,
G / (R + P·(c_token + (v − 1)/k)), with G tokens in R rounds and P draft tokens, c_token the
cost of one draft token and verification cost linear in the block size. For a fixed k and
i.i.d. acceptance its expectation is S above. Both are reported.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

from specdec.lm import CausalLM
from specdec.sessions import Session

# Repetitions of each timed forward (interleaved, median taken).
COST_REPEATS = 7


def leviathan_speedup(alpha: float, k: float, c: float, v: float) -> float:
    """(1 − α^(k+1)) / ((1 − α)(k·c + v)); α = 1 gives (k + 1) / (k·c + v)."""
    tokens = k + 1 if alpha >= 1.0 else (1 - alpha ** (k + 1)) / (1 - alpha)
    return tokens / (k * c + v)


def alpha_from_acceptance_rate(rate: float, k: int) -> float:
    """The per-token acceptance α whose expected accepted fraction of a k-token block,
    α(1 − α^k) / ((1 − α) k), equals `rate` (accepted / proposed counts a block as cut at
    its first rejection, so it is lower than α). Bisection; the map is increasing in α."""
    if k <= 0 or rate <= 0.0:
        return 0.0
    if rate >= 1.0:
        return 1.0

    def accepted_fraction(a: float) -> float:
        return a * (1 - a ** k) / ((1 - a) * k)

    low, high = 0.0, 1.0 - 1e-12
    for _ in range(100):
        mid = (low + high) / 2
        low, high = (mid, high) if accepted_fraction(mid) < rate else (low, mid)
    return (low + high) / 2


def observed_theoretical_speedup(generated: int, rounds: int, proposed: int, c_token: float, v: float,
                                 k: int) -> float:
    """G / (R + P·(c_token + (v − 1)/k)): the speedup the observed rounds would give if the
    split cost nothing (see the module docstring)."""
    if rounds <= 0:
        return 0.0
    cost = rounds + proposed * (c_token + (v - 1) / k if k > 0 else 0.0)
    return generated / cost


@dataclass(frozen=True)
class StepCosts:
    """Measured seconds at one context length, on the serving path."""

    context: int
    target_step_s: float  # one new token
    verify_s: float  # k + 1 new tokens
    k: int

    @property
    def v(self) -> float:
        return self.verify_s / self.target_step_s


def _timed(fn) -> float:
    began = time.perf_counter()
    fn()
    return time.perf_counter() - began


def measure_target(lm: CausalLM, context: list[int], k: int, repeats: int = COST_REPEATS) -> StepCosts:
    """Times a 1-token step and a (k + 1)-token verification on top of a cache holding
    `context` minus its last token, interleaved so drift hits both alike."""
    session = Session("cost")
    session.cache = lm._new_cache()
    lm.feed(session, context[:-1], logits_to_keep=1)
    base = len(context) - 1
    block = context[-1:] * (k + 1)  # any ids will do: the cost depends on the shape only
    steps, verifies = [], []
    for _ in range(repeats):
        steps.append(_timed(lambda: lm.feed(session, block[:1], logits_to_keep=1)))
        lm.crop(session, base)
        verifies.append(_timed(lambda: lm.feed(session, block, logits_to_keep=k + 1)))
        lm.crop(session, base)
    return StepCosts(len(context), statistics.median(steps), statistics.median(verifies), k)


def measure_draft_model(lm: CausalLM, context: list[int], repeats: int = COST_REPEATS) -> float:
    """Seconds of one draft-model step (1 token on a cache of `context`)."""
    return measure_target(lm, context, 1, repeats).target_step_s


def measure_head(head, context: list[int], repeats: int = COST_REPEATS) -> float:
    """Seconds of one step of a feature-level head (specdec.eagle): 1 position on a cache
    of `context`, then its draft-vocabulary logits and argmax, as the draft worker runs it."""
    import torch

    from specdec.eagle import HeadCache

    cache = HeadCache(head.config.num_kv_heads, head.config.head_dim, head.fc.weight.dtype)
    hidden = head.config.hidden_size
    head.extend(cache, torch.zeros(len(context), hidden), context)

    def step() -> None:
        out = head.extend(cache, torch.zeros(1, hidden), context[-1:])
        int(torch.argmax(head.logits(out[0])))
        cache.crop(len(context))

    step()  # warm-up
    return statistics.median(_timed(step) for _ in range(repeats))


def measure_ngram(context: list[int], k: int, repeats: int = COST_REPEATS * 3) -> float:
    """Seconds of one n-gram lookup proposing up to k tokens (the whole block at once)."""
    from draft_worker.drafters.ngram import NgramDrafter
    from specdec.sessions import SyncedContext

    drafter = NgramDrafter()
    synced = SyncedContext(session=Session("cost"), context=list(context), reusable=0)
    return statistics.median(_timed(lambda: drafter.propose(synced, k)) for _ in range(repeats))

