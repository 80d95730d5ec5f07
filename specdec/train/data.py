"""The data phase of `specdec distill`: the target answers the prompts in shards (held-out
prompts first), greedily and then sampled, until the plan is done or the data time budget is
spent; each shard is stored whole in the work directory, so a resume continues the plan.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass

import torch

from specdec.models import eos_token_ids
from specdec.train import prompts
from specdec.train.config import EAGLE, DistillConfig
from specdec.train.progress import progress_bar
from specdec.train.prompts import HELDOUT, TRAIN
from specdec.train.self_prompts import read_self_prompts, write_self_prompts
from specdec.train.teacher import chat_ids, teacher_for_generation, teacher_generate
from specdec.train.workdir import DATA_DIR, DATA_SUMMARY_NAME, atomic_save, aux_path

log = logging.getLogger(__name__)

GREEDY_SAMPLE = 0  # sample index 0 of a prompt is its greedy answer; 1.. are sampled


@dataclass(frozen=True)
class Shard:
    """One teacher generation batch of the plan."""

    index: int
    split: str
    sample: int  # GREEDY_SAMPLE or a sampled answer's index
    prompts: tuple[int, ...]  # indices into the split's prompt list

    @property
    def path_name(self) -> str:
        return f"{self.index:05d}-{self.split}-s{self.sample}.pt"


def plan_shards(n_train: int, n_heldout: int, config: DistillConfig) -> list[Shard]:
    """Held-out greedy answers first (evaluation needs them), then one greedy pass over the
    training prompts, then sampled passes: a time bound that cuts the plan short keeps the
    most diverse data (every prompt once) before repeats."""
    generator = torch.Generator().manual_seed(config.seed)
    shards: list[Shard] = []

    def add(split: str, sample: int, order: list[int]) -> None:
        for start in range(0, len(order), config.gen_batch):
            shards.append(Shard(len(shards), split, sample, tuple(order[start:start + config.gen_batch])))

    add(HELDOUT, GREEDY_SAMPLE, list(range(n_heldout)))
    for sample in range(config.samples_per_prompt):
        add(TRAIN, sample, torch.randperm(n_train, generator=generator).tolist())
    return shards


def select_prompts(config: DistillConfig, self_written: list[str] = ()) -> tuple[list[str], list[str]]:
    """(train texts, held-out texts): the built-in set's, limited as configured, then the
    --prompts file's and the target's own (`self_written`), without duplicates or bench
    subjects; held-out ones (built-in only) evenly spaced so every kind of request is
    represented."""
    built = prompts.build_prompts()
    train = [p.text for p in prompts.split(built, TRAIN)][:config.train_prompts]
    heldout_all = [p.text for p in prompts.split(built, HELDOUT)]
    count = min(config.heldout_prompts, len(heldout_all))
    heldout = [heldout_all[i * len(heldout_all) // count] for i in range(count)] if count else []
    extra = prompts.read_prompt_file(config.prompts_file) if config.prompts_file is not None else []
    seen = set(train) | set(heldout)
    for text in [*extra, *self_written]:
        if text not in seen and not prompts.excluded(text):  # never the bench's subjects
            seen.add(text)
            train.append(text)
    return train, heldout


def generate_data(config: DistillConfig, target, tokenizer, deadline: float) -> dict:
    """Runs the shard plan from where it stopped, until done or `deadline` (monotonic);
    returns and stores the data phase's summary in the work dir."""
    data_dir = config.work / DATA_DIR
    data_dir.mkdir(parents=True, exist_ok=True)
    summary_path = config.work / DATA_SUMMARY_NAME
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {
        "shards_done": 0, "seconds": 0.0, "generated_tokens": 0, "prompt_tokens": 0}
    model, cache_factory = teacher_for_generation(target, config.teacher_dtype)
    # Held-out answers measure agreement with the target as served: always from it.
    served = (model, cache_factory) if config.teacher_dtype == "float32" else teacher_for_generation(target)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_token_ids(target, tokenizer)[0]
    eos_ids = eos_token_ids(target, tokenizer)
    self_written = read_self_prompts(config.work) if config.self_prompts else []
    if self_written is None:  # first run: the target writes its requests before any shard (they fix the plan)
        train_texts, heldout_texts = select_prompts(config)
        taken = set(train_texts) | set(heldout_texts)
        summary["self_prompts"] = write_self_prompts(config, model, tokenizer, pad_id=pad_id, eos_ids=eos_ids,
                                                     taken=taken, deadline=deadline, new_cache=cache_factory)
        summary_path.write_text(json.dumps(summary, indent=1))
        self_written = read_self_prompts(config.work)
    train_texts, heldout_texts = select_prompts(config, self_written)
    prompt_ids = {TRAIN: [chat_ids(tokenizer, t) for t in train_texts],
                  HELDOUT: [chat_ids(tokenizer, t) for t in heldout_texts]}
    plan = plan_shards(len(train_texts), len(heldout_texts), config)
    summary.update(train_prompts=len(train_texts), heldout_prompts=len(heldout_texts), shards_planned=len(plan))
    # A feature head's aux layers are captured in the generation passes themselves (no
    # teacher-forced pass later for shards generated now).
    aux_layers = tuple(config.aux_layers) if config.kind == EAGLE else ()
    todo = [s for s in plan if not (data_dir / s.path_name).exists()]
    bar = progress_bar(len(plan), config.progress, "teacher data", unit="shard", initial=len(plan) - len(todo))
    last_shard_s = 0.0
    stopped = "plan done"
    for shard in todo:
        enough = any(s.split == TRAIN for s in plan[:shard.index]) and shard.split == TRAIN
        if enough and time.monotonic() + last_shard_s > deadline:
            stopped = "data time budget"
            break
        began = time.monotonic()
        generator = torch.Generator().manual_seed(config.seed * 1_000_003 + shard.index)
        batch = [prompt_ids[shard.split][i] for i in shard.prompts]
        teacher, teacher_cache = served if shard.split == HELDOUT else (model, cache_factory)
        result = teacher_generate(teacher, batch, pad_id=pad_id, eos_ids=eos_ids, max_new_tokens=config.max_new_tokens,
                                  top_k=config.top_k, sample=shard.sample != GREEDY_SAMPLE,
                                  temperature=config.temperature, top_p=config.top_p, generator=generator,
                                  new_cache=teacher_cache, features=config.kind == EAGLE,
                                  aux_layers=aux_layers)
        stored = {"shard": asdict(shard), **asdict(result)}
        if aux_layers:  # beside the shard, as extract_aux would write it (written first: a shard implies it)
            aux_file = aux_path(config.work, data_dir / shard.path_name, aux_layers)
            aux_file.parent.mkdir(parents=True, exist_ok=True)
            atomic_save(stored["aux"], aux_file)
        del stored["aux"]
        atomic_save(stored, data_dir / shard.path_name)
        last_shard_s = time.monotonic() - began
        tokens = sum(len(a) for a in result.answers)
        summary["shards_done"] += 1
        summary["seconds"] += last_shard_s
        summary["generated_tokens"] += tokens
        summary["prompt_tokens"] += sum(len(p) for p in result.prompts)
        summary_path.write_text(json.dumps(summary, indent=1))
        bar.update(1)
        bar.set_postfix_str(f"{tokens / last_shard_s:.0f} tok/s")
        log.info("teacher shard %d/%d (%s, sample %d): %d tokens in %.1f s (%.0f tok/s)", shard.index + 1,
                 len(plan), shard.split, shard.sample, tokens, last_shard_s, tokens / last_shard_s)
    bar.close()
    summary["stopped"] = stopped
    summary["tokens_per_s"] = summary["generated_tokens"] / summary["seconds"] if summary["seconds"] else 0.0
    summary_path.write_text(json.dumps(summary, indent=1))
    return summary
