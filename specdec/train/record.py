"""The run record of `specdec distill`: distill.json in the draft directory (the command,
the config, the data, the training, the final held-out metrics, the cost ratio and the
history), built by `build` for every kind of draft, and the README rendered from it.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import asdict
from pathlib import Path

import torch

from specdec.train.config import EAGLE, DistillConfig
from specdec.train.loop import TrainState

log = logging.getLogger(__name__)

RECORD_NAME = "distill.json"


def build(config: DistillConfig, *, student: dict, data: dict, state: TrainState, train_sequences: int,
          final: dict, cost: dict, began: float) -> dict:
    """The record of a run that began at `began` (monotonic) and ends now: `student` is the
    draft's description (Student.describe), `data` the data phase's summary, `state` where
    training ended, `final` the held-out metrics ({} without held-out data), `cost` the
    cost ratio. A draft model's record has no "kind" (it predates --kind)."""
    losses = [h for h in state.history if "loss" in h]
    return {
        "command": config.command, **({"kind": EAGLE} if config.kind == EAGLE else {}), "target": config.target,
        "out_dir": str(config.out_dir), "work_dir": str(config.work),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(config).items()},
        "student": student,
        "data": data,
        "training": {"steps": state.step, "epochs": state.epoch + state.cursor / train_sequences,
                     "tokens_seen": state.tokens_seen, "trained_s": state.trained_s,
                     "first_loss": losses[0]["loss"] if losses else math.nan,
                     "final_loss": losses[-1]["loss"] if losses else math.nan},
        "final": final, "cost": cost, "history": state.history,
        "wall_s": time.monotonic() - began, "threads": config.threads, "torch": torch.__version__,
    }


def write(out_dir: Path, record: dict) -> None:
    """Writes the record into the draft directory, and its README when there are final metrics."""
    (out_dir / RECORD_NAME).write_text(json.dumps(record, indent=1))
    final = record["final"]
    if final:
        _write_model_card(out_dir, record)
    log.info("wrote %s (%.1f MB): held-out agreement %.3f, simulated alpha %.3f, %.2f tokens/round, c %.3f",
             out_dir, record["student"]["dir_mb"], final.get("heldout_top1_agreement", math.nan),
             final.get("sim_alpha", math.nan), final.get("sim_tokens_per_round", math.nan), record["cost"]["c"])


def _write_model_card(out_dir: Path, record: dict) -> None:
    final, data, training = record["final"], record["data"], record["training"]
    student = record["student"]
    if record.get("kind") == EAGLE:
        aux = student.get("aux_layers") or []
        if aux:
            about = ("A feature-level draft head (specdec.eagle, in the style of EAGLE-3): one decoder layer that "
                     "reads the target's final hidden states and the outputs of some of its middle layers, and "
                     "proposes through the target's own embeddings and LM-head rows (loaded from the target, not "
                     "stored here). Trained by self-distillation on text the target generated. Use it with "
                     "`specdec up --draft DIR` or `specdec serve target --head DIR`: the target worker runs it next "
                     "to the target (those layers' states never leave it, so a draft worker cannot serve it); not "
                     "a Hugging Face model.")
        else:
            about = ("A feature-level draft head (specdec.eagle, in the style of EAGLE): one decoder layer that reads "
                     "the target's hidden states and proposes through the target's own embeddings and LM-head rows "
                     "(loaded from the target, not stored here). Trained by self-distillation on text the target "
                     "generated. Use it with `specdec up --draft DIR` or `specdec serve target --head DIR` (the "
                     "target worker runs it next to the target), or `specdec serve draft --model DIR`; not a "
                     "Hugging Face model.")
        reads = (f"reads the target's final hidden states and the outputs of its layers {aux} (0-based; on the "
                 "target worker only)" if aux else
                 f"{student['feature_bytes_per_token']} feature bytes per token on the wire when a draft worker "
                 "serves it")
        shape = (f"1 decoder layer, hidden {student['hidden']}, MLP {student['intermediate']}, draft vocabulary "
                 f"{student['draft_vocab']} tokens ({record['data'].get('draft_vocab_coverage_heldout', 0):.3f} of "
                 f"held-out greedy tokens), {student['parameters'] / 1e6:.1f}M trained parameters, bfloat16 "
                 f"({student['dir_mb']:.1f} MB); {reads}")
    else:
        about = ("A small LlamaForCausalLM sharing the target's tokenizer, trained by self-distillation on text the "
                 "target generated (its top-K distributions). Use it with `specdec up --draft DIR`, "
                 "`specdec serve draft --model DIR`, or Hugging Face `generate(..., assistant_model=draft)`.")
        shape = (f"{student['layers']} layers, hidden {student['hidden']}, {student['parameters'] / 1e6:.1f}M "
                 f"parameters, bfloat16 ({student['dir_mb']:.1f} MB)")
    lines = [
        f"# Draft for `{record['target']}`, trained by `specdec distill`", "", about, "",
        f"- command: `{record['command']}`",
        f"- architecture: {shape}",
        f"- data: {data['generated_tokens']} teacher tokens from {data['train_prompts']} training prompts "
        f"({data['shards_done']} of {data['shards_planned']} planned shards, {data['seconds'] / 60:.1f} min, "
        f"{data['tokens_per_s']:.0f} tok/s)",
        f"- training: {training['steps']} steps, {training['epochs']:.2f} epochs, "
        f"{training['trained_s'] / 60:.1f} min; loss {training['first_loss']:.3f} → {training['final_loss']:.3f}"
        + (f" (started from the weights of `{record['config']['init_from']}`)"
           if record.get("config", {}).get("init_from") else ""),
        f"- held-out ({data['heldout_prompts']} prompts unseen in training): top-1 agreement "
        f"{final['heldout_top1_agreement']:.3f}; simulated greedy k={final['sim_k']}: acceptance rate "
        f"{final['sim_acceptance_rate']:.3f}, alpha {final['sim_alpha']:.3f}, "
        f"{final['sim_tokens_per_round']:.2f} tokens/round",
        f"- cost ratio c (draft step / target step, serving path, {record['cost']['context_tokens']}-token "
        f"context): {record['cost']['c']:.3f}",
        f"- wall time of this invocation: {record['wall_s'] / 60:.1f} min", "",
        f"Full record: `{RECORD_NAME}`.",
    ]
    (out_dir / "README.md").write_text("\n".join(lines) + "\n")
