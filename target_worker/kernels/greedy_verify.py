"""Greedy verification as two Triton kernels; ``greedy_verify_ref.py`` holds the same maths in
plain torch.

Stage 1 (`_argmax_kernel`, grid [B, k + 1]): one program per (row, position) walks the
vocabulary in BLOCK_V tiles and writes the target's argmax. Positions past a row's num_draft
are never needed, so their programs run zero tiles and read nothing. The logits of a
position are found through a row table (`rows`, [B, k + 1] into [R, V] logits): a step's
chains are ragged, and the table lets them be verified where the forward wrote them, with
no copy padded to the longest chain (`greedy_verify_rows_triton`).
Stage 2 (`_accept_kernel`, grid [B]): compares drafts with those argmaxes and writes the
accepted length and the correction / bonus token.

Argmax ties break to the lowest token id and a NaN logit wins, as ``torch.argmax`` does: each
lane keeps the first position of its running maximum (tiles are visited in ascending order and
only a strictly larger value replaces it), and the final reduction takes the lowest such id.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from target_worker.kernels.launch import assert_launchable, block_size, next_power_of_2

NUM_WARPS = 8
# Larger than any token id: the identity of a "lowest id" min-reduction.
NO_TOKEN = 2**31 - 1


@triton.jit
def _argmax_kernel(
    logits_ptr,  # [R, V] fp32 / bf16 / fp16
    rows_ptr,  # [B, k + 1] int64: the logits row of each (row, position)
    num_draft_ptr,  # [B] int64
    target_tokens_ptr,  # [B, k + 1] int64 out, written at positions <= num_draft
    k,
    V,
    NO_TOKEN: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0)
    position = tl.program_id(1)
    num_draft = tl.minimum(tl.maximum(tl.load(num_draft_ptr + row), 0), k)
    needed = position <= num_draft
    v_end = tl.where(needed, V, 0)
    logits_row = tl.load(rows_ptr + row * (k + 1) + position, mask=needed, other=0)
    base = logits_ptr + logits_row.to(tl.int64) * V

    lanes = tl.arange(0, BLOCK_V)
    best = tl.full([BLOCK_V], float("-inf"), tl.float32)
    best_id = lanes  # a lane that never sees a value above -inf keeps id 0 at lane 0
    first_nan = tl.full([BLOCK_V], NO_TOKEN, tl.int32)
    for start in range(0, v_end, BLOCK_V):
        ids = start + lanes
        # Cast right after the load: bf16 arithmetic is wrong under the interpreter.
        x = tl.load(base + ids, mask=ids < V, other=float("-inf")).to(tl.float32)
        larger = x > best  # strict: an equal value later in the row never replaces
        best = tl.where(larger, x, best)
        best_id = tl.where(larger, ids, best_id)
        first_nan = tl.minimum(first_nan, tl.where(x != x, ids, NO_TOKEN))

    top = tl.max(best, axis=0)
    argmax = tl.min(tl.where(best == top, best_id, NO_TOKEN), axis=0)
    nan_id = tl.min(first_nan, axis=0)
    argmax = tl.where(nan_id < NO_TOKEN, nan_id, argmax)
    tl.store(target_tokens_ptr + row * (k + 1) + position, argmax.to(tl.int64), mask=needed)


@triton.jit
def _accept_kernel(
    draft_tokens_ptr,  # [B, k] int64
    target_tokens_ptr,  # [B, k + 1] int64, valid at positions <= num_draft
    num_draft_ptr,  # [B] int64
    accepted_ptr,  # [B] int64 out
    next_token_ptr,  # [B] int64 out
    k,
    BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0)
    num_draft = tl.minimum(tl.maximum(tl.load(num_draft_ptr + row), 0), k)
    index = tl.arange(0, BLOCK_K)
    live = index < num_draft
    draft = tl.load(draft_tokens_ptr + row * k + index, mask=live, other=0)
    target = tl.load(target_tokens_ptr + row * (k + 1) + index, mask=live, other=0)
    stop = (draft != target) | (index >= num_draft)
    accepted = tl.minimum(tl.min(tl.where(stop, index, BLOCK_K), axis=0), num_draft)
    next_token = tl.load(target_tokens_ptr + row * (k + 1) + accepted)
    tl.store(accepted_ptr + row, accepted.to(tl.int64))
    tl.store(next_token_ptr + row, next_token)


def greedy_verify_triton(
    logits: torch.Tensor,  # [B, k + 1, V] fp32 / bf16 / fp16
    draft_tokens: torch.Tensor,  # [B, k] int64
    num_draft: torch.Tensor,  # [B] int64
    block_v: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (accepted [B] int64, next_token [B] int64); see greedy_verify_ref."""
    batch, positions, vocab = logits.shape
    rows = torch.arange(batch * positions, dtype=torch.int64, device=logits.device).view(batch, positions)
    return greedy_verify_rows_triton(logits.reshape(batch * positions, vocab), rows, draft_tokens, num_draft, block_v)


def greedy_verify_rows_triton(
    logits: torch.Tensor,  # [R, V] fp32 / bf16 / fp16
    rows: torch.Tensor,  # [B, k + 1] int64 into logits
    draft_tokens: torch.Tensor,  # [B, k] int64
    num_draft: torch.Tensor,  # [B] int64
    block_v: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (accepted [B] int64, next_token [B] int64); see greedy_verify_rows_ref."""
    batch, positions = rows.shape
    vocab = logits.shape[1]
    k = positions - 1
    assert logits.dim() == 2 and logits.dtype in (torch.float32, torch.bfloat16, torch.float16), logits.dtype
    assert rows.dtype == torch.int64
    assert draft_tokens.shape == (batch, k) and draft_tokens.dtype == torch.int64
    assert num_draft.shape == (batch,) and num_draft.dtype == torch.int64
    assert 0 < vocab < NO_TOKEN
    assert_launchable(_argmax_kernel, logits, rows, draft_tokens, num_draft)
    block_v = block_size(vocab, block_v)

    target_tokens = torch.empty((batch, positions), dtype=torch.int64, device=logits.device)
    accepted = torch.empty((batch,), dtype=torch.int64, device=logits.device)
    next_token = torch.empty((batch,), dtype=torch.int64, device=logits.device)
    if batch == 0:
        return accepted, next_token
    _argmax_kernel[(batch, positions)](
        logits, rows, num_draft, target_tokens, k, vocab,
        NO_TOKEN=NO_TOKEN, BLOCK_V=block_v, num_warps=NUM_WARPS,
    )
    _accept_kernel[(batch,)](
        draft_tokens, target_tokens, num_draft, accepted, next_token, k,
        BLOCK_K=next_power_of_2(max(k, 1)), num_warps=1,
    )
    return accepted, next_token
