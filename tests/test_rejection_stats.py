"""Speculative sampling is lossless in distribution: a chi-square test at every output position.

Setting: k = 3 drafts plus the bonus position over a small vocabulary, with fixed target
distributions p_0 .. p_3 (the target's conditionals given the drafted prefix) and draft
distributions q_0 .. q_2 that differ from p, including tokens with p = 0 < q and q = 0 < p.
Each trial is one verify round on the torch reference with real random uniforms; all trials
run as one big batch. The token at output position i (the draft x_i if accepted past i, the
recovered / bonus token if the round stopped at i) must follow p_i among the trials that
reached position i, and tokens with p_i = 0 must never appear there. Drafts without
probabilities (one-hot q) go through the coupled rule (the target's own draw at every
position, drafts kept while they equal it), which must in addition emit exactly the tokens the
target alone draws with the same uniforms.

Power. Shifting one token a's probability by delta = 0.01 (the rest moving to keep the sum,
proportionally, which is the least detectable way) gives the chi-square statistic a
noncentrality lambda = n * delta**2 / (p_a * (1 - p_a)) >= 4 * n * delta**2 at n trials
reaching the position. With n >= 170k, lambda >= 68, and at alpha = 1e-3 with up to 5 degrees
of freedom the power is > 0.9999 (computed per position below and asserted >= 0.99).
The trials are seeded, so the test is deterministic; alpha = 1e-3 per position keeps a
correct sampler from failing on an unlucky seed.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from scipy import stats

from target_worker.kernels.rejection_sample_ref import (
    accepted_length,
    probability_weights,
    rejection_sample_ref,
    sample_weights,
)
from target_worker.kernels.sampled_match_ref import sampled_match_ref

K = 3
VOCAB = 6
ALPHA = 1e-3
SHIFT = 0.01  # the absolute change in one token's probability the test must detect
MIN_POWER = 0.99

# Target p_0 .. p_3 and draft q_0 .. q_2 for a drafter with probabilities.
P = torch.tensor([
    [0.30, 0.25, 0.20, 0.15, 0.10, 0.00],
    [0.00, 0.10, 0.35, 0.05, 0.30, 0.20],
    [0.22, 0.00, 0.18, 0.25, 0.05, 0.30],
    [0.10, 0.30, 0.00, 0.20, 0.25, 0.15],
])  # [k + 1, V]
Q = torch.tensor([
    [0.20, 0.30, 0.00, 0.20, 0.10, 0.20],  # q = 0 < p at 2, p = 0 < q at 5
    [0.15, 0.10, 0.25, 0.00, 0.30, 0.20],  # p = 0 < q at 0, q = 0 < p at 3
    [0.20, 0.10, 0.30, 0.20, 0.00, 0.20],  # p = 0 < q at 1, q = 0 < p at 4
])  # [k, V]
# Target for a drafter without probabilities: a favourite token, as the drafter guesses it.
P_PEAKED = torch.tensor([
    [0.70, 0.10, 0.08, 0.07, 0.05, 0.00],
    [0.00, 0.75, 0.10, 0.05, 0.05, 0.05],
    [0.05, 0.00, 0.80, 0.05, 0.05, 0.05],
    [0.10, 0.30, 0.00, 0.20, 0.25, 0.15],
])  # [k + 1, V]
ONE_HOT_GUESS_RATE = 0.8  # otherwise a uniform token, p = 0 ones included
RAGGED_NUM_DRAFT = torch.tensor([0.1, 0.1, 0.1, 0.7])  # P(num_draft = 0 .. 3)

Sampler = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def make_trials(
    trials: int, one_hot: bool, ragged: bool, seed: int
) -> dict[str, torch.Tensor | None]:
    """One verify round per trial, as a batch [trials, ...] (p and q are broadcast views)."""
    generator = torch.Generator().manual_seed(seed)
    target = P_PEAKED if one_hot else P
    if one_hot:
        guess = target[:K].argmax(dim=-1).expand(trials, K).clone()  # [N, k]
        other = torch.rand(trials, K, generator=generator) >= ONE_HOT_GUESS_RATE
        guess[other] = torch.randint(0, VOCAB, (int(other.sum()),), generator=generator)
        draft_tokens, draft_probs = guess, None
    else:
        draft_tokens = torch.stack(
            [
                torch.multinomial(Q[i], trials, replacement=True, generator=generator)
                for i in range(K)
            ],
            dim=1,
        )  # [N, k], x_i ~ q_i
        draft_probs = Q.expand(trials, K, VOCAB)
    if ragged:
        num_draft = torch.multinomial(
            RAGGED_NUM_DRAFT, trials, replacement=True, generator=generator
        )
    else:
        num_draft = torch.full((trials,), K)
    return {
        "target_probs": target.expand(trials, K + 1, VOCAB),
        "draft_probs": draft_probs,
        "draft_tokens": draft_tokens,
        "num_draft": num_draft,
        "u_accept": torch.rand(trials, K, generator=generator, dtype=torch.float64),
        "u_sample": torch.rand(trials, K + 1, generator=generator, dtype=torch.float64),
    }


def emitted_counts(
    inputs: dict, accepted: torch.Tensor, next_token: torch.Tensor
) -> list[torch.Tensor]:
    """Per output position, counts [V] of the tokens emitted there by the trials reaching it."""
    counts = []
    for position in range(K + 1):
        reached = accepted >= position  # [N]
        token = next_token
        if position < K:
            kept_draft = accepted > position
            token = torch.where(kept_draft, inputs["draft_tokens"][:, position], next_token)
        counts.append(torch.bincount(token[reached], minlength=VOCAB).double())
    return counts


def target_at(inputs: dict, position: int) -> torch.Tensor:
    p = inputs["target_probs"][0, position].double()
    return p / p.sum()  # the float32 rows sum to 1 only within rounding


def power_to_detect_shift(n: int, p: torch.Tensor) -> float:
    """Power of the chi-square test against the least detectable SHIFT in one token."""
    support = p > 0
    degrees = int(support.sum()) - 1
    noncentrality = n * SHIFT**2 / float((p[support] * (1 - p[support])).max())
    return float(stats.ncx2.sf(stats.chi2.ppf(1 - ALPHA, degrees), degrees, noncentrality))


def chi_square_failures(inputs: dict, counts: list[torch.Tensor]) -> list[str]:
    """The positions whose emitted tokens do not follow p (empty when all pass)."""
    failures = []
    for position, observed in enumerate(counts):
        p = target_at(inputs, position)
        support = p > 0
        if observed[~support].sum() > 0:
            failures.append(f"position {position}: emitted a token with p = 0: {observed.tolist()}")
            continue
        expected = observed.sum() * p[support]
        statistic, p_value = stats.chisquare(observed[support].numpy(), expected.numpy())
        if p_value < ALPHA:
            failures.append(f"position {position}: chi2 {statistic:.1f}, p-value {p_value:.2e}")
    return failures


CASES = {
    # name: (one_hot, ragged, trials); trials chosen so position 3 is reached >= 170k times.
    "draft_probs": (False, False, 400_000),
    "draft_probs_ragged": (False, True, 600_000),
    "one_hot": (True, False, 700_000),
    "one_hot_ragged": (True, True, 1_000_000),
}


@pytest.mark.parametrize("case", CASES)
def test_emitted_tokens_follow_target_at_every_position(case: str) -> None:
    one_hot, ragged, trials = CASES[case]
    inputs = make_trials(trials, one_hot, ragged, seed=2024)
    accepted, next_token = rejection_sample_ref(**inputs)
    counts = emitted_counts(inputs, accepted, next_token)
    for position, observed in enumerate(counts):
        power = power_to_detect_shift(int(observed.sum()), target_at(inputs, position))
        assert power >= MIN_POWER, f"position {position}: too few trials reach it ({power=:.3f})"
    assert chi_square_failures(inputs, counts) == []


def test_one_hot_rule_emits_what_target_alone_draws_with_the_same_uniforms() -> None:
    inputs = make_trials(5000, one_hot=True, ragged=True, seed=11)
    accepted, next_token = rejection_sample_ref(**inputs)
    alone = sample_weights(  # the target sampling each position by itself: [N, k + 1]
        probability_weights(inputs["target_probs"].reshape(-1, VOCAB)), inputs["u_sample"].reshape(-1)
    ).reshape(-1, K + 1)
    rows = torch.arange(len(accepted))
    assert torch.equal(next_token, alone[rows, accepted])
    for position in range(K):
        kept = accepted > position
        assert torch.equal(inputs["draft_tokens"][kept, position], alone[kept, position])
    assert len(set(accepted.tolist())) == K + 1  # every acceptance length occurs
    # The serving name of the same rule.
    same = sampled_match_ref(inputs["target_probs"], inputs["draft_tokens"], inputs["num_draft"],
                             inputs["u_sample"])
    assert torch.equal(same[0], accepted) and torch.equal(same[1], next_token)


# --- the test has teeth: deliberately wrong samplers fail it -------------------------------


def match_then_resample(target_probs, draft_probs, draft_tokens, num_draft, u_accept, u_sample):
    """Wrong: accepts like the coupled rule, but after a rejection draws again from p with a
    fresh uniform (the draft token can then come back: too much mass on it)."""
    accepted, _ = sampled_match_ref(target_probs, draft_tokens, num_draft, u_sample)
    rows = torch.arange(len(accepted))
    fresh = (u_sample[:, 0] * 7919.0) % 1.0
    return accepted, sample_weights(probability_weights(target_probs[rows, accepted]), fresh)


def uncoupled_acceptance(target_probs, draft_probs, draft_tokens, num_draft, u_accept, u_sample):
    """Wrong: accepts x with probability p(x) on its own uniform (as the uncoupled rule does),
    but then emits the target's draw y as if it were the residual, though y may be x again."""
    batch, positions, vocab = target_probs.shape
    rows = torch.arange(batch)
    in_vocab = (draft_tokens >= 0) & (draft_tokens < vocab)  # [N, k]
    p_draft = target_probs[:, :K].gather(2, draft_tokens.clamp(0, vocab - 1)[..., None]).squeeze(2)
    keep = (u_accept < p_draft.double()) & in_vocab
    accepted = accepted_length(keep, num_draft.clamp(0, K))
    drawn = sample_weights(probability_weights(target_probs[rows, accepted]), u_sample[rows, accepted])
    return accepted, drawn


def lenient_coupled(target_probs, draft_probs, draft_tokens, num_draft, u_accept, u_sample):
    """Subtly wrong: the coupled rule, but a draft with p > 0 that misses the draw is still kept
    5% of the time (a "near miss" slack): ~1.2% of the mass at position 0 moves to drafted
    tokens, and no token with p = 0 is emitted, so only the chi-square can see it."""
    batch, positions, vocab = target_probs.shape
    drawn = sample_weights(  # [N, k + 1]
        probability_weights(target_probs.reshape(-1, vocab)), u_sample.reshape(-1)
    ).reshape(batch, positions)
    in_vocab = (draft_tokens >= 0) & (draft_tokens < vocab)  # [N, k]
    p_draft = target_probs[:, :K].gather(2, draft_tokens.clamp(0, vocab - 1)[..., None]).squeeze(2)
    slack = (u_accept < 0.05) & (p_draft > 0) & in_vocab  # [N, k]
    accepted = accepted_length((draft_tokens == drawn[:, :K]) | slack, num_draft.clamp(0, K))
    return accepted, drawn.gather(1, accepted[:, None]).squeeze(1)


@pytest.mark.parametrize(
    "wrong_sampler", [match_then_resample, uncoupled_acceptance, lenient_coupled]
)
def test_wrong_one_hot_samplers_are_rejected(wrong_sampler: Sampler) -> None:
    inputs = make_trials(CASES["one_hot"][2], one_hot=True, ragged=False, seed=2025)
    accepted, next_token = wrong_sampler(**inputs)
    assert chi_square_failures(inputs, emitted_counts(inputs, accepted, next_token)) != []


def recover_from_p(target_probs, draft_probs, draft_tokens, num_draft, u_accept, u_sample):
    """Wrong: at a rejection, draws from p instead of the residual max(0, p - q)."""
    accepted, next_token = rejection_sample_ref(
        target_probs, draft_probs, draft_tokens, num_draft, u_accept, u_sample
    )
    rows = torch.arange(len(accepted))
    p_weights = probability_weights(target_probs[rows, accepted])
    from_p = sample_weights(p_weights, u_sample[rows, accepted])
    return accepted, from_p


def unnormalised_residual(target_probs, draft_probs, draft_tokens, num_draft, u_accept, u_sample):
    """Wrong: inverse CDF over the residual without normalising it (u against raw mass)."""
    accepted, next_token = rejection_sample_ref(
        target_probs, draft_probs, draft_tokens, num_draft, u_accept, u_sample
    )
    rows = torch.arange(len(accepted))
    rejected = accepted < num_draft
    at = accepted.clamp(max=K - 1)
    residual = (target_probs[rows, at] - draft_probs[rows, at]).clamp(min=0)  # [N, V]
    below = residual.cumsum(dim=-1) <= u_sample[rows, accepted, None]
    wrong = below.sum(dim=-1).clamp(max=VOCAB - 1)
    return accepted, torch.where(rejected, wrong, next_token)


def recover_from_q(target_probs, draft_probs, draft_tokens, num_draft, u_accept, u_sample):
    """Wrong: at a rejection, draws from the draft's q."""
    accepted, next_token = rejection_sample_ref(
        target_probs, draft_probs, draft_tokens, num_draft, u_accept, u_sample
    )
    rows = torch.arange(len(accepted))
    rejected = accepted < num_draft
    at = accepted.clamp(max=K - 1)
    from_q = sample_weights(probability_weights(draft_probs[rows, at]), u_sample[rows, accepted])
    return accepted, torch.where(rejected, from_q, next_token)


def lenient_acceptance(target_probs, draft_probs, draft_tokens, num_draft, u_accept, u_sample):
    """Subtly wrong: accepts with min(1, 1.04 * p / q), a "float slack" that moves ~1.6% of the
    mass at position 0 from the residual tokens to the over-drafted ones."""
    return rejection_sample_ref(
        target_probs, draft_probs, draft_tokens, num_draft, u_accept / 1.04, u_sample
    )


@pytest.mark.parametrize(
    "wrong_sampler", [recover_from_p, unnormalised_residual, recover_from_q, lenient_acceptance]
)
def test_wrong_samplers_are_rejected(wrong_sampler: Sampler) -> None:
    inputs = make_trials(400_000, one_hot=False, ragged=False, seed=2024)
    accepted, next_token = wrong_sampler(**inputs)
    assert chi_square_failures(inputs, emitted_counts(inputs, accepted, next_token)) != []


def test_interpreted_kernel_draws_the_same_tokens() -> None:
    kernels = pytest.importorskip("target_worker.kernels.rejection_sample")
    for one_hot in (False, True):
        inputs = make_trials(128, one_hot, ragged=True, seed=7)
        inputs = {name: None if t is None else t.contiguous() for name, t in inputs.items()}
        expected = rejection_sample_ref(**inputs)
        got = kernels.rejection_sample_triton(**inputs)
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
