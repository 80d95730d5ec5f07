"""Logits -> sampling probabilities (temperature, top-k, top-p) in plain torch: the
specification the Triton kernel in ``warp.py`` is tested against, and the CPU path.

Per row, with e = exp((logits - max) / temperature):

* top-k keeps every token whose logit is >= the k-th largest logit (k counts repeated values;
  top_k <= 0 or >= V is off);
* top-p then keeps every token whose logit is >= t, for the largest logit value t such that
  the tokens at or above t (among those top-k kept) carry at least top_p of the kept mass;
  top_p >= 1 is off, top_p <= 0 keeps only the maximum;
* the kept e are normalised; the others get probability 0.

Ties rule: both filters are thresholds on the logit *value*, so tokens with equal logits are
kept or dropped together, never split by their ids or by sort order. The kept set can
therefore hold more than k tokens (ties at the k-th value) or more mass than the smallest
possible top-p set (ties at the boundary). This is what lets the kernel find thresholds by
bisection without sorting, and kernel and reference agree on it exactly for top-k; for top-p
the masses are float sums taken in different orders, so the two can disagree only when a
boundary mass lies within float32 rounding (~1e-6 relative) of top_p * kept mass.
Thresholds compare the raw logits (before the temperature division), so a temperature
cannot round two different logits into a tie.
"""

from __future__ import annotations

import torch


def warp_probs_ref(
    logits: torch.Tensor,  # [N, V] fp32 / bf16 / fp16
    temperature: torch.Tensor,  # [N] float, > 0
    top_k: torch.Tensor,  # [N] int, 0 = off
    top_p: torch.Tensor,  # [N] float, 1.0 = off
) -> torch.Tensor:
    """Returns probs [N, V] float32."""
    rows, vocab = logits.shape
    assert temperature.shape == top_k.shape == top_p.shape == (rows,)
    x = logits.float()  # [N, V]
    temperature = temperature.float()[:, None]  # [N, 1]
    top_p = top_p.float()[:, None]  # [N, 1]
    top = x.max(dim=-1, keepdim=True).values  # [N, 1]
    e = torch.exp((x - top) / temperature)  # [N, V], unnormalised

    sorted_x, order = x.sort(dim=-1, descending=True)  # [N, V]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab).to(torch.int64)  # [N]
    kth = sorted_x.gather(1, k[:, None] - 1)  # [N, 1], the k-th largest logit

    sorted_e = torch.where(sorted_x >= kth, e.gather(1, order), 0.0)  # [N, V]
    mass = sorted_e.cumsum(dim=-1)  # [N, V]
    target = top_p * mass[:, -1:]  # [N, 1]
    # The first sorted position whose running mass reaches the target; its logit is t, and
    # the run of ties at t is kept whole by the >= below.
    first = (mass < target).sum(dim=-1, keepdim=True).clamp(max=vocab - 1)  # [N, 1]
    threshold = torch.where(top_p < 1.0, sorted_x.gather(1, first), kth)  # [N, 1]
    threshold = torch.maximum(threshold, kth)

    kept = torch.where(x >= threshold, e, 0.0)  # [N, V]
    return kept / kept.sum(dim=-1, keepdim=True)
