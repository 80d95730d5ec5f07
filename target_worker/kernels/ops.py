"""The kernel ops the target worker calls.

Each op runs its compiled Triton kernel when the tensors live on CUDA and triton is
installed, and its plain-torch reference otherwise (CPU serving, machines without triton).
Both paths compute the same function: exactly for token choices, within float32 rounding for
probabilities (see each ``*_ref`` module), within the inputs' dtype rounding for attention
(whose reference, specdec.runtime.paged_attention, is also the runtime's CPU path). The kernel
modules import triton, so they are only imported here, lazily, once a CUDA tensor arrives.

Validation of request-level values (num_draft in [0, k], temperature > 0, top_p in (0, 1])
belongs to the caller, on the host: the CUDA path does not read device values back (that
would stall the stream), and the kernels clamp num_draft rather than read out of bounds.
"""

from __future__ import annotations

import torch

from specdec.runtime.paged_attention import paged_attention_reference
from target_worker.kernels.greedy_verify_ref import greedy_verify_ref, greedy_verify_rows_ref
from target_worker.kernels.rejection_sample_ref import rejection_sample_ref
from target_worker.kernels.warp_ref import warp_probs_ref

try:
    import triton  # noqa: F401  (only probed: the kernel modules import it themselves)
except ImportError:
    TRITON_AVAILABLE = False
else:
    TRITON_AVAILABLE = True


def _use_triton(tensor: torch.Tensor) -> bool:
    return TRITON_AVAILABLE and tensor.is_cuda


def greedy_verify(
    logits: torch.Tensor,  # [B, k + 1, V] fp32 / bf16 / fp16
    draft_tokens: torch.Tensor,  # [B, k] int, entries past num_draft are ignored
    num_draft: torch.Tensor,  # [B] int, drafts per row (0 .. k)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification: (accepted [B] int64, next_token [B] int64).

    accepted is the length of the longest prefix of the row's drafts equal to the target's
    argmax at the same positions; next_token is the argmax at position ``accepted`` (the
    correction, or the bonus token when every draft was accepted). Ties: lowest id.
    """
    logits = logits.contiguous()
    draft_tokens = draft_tokens.to(torch.int64).contiguous()
    num_draft = num_draft.to(device=logits.device, dtype=torch.int64).contiguous()
    if _use_triton(logits):
        # Lazy: the kernel module imports triton, which CPU-only workers need not have.
        from target_worker.kernels.greedy_verify import greedy_verify_triton

        return greedy_verify_triton(logits, draft_tokens, num_draft)
    return greedy_verify_ref(logits, draft_tokens, num_draft)


def greedy_verify_rows(
    logits: torch.Tensor,  # [R, V] fp32 / bf16 / fp16: a step's scored rows, each once
    rows: torch.Tensor,  # [B, k + 1] int: the logits row of each chain position
    draft_tokens: torch.Tensor,  # [B, k] int, entries past num_draft are ignored
    num_draft: torch.Tensor,  # [B] int, drafts per row (0 .. k)
) -> tuple[torch.Tensor, torch.Tensor]:
    """greedy_verify over ragged chains, in place: chain b's position j is scored by
    logits[rows[b, j]] (entries past num_draft may name any row and are not read on CUDA).
    A step whose chains differ in length verifies them where the forward wrote their logits,
    without a [B, k + 1, V] copy padded to the longest chain (one long chain in a large step
    would make every chain as long)."""
    logits = logits.contiguous()
    rows = rows.to(device=logits.device, dtype=torch.int64).contiguous()
    draft_tokens = draft_tokens.to(device=logits.device, dtype=torch.int64).contiguous()
    num_draft = num_draft.to(device=logits.device, dtype=torch.int64).contiguous()
    if _use_triton(logits):
        from target_worker.kernels.greedy_verify import greedy_verify_rows_triton

        return greedy_verify_rows_triton(logits, rows, draft_tokens, num_draft)
    return greedy_verify_rows_ref(logits, rows, draft_tokens, num_draft)


def rejection_sample(
    target_probs: torch.Tensor,  # [B, k + 1, V] p, already warped
    draft_probs: torch.Tensor | None,  # [B, k, V] q, or None for drafters without probabilities
    draft_tokens: torch.Tensor,  # [B, k] int, entries past num_draft are ignored
    num_draft: torch.Tensor,  # [B] int, drafts per row (0 .. k)
    u_accept: torch.Tensor,  # [B, k] uniforms in [0, 1), one per draft (philox STREAM_ACCEPT)
    u_sample: torch.Tensor,  # [B, k + 1] uniforms in [0, 1), one per position (STREAM_SAMPLE)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling: (accepted [B] int64, next_token [B] int64).

    With draft_probs, draft i is accepted while ``u_accept[:, i] * q_i(x_i) < p_i(x_i)``; at
    the first rejection next_token is drawn from norm(max(0, p_i - q_i)) with
    ``u_sample[:, i]``, else the bonus token is drawn from p at position num_draft with
    ``u_sample[:, num_draft]``. With draft_probs None (q a one-hot on the drafted token) the
    coupled rule runs: the target draws its own token at every position with u_sample, drafts
    are accepted while they equal those draws, and next_token is the draw at the first stop
    (u_accept is not read; see rejection_sample.py for why both are exact).

    So that randomness depends on (request seed, position) alone, column i of both uniforms
    belongs to the absolute position of output token i, as
    ``specdec.philox.round_uniforms(seeds, first_positions, k)`` builds them.
    """
    target_probs = target_probs.contiguous()
    device = target_probs.device
    if draft_probs is not None:
        draft_probs = draft_probs.to(target_probs.dtype).contiguous()
    draft_tokens = draft_tokens.to(device=device, dtype=torch.int64).contiguous()
    num_draft = num_draft.to(device=device, dtype=torch.int64).contiguous()
    u_accept = u_accept.to(device=device, dtype=torch.float64).contiguous()
    u_sample = u_sample.to(device=device, dtype=torch.float64).contiguous()
    if _use_triton(target_probs):
        # Lazy: the kernel module imports triton, which CPU-only workers need not have.
        from target_worker.kernels.rejection_sample import rejection_sample_triton

        return rejection_sample_triton(
            target_probs, draft_probs, draft_tokens, num_draft, u_accept, u_sample
        )
    return rejection_sample_ref(
        target_probs, draft_probs, draft_tokens, num_draft, u_accept, u_sample
    )


def sampled_match(
    target_probs: torch.Tensor,  # [B, k + 1, V] p, already warped
    draft_tokens: torch.Tensor,  # [B, k] int, entries past num_draft are ignored
    num_draft: torch.Tensor,  # [B] int, drafts per row (0 .. k)
    u_sample: torch.Tensor,  # [B, k + 1] uniforms in [0, 1) (philox STREAM_SAMPLE)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sampling verification of drafts without probabilities: (accepted [B], next_token [B]).

    The target draws its own token at every position with u_sample; drafts are accepted
    while they equal those draws, and next_token is the draw at the first stop. This is
    rejection_sample's one-hot path (the Triton kernels on CUDA, the torch reference
    otherwise); rejection_sample.py says why it is exact and why the output then equals
    target-only sampling token for token.
    """
    batch, positions, _ = target_probs.shape
    # [B, k]: the one-hot rule reads no acceptance uniforms.
    u_accept = torch.zeros(batch, positions - 1, dtype=torch.float64, device=target_probs.device)
    return rejection_sample(target_probs, None, draft_tokens, num_draft, u_accept, u_sample)


def warp_probs(
    logits: torch.Tensor,  # [N, V], or [B, P, V] with per-request parameters [B]
    temperature: torch.Tensor,  # [N] (or [B]) float, > 0: temperature 0 is greedy, the caller's
    top_k: torch.Tensor,  # [N] (or [B]) int, 0 = off
    top_p: torch.Tensor,  # [N] (or [B]) float, 1.0 = off
) -> torch.Tensor:
    """Probabilities after temperature, top-k then top-p: [N, V] (or [B, P, V]) float32.

    Tokens with equal logits are kept or dropped together (see warp_ref).
    """
    shape = logits.shape
    if logits.dim() == 3:
        positions = shape[1]
        logits = logits.reshape(-1, shape[-1])
        temperature, top_k, top_p = (
            t.repeat_interleave(positions) for t in (temperature, top_k, top_p)
        )
    device = logits.device
    logits = logits.contiguous()
    temperature = temperature.to(device=device, dtype=torch.float32).contiguous()
    top_k = top_k.to(device=device, dtype=torch.int64).contiguous()
    top_p = top_p.to(device=device, dtype=torch.float32).contiguous()
    if temperature.device.type == "cpu":
        assert bool((temperature > 0).all()), "temperature 0 is greedy: the caller's path"
    if _use_triton(logits):
        # Lazy: the kernel module imports triton, which CPU-only workers need not have.
        from target_worker.kernels.warp import warp_probs_triton

        probs = warp_probs_triton(logits, temperature, top_k, top_p)
    else:
        probs = warp_probs_ref(logits, temperature, top_k, top_p)
    return probs.reshape(shape)


def paged_attention(
    q: torch.Tensor,  # [T, Hq, D] new tokens of B sessions, packed
    k_pool: torch.Tensor,  # [num_blocks, block_size, Hkv, D] one layer's K blocks
    v_pool: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # int [B, max_blocks]; entries past a session's blocks ignored
    context_lens: torch.Tensor,  # int [B]: tokens of session i in the pool before its new ones
    query_starts: torch.Tensor,  # int [B + 1], cumulative, query_starts[B] == T
    tree_mask: torch.Tensor | None = None,  # bool [B, Qmax, Qmax] or None (causal chain)
    scale: float | None = None,  # default 1 / sqrt(D)
) -> torch.Tensor:
    """Attention of each session's new tokens over its paged KV cache: [T, Hq, D], q's dtype.

    The new tokens' keys and values are already in the pool; token j of session i sees its
    context and, of the new tokens, those up to j (or those tree_mask[i, j] marks). The whole
    contract is specdec.runtime.paged_attention's. On CUDA the host reads no index value.
    """
    device = q.device
    block_tables, context_lens, query_starts = (
        index.to(device=device, dtype=torch.int32).contiguous()
        for index in (block_tables, context_lens, query_starts)
    )
    q, k_pool, v_pool = q.contiguous(), k_pool.contiguous(), v_pool.contiguous()
    if tree_mask is not None:
        tree_mask = tree_mask.to(device=device, dtype=torch.bool).contiguous()
    if _use_triton(q):
        # Lazy: the kernel module imports triton, which CPU-only workers need not have.
        from target_worker.kernels.paged_attention import paged_attention_triton

        return paged_attention_triton(
            q, k_pool, v_pool, block_tables, context_lens, query_starts, tree_mask, scale
        )
    return paged_attention_reference(
        q, k_pool, v_pool, block_tables, context_lens, query_starts, tree_mask, scale
    )
