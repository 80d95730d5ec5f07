"""Speculative (rejection) sampling as Triton kernels; ``rejection_sample_ref.py`` holds the
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
q_i is a one-hot on x_i, and the rule runs *coupled* to the target's own sampling:

    y_i = inverse-CDF(p_i, u_sample_i)  at every position i in 0 .. n
    accepted = the first i < n with x_i != y_i (n if none); emit y_accepted

This is the rule above for q_i = one-hot(x_i): y_i equals x_i with probability p_i(x_i), which
is min(1, p_i(x_i) / q_i(x_i)); and given y_i != x_i, y_i follows p_i restricted to the tokens
other than x_i, renormalised, which is norm(max(0, p_i - q_i)), the residual. The coupling
gives more than the distribution: the token emitted at each position is the draw the target
alone makes there with the same uniform (Philox, keyed by seed and absolute position), from
the same p_i (the accepted prefix is the target's own draws), so a seeded request yields the
very tokens target-only sampling yields, however the drafts were chosen. u_accept is not read.

Kernels, all walking the vocabulary in BLOCK_V tiles with exact integer weights:

* `_rejection_sample_kernel` (drafts with probabilities; grid [B]): a vectorised acceptance
  test over the k drafts, then two passes over the vocabulary of the one position that emits
  (exact integer totals, then the inverse-CDF search; the search stops reading memory once
  the token is found).
* `_draw_kernel` (one-hot drafts; grid [B, k + 1]): one program per (row, position) draws y_i
  with the same two passes; positions past a row's num_draft read nothing. Then greedy
  verification's `_accept_kernel` (grid [B]) keeps drafts while they equal those draws and
  emits the draw at the first stop: greedy verification with the argmax replaced by a draw.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from target_worker.kernels.greedy_verify import _accept_kernel
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
def _p_weights(p_row, ids, mask, WEIGHT_SCALE: tl.constexpr):
    """One tile of p as integer weights in units of 2**-40 (0 where masked)."""
    # Cast right after the load: bf16 arithmetic is wrong under the interpreter.
    p = tl.load(p_row + ids, mask=mask, other=0.0).to(tl.float32)
    return (tl.minimum(tl.maximum(p, 0.0), 1.0) * WEIGHT_SCALE).to(tl.int64)


@triton.jit
def _tile_weights(p_row, q_row, ids, in_row, read_q, WEIGHT_SCALE: tl.constexpr):
    """One tile of integer weights: (p, the residual max(0, p - q)), in units of 2**-40."""
    p_weight = _p_weights(p_row, ids, in_row, WEIGHT_SCALE)
    q = tl.load(q_row + ids, mask=in_row & read_q, other=0.0).to(tl.float32)
    q_weight = (tl.minimum(tl.maximum(q, 0.0), 1.0) * WEIGHT_SCALE).to(tl.int64)
    return p_weight, tl.maximum(p_weight - q_weight, 0)


@triton.jit
def _threshold(total, u, UNIFORM_SCALE: tl.constexpr, UNIFORM_BITS: tl.constexpr,
               UNIFORM_MASK: tl.constexpr):
    """floor(total * u) in exact integers (see rejection_sample_ref.sample_weights)."""
    u_int = (u * UNIFORM_SCALE).to(tl.int64)
    return (total >> UNIFORM_BITS) * u_int + (((total & UNIFORM_MASK) * u_int) >> UNIFORM_BITS)


@triton.jit
def _rejection_sample_kernel(
    p_ptr,  # [B, k + 1, V] target probs
    q_ptr,  # [B, k, V] draft probs
    draft_tokens_ptr,  # [B, k] int64
    num_draft_ptr,  # [B] int64
    u_accept_ptr,  # [B, k] float64
    u_sample_ptr,  # [B, k + 1] float64
    accepted_ptr,  # [B] int64 out
    next_token_ptr,  # [B] int64 out
    k,
    V,
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
    q_draft_ptr = q_ptr + (row * k + index).to(tl.int64) * V + draft
    q_draft = tl.load(q_draft_ptr, mask=gather, other=0.0).to(tl.float32).to(tl.float64)
    u_accept = tl.load(u_accept_ptr + row * k + index, mask=live, other=1.0)
    accept = (u_accept * q_draft < p_draft) & gather
    accepted = tl.minimum(tl.min(tl.where(accept, BLOCK_K, index), axis=0), num_draft)
    rejected = accepted < num_draft

    p_row = p_ptr + (row * (k + 1) + accepted).to(tl.int64) * V
    q_row = q_ptr + (row * k + accepted).to(tl.int64) * V  # read only when rejected
    lanes = tl.arange(0, BLOCK_V)

    # Pass 1: exact integer totals of p and of the residual.
    p_total = tl.zeros([BLOCK_V], tl.int64)
    residual_total = tl.zeros([BLOCK_V], tl.int64)
    for start in range(0, V, BLOCK_V):
        ids = start + lanes
        p_weight, residual = _tile_weights(p_row, q_row, ids, ids < V, rejected, WEIGHT_SCALE)
        p_total += p_weight
        residual_total += residual
    p_total_sum = tl.sum(p_total, axis=0)
    residual_total_sum = tl.sum(residual_total, axis=0)
    use_residual = rejected & (residual_total_sum > 0)
    total = tl.where(use_residual, residual_total_sum, p_total_sum)

    u_sample = tl.load(u_sample_ptr + row * (k + 1) + accepted)
    threshold = _threshold(total, u_sample, UNIFORM_SCALE, UNIFORM_BITS, UNIFORM_MASK)

    # Pass 2: the first id whose running weight exceeds the threshold.
    found = tl.full([], NO_TOKEN, tl.int32)
    carry = tl.zeros([], tl.int64)
    for start in range(0, V, BLOCK_V):
        ids = start + lanes
        in_row = (ids < V) & (found == NO_TOKEN)  # nothing is read once the token is found
        p_weight, residual = _tile_weights(p_row, q_row, ids, in_row, use_residual, WEIGHT_SCALE)
        weight = tl.where(use_residual, residual, p_weight)
        running = carry + tl.cumsum(weight, axis=0)
        hit = (running > threshold) & in_row
        found = tl.minimum(found, tl.min(tl.where(hit, ids, NO_TOKEN), axis=0))
        carry += tl.sum(weight, axis=0)

    next_token = tl.minimum(found, V - 1)
    tl.store(accepted_ptr + row, accepted.to(tl.int64))
    tl.store(next_token_ptr + row, next_token.to(tl.int64))


@triton.jit
def _draw_kernel(
    p_ptr,  # [B, k + 1, V] target probs
    num_draft_ptr,  # [B] int64
    u_sample_ptr,  # [B, k + 1] float64
    drawn_ptr,  # [B, k + 1] int64 out, written at positions <= num_draft
    k,
    V,
    WEIGHT_SCALE: tl.constexpr,
    UNIFORM_SCALE: tl.constexpr,
    UNIFORM_BITS: tl.constexpr,
    UNIFORM_MASK: tl.constexpr,
    NO_TOKEN: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0)
    position = tl.program_id(1)
    num_draft = tl.minimum(tl.maximum(tl.load(num_draft_ptr + row), 0), k)
    needed = position <= num_draft
    v_end = tl.where(needed, V, 0)  # positions no draft reaches run zero tiles
    p_row = p_ptr + (row * (k + 1) + position).to(tl.int64) * V
    lanes = tl.arange(0, BLOCK_V)

    # Pass 1: the exact integer total of p.
    total = tl.zeros([BLOCK_V], tl.int64)
    for start in range(0, v_end, BLOCK_V):
        ids = start + lanes
        total += _p_weights(p_row, ids, ids < V, WEIGHT_SCALE)
    u_sample = tl.load(u_sample_ptr + row * (k + 1) + position)
    threshold = _threshold(tl.sum(total, axis=0), u_sample, UNIFORM_SCALE, UNIFORM_BITS,
                           UNIFORM_MASK)

    # Pass 2: the first id whose running weight exceeds the threshold.
    found = tl.full([], NO_TOKEN, tl.int32)
    carry = tl.zeros([], tl.int64)
    for start in range(0, v_end, BLOCK_V):
        ids = start + lanes
        in_row = (ids < V) & (found == NO_TOKEN)  # nothing is read once the token is found
        weight = _p_weights(p_row, ids, in_row, WEIGHT_SCALE)
        running = carry + tl.cumsum(weight, axis=0)
        hit = (running > threshold) & in_row
        found = tl.minimum(found, tl.min(tl.where(hit, ids, NO_TOKEN), axis=0))
        carry += tl.sum(weight, axis=0)

    drawn = tl.minimum(found, V - 1)  # an all-zero row yields V - 1, as sample_weights does
    tl.store(drawn_ptr + row * (k + 1) + position, drawn.to(tl.int64), mask=needed)


def rejection_sample_triton(
    target_probs: torch.Tensor,  # [B, k + 1, V] fp32 / bf16 / fp16
    draft_probs: torch.Tensor | None,  # [B, k, V] same dtype, or None for one-hot drafts
    draft_tokens: torch.Tensor,  # [B, k] int64
    num_draft: torch.Tensor,  # [B] int64
    u_accept: torch.Tensor,  # [B, k] float64, not read when draft_probs is None
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
    constants = dict(
        WEIGHT_SCALE=WEIGHT_SCALE, UNIFORM_SCALE=UNIFORM_SCALE, UNIFORM_BITS=UNIFORM_BITS,
        UNIFORM_MASK=UNIFORM_MASK, NO_TOKEN=NO_TOKEN, BLOCK_V=block_v,
    )

    device = target_probs.device
    accepted = torch.empty((batch,), dtype=torch.int64, device=device)
    next_token = torch.empty((batch,), dtype=torch.int64, device=device)
    if batch == 0:
        return accepted, next_token
    if draft_probs is not None:
        _rejection_sample_kernel[(batch,)](
            target_probs, draft_probs, draft_tokens, num_draft, u_accept, u_sample,
            accepted, next_token, k, vocab,
            BLOCK_K=next_power_of_2(max(k, 1)), num_warps=NUM_WARPS, **constants,
        )
        return accepted, next_token
    drawn = torch.empty((batch, positions), dtype=torch.int64, device=device)  # [B, k + 1]
    _draw_kernel[(batch, positions)](
        target_probs, num_draft, u_sample, drawn, k, vocab, num_warps=NUM_WARPS, **constants,
    )
    _accept_kernel[(batch,)](
        draft_tokens, drawn, num_draft, accepted, next_token, k,
        BLOCK_K=next_power_of_2(max(k, 1)), num_warps=1,
    )
    return accepted, next_token
