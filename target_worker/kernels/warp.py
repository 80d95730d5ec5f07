"""Logits -> sampling probabilities (temperature, top-k, top-p) as a Triton kernel;
``warp_ref.py`` holds the same maths in plain torch and states the ties rule both share.

One program per row, no sort. Both filters keep the tokens whose logit is >= a threshold, and
each threshold is found by bisection over the logits' order-preserving int32 keys:

* top-k: the largest key t with count(key >= t) >= k  (t is then the k-th largest logit);
* top-p: the largest key t >= t_k with mass(key >= t) >= top_p * mass(key >= t_k).

Each bisection step is one pass over the row, at most 32 per threshold (fewer when the keys
span a narrow range); a filter that is off costs no pass. A last pass normalises and writes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from target_worker.kernels.launch import assert_launchable, block_size

NUM_WARPS = 8
# Identities of min / max reductions over int32 keys.
KEY_MAX = 2**31 - 1
KEY_MIN = -(2**31)
# Flipping the 31 value bits of a negative float makes its int32 bits order like the float.
SIGN_FLIP = 0x7FFFFFFF
LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _load_keys(row_ptr, ids, V, SIGN_FLIP: tl.constexpr):
    """One tile: (logits as fp32, their order-preserving int32 keys, in-row mask)."""
    in_row = ids < V
    # Cast right after the load: bf16 arithmetic is wrong under the interpreter.
    x = tl.load(row_ptr + ids, mask=in_row, other=float("-inf")).to(tl.float32)
    bits = x.to(tl.int32, bitcast=True)
    key = tl.where(bits < 0, bits ^ SIGN_FLIP, bits)
    key = tl.where(x == 0.0, 0, key)  # -0.0 and +0.0 are one value
    return x, key, in_row


@triton.jit
def _warp_kernel(
    logits_ptr,  # [N, V] fp32 / bf16 / fp16
    temperature_ptr,  # [N] fp32, > 0
    top_k_ptr,  # [N] int64, <= 0 or >= V: off
    top_p_ptr,  # [N] fp32, >= 1: off
    probs_ptr,  # [N, V] fp32 out
    V,
    KEY_MIN: tl.constexpr,
    KEY_MAX: tl.constexpr,
    SIGN_FLIP: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0)
    row_ptr = logits_ptr + row.to(tl.int64) * V
    out_ptr = probs_ptr + row.to(tl.int64) * V
    temperature = tl.load(temperature_ptr + row)
    top_k = tl.load(top_k_ptr + row)
    top_p = tl.load(top_p_ptr + row)
    lanes = tl.arange(0, BLOCK_V)

    # One pass: the maximum logit and the range of keys.
    top_lanes = tl.full([BLOCK_V], float("-inf"), tl.float32)
    key_lo_lanes = tl.full([BLOCK_V], KEY_MAX, tl.int32)
    key_hi_lanes = tl.full([BLOCK_V], KEY_MIN, tl.int32)
    for start in range(0, V, BLOCK_V):
        x, key, in_row = _load_keys(row_ptr, start + lanes, V, SIGN_FLIP)
        top_lanes = tl.maximum(top_lanes, x)
        key_lo_lanes = tl.minimum(key_lo_lanes, tl.where(in_row, key, KEY_MAX))
        key_hi_lanes = tl.maximum(key_hi_lanes, tl.where(in_row, key, KEY_MIN))
    top = tl.max(top_lanes, axis=0)
    key_lo = tl.min(key_lo_lanes, axis=0).to(tl.int64)
    key_hi = tl.max(key_hi_lanes, axis=0).to(tl.int64)

    # Top-k: invariant count(key >= lo) >= k; hi bounds the answer from above.
    lo = key_lo
    hi = tl.where((top_k > 0) & (top_k < V), key_hi, key_lo)
    while lo < hi:
        mid = lo + ((hi - lo + 1) >> 1)
        count_lanes = tl.zeros([BLOCK_V], tl.int32)
        for start in range(0, V, BLOCK_V):
            x, key, in_row = _load_keys(row_ptr, start + lanes, V, SIGN_FLIP)
            count_lanes += (in_row & (key >= mid.to(tl.int32))).to(tl.int32)
        enough = tl.sum(count_lanes, axis=0) >= top_k
        lo = tl.where(enough, mid, lo)
        hi = tl.where(enough, hi, mid - 1)
    key_k = lo

    # Top-p over the top-k survivors: invariant mass(key >= lo) >= top_p * kept mass.
    hi = tl.where(top_p < 1.0, key_hi, key_k)
    mass_lanes = tl.zeros([BLOCK_V], tl.float32)
    for start in range(0, tl.where(top_p < 1.0, V, 0), BLOCK_V):
        x, key, in_row = _load_keys(row_ptr, start + lanes, V, SIGN_FLIP)
        e = tl.exp((x - top) / temperature)
        mass_lanes += tl.where(key >= key_k.to(tl.int32), e, 0.0)
    target = top_p * tl.sum(mass_lanes, axis=0)
    while lo < hi:
        mid = lo + ((hi - lo + 1) >> 1)
        mass_lanes = tl.zeros([BLOCK_V], tl.float32)
        for start in range(0, V, BLOCK_V):
            x, key, in_row = _load_keys(row_ptr, start + lanes, V, SIGN_FLIP)
            e = tl.exp((x - top) / temperature)
            mass_lanes += tl.where(key >= mid.to(tl.int32), e, 0.0)
        enough = tl.sum(mass_lanes, axis=0) >= target
        lo = tl.where(enough, mid, lo)
        hi = tl.where(enough, hi, mid - 1)
    threshold = lo.to(tl.int32)

    # Normalise the kept tokens and write.
    mass_lanes = tl.zeros([BLOCK_V], tl.float32)
    for start in range(0, V, BLOCK_V):
        x, key, in_row = _load_keys(row_ptr, start + lanes, V, SIGN_FLIP)
        e = tl.exp((x - top) / temperature)
        mass_lanes += tl.where(key >= threshold, e, 0.0)
    kept_mass = tl.sum(mass_lanes, axis=0)
    for start in range(0, V, BLOCK_V):
        ids = start + lanes
        x, key, in_row = _load_keys(row_ptr, ids, V, SIGN_FLIP)
        e = tl.exp((x - top) / temperature)
        tl.store(out_ptr + ids, tl.where(key >= threshold, e, 0.0) / kept_mass, mask=in_row)


def warp_probs_triton(
    logits: torch.Tensor,  # [N, V] fp32 / bf16 / fp16
    temperature: torch.Tensor,  # [N] fp32
    top_k: torch.Tensor,  # [N] int64
    top_p: torch.Tensor,  # [N] fp32
    block_v: int | None = None,
) -> torch.Tensor:
    """Returns probs [N, V] float32; see warp_ref for the rule and its ties."""
    rows, vocab = logits.shape
    assert logits.dtype in LOGIT_DTYPES, logits.dtype
    assert temperature.shape == (rows,) and temperature.dtype == torch.float32
    assert top_k.shape == (rows,) and top_k.dtype == torch.int64
    assert top_p.shape == (rows,) and top_p.dtype == torch.float32
    assert 0 < vocab < KEY_MAX
    assert_launchable(_warp_kernel, logits, temperature, top_k, top_p)
    block_v = block_size(vocab, block_v)

    probs = torch.empty((rows, vocab), dtype=torch.float32, device=logits.device)
    if rows == 0:
        return probs
    _warp_kernel[(rows,)](
        logits, temperature, top_k, top_p, probs, vocab,
        KEY_MIN=KEY_MIN, KEY_MAX=KEY_MAX, SIGN_FLIP=SIGN_FLIP, BLOCK_V=block_v, num_warps=NUM_WARPS,
    )
    return probs
