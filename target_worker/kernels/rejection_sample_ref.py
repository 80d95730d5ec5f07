"""Speculative (rejection) sampling in plain torch: the specification the Triton kernels in
``rejection_sample.py`` are tested against (that module states both rules, says why they are
exact and cites the papers), and the path the target worker takes on CPU.

Exactness between kernel and reference. Both consume the caller's uniforms and must pick the
same token, so no step may depend on the order of a floating-point sum:

* acceptance with draft probabilities compares ``u * q(x) < p(x)`` in float64 (one rounding,
  identical everywhere; it is ``u < p / q`` without the division, and gives accept when
  q = 0 < p, reject when p = 0); acceptance of one-hot drafts compares token ids;
* a distribution is sampled by inverse CDF over *integer* weights: each probability becomes
  ``floor(clamp(w, 0, 1) * 2**WEIGHT_BITS)`` (exact: a power-of-two scale of an fp32), sums
  and prefix sums are exact int64, and the uniform becomes a UNIFORM_BITS-bit integer, so
  the token is the first index whose prefix sum exceeds ``floor(u * total)`` on every device.
  The quantisation moves a token's probability by at most ~2**-31 (the uniform's resolution)
  plus V * 2**-40 in all: far below what float32 probabilities resolve anyway.
"""

from __future__ import annotations

import torch

# Probabilities become int64 weights in units of 2**-40 ...
WEIGHT_BITS = 40
WEIGHT_SCALE = float(2**WEIGHT_BITS)
# ... and a sampling uniform an integer in [0, 2**31).
UNIFORM_BITS = 31
UNIFORM_SCALE = float(2**UNIFORM_BITS)
UNIFORM_MASK = 2**UNIFORM_BITS - 1
# total <= V * 2**40 and floor(total * u) is formed from 31-bit halves: both stay < 2**63.
MAX_VOCAB = 1 << 22


def probability_weights(probs: torch.Tensor) -> torch.Tensor:
    """[..., V] probabilities (any float dtype) -> [..., V] int64 weights in units of 2**-40."""
    return (probs.float().clamp(0.0, 1.0) * WEIGHT_SCALE).to(torch.int64)


def sample_weights(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw: weights [N, V] int64 >= 0, uniforms [N] float in [0, 1) -> [N] int64.

    The token is the first index whose running weight exceeds floor(u * total); a row of all
    zero weights (no distribution at all) yields V - 1.
    """
    total = weights.sum(dim=-1)  # [N]
    u_int = (uniforms.double() * UNIFORM_SCALE).to(torch.int64)  # [N], < 2**31
    # floor(total * u_int / 2**31) without overflow: split total at bit 31.
    threshold = (total >> UNIFORM_BITS) * u_int + (((total & UNIFORM_MASK) * u_int) >> UNIFORM_BITS)
    cumulative = weights.cumsum(dim=-1)  # [N, V]
    # Counting the prefix sums <= threshold gives the first index whose sum exceeds it.
    token = (cumulative <= threshold[:, None]).sum(dim=-1)  # [N]
    return token.clamp(max=weights.shape[-1] - 1)


def rejection_sample_ref(
    target_probs: torch.Tensor,  # [B, k + 1, V] p, already warped
    draft_probs: torch.Tensor | None,  # [B, k, V] q, or None: one-hot on the drafted token
    draft_tokens: torch.Tensor,  # [B, k] int64, entries past num_draft are padding
    num_draft: torch.Tensor,  # [B] int64, clamped to [0, k]
    u_accept: torch.Tensor,  # [B, k] float64 in [0, 1), not read when draft_probs is None
    u_sample: torch.Tensor,  # [B, k + 1] float64 in [0, 1)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (accepted [B] int64, next_token [B] int64): the recovered token at the first
    rejection, else the bonus token drawn from p at position num_draft. With draft_probs None
    the coupled one-hot rule runs (match_target_draws)."""
    batch, positions, vocab = target_probs.shape
    k = positions - 1
    assert draft_tokens.shape == (batch, k) and num_draft.shape == (batch,)
    assert u_accept.shape == (batch, k) and u_sample.shape == (batch, positions)
    num_draft = num_draft.clamp(0, k)
    if draft_probs is None:
        return match_target_draws(target_probs, draft_tokens, num_draft, u_sample)
    rows = torch.arange(batch, device=target_probs.device)  # [B]

    # Acceptance: draft i is kept while u_i * q_i(x_i) < p_i(x_i).
    in_vocab = (draft_tokens >= 0) & (draft_tokens < vocab)  # [B, k]
    token_index = draft_tokens.clamp(0, vocab - 1)[..., None]  # [B, k, 1]
    p_draft = target_probs[:, :k].gather(2, token_index).squeeze(2).double()  # [B, k]
    q_draft = draft_probs.gather(2, token_index).squeeze(2).double()  # [B, k]
    accept = (u_accept.double() * q_draft < p_draft) & in_vocab  # [B, k]
    accepted = accepted_length(accept, num_draft)  # [B]
    rejected = accepted < num_draft  # [B]

    # The emitted token: from norm(max(0, p - q)) at a rejection, from p for the bonus.
    p_weights = probability_weights(target_probs[rows, accepted])  # [B, V]
    weights = p_weights
    if k > 0:
        at = accepted.clamp(max=k - 1)  # [B], only meaningful where rejected
        q_weights = probability_weights(draft_probs[rows, at])  # [B, V]
        residual = (p_weights - q_weights).clamp(min=0)  # [B, V]
        # p == q leaves no residual; a rejection is then a rounding artefact and p is right.
        use_residual = rejected & (residual.sum(dim=-1) > 0)  # [B]
        weights = torch.where(use_residual[:, None], residual, p_weights)
    next_token = sample_weights(weights, u_sample.gather(1, accepted[:, None]).squeeze(1))
    return accepted, next_token


def match_target_draws(
    target_probs: torch.Tensor,  # [B, k + 1, V] p, already warped
    draft_tokens: torch.Tensor,  # [B, k] int64, entries past num_draft are padding
    num_draft: torch.Tensor,  # [B] int64 in [0, k]
    u_sample: torch.Tensor,  # [B, k + 1] float64 in [0, 1)
) -> tuple[torch.Tensor, torch.Tensor]:
    """The coupled rule for one-hot drafts: the target draws y_i from p_i with u_sample[:, i]
    at every position, drafts are kept while x_i == y_i, and y at the first stop is emitted.
    Returns (accepted [B] int64, next_token [B] int64)."""
    batch, positions, vocab = target_probs.shape
    weights = probability_weights(target_probs.reshape(batch * positions, vocab))  # [B * (k + 1), V]
    drawn = sample_weights(weights, u_sample.reshape(-1)).reshape(batch, positions)  # [B, k + 1]
    accepted = accepted_length(draft_tokens == drawn[:, :-1], num_draft)  # [B]
    next_token = drawn.gather(1, accepted[:, None]).squeeze(1)  # [B]
    return accepted, next_token


def accepted_length(
    keep: torch.Tensor,  # [B, k] bool, draft i passes its test
    num_draft: torch.Tensor,  # [B] int64 in [0, k]
) -> torch.Tensor:
    """[B] int64: the length of the prefix of kept drafts, at most num_draft."""
    batch, k = keep.shape
    draft_index = torch.arange(k, device=keep.device)  # [k]
    stop = ~keep | (draft_index >= num_draft[:, None])  # [B, k]
    stop = torch.cat((stop, stop.new_ones(batch, 1)), dim=1)  # [B, k + 1], sentinel after the last
    return stop.to(torch.int8).argmax(dim=1)  # [B], first stop
