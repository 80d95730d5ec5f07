"""--kind model: a small standalone draft model, a Llama of a few narrow layers over the
target's full vocabulary, sharing its tokenizer, with tied embeddings initialised from the
principal directions of the target's output embeddings (so the draft starts in the
subspace the target's logits live in). Its cost is mostly the output layer over the full
vocabulary: a useful draft keeps its step cost c well below one target step.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specdec.models import eos_token_ids, load_model, max_context
from specdec.train import losses
from specdec.train.config import DistillConfig
from specdec.train.evaluate import evaluate_model, model_cost_ratio
from specdec.train.examples import Example, collate, load_examples
from specdec.train.export import dir_mb, export_model
from specdec.train.prompts import HELDOUT, TRAIN
from specdec.train.students.base import StepLoss

log = logging.getLogger(__name__)


def _rope_parameters(text_config) -> dict:
    rope = getattr(text_config, "rope_parameters", None) or {}
    if "rope_type" not in rope and "full_attention" in rope:  # per-layer-type (Gemma 3): the global one
        rope = rope["full_attention"]
    if "rope_type" not in rope:
        rope = {"rope_type": "default", "rope_theta": float(getattr(text_config, "rope_theta", 10000.0))}
    return dict(rope)


def build_student(target, tokenizer, config: DistillConfig):
    """A LlamaForCausalLM over the target's vocabulary, special ids, context length and
    rotary settings, with tied embeddings initialised from the target's output embeddings
    projected onto their top principal directions (uncentred SVD)."""
    text = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
    heads = config.heads or max(1, config.hidden // 64)
    kv_heads = config.kv_heads or max(1, heads // 2)
    if config.hidden % heads or heads % kv_heads:
        raise ValueError(f"--hidden {config.hidden} must divide into --heads {heads}, "
                         f"and the heads into --kv-heads {kv_heads}")
    head_embeddings = target.get_output_embeddings().weight.detach().float()  # [V, D]
    eos = eos_token_ids(target, tokenizer)
    student_config = LlamaConfig(
        vocab_size=head_embeddings.shape[0], hidden_size=config.hidden, intermediate_size=config.intermediate,
        num_hidden_layers=config.layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=config.hidden // heads, max_position_embeddings=max_context(target),
        rope_parameters=_rope_parameters(text), rms_norm_eps=float(getattr(text, "rms_norm_eps", 1e-5)),
        tie_word_embeddings=True, hidden_act="silu",
        bos_token_id=getattr(text, "bos_token_id", None) or tokenizer.bos_token_id,
        eos_token_id=eos[0] if len(eos) == 1 else eos,
        pad_token_id=(tokenizer.pad_token_id if tokenizer.pad_token_id is not None
                      else getattr(text, "pad_token_id", None)),
    )
    torch.manual_seed(config.seed)
    student = LlamaForCausalLM(student_config)
    with torch.no_grad():
        rank = min(config.hidden, head_embeddings.shape[1])
        _, _, right = torch.linalg.svd(head_embeddings, full_matrices=False)  # right: [D, D]
        projected = head_embeddings @ right[:rank].T  # [V, rank]
        # At the target's own scale, tied embeddings make the untrained draft predict its
        # input token with large logits (a first loss above uniform's, measured); the
        # directions are what carries over, at the initialiser's scale.
        std = student.config.initializer_range
        student.get_input_embeddings().weight[:, :rank] = projected * (std / projected.std())
    return student


class ModelStudent:
    """A draft model (LlamaForCausalLM) as a Student."""

    shape_defaults: dict = {}

    def __init__(self, module, config: DistillConfig, target, tokenizer, pad_id: int):
        self.module, self.config, self.target, self.tokenizer, self.pad_id = module, config, target, tokenizer, pad_id

    def shape(self) -> dict:
        return {k: getattr(self.module.config, k) for k in ("num_hidden_layers", "hidden_size", "intermediate_size")}

    def step_loss(self, examples: list[Example], step: int, progress: float) -> StepLoss:
        batch = collate(examples, self.pad_id)
        loss, parts = losses.model_step_loss(self.module, batch, self.config.hard_weight, self.config.bf16)
        return StepLoss(loss, len(batch.rows), parts)

    def evaluate(self, examples: list[Example]) -> dict:
        return evaluate_model(self.module, examples, self.pad_id)

    def export(self, out_dir: Path) -> ModelStudent:
        export_model(self.module, self.tokenizer, self.target, out_dir)
        served, _ = load_model(str(out_dir))  # what `--draft DIR` loads: fp32 from the bf16 files
        return ModelStudent(served, self.config, self.target, self.tokenizer, self.pad_id)

    def cost_ratio(self, context: list[int]) -> dict:
        return model_cost_ratio(self.target, self.module, context)

    def describe(self, out_dir: Path) -> dict:
        return {"layers": self.config.layers, "hidden": self.config.hidden, "intermediate": self.config.intermediate,
                "parameters": sum(p.numel() for p in self.module.parameters()), "dir_mb": dir_mb(out_dir)}


def prepare(config: DistillConfig, target, tokenizer, data: dict,
            deadline: float) -> tuple[ModelStudent, list[Example], list[Example]]:
    """(the student, training examples, held-out examples) from the work dir's data; adds
    the examples' counts to the data summary `data`."""
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    train_set, heldout = load_examples(config.work, TRAIN), load_examples(config.work, HELDOUT)
    data["train_sequences"], data["train_positions"] = len(train_set), sum(len(e.topk_ids) for e in train_set)
    data["heldout_positions"] = sum(len(e.topk_ids) for e in heldout)
    if not train_set:
        raise ValueError("no training data: the data budget ended before the first training shard")
    log.info("data: %d training sequences (%d answer positions), %d held-out", len(train_set),
             data["train_positions"], len(heldout))
    return ModelStudent(build_student(target, tokenizer, config), config, target, tokenizer, pad_id), train_set, heldout
