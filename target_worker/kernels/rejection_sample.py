"""Speculative (rejection) sampling as a Triton kernel; ``rejection_sample_ref.py`` holds the
same maths in plain torch, and explains why both give bit-identical token choices.

The rule (Leviathan et al. 2023, arXiv 2211.17192, Algorithm 1; Chen et al. 2023,
arXiv 2302.01318, Algorithm 2), for a row with drafts x_0 .. x_{n-1} drawn from the draft
distributions q_i and target distributions p_0 .. p_n scored in one forward pass:

    for i in 0 .. n-1:
        accept x_i with probability min(1, p_i(x_i) / q_i(x_i))      (u_i * q_i(x_i) < p_i(x_i))
        on the first rejection emit a token from norm(max(0, p_i - q_i)) and stop
    if all n were accepted, emit a token from p_n

Every emitted token is then distributed exactly as the target alone would sample it.

* accepted  - the number of drafts kept (the length of the accepted prefix);
* recovered - the token drawn from the residual norm(max(0, p_i - q_i)) at the first rejection
  (p_i itself when the residual is all zero, i.e. p_i == q_i, where rejection has probability 0);
* bonus     - the token drawn from p_n when every draft was accepted.

A drafter without probabilities (n-gram lookup, a greedy draft model) proposes a fixed token:
q_i is a one-hot on x_i, so x_i is accepted with probability p_i(x_i) and the residual is p_i
with x_i removed. That is lossless however x_i was chosen (a sampled draft too, at a lower
acceptance rate), since it is the rule above for a proposal that put all its mass on x_i.

One program per row: a vectorised acceptance test over the k drafts, then two passes over the
vocabulary of the one position that emits (exact integer totals, then the inverse-CDF search;
the search stops reading memory once the token is found).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from target_worker.kernels.launch import assert_launchable, block_size, next_power_of_2
from target_worker.kernels.rejection_sample_ref import (
    MAX_VOCAB,
    UNIFORM_BITS,
    UNIFORM_MASK,
    UNIFORM_SCALE,
    WEIGHT_SCALE,
)

NUM_WARPS = 8
# Larger than any token id: "not found yet" in the inverse-CDF search.
NO_TOKEN = 2**31 - 1
PROB_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _tile_weights(p_row, q_row, ids, in_row, read_q, rejected_token,
                  HAS_Q: tl.constexpr, WEIGHT_SCALE: tl.constexpr):
    """One tile of integer weights: (p, the residual max(0, p - q)), in units of 2**-40."""
    p = tl.load(p_row + ids, mask=in_row, other=0.0).to(tl.float32)
    p_weight = (tl.minimum(tl.maximum(p, 0.0), 1.0) * WEIGHT_SCALE).to(tl.int64)
    if HAS_Q:
        q = tl.load(q_row + ids, mask=in_row & read_q, other=0.0).to(tl.float32)
        q_weight = (tl.minimum(tl.maximum(q, 0.0), 1.0) * WEIGHT_SCALE).to(tl.int64)
        residual = tl.maximum(p_weight - q_weight, 0)
    else:
        residual = tl.where(ids == rejected_token, 0, p_weight)  # q one-hot on the draft
    return p_weight, residual


@triton.jit
def _rejection_sample_kernel(
    p_ptr,  # [B, k + 1, V] target probs
    q_ptr,  # [B, k, V] draft probs (unused when HAS_Q is false)
    draft_tokens_ptr,  # [B, k] int64
    num_draft_ptr,  # [B] int64
    u_accept_ptr,  # [B, k] float64
    u_sample_ptr,  # [B, k + 1] float64
    accepted_ptr,  # [B] int64 out
    next_token_ptr,  # [B] int64 out
    k,
    V,
    HAS_Q: tl.constexpr,
    WEIGHT_SCALE: tl.constexpr,
    UNIFORM_SCALE: tl.constexpr,
    UNIFORM_BITS: tl.constexpr,
    UNIFORM_MASK: tl.constexpr,
    NO_TOKEN: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0)
    num_draft = tl.minimum(tl.maximum(tl.load(num_draft_ptr + row), 0), k)

    # Acceptance, all drafts at once: accepted = index of the first stop.
    index = tl.arange(0, BLOCK_K)
    live = index < num_draft
    draft = tl.load(draft_tokens_ptr + row * k + index, mask=live, other=0)
    gather = live & (draft >= 0) & (draft < V)
    p_draft_ptr = p_ptr + (row * (k + 1) + index).to(tl.int64) * V + draft
    p_draft = tl.load(p_draft_ptr, mask=gather, other=0.0).to(tl.float32).to(tl.float64)
    if HAS_Q:
        q_draft_ptr = q_ptr + (row * k + index).to(tl.int64) * V + draft
        q_draft = tl.load(q_draft_ptr, mask=gather, other=0.0).to(tl.float32).to(tl.float64)
    else:
        q_draft = tl.full([BLOCK_K], 1.0, tl.float64)
    u_accept = tl.load(u_accept_ptr + row * k + index, mask=live, other=1.0)
    accept = (u_accept * q_draft < p_draft) & gather
    accepted = tl.minimum(tl.min(tl.where(accept, BLOCK_K, index), axis=0), num_draft)
    rejected = accepted < num_draft

    p_row = p_ptr + (row * (k + 1) + accepted).to(tl.int64) * V
    q_row = q_ptr + (row * k + accepted).to(tl.int64) * V  # read only when rejected
    rejected_token = tl.load(draft_tokens_ptr + row * k + accepted, mask=rejected, other=-1)
    lanes = tl.arange(0, BLOCK_V)

    # Pass 1: exact integer totals of p and of the residual.
    p_total = tl.zeros([BLOCK_V], tl.int64)
    residual_total = tl.zeros([BLOCK_V], tl.int64)
    for start in range(0, V, BLOCK_V):
        ids = start + lanes
        p_weight, residual = _tile_weights(
            p_row, q_row, ids, ids < V, rejected, rejected_token, HAS_Q, WEIGHT_SCALE
        )
        p_total += p_weight
        residual_total += residual
    p_total_sum = tl.sum(p_total, axis=0)
    residual_total_sum = tl.sum(residual_total, axis=0)
    use_residual = rejected & (residual_total_sum > 0)
    total = tl.where(use_residual, residual_total_sum, p_total_sum)

    # floor(total * u) in exact integers (see rejection_sample_ref.sample_weights).
    u_sample = tl.load(u_sample_ptr + row * (k + 1) + accepted)
    u_int = (u_sample * UNIFORM_SCALE).to(tl.int64)
    threshold = (total >> UNIFORM_BITS) * u_int + (((total & UNIFORM_MASK) * u_int) >> UNIFORM_BITS)

    # Pass 2: the first id whose running weight exceeds the threshold.
    found = tl.full([], NO_TOKEN, tl.int32)
    carry = tl.zeros([], tl.int64)
    for start in range(0, V, BLOCK_V):
        ids = start + lanes
        in_row = (ids < V) & (found == NO_TOKEN)  # nothing is read once the token is found
        p_weight, residual = _tile_weights(
            p_row, q_row, ids, in_row, use_residual, rejected_token, HAS_Q, WEIGHT_SCALE
        )
        weight = tl.where(use_residual, residual, p_weight)
        running = carry + tl.cumsum(weight, axis=0)
        hit = (running > threshold) & in_row
        found = tl.minimum(found, tl.min(tl.where(hit, ids, NO_TOKEN), axis=0))
        carry += tl.sum(weight, axis=0)

    next_token = tl.minimum(found, V - 1)
    tl.store(accepted_ptr + row, accepted.to(tl.int64))
    tl.store(next_token_ptr + row, next_token.to(tl.int64))


def rejection_sample_triton(
    target_probs: torch.Tensor,  # [B, k + 1, V] fp32 / bf16 / fp16
    draft_probs: torch.Tensor | None,  # [B, k, V] same dtype, or None for one-hot drafts
    draft_tokens: torch.Tensor,  # [B, k] int64
    num_draft: torch.Tensor,  # [B] int64
    u_accept: torch.Tensor,  # [B, k] float64
    u_sample: torch.Tensor,  # [B, k + 1] float64
    block_v: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (accepted [B] int64, next_token [B] int64); see rejection_sample_ref."""
    batch, positions, vocab = target_probs.shape
    k = positions - 1
    assert target_probs.dtype in PROB_DTYPES, target_probs.dtype
    assert draft_tokens.shape == (batch, k) and draft_tokens.dtype == torch.int64
    assert num_draft.shape == (batch,) and num_draft.dtype == torch.int64
    assert u_accept.shape == (batch, k) and u_accept.dtype == torch.float64
    assert u_sample.shape == (batch, positions) and u_sample.dtype == torch.float64
    assert 0 < vocab <= MAX_VOCAB, vocab
    tensors = [target_probs, draft_tokens, num_draft, u_accept, u_sample]
    if draft_probs is not None:
        assert draft_probs.shape == (batch, k, vocab) and draft_probs.dtype == target_probs.dtype
        tensors.append(draft_probs)
    assert_launchable(_rejection_sample_kernel, *tensors)
    block_v = block_size(vocab, block_v)

    accepted = torch.empty((batch,), dtype=torch.int64, device=target_probs.device)
    next_token = torch.empty((batch,), dtype=torch.int64, device=target_probs.device)
    if batch == 0:
        return accepted, next_token
    _rejection_sample_kernel[(batch,)](
        target_probs, target_probs if draft_probs is None else draft_probs,
        draft_tokens, num_draft, u_accept, u_sample, accepted, next_token, k, vocab,
        HAS_Q=draft_probs is not None, WEIGHT_SCALE=WEIGHT_SCALE, UNIFORM_SCALE=UNIFORM_SCALE,
        UNIFORM_BITS=UNIFORM_BITS, UNIFORM_MASK=UNIFORM_MASK, NO_TOKEN=NO_TOKEN,
        BLOCK_K=next_power_of_2(max(k, 1)), BLOCK_V=block_v, num_warps=NUM_WARPS,
    )
    return accepted, next_token
