"""The stored teacher data as training examples and batches, per kind of draft: for a draft
model, token sequences with the teacher's top-K at each answer position; for a feature-level
head (--kind eagle), those plus the target's features, and the head's draft vocabulary.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from specdec.train.workdir import DATA_DIR, aux_path


@dataclass
class Example:
    tokens: torch.Tensor  # [prompt + answer] int64
    prompt_len: int
    topk_ids: torch.Tensor  # [answer, K] int64
    topk_logprobs: torch.Tensor  # [answer, K] float32


def load_examples(work: Path, split: str) -> list[Example]:
    """A split's sequences (those with an answer) from the data shards."""
    examples = []
    for path in sorted((work / DATA_DIR).glob(f"*-{split}-s*.pt")):
        shard = torch.load(path, weights_only=True)
        for prompt, answer, ids, logprobs in zip(shard["prompts"], shard["answers"], shard["topk_ids"],
                                                 shard["topk_logprobs"]):
            if answer:
                examples.append(Example(torch.tensor(prompt + answer), len(prompt), ids.long(), logprobs.float()))
    return examples


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, T], right-padded
    rows: torch.Tensor  # [N] flat indices into B*T of the positions that predict an answer token
    topk_ids: torch.Tensor  # [N, K]
    topk_probs: torch.Tensor  # [N, K], renormalised over the top K
    teacher_neg_entropy: torch.Tensor  # [N]: sum p log p, so KL = soft loss + this


def collate(examples: list[Example], pad_id: int) -> Batch:
    """Right padding needs no attention mask: under a causal mask real positions never see
    the pads after them. Position prompt_len - 1 + j predicts answer token j."""
    length = max(len(e.tokens) for e in examples)
    input_ids = torch.full((len(examples), length), pad_id, dtype=torch.long)
    rows = []
    for b, example in enumerate(examples):
        input_ids[b, :len(example.tokens)] = example.tokens
        start = b * length + example.prompt_len - 1
        rows.append(torch.arange(start, start + len(example.topk_ids)))
    topk_ids = torch.cat([e.topk_ids for e in examples])  # [N, K]
    logprobs = torch.log_softmax(torch.cat([e.topk_logprobs for e in examples]), dim=-1)  # [N, K]
    probs = logprobs.exp()
    return Batch(input_ids, torch.cat(rows), topk_ids, probs, (probs * logprobs).sum(-1))


# ----------------------------------------------------------------------------- --kind eagle


@dataclass
class EagleExample:
    tokens: torch.Tensor  # [L] int64, prompt + answer
    prompt_len: int
    topk_ids: torch.Tensor  # [answer, K] int64 (target ids)
    topk_logprobs: torch.Tensor  # [answer, K] float32
    features: torch.Tensor  # [L - 1, F] float16: features[p] is the target's f_p (then aux states, F = feature_size)


def load_eagle_examples(work: Path, split: str, aux_layers: tuple[int, ...] = ()) -> list[EagleExample]:
    """A split's sequences; with aux_layers, each one's features carry those layers' states
    after the final ones ([L - 1, H·(1 + len(aux_layers))], from teacher.extract_aux)."""
    examples = []
    for path in sorted((work / DATA_DIR).glob(f"*-{split}-s*.pt")):
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


def collate_eagle(examples: list[EagleExample], pad_id: int, index_of: torch.Tensor, hidden: int) -> EagleBatch:
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
