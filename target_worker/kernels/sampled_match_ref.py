"""Verification of token-only drafts (n-gram lookup, a greedy draft model) under sampling,
in plain torch, under the name the target worker uses: the target draws its own token at every
position and a draft token is accepted exactly when it equals that draw.

This is the one-hot path of ``rejection_sample_ref`` (``match_target_draws``), not a second
copy of the rule; ``rejection_sample.py`` states it, says why it is the rejection sampler of
Leviathan et al. (arXiv 2211.17192) for a one-hot proposal, and why a seeded request then
yields the very tokens target-only sampling yields.
"""

from __future__ import annotations

import torch

from target_worker.kernels.rejection_sample_ref import rejection_sample_ref


def sampled_match_ref(
    target_probs: torch.Tensor,  # [B, k + 1, V] p, already warped
    draft_tokens: torch.Tensor,  # [B, k] int64, entries past num_draft are padding
    num_draft: torch.Tensor,  # [B] int64, clamped to [0, k]
    u_sample: torch.Tensor,  # [B, k + 1] float64 in [0, 1), column i: absolute position first + i
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (accepted [B] int64, next_token [B] int64)."""
    batch, positions, _ = target_probs.shape
    # [B, k]: the one-hot rule reads no acceptance uniforms.
    u_accept = torch.zeros(batch, positions - 1, dtype=torch.float64, device=target_probs.device)
    return rejection_sample_ref(target_probs, None, draft_tokens, num_draft, u_accept, u_sample)
