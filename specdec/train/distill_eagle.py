"""`specdec distill --kind eagle`: training a feature-level head (specdec.eagle) on the same
self-distillation data as a standalone draft, plus the target's hidden states.

The data phase stores, per sequence, the target's feature at every fed position (float16);
a training step unrolls the head `--unroll` steps (training-time test) over whole sequences
and minimises, at every answer position and every step, the top-K KL to the target's
distribution restricted to the draft vocabulary plus a cross-entropy on the target's greedy
token (steps weighted STEP_DECAY^(s-1)), and a smooth-L1 regression of the predicted feature
on the true one (`--feature-weight`). Held-out evaluation drafts exactly as the worker does:
acceptance of greedy k-token chains at every answer position, from the unrolled forward.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from specdec import eagle

log = logging.getLogger(__name__)

STEP_DECAY = 0.8  # weight of unrolled step s is STEP_DECAY ** (s - 1)


@dataclass
class EagleExample:
    tokens: torch.Tensor  # [L] int64, prompt + answer
    prompt_len: int
    topk_ids: torch.Tensor  # [answer, K] int64 (target ids)
    topk_logprobs: torch.Tensor  # [answer, K] float32
    features: torch.Tensor  # [L - 1, F] float16: features[p] is the target's f_p (then aux states, F = feature_size)


def load_examples(work: Path, split: str, aux_layers: tuple[int, ...] = ()) -> list[EagleExample]:
    """A split's sequences; with aux_layers, each one's features carry those layers' states
    after the final ones ([L - 1, H·(1 + len(aux_layers))], from extract_aux)."""
    examples = []
    for path in sorted((work / "data").glob(f"*-{split}-s*.pt")):
        shard = torch.load(path, weights_only=True)
        if shard.get("features") is None:
            raise ValueError(f"{path} has no target features: its data was generated for --kind model "
                             "(use another --work for --kind eagle)")
        features = shard["features"]
        if aux_layers:
            aux = torch.load(aux_path(work, path, aux_layers), weights_only=True)
            features = [torch.cat([f, a], -1) for f, a in zip(features, aux)]
        for prompt, answer, ids, logprobs, feats in zip(shard["prompts"], shard["answers"], shard["topk_ids"],
                                                        shard["topk_logprobs"], features):
            if answer:
                examples.append(EagleExample(torch.tensor(prompt + answer), len(prompt), ids.long(), logprobs.float(),
                                             feats))
    return examples


def aux_path(work: Path, shard_path: Path, aux_layers: tuple[int, ...]) -> Path:
    return work / ("aux-" + "-".join(map(str, aux_layers))) / shard_path.name


class _Enough(Exception):
    """Stops a forward pass once the deepest wanted layer has run."""


AUX_BATCH = 8  # sequences per teacher-forced pass


@torch.inference_mode()
def aux_states(model, sequences: list[list[int]], aux_layers: tuple[int, ...]) -> list[torch.Tensor]:
    """The residual stream after decoder layers `aux_layers` (0-based) at every position of
    each sequence, teacher-forced: [len(seq), H·len(aux_layers)] float16 each. Runs only the
    layers up to the deepest one asked for."""
    layers = model.model.layers
    captured: dict[int, torch.Tensor] = {}
    deepest = max(aux_layers)

    def hook(index):
        def capture(module, args, output):
            captured[index] = output[0] if isinstance(output, tuple) else output
            if index == deepest:
                raise _Enough
        return capture

    handles = [layers[i].register_forward_hook(hook(i)) for i in aux_layers]
    out: list[torch.Tensor] = []
    try:
        for start in range(0, len(sequences), AUX_BATCH):
            batch = sequences[start:start + AUX_BATCH]
            length = max(len(s) for s in batch)
            ids = torch.zeros((len(batch), length), dtype=torch.long)  # right-padded
            mask = torch.zeros_like(ids)
            for row, seq in enumerate(batch):
                ids[row, :len(seq)] = torch.tensor(seq)
                mask[row, :len(seq)] = 1
            try:
                model.model(input_ids=ids, attention_mask=mask, use_cache=False)
            except _Enough:
                pass
            states = torch.cat([captured[i] for i in aux_layers], -1)  # [b, length, H·a]
            out.extend(states[row, :len(seq)].to(eagle.FEATURE_DTYPE).clone() for row, seq in enumerate(batch))
    finally:
        for handle in handles:
            handle.remove()
    return out


def extract_aux(work: Path, target, aux_layers: tuple[int, ...], deadline: float, progress: bool = False) -> int:
    """Adds the aux layers' states of every stored sequence's fed positions (prompt + answer
    but the last token), teacher-forced, one file per data shard (resumable). Returns the
    positions computed. Teacher forcing gives the states generation saw: the stored final
    features agree with a teacher-forced pass to ~2e-4 relative (float rounding)."""
    import time

    from specdec.runtime.cpu import agrees, fast_cpu_model
    from specdec.train.distill import _atomic_save

    fast = fast_cpu_model(target)
    model = fast if fast is not target and agrees(target, fast) else target
    shards = sorted((work / "data").glob("*-s*.pt"))
    todo = [p for p in shards if not aux_path(work, p, aux_layers).exists()]
    aux_path(work, shards[0], aux_layers).parent.mkdir(parents=True, exist_ok=True) if shards else None
    done = 0
    for path in todo:
        if time.monotonic() > deadline:
            raise TimeoutError(f"aux features: {len(todo)} shards left when the time budget ended (rerun with --resume)")
        began = time.monotonic()
        shard = torch.load(path, weights_only=True)
        sequences = [(p + a)[:-1] for p, a in zip(shard["prompts"], shard["answers"])]
        states = aux_states(model, sequences, aux_layers)
        _atomic_save(states, aux_path(work, path, aux_layers))
        n = sum(len(s) for s in sequences)
        done += n
        log.info("aux features of %s: %d positions in %.1f s", path.name, n, time.monotonic() - began)
    return done


def choose_vocab(examples: list[EagleExample], size: int, always: list[int], vocab_size: int) -> torch.Tensor:
    """The `size` target ids the head may propose: the tokens the target chose most often
    in the training answers (plus `always`, e.g. EOS), sorted by id."""
    counts: Counter[int] = Counter()
    for example in examples:
        counts.update(example.topk_ids[:, 0].tolist())
    chosen = [t for t in always if 0 <= t < vocab_size]
    for token, _ in counts.most_common():
        if len(chosen) >= size:
            break
        if token not in chosen:
            chosen.append(token)
    for token in range(vocab_size):  # a tiny data set: fill up in id order
        if len(chosen) >= size:
            break
        if token not in counts and token not in chosen:
            chosen.append(token)
    return torch.tensor(sorted(chosen[:size]), dtype=torch.long)


def vocab_coverage(examples: list[EagleExample], draft_vocab: torch.Tensor, vocab_size: int) -> float:
    inside = torch.zeros(vocab_size, dtype=torch.bool)
    inside[draft_vocab] = True
    greedy = torch.cat([e.topk_ids[:, 0] for e in examples]) if examples else torch.zeros(0, dtype=torch.long)
    return float(inside[greedy].float().mean()) if len(greedy) else 0.0


@dataclass
class EagleBatch:
    tokens: torch.Tensor  # [B, T]
    features_in: torch.Tensor  # [B, T, F]: f_{t-1} (and the aux layers' states), zeros at t = 0 and on padding
    features_out: torch.Tensor  # [B, T, H]: f_t
    reg_mask: torch.Tensor  # [B, T] bool: f_t is known
    rows: torch.Tensor  # [N] flat B*T indices of answer-predicting positions
    topk_index: torch.Tensor  # [N, K] draft-vocab indices (0 where out of the draft vocabulary)
    topk_probs: torch.Tensor  # [N, K] teacher probs renormalised over those inside it
    hard_ok: torch.Tensor  # [N] bool: the greedy token is inside it
    teacher_neg_entropy: torch.Tensor  # [N]


def collate(examples: list[EagleExample], pad_id: int, index_of: torch.Tensor, hidden: int) -> EagleBatch:
    """index_of [V]: draft-vocab index of each target id, -1 outside; hidden: the target's
    hidden size (the final features' width, what the head predicts)."""
    length = max(len(e.tokens) for e in examples)
    width = examples[0].features.shape[-1]
    b = len(examples)
    tokens = torch.full((b, length), pad_id, dtype=torch.long)
    f_in = torch.zeros((b, length, width), dtype=torch.float32)
    f_out = torch.zeros((b, length, hidden), dtype=torch.float32)
    reg = torch.zeros((b, length), dtype=torch.bool)
    rows = []
    for i, e in enumerate(examples):
        n = len(e.tokens)
        tokens[i, :n] = e.tokens
        f_in[i, 1:n] = e.features.float()
        f_out[i, :n - 1] = e.features[:, :hidden].float()
        reg[i, :n - 1] = True
        start = i * length + e.prompt_len - 1
        rows.append(torch.arange(start, start + len(e.topk_ids)))
    ids = torch.cat([e.topk_ids for e in examples])  # [N, K]
    logprobs = torch.log_softmax(torch.cat([e.topk_logprobs for e in examples]), -1)  # [N, K]
    index = index_of[ids]  # [N, K]
    inside = index >= 0
    probs = logprobs.exp() * inside
    probs = probs / probs.sum(-1, keepdim=True).clamp_min(1e-9)
    neg_entropy = (probs * torch.log(probs.clamp_min(1e-12))).sum(-1)
    return EagleBatch(tokens, f_in, f_out, reg, torch.cat(rows), index.clamp_min(0), probs, inside[:, 0], neg_entropy)


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


def step_loss(head: eagle.EagleHead, batch: EagleBatch, unroll: int, hard_weight: float, feature_weight: float,
              bf16: bool, bf16_logits: bool = False, feature_noise: float = 0.0,
              generator: torch.Generator | None = None) -> tuple[torch.Tensor, dict]:
    """bf16: the head's layer under bf16 autocast; bf16_logits: its draft-vocabulary LM head
    too (the largest product of a step: [answer positions, H] × [H, Vd] per unrolled step,
    forward and backward), with the logits rounded to bf16 before the fp32 loss.
    feature_noise: the amplitude of noisy_features on the head's inputs (the regression
    targets stay clean); 0: none."""
    from specdec.train.distill import topk_distill_loss

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


@torch.inference_mode()
def evaluate(head: eagle.EagleHead, examples: list[EagleExample], pad_id: int, index_of: torch.Tensor,
             k: int, batch_size: int = 16) -> dict:
    """Greedy k-token chains drafted from every answer position, as the worker drafts
    them (true features for committed positions, its own after), against the reference
    greedy answer: exact acceptance (a draft counts only if all before it were right, and
    then the chain's tokens are the reference's)."""
    from specdec.speedup import alpha_from_acceptance_rate
    from specdec.train.distill import simulate_chains

    was_training = head.training
    head.eval()
    agreed = total = rounds = proposed = accepted = 0
    for start in range(0, len(examples), batch_size):
        chunk = examples[start:start + batch_size]
        batch = collate(chunk, pad_id, index_of, head.config.hidden_size)
        outputs = head.unrolled(batch.tokens, batch.features_in, k)
        # predicted[s][b, t]: step s+1's token at position t (a target id)
        predicted = [head.draft_vocab[head.logits(o.float()).argmax(-1)] for o in outputs]
        for b, e in enumerate(chunk):
            n = len(e.tokens)
            # chain_ok[s][c]: step s+1 drafted from committed position c (at c + s) is right
            chain_ok = [[c + s + 1 < n and int(predicted[s][b, c + s]) == int(e.tokens[c + s + 1])
                         for c in range(n)] for s in range(k)]
            r, p, a = simulate_chains(chain_ok, e.prompt_len, n, k)
            rounds, proposed, accepted = rounds + r, proposed + p, accepted + a
            agreed += sum(chain_ok[0][e.prompt_len - 1:n - 1])
            total += n - e.prompt_len
    head.train(was_training)
    rate = accepted / proposed if proposed else 0.0
    return {"heldout_top1_agreement": agreed / total if total else 0.0, "sim_k": k,
            "sim_acceptance_rate": rate, "sim_alpha": alpha_from_acceptance_rate(rate, k),
            "sim_tokens_per_round": total / rounds if rounds else 0.0, "heldout_positions": total}


def measure_cost_ratio(target, head: eagle.EagleHead, context: list[int]) -> dict:
    """c: one head step (1 position on a cache holding `context`, then its argmax) over one
    target step, each on its serving path."""
    from specdec.runtime.costs import measure_head, measure_target
    from specdec.runtime.load import serving_lm

    target_s = measure_target(serving_lm(target), context, 1).target_step_s
    draft_s = measure_head(eagle.fast_cpu_head(head), context)  # as the workers serve it
    return {"context_tokens": len(context), "target_step_s": target_s, "draft_step_s": draft_s,
            "c": draft_s / target_s}
