"""Verification of token-only drafts (n-gram lookup, a greedy draft model) under sampling,
in plain torch: the target draws its own token at every position and a draft token is
accepted exactly when it equals that draw.

Why this is the rejection sampler for a one-hot proposal (q = δ_x), coupled: the draw y ~ p
equals x with probability p(x), which is min(1, p(x)/q(x)) — the acceptance probability of
Leviathan et al. (arXiv 2211.17192) — and when y ≠ x, y is distributed as p restricted to
tokens ≠ x, renormalised, which is norm(max(0, p − δ_x)), their residual. So the emitted
tokens follow p, as the uncoupled rule in rejection_sample_ref does. The coupling adds one
thing: the draw at each position uses the same uniform (Philox, keyed by seed and absolute
position) that the target alone would use there, so a seeded request yields the very tokens
target-only sampling yields, whatever was drafted. Output identity, not just identity in
distribution, is what users check.
"""

from __future__ import annotations

import torch

from target_worker.kernels.rejection_sample_ref import probability_weights, sample_weights


def sampled_match_ref(
    target_probs: torch.Tensor,  # [B, k + 1, V] p, already warped
    draft_tokens: torch.Tensor,  # [B, k] int64, entries past num_draft are padding
    num_draft: torch.Tensor,  # [B] int64, clamped to [0, k]
    u_sample: torch.Tensor,  # [B, k + 1] float64 in [0, 1), column i: absolute position first + i
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (accepted [B] int64, next_token [B] int64)."""
    batch, positions, vocab = target_probs.shape
    k = positions - 1
    assert draft_tokens.shape == (batch, k) and num_draft.shape == (batch,)
    assert u_sample.shape == (batch, positions)
    weights = probability_weights(target_probs.reshape(batch * positions, vocab))  # [B * (k + 1), V]
    drawn = sample_weights(weights, u_sample.reshape(-1)).reshape(batch, positions)  # [B, k + 1]
    num_draft = num_draft.clamp(0, k)
    draft_index = torch.arange(k, device=target_probs.device)  # [k]
    stop = (draft_tokens != drawn[:, :k]) | (draft_index >= num_draft[:, None])  # [B, k]
    stop = torch.cat((stop, stop.new_ones(batch, 1)), dim=1)  # [B, k + 1], sentinel after the last
    accepted = stop.to(torch.int8).argmax(dim=1)  # [B], first stop
    next_token = drawn.gather(1, accepted[:, None]).squeeze(1)  # [B]
    return accepted, next_token
