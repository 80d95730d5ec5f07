"""The speedup of speculative decoding (Leviathan et al. 2023, arXiv 2211.17192, §3.3–3.4): the
one formula the coordinator's adaptive k, the bench and training all use.

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


def expected_tokens(alpha: float, k: float) -> float:
    """Tokens a round commits with k drafts at per-token acceptance alpha, the bonus or
    correction token included: (1 − α^(k+1)) / (1 − α); k + 1 at α = 1."""
    return k + 1.0 if alpha >= 1.0 else (1 - alpha ** (k + 1)) / (1 - alpha)


def leviathan_speedup(alpha: float, k: float, c: float, v: float) -> float:
    """(1 − α^(k+1)) / ((1 − α)(k·c + v)); α = 1 gives (k + 1) / (k·c + v)."""
    return expected_tokens(alpha, k) / (k * c + v)


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
