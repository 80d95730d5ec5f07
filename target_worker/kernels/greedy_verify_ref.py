"""Greedy verification in plain torch: the specification the Triton kernel is tested against,
and the path the target worker takes on CPU.

A row's drafts are accepted up to the first one that differs from the target's argmax at the
same position; the target then emits its own argmax at the first unaccepted position (the
correction), or after the last draft (the bonus token) when every draft was accepted.
Argmax ties break to the lowest token id and a NaN logit wins (both as ``torch.argmax``).
"""

from __future__ import annotations

import torch

from target_worker.kernels.rejection_sample_ref import accepted_length


def greedy_verify_ref(
    logits: torch.Tensor,  # [B, k + 1, V] fp32 / bf16 / fp16
    draft_tokens: torch.Tensor,  # [B, k] int64, entries past num_draft are padding
    num_draft: torch.Tensor,  # [B] int64, clamped to [0, k]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (accepted [B] int64, next_token [B] int64)."""
    batch, positions, _ = logits.shape
    assert draft_tokens.shape == (batch, positions - 1) and num_draft.shape == (batch,)
    return accept_ref(logits.argmax(dim=-1), draft_tokens, num_draft)


def greedy_verify_rows_ref(
    logits: torch.Tensor,  # [R, V]: the step's scored rows, each once
    rows: torch.Tensor,  # [B, k + 1] int64: row b's position j is logits[rows[b, j]]
    draft_tokens: torch.Tensor,  # [B, k] int64, entries past num_draft are padding
    num_draft: torch.Tensor,  # [B] int64, clamped to [0, k]
) -> tuple[torch.Tensor, torch.Tensor]:
    """greedy_verify_ref over ragged chains: each of the R rows' argmax once, then each
    chain's positions read from them (entries of `rows` past num_draft may name any row).
    Returns (accepted [B] int64, next_token [B] int64)."""
    batch, positions = rows.shape
    assert logits.dim() == 2 and draft_tokens.shape == (batch, positions - 1) and num_draft.shape == (batch,)
    return accept_ref(logits.argmax(dim=-1)[rows], draft_tokens, num_draft)


def accept_ref(
    target_tokens: torch.Tensor,  # [B, k + 1] int64, the target's token at each position
    draft_tokens: torch.Tensor,  # [B, k] int64
    num_draft: torch.Tensor,  # [B] int64
) -> tuple[torch.Tensor, torch.Tensor]:
    """Drafts kept while they equal the target's tokens (its argmax, or its draws when
    sampling one-hot drafts); the target's token at the first stop."""
    k = target_tokens.shape[1] - 1
    accepted = accepted_length(draft_tokens == target_tokens[:, :k], num_draft.clamp(0, k))  # [B]
    next_token = target_tokens.gather(1, accepted[:, None]).squeeze(1)  # [B]
    return accepted, next_token
