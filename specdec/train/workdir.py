"""The work directory of `specdec distill` (default `<out>.work`): what lives where in it,
files written whole or not at all, and the identity of its data that a resume must match.

    meta.json             the data's identity (data_identity), checked by --resume
    self_prompts.jsonl    --self-prompts: the target's own requests, written before any shard
    data/NNNNN-SPLIT-sS.pt  one teacher generation batch each (specdec.train.data.Shard)
    data.json             the data phase's summary
    aux-L1-L2/…           --aux-layers: those layers' states, one file per shard, same name
    draft_vocab.pt        --kind eagle: the head's vocabulary, fixed when training begins
    checkpoint.pt         model, optimizer, step and data cursor (specdec.train.loop)
    metrics.jsonl         the training history, one line per entry
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

from specdec.train import prompts
from specdec.train.config import EAGLE, DistillConfig

META_NAME = "meta.json"
SELF_PROMPTS_NAME = "self_prompts.jsonl"
DATA_DIR = "data"
DATA_SUMMARY_NAME = "data.json"
DRAFT_VOCAB_NAME = "draft_vocab.pt"
CHECKPOINT_NAME = "checkpoint.pt"
METRICS_NAME = "metrics.jsonl"


def aux_path(work: Path, shard_path: Path, aux_layers: tuple[int, ...]) -> Path:
    """Where the aux layers' states of a data shard are stored (beside it, same name)."""
    return work / ("aux-" + "-".join(map(str, aux_layers))) / shard_path.name


def atomic_save(obj, path: Path) -> None:
    """torch.save, whole or not at all (a stopped run leaves no half-written file)."""
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _prompts_digest(path: Path | None) -> str | None:
    """What a --prompts file contributes to the data's identity: its prompts, not its name."""
    if path is None:
        return None
    texts = prompts.read_prompt_file(path)
    return hashlib.sha256("\n".join(texts).encode()).hexdigest()[:16]


def data_identity(config: DistillConfig) -> dict:
    """What the teacher data depends on: a resume may change the student or the optimiser
    settings until training has begun (a checkpoint of another shape is refused later)."""
    return {"target": config.target, "train_prompts": config.train_prompts, "heldout_prompts": config.heldout_prompts,
            "samples_per_prompt": config.samples_per_prompt, "temperature": config.temperature,
            "top_p": config.top_p, "max_new_tokens": config.max_new_tokens, "gen_batch": config.gen_batch,
            "top_k": config.top_k, "seed": config.seed, "features": config.kind == EAGLE,
            "prompts_file": _prompts_digest(config.prompts_file), "self_prompts": config.self_prompts,
            "teacher_dtype": config.teacher_dtype,
            "prompt_set": hashlib.sha256("\n".join(p.text for p in prompts.build_prompts())
                                         .encode()).hexdigest()[:16]}


def prepare(config: DistillConfig) -> None:
    """Creates the work directory, or checks that a resumed one holds this config's data;
    refuses a used one without --resume."""
    work = config.work
    identity = data_identity(config)
    meta_path = work / META_NAME
    if work.exists() and any(work.iterdir()):
        if not config.resume:
            raise ValueError(f"work directory {work} is not empty: pass --resume to continue it, "
                             "or choose another --work")
        if meta_path.exists():
            # work dirs from before these flags
            saved = {"self_prompts": 0, "teacher_dtype": "float32", **json.loads(meta_path.read_text())}
            changed = {k: (saved.get(k), v) for k, v in identity.items() if saved.get(k) != v}
            if changed:
                raise ValueError(f"--resume with settings that differ from the work directory's: {changed}")
    work.mkdir(parents=True, exist_ok=True)
    meta_path.write_text(json.dumps(identity, indent=1))
