"""The training losses of `specdec distill`.

Both kinds of draft learn the target's next-token distribution: a top-K cross-entropy
against the teacher's renormalised top-K (the KL to it up to a constant) plus a
cross-entropy on the teacher's greedy token, which is what greedy acceptance rewards. A
feature-level head (EAGLE, Li et al. 2024, arXiv:2401.15077; EAGLE-3, arXiv:2503.01840)
also regresses the target's next feature, over several unrolled drafting steps
(training-time test), each step reading the head's own previous outputs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specdec import eagle
from specdec.train.examples import Batch, EagleBatch

STEP_DECAY = 0.8  # weight of unrolled step s is STEP_DECAY ** (s - 1)


def topk_distill_loss(logits: torch.Tensor, ids: torch.Tensor,
                      probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, with logits [N, V] float32, ids [N, K] and probs [N, K] (rows summing to 1):
    soft = −Σ_k p_k log q(id_k) (the teacher's renormalised top-K against the student's
    full softmax q) and hard = −log q(id_0) (the teacher's greedy token). Returns ([N], [N]).

    Written out because autograd's log_softmax backward materialises several [N, V]
    buffers; the gradient is one softmax pass and two scatters:
    ∂/∂z = (g_s + g_h)·softmax(z) − g_s·p·[id_k] − g_h·[id_0].
    """
    return _TopKDistillLoss.apply(logits, ids, probs)


class _TopKDistillLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, ids: torch.Tensor, probs: torch.Tensor):
        lse = torch.logsumexp(logits, dim=-1)  # [N]
        picked = logits.gather(1, ids)  # [N, K]
        soft = lse - (probs * picked).sum(-1)  # [N]
        hard = lse - picked[:, 0]  # [N]
        ctx.save_for_backward(logits, lse, ids, probs)
        return soft, hard

    @staticmethod
    def backward(ctx, grad_soft: torch.Tensor, grad_hard: torch.Tensor):
        logits, lse, ids, probs = ctx.saved_tensors
        grad = torch.sub(logits, lse[:, None]).exp_()  # [N, V] softmax
        grad.mul_((grad_soft + grad_hard)[:, None])
        grad.scatter_add_(1, ids, -probs * grad_soft[:, None])
        grad.scatter_add_(1, ids[:, :1], -grad_hard[:, None])
        return grad, None, None


def model_step_loss(model, batch: Batch, hard_weight: float, bf16: bool) -> tuple[torch.Tensor, dict]:
    """A draft model's loss on a batch: the soft loss plus hard_weight times the greedy
    token's cross-entropy, averaged over answer positions (the forward under bf16 autocast
    with `bf16`, the loss in fp32); and the log's parts: the KL to the teacher's top-K and
    the cross-entropy on its greedy token."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        hidden = model.model(input_ids=batch.input_ids).last_hidden_state  # [B, T, H]
        hidden = hidden.reshape(-1, hidden.shape[-1])[batch.rows]  # [N, H]
        logits = model.lm_head(hidden)  # [N, V]
    soft, hard = topk_distill_loss(logits.float(), batch.topk_ids, batch.topk_probs)  # [N], [N]
    loss = soft.mean() + hard_weight * hard.mean()
    parts = {"kl": (soft.detach() + batch.teacher_neg_entropy).mean().item(),
             "ce_top1": hard.detach().mean().item()}
    return loss, parts


def noisy_features(features: torch.Tensor, hidden: int, amplitude: float, generator: torch.Generator) -> torch.Tensor:
    """The target's features [..., F] with uniform noise added, EAGLE-1 style (Li et al. 2024,
    §4.2: U(-0.1, 0.1) on the features while training), here scaled to each state: every
    H-wide segment (the final state, then each aux layer's: their scales differ by orders of
    magnitude) of every position gets U(-a, a) × that segment's RMS, so zero rows (position 0,
    padding) stay zero. The head then cannot lean on exact feature values that differ between
    the training answers and new ones."""
    segments = features.unflatten(-1, (features.shape[-1] // hidden, hidden))  # [..., S, H]
    rms = segments.pow(2).mean(-1, keepdim=True).sqrt()
    noise = torch.rand(segments.shape, generator=generator, dtype=segments.dtype) * 2 - 1
    return (segments + amplitude * rms * noise).flatten(-2)


def eagle_step_loss(head: eagle.EagleHead, batch: EagleBatch, unroll: int, hard_weight: float, feature_weight: float,
                    bf16: bool, bf16_logits: bool = False, feature_noise: float = 0.0,
                    generator: torch.Generator | None = None) -> tuple[torch.Tensor, dict]:
    """A head's loss on a batch, unrolled `unroll` drafting steps over whole sequences: at
    every answer position and step, the top-K soft loss within the draft vocabulary plus
    hard_weight times the greedy token's cross-entropy (where that token is inside it), plus
    feature_weight times a smooth-L1 regression of the predicted feature on the target's;
    step s weighted STEP_DECAY^(s-1). Returns (loss, the first step's parts for the log).

    bf16: the head's layer under bf16 autocast; bf16_logits: its draft-vocabulary LM head
    too (the largest product of a step: [answer positions, H] × [H, Vd] per unrolled step,
    forward and backward), with the logits rounded to bf16 before the fp32 loss.
    feature_noise: the amplitude of noisy_features on the head's inputs (the regression
    targets stay clean); 0: none."""
    features_in = batch.features_in
    if feature_noise > 0:
        features_in = noisy_features(features_in, head.config.hidden_size, feature_noise,
                                     generator if generator is not None else torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        outputs = head.unrolled(batch.tokens, features_in, unroll)
    total = torch.zeros(())
    weights = 0.0
    logs: dict = {}
    hard_n = max(1, int(batch.hard_ok.sum()))
    for s, out in enumerate(outputs, start=1):
        weight = STEP_DECAY ** (s - 1)
        flat = out.reshape(-1, out.shape[-1])
        if bf16 and bf16_logits:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = (flat[batch.rows] @ head.head.T).float()  # [N, Vd]
        else:
            logits = head.logits(flat[batch.rows].float())  # [N, Vd]
        soft, hard = topk_distill_loss(logits, batch.topk_index, batch.topk_probs)
        hard = (hard * batch.hard_ok).sum() / hard_n
        mask = batch.reg_mask.clone()
        mask[:, :s - 1] = False  # positions before the chain could start
        reg = F.smooth_l1_loss(out[mask].float(), batch.features_out[mask])
        total = total + weight * (soft.mean() + hard_weight * hard + feature_weight * reg)
        weights += weight
        if s == 1:
            logs = {"kl": (soft.detach() + batch.teacher_neg_entropy).mean().item(), "ce_top1": hard.item(),
                    "feature_l1": reg.item()}
    return total / weights, logs
