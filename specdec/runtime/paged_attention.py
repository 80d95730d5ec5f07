"""Attention of packed new tokens over a paged KV cache: the plain-torch reference.

PagedAttention (Kwon et al. 2023, arXiv 2309.06180): a layer's keys and values live in a pool
of fixed-size blocks, ``[num_blocks, block_size, Hkv, D]``, and session i's logical position p
lives in block ``block_tables[i, p // block_size]``, row ``p % block_size``. The sessions' new
tokens come packed, ``[T, Hq, D]``, session i owning rows ``query_starts[i]:query_starts[i+1]``
(nᵢ of them, zero allowed), and their own keys and values are ALREADY in the pool, at logical
positions ``context_lens[i] .. context_lens[i] + nᵢ - 1``.

New token j of session i attends every context position p < context_lens[i], and new position
``context_lens[i] + j2`` when ``j2 <= j`` (no tree mask: the new tokens are a chain) or when
``tree_mask[i, j, j2]`` (a tree of candidate continuations, specdec.runtime.tree: a token sees
its ancestors and itself). Grouped-query attention: query head h reads kv head
``h // (Hq // Hkv)``. Scores, softmax and the weighted sum are float32 whatever the inputs'
dtype; the output has q's dtype. A token that may attend nothing (a tree row with no True on
an empty context) gets zeros, not NaN.

This module is the specification the Triton kernel (target_worker.kernels.paged_attention) is
tested against and the CPU serving path. Backends (`attention_backends`): the reference runs
everywhere; `paged_attention_sdpa` runs the same function through torch's fused
``scaled_dot_product_attention``, one call per session (no varlen entry point), which on CPU
adds nothing over the reference's two matrix products at decoding's few queries per session,
so on CPU the reference is the backend. FlashInfer's batch prefill over a paged cache takes
this pool layout ("NHD") and would be a CUDA backend; it is not wired in (it is never a
dependency, and its host-side planning step is not this module's business).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

REFERENCE = "reference"
SDPA = "sdpa"
# Dtypes of q and the pools: softmax and accumulation are float32 for all of them.
ATTENTION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_paged_inputs(
    q: torch.Tensor,  # [T, Hq, D]
    k_pool: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_pool: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int
    context_lens: torch.Tensor,  # [B] int
    query_starts: torch.Tensor,  # [B + 1] int
    tree_mask: torch.Tensor | None,  # [B, Qmax, Qmax] bool
) -> None:
    """Shapes, dtypes and devices; reads no tensor value, so it never waits on the GPU."""
    assert q.dim() == 3 and k_pool.dim() == 4, (q.shape, k_pool.shape)
    assert k_pool.shape == v_pool.shape, (k_pool.shape, v_pool.shape)
    _, heads, head_dim = q.shape
    _, _, kv_heads, pool_head_dim = k_pool.shape
    assert pool_head_dim == head_dim, f"q has D={head_dim}, the pool D={pool_head_dim}"
    assert kv_heads > 0 and heads % kv_heads == 0, f"Hq={heads} is not a multiple of Hkv={kv_heads}"
    assert q.dtype in ATTENTION_DTYPES and k_pool.dtype == v_pool.dtype == q.dtype, (
        q.dtype, k_pool.dtype, v_pool.dtype,
    )
    batch = context_lens.shape[0]
    assert context_lens.shape == (batch,) and query_starts.shape == (batch + 1,)
    assert block_tables.dim() == 2 and block_tables.shape[0] == batch, block_tables.shape
    for index in (block_tables, context_lens, query_starts):
        assert not index.is_floating_point() and not index.is_complex(), index.dtype
    if tree_mask is not None:
        assert tree_mask.dtype == torch.bool, tree_mask.dtype
        assert tree_mask.dim() == 3 and tree_mask.shape[0] == batch, tree_mask.shape
        assert tree_mask.shape[1] == tree_mask.shape[2], tree_mask.shape
    for tensor in (k_pool, v_pool, block_tables, context_lens, query_starts, tree_mask):
        if tensor is not None:
            assert tensor.device == q.device, f"tensors on {tensor.device} and {q.device}"


def _session_attention_inputs(
    q: torch.Tensor,  # [T, Hq, D]
    k_pool: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_pool: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks]
    context_lens: torch.Tensor,  # [B]
    query_starts: torch.Tensor,  # [B + 1]
    tree_mask: torch.Tensor | None,  # [B, Qmax, Qmax] bool
) -> Iterator[tuple[int, int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per session with new tokens: (its rows of q, its K and V gathered in logical order, the
    [n, context + n] bool mask of what each new token attends, or None where it attends
    every position: a single chain token)."""
    check_paged_inputs(q, k_pool, v_pool, block_tables, context_lens, query_starts, tree_mask)
    block_size = k_pool.shape[1]
    # One host read of the small index vectors: the reference is the CPU path (and the spec).
    starts = query_starts.tolist()
    contexts = context_lens.tolist()
    assert starts[0] == 0 and starts[-1] == q.shape[0], f"query_starts {starts[0]}..{starts[-1]}"
    for session, context in enumerate(contexts):
        first, last = starts[session], starts[session + 1]
        new = last - first
        assert new >= 0 and context >= 0, f"session {session}: {new} new tokens, context {context}"
        if new == 0:
            continue
        kv_len = context + new
        live_blocks = -(-kv_len // block_size)
        assert live_blocks <= block_tables.shape[1], f"session {session} needs {live_blocks} blocks"
        blocks = block_tables[session, :live_blocks].long()  # entries past these are never read
        keys = k_pool[blocks].flatten(0, 1)[:kv_len]  # [L, Hkv, D], L = context + n
        values = v_pool[blocks].flatten(0, 1)[:kv_len]  # [L, Hkv, D]
        if tree_mask is None and new == 1:
            allowed = None  # one chain token sees its whole row
        elif tree_mask is None:
            columns = torch.arange(kv_len, device=q.device)  # [L]
            rows = torch.arange(new, device=q.device)  # [n]
            allowed = columns[None, :] <= context + rows[:, None]  # [n, L], causal chain
        else:
            assert new <= tree_mask.shape[1], f"session {session}: {new} new tokens, Qmax {tree_mask.shape[1]}"
            seen_context = torch.ones(new, context, dtype=torch.bool, device=q.device)
            allowed = torch.cat([seen_context, tree_mask[session, :new, :new]], dim=1)  # [n, L]
        yield first, last, q[first:last], keys, values, allowed


def paged_attention_reference(
    q: torch.Tensor,  # [T, Hq, D] new tokens of B sessions, packed
    k_pool: torch.Tensor,  # [num_blocks, block_size, Hkv, D] one layer's K blocks
    v_pool: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # int32 [B, max_blocks]; entries past a session's blocks ignored
    context_lens: torch.Tensor,  # int32 [B]: tokens of session i in the pool before its new ones
    query_starts: torch.Tensor,  # int32 [B + 1], cumulative, query_starts[B] == T
    tree_mask: torch.Tensor | None = None,  # bool [B, Qmax, Qmax] or None (causal chain)
    scale: float | None = None,  # default 1 / sqrt(D)
) -> torch.Tensor:  # [T, Hq, D], q's dtype
    """Paged attention of the packed new tokens (see the module docstring): one pair of
    matrix products per session, float32 throughout."""
    _, heads, head_dim = q.shape
    kv_heads = k_pool.shape[2]
    group = heads // max(kv_heads, 1)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    out = torch.zeros_like(q)  # [T, Hq, D]; sessions with no new tokens own no rows
    sessions = _session_attention_inputs(
        q, k_pool, v_pool, block_tables, context_lens, query_starts, tree_mask
    )
    for first, last, queries, keys, values, allowed in sessions:
        new = last - first
        # Rows (g, j) of kv head h: query head h·G + g at new token j.
        queries = queries.float().view(new, kv_heads, group, head_dim).permute(1, 2, 0, 3)  # [Hkv, G, n, D]
        queries = queries.reshape(kv_heads, group * new, head_dim)
        scores = torch.bmm(queries, keys.float().permute(1, 2, 0)) * scale  # [Hkv, G·n, L]
        scores = scores.view(kv_heads, group, new, -1)  # [Hkv, G, n, L]
        if allowed is not None:
            scores = scores.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(scores, dim=-1)  # [Hkv, G, n, L]
        if tree_mask is not None:
            # A tree row that may attend nothing is all -inf, so NaN after softmax: it reads nothing.
            probs = probs.masked_fill(~allowed.any(dim=-1)[:, None], 0.0)
        attended = torch.bmm(probs.view(kv_heads, group * new, -1), values.float().transpose(0, 1))  # [Hkv, G·n, D]
        attended = attended.view(kv_heads, group, new, head_dim).permute(2, 0, 1, 3)  # [n, Hkv, G, D]
        out[first:last] = attended.reshape(new, heads, head_dim).to(q.dtype)
    return out


def paged_attention_sdpa(
    q: torch.Tensor,  # [T, Hq, D]
    k_pool: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_pool: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # int [B, max_blocks]
    context_lens: torch.Tensor,  # int [B]
    query_starts: torch.Tensor,  # int [B + 1]
    tree_mask: torch.Tensor | None = None,  # bool [B, Qmax, Qmax] or None
    scale: float | None = None,
) -> torch.Tensor:  # [T, Hq, D], q's dtype
    """The reference's function through ``F.scaled_dot_product_attention``, one call per
    session. q, K and V stay in their dtype, so it equals the reference within that dtype's
    rounding (float32 accumulation is the fused kernels' choice, not this function's)."""
    head_dim = q.shape[2]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    out = torch.zeros_like(q)  # [T, Hq, D]
    sessions = _session_attention_inputs(
        q, k_pool, v_pool, block_tables, context_lens, query_starts, tree_mask
    )
    for first, last, queries, keys, values, allowed in sessions:
        # A single chain token sees its whole row: no mask lets SDPA pick its fastest kernel.
        mask = allowed  # [n, L] or None
        attended = F.scaled_dot_product_attention(
            queries.transpose(0, 1),  # [Hq, n, D]
            keys.transpose(0, 1),  # [Hkv, L, D]
            values.transpose(0, 1),
            attn_mask=mask, scale=scale, enable_gqa=True,
        )  # [Hq, n, D]
        if tree_mask is not None:
            attended = attended.masked_fill(~allowed.any(dim=-1)[None, :, None], 0.0)
        out[first:last] = attended.transpose(0, 1)
    return out


def attention_backends(device: torch.device | str) -> tuple[str, ...]:
    """The backends of this module that run on `device`, preferred first.

    On CPU the reference comes first: SDPA's fused CPU kernel buys nothing at a few queries per
    session. On CUDA SDPA comes first: its kernels read bf16 K and V in place of the
    reference's float32 copies of every context (benchmarks/paged_attention_gpu.py times
    both). Neither is the GPU serving path: that is the Triton kernel behind
    target_worker.kernels.ops.paged_attention, which this layer may not import, so a model
    in the runtime that should use it is handed it by the worker.
    """
    if torch.device(device).type == "cuda":
        return (SDPA, REFERENCE)
    return (REFERENCE, SDPA)


def choose_attention_backend(device: torch.device | str) -> Callable[..., torch.Tensor]:
    """The function to call for paged attention on `device` (both backends take a tree mask);
    it has `paged_attention_reference`'s signature."""
    name = attention_backends(device)[0]
    return {REFERENCE: paged_attention_reference, SDPA: paged_attention_sdpa}[name]
