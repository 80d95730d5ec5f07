"""--kind eagle: a feature-level draft head (specdec.eagle; EAGLE, Li et al. 2024,
arXiv:2401.15077, and EAGLE-3's reading of middle layers, arXiv:2503.01840) trained on the
same self-distillation data as a draft model plus the target's features at every fed
position (and, with --aux-layers, the states of those decoder layers).

A step unrolls the head --unroll drafting steps (training-time test; one step only for the
first --single-step-fraction of the schedule) over whole sequences (losses.eagle_step_loss).
The head proposes only from its draft vocabulary: the tokens the target chose most often in
the training answers, fixed when training begins so that a resume keeps it.
"""

from __future__ import annotations

import logging
from dataclasses import asdict
from pathlib import Path

import torch

from specdec import eagle
from specdec.models import eos_token_ids
from specdec.train import losses
from specdec.train.config import EAGLE, DistillConfig
from specdec.train.evaluate import EVAL_K, eagle_cost_ratio, evaluate_eagle
from specdec.train.examples import EagleExample, choose_vocab, collate_eagle, load_eagle_examples, vocab_coverage
from specdec.train.export import dir_mb, export_eagle
from specdec.train.prompts import HELDOUT, TRAIN
from specdec.train.students.base import StepLoss
from specdec.train.teacher import extract_aux
from specdec.train.workdir import CHECKPOINT_NAME, DRAFT_VOCAB_NAME, atomic_save

log = logging.getLogger(__name__)


class EagleStudent:
    """A feature-level head (specdec.eagle.EagleHead) as a Student; index_of [V] maps a
    target id to its draft-vocabulary index (-1 outside it)."""

    shape_defaults: dict = {"aux_layers": []}  # checkpoints from before --aux-layers

    def __init__(self, module: eagle.EagleHead, config: DistillConfig, target, pad_id: int, index_of: torch.Tensor):
        self.module, self.config, self.target, self.pad_id, self.index_of = module, config, target, pad_id, index_of

    def shape(self) -> dict:
        return {"kind": EAGLE, **asdict(self.module.config)}

    def step_loss(self, examples: list[EagleExample], step: int, progress: float) -> StepLoss:
        config = self.config
        batch = collate_eagle(examples, self.pad_id, self.index_of, self.module.config.hidden_size)
        noise = torch.Generator().manual_seed(config.seed * 1_000_003 + step)  # same on a resume
        unroll = config.unroll if progress >= config.single_step_fraction else 1
        loss, parts = losses.eagle_step_loss(self.module, batch, unroll, config.hard_weight, config.feature_weight,
                                             config.bf16, config.bf16_logits, config.feature_noise, noise)
        return StepLoss(loss, len(batch.rows), {**parts, "unroll": unroll})

    def evaluate(self, examples: list[EagleExample]) -> dict:
        return evaluate_eagle(self.module, examples, self.pad_id, self.index_of, EVAL_K)

    def export(self, out_dir: Path) -> EagleStudent:
        export_eagle(self.module, out_dir)
        served = eagle.load(out_dir, target=self.target)  # what the draft worker loads: fp32 from the bf16 file
        return EagleStudent(served, self.config, self.target, self.pad_id, self.index_of)

    def cost_ratio(self, context: list[int]) -> dict:
        return eagle_cost_ratio(self.target, self.module, context)

    def describe(self, out_dir: Path) -> dict:
        head = self.module
        return {"layers": 1, "hidden": head.config.hidden_size, "intermediate": head.config.intermediate_size,
                "draft_vocab": len(head.draft_vocab), "parameters": sum(p.numel() for p in head.parameters()),
                "dir_mb": dir_mb(out_dir), "aux_layers": list(head.config.aux_layers),
                "feature_bytes_per_token": head.config.hidden_size * eagle.FEATURE_BYTES}


def check_target(config: DistillConfig, target) -> None:
    """Refuses --aux-layers the target lacks (before any data is generated)."""
    if config.aux_layers:
        eagle.new_config(target, config.target, 1, aux_layers=tuple(config.aux_layers))


def prepare(config: DistillConfig, target, tokenizer, data: dict,
            deadline: float) -> tuple[EagleStudent, list[EagleExample], list[EagleExample]]:
    """(the student, training examples, held-out examples) from the work dir's data: first
    the aux layers' states of shards generated before they were asked for (teacher-forced,
    until `deadline`), then the draft vocabulary (chosen now, or as chosen when training
    began); adds what it did to the data summary `data`."""
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    aux_layers = tuple(config.aux_layers)
    if aux_layers:  # teacher-forced, for shards generated before these layers were asked for
        data["aux_positions_computed"] = extract_aux(config.work, target, aux_layers, deadline)
    train_set = load_eagle_examples(config.work, TRAIN, aux_layers)
    heldout = load_eagle_examples(config.work, HELDOUT, aux_layers)
    if not train_set:
        raise ValueError("no training data: the data budget ended before the first training shard")
    vocab_size = int(target.get_output_embeddings().weight.shape[0])
    vocab_path = config.work / DRAFT_VOCAB_NAME
    if vocab_path.exists():  # chosen when training began: a resume keeps it
        draft_vocab = torch.load(vocab_path, weights_only=True)
    else:
        draft_vocab = choose_vocab(train_set, min(config.draft_vocab, vocab_size), eos_token_ids(target, tokenizer),
                                   vocab_size)
        atomic_save(draft_vocab, vocab_path)
    index_of = torch.full((vocab_size,), -1, dtype=torch.long)
    index_of[draft_vocab] = torch.arange(len(draft_vocab))
    data["train_sequences"], data["train_positions"] = len(train_set), sum(len(e.topk_ids) for e in train_set)
    data["heldout_positions"] = sum(len(e.topk_ids) for e in heldout)
    data["draft_vocab"] = len(draft_vocab)
    data["draft_vocab_coverage_train"] = vocab_coverage(train_set, draft_vocab, vocab_size)
    data["draft_vocab_coverage_heldout"] = vocab_coverage(heldout, draft_vocab, vocab_size)
    log.info("data: %d training sequences (%d answer positions), %d held-out; draft vocabulary %d tokens covers "
             "%.3f of the held-out greedy tokens", len(train_set), data["train_positions"], len(heldout),
             len(draft_vocab), data["draft_vocab_coverage_heldout"])
    head = eagle.build(eagle.new_config(target, config.target, len(draft_vocab), aux_layers=aux_layers), target,
                       draft_vocab)
    if config.init_from is not None and not (config.work / CHECKPOINT_NAME).exists():
        eagle.warm_start(head, config.init_from)
        log.info("starting from the weights of %s", config.init_from)
    return EagleStudent(head, config, target, pad_id, index_of), train_set, heldout
