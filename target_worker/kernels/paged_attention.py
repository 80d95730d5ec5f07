"""Paged attention of packed new tokens as one Triton kernel; the specification, in plain torch,
is ``specdec.runtime.paged_attention.paged_attention_reference`` (PagedAttention, Kwon et al.
2023, arXiv 2309.06180).

Grid [T, Hkv]: one program per (packed new token, kv head) computes the GROUP = Hq / Hkv query
heads that share that kv head, so each key and value row is read once for the whole group
(grouped-query attention). Token-major order puts a session's new tokens in neighbouring
programs, which then read the same blocks while they are still in L2.

A program walks its session's logical positions in tiles of whole blocks, looking each
position's block up in the session's block table, and keeps a FlashAttention-style online
softmax (Dao et al. 2022, arXiv 2205.14135): a running maximum m, normaliser l and weighted sum
acc per query head, all float32, rescaled by exp(m_old - m_new) whenever the maximum grows.
Scores use exp2 with log2(e) folded into the scale. Without a tree (HAS_TREE false) token j of
a session stops at position context + j, which is the causal mask; with one, it walks to
context + n and reads the tree mask for the new-token tail only (positions below the context
are always attended). Rows past a session's live positions, and block-table entries past its
live blocks, are never read (their loads are masked), so whatever they hold cannot leak in.

The group's query heads are padded to MIN_DOT_ROWS rows so both products run on tl.dot
(tensor cores for bf16 / fp16, float32 accumulation). For bf16 / fp16 the probabilities are
rounded to the inputs' dtype before the second product, as FlashAttention does; float32
inputs use IEEE float32 products throughout (no TF32). The interpreter's tl.dot mishandles
bf16 operands, so under TRITON_INTERPRET the launcher asks for float32 products (DOT_FP32)
for every dtype: the CPU tests check the algorithm, the compile tests and
benchmarks/paged_attention_gpu.py the half-precision products.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from specdec.runtime.paged_attention import check_paged_inputs
from target_worker.kernels.launch import (
    assert_launchable,
    is_interpreted,
    next_power_of_2,
)

NUM_WARPS = 4
# Key/value positions per online-softmax step: whole blocks, at least this many positions.
TILE_POSITIONS = 64
# tl.dot needs at least 16 rows: a kv head's GROUP query heads are padded up to this.
MIN_DOT_ROWS = 16
LOG2_E = 1.4426950408889634


@triton.jit
def _paged_attention_kernel(
    q_ptr,  # [T, Hq, D] fp32 / bf16 / fp16
    k_pool_ptr,  # [num_blocks, BLOCK_SIZE, Hkv, D], q's dtype
    v_pool_ptr,  # [num_blocks, BLOCK_SIZE, Hkv, D]
    block_tables_ptr,  # [B, max_blocks] int32
    context_lens_ptr,  # [B] int32
    query_starts_ptr,  # [B + 1] int32
    token_sessions_ptr,  # [T] int32: the session each packed token belongs to
    tree_mask_ptr,  # [B, Qmax, Qmax] uint8; read only when HAS_TREE
    out_ptr,  # [T, Hq, D] out, q's dtype
    max_blocks,
    max_queries,  # Qmax
    qk_scale,  # scale * log2(e)
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,  # positions per step, a multiple of BLOCK_SIZE
    BLOCK_H: tl.constexpr,  # GROUP padded to a power of two >= MIN_DOT_ROWS
    BLOCK_D: tl.constexpr,  # HEAD_DIM padded to a power of two
    HAS_TREE: tl.constexpr,
    DOT_FP32: tl.constexpr,  # products in float32 (fp32 inputs, or the interpreter)
):
    GROUP: tl.constexpr = HQ // HKV
    if DOT_FP32:
        dot_dtype = tl.float32
    else:
        dot_dtype = q_ptr.dtype.element_ty
    token = tl.program_id(0)
    kv_head = tl.program_id(1)
    session = tl.load(token_sessions_ptr + token)
    context = tl.load(context_lens_ptr + session)
    first = tl.load(query_starts_ptr + session)
    row = token - first  # j: this token's index among its session's new tokens
    if HAS_TREE:
        kv_len = context + tl.load(query_starts_ptr + session + 1) - first
    else:
        kv_len = context + row + 1

    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    head_live = heads < GROUP
    dim_live = dims < HEAD_DIM
    # [BLOCK_H]: element offset of each query head's row, in q and in out
    q_rows = token.to(tl.int64) * (HQ * HEAD_DIM) + (kv_head * GROUP + heads) * HEAD_DIM
    q_mask = head_live[:, None] & dim_live[None, :]
    q = tl.load(q_ptr + q_rows[:, None] + dims[None, :], mask=q_mask, other=0.0)
    q = q.to(dot_dtype)  # [BLOCK_H, BLOCK_D]

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)  # running max of scores (log2 units)
    l = tl.zeros([BLOCK_H], tl.float32)  # running sum of exp2(score - m)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)  # running sum of exp2(score - m) * v
    offsets = tl.arange(0, TILE)
    table = block_tables_ptr + session.to(tl.int64) * max_blocks
    for start in range(0, kv_len, TILE):
        positions = start + offsets  # [TILE] logical positions in the session
        live = positions < kv_len
        block = tl.load(table + positions // BLOCK_SIZE, mask=live, other=0)  # [TILE] physical
        kv_rows = (block.to(tl.int64) * BLOCK_SIZE + positions % BLOCK_SIZE) * (HKV * HEAD_DIM)
        kv_offsets = kv_rows[:, None] + kv_head * HEAD_DIM + dims[None, :]  # [TILE, BLOCK_D]
        kv_mask = live[:, None] & dim_live[None, :]
        k = tl.load(k_pool_ptr + kv_offsets, mask=kv_mask, other=0.0).to(dot_dtype)  # [TILE, BLOCK_D]
        v = tl.load(v_pool_ptr + kv_offsets, mask=kv_mask, other=0.0).to(dot_dtype)  # [TILE, BLOCK_D]

        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale  # [BLOCK_H, TILE]
        attended = live
        if HAS_TREE:
            tail = positions - context  # j2 for new positions, negative for the context
            in_tree = live & (tail >= 0) & (tail < max_queries) & (row < max_queries)
            tree_row = tree_mask_ptr + (session.to(tl.int64) * max_queries + row) * max_queries
            bit = tl.load(tree_row + tail, mask=in_tree, other=0)
            attended = live & ((tail < 0) | (bit != 0))
        scores = tl.where(attended[None, :], scores, float("-inf"))

        m_new = tl.maximum(m, tl.max(scores, axis=1))  # [BLOCK_H]
        # A row that has attended nothing yet keeps m = -inf; subtract 0 there, not -inf.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_safe)  # [BLOCK_H], 0 while m is -inf
        p = tl.exp2(scores - m_safe[:, None])  # [BLOCK_H, TILE], 0 where not attended
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(dot_dtype), v, input_precision="ieee")
        m = m_new

    # A row that attended nothing (l = 0) reads nothing: zeros, as the reference.
    out = tl.where(l[:, None] > 0, acc / tl.where(l > 0, l, 1.0)[:, None], 0.0)
    tl.store(out_ptr + q_rows[:, None] + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=q_mask)


def paged_attention_triton(
    q: torch.Tensor,  # [T, Hq, D] fp32 / bf16 / fp16
    k_pool: torch.Tensor,  # [num_blocks, block_size, Hkv, D], q's dtype
    v_pool: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    context_lens: torch.Tensor,  # [B] int32
    query_starts: torch.Tensor,  # [B + 1] int32
    tree_mask: torch.Tensor | None = None,  # [B, Qmax, Qmax] bool
    scale: float | None = None,
) -> torch.Tensor:  # [T, Hq, D], q's dtype
    """See paged_attention_reference. Reads no device value on the host (no stream stall);
    the caller guarantees the index values (query_starts cumulative from 0 to T, each session's
    blocks in its table, at most Qmax new tokens per session with a tree mask)."""
    check_paged_inputs(q, k_pool, v_pool, block_tables, context_lens, query_starts, tree_mask)
    for index in (block_tables, context_lens, query_starts):
        assert index.dtype == torch.int32, index.dtype
    tokens, heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_pool.shape
    assert block_size & (block_size - 1) == 0, f"block_size {block_size} is not a power of two"
    batch = context_lens.shape[0]
    # Without a tree the kernel never reads this pointer; any int tensor on the device will do.
    tree_bits = (tree_mask if tree_mask is not None else context_lens).view(torch.uint8)
    max_queries = tree_mask.shape[1] if tree_mask is not None else 0
    assert_launchable(
        _paged_attention_kernel, q, k_pool, v_pool, block_tables, context_lens, query_starts, tree_bits
    )
    out = torch.empty_like(q)
    if tokens == 0:
        return out
    sessions = torch.arange(batch, dtype=torch.int32, device=q.device)
    # output_size is known on the host, so this does not wait for the device.
    token_sessions = torch.repeat_interleave(sessions, query_starts.diff(), output_size=tokens)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    _paged_attention_kernel[(tokens, kv_heads)](
        q, k_pool, v_pool, block_tables, context_lens, query_starts, token_sessions,
        tree_bits, out, block_tables.shape[1], max_queries, scale * LOG2_E,
        HQ=heads, HKV=kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        TILE=max(block_size, TILE_POSITIONS),
        BLOCK_H=max(MIN_DOT_ROWS, next_power_of_2(heads // kv_heads)),
        BLOCK_D=max(MIN_DOT_ROWS, next_power_of_2(head_dim)),
        HAS_TREE=tree_mask is not None,
        DOT_FP32=q.dtype == torch.float32 or is_interpreted(_paged_attention_kernel),
        num_warps=NUM_WARPS,
    )
    return out
