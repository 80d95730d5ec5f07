"""--self-prompts: training requests written by the target itself (Magpie, Xu et al. 2024,
arXiv:2406.08464): an instruction-tuned target, fed its chat template up to where a user's
message begins, writes a user's request. Kept ones are stored once in the work directory,
before any shard (they fix the shard plan), and reused on a resume.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import torch

from specdec.train import prompts
from specdec.train.config import DistillConfig
from specdec.train.teacher import teacher_generate
from specdec.train.workdir import SELF_PROMPTS_NAME

log = logging.getLogger(__name__)

SELF_PROMPT_MAX_TOKENS = 96  # a request not finished by its end-of-turn within this is dropped
SELF_PROMPT_TEMPERATURE = 1.0  # the target's own distribution over requests
SELF_PROMPT_TOP_P = 0.95
SELF_PROMPT_MIN_WORDS = 4
SELF_PROMPT_MAX_ATTEMPTS = 4  # rows sampled per wanted request, at most
SELF_PROMPT_SEED = 7_919  # offsets --seed for the request sampler (shards use seed·1000003 + index)


def user_turn_prefix(tokenizer) -> list[int]:
    """The ids a chat starts with up to where the user's message begins (the template's
    default system turn, if it adds one, and the user header): what the target continues
    to write a request of its own."""
    sentinel = "\u2063specdec-user-message\u2063"
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("--self-prompts needs a target whose tokenizer has a chat template")
    text = tokenizer.apply_chat_template([{"role": "user", "content": sentinel}], tokenize=False,
                                         add_generation_prompt=False)
    if sentinel not in text:
        raise ValueError("--self-prompts: the chat template does not render the user's message verbatim")
    return list(tokenizer(text[:text.index(sentinel)], add_special_tokens=False)["input_ids"])


def write_self_prompts(config: DistillConfig, model, tokenizer, *, pad_id: int, eos_ids: list[int], taken: set[str],
                       deadline: float, new_cache=None) -> dict:
    """Samples up to config.self_prompts requests from the target (user_turn_prefix, then
    its own tokens at SELF_PROMPT_TEMPERATURE / SELF_PROMPT_TOP_P) and writes those kept to
    WORK/SELF_PROMPTS_NAME (JSONL, read back by prompts.read_prompt_file). Kept: a
    request the target ended with its end-of-turn within SELF_PROMPT_MAX_TOKENS, of at least
    SELF_PROMPT_MIN_WORDS words, with no special tokens, not in `taken` nor already kept, and
    off the bench's subjects. Stops at the count, at SELF_PROMPT_MAX_ATTEMPTS rows per
    request, or at `deadline` (monotonic). Returns the phase's summary."""
    began = time.monotonic()
    prefix = user_turn_prefix(tokenizer)
    special = set(tokenizer.all_special_ids)
    generator = torch.Generator().manual_seed(config.seed * 1_000_003 + SELF_PROMPT_SEED)
    kept: list[str] = []
    seen = set(taken)
    sampled = tokens = 0
    counts = {"unfinished": 0, "short": 0, "special": 0, "duplicate": 0, "bench_subject": 0}
    while (len(kept) < config.self_prompts and sampled < SELF_PROMPT_MAX_ATTEMPTS * config.self_prompts
           and time.monotonic() < deadline):
        result = teacher_generate(model, [prefix] * config.gen_batch, pad_id=pad_id, eos_ids=eos_ids,
                                  max_new_tokens=SELF_PROMPT_MAX_TOKENS, top_k=1, sample=True,
                                  temperature=SELF_PROMPT_TEMPERATURE, top_p=SELF_PROMPT_TOP_P,
                                  generator=generator, new_cache=new_cache)
        for answer in result.answers:  # rows past the count are not looked at, nor counted
            sampled += 1
            tokens += len(answer)
            if not answer or answer[-1] not in eos_ids:
                counts["unfinished"] += 1
                continue
            text = tokenizer.decode(answer[:-1], skip_special_tokens=False).strip()
            reason = ("special" if special.intersection(answer[:-1]) else
                      "short" if len(text.split()) < SELF_PROMPT_MIN_WORDS else
                      "duplicate" if text in seen else
                      "bench_subject" if prompts.excluded(text) else None)
            if reason:
                counts[reason] += 1
                continue
            seen.add(text)
            kept.append(text)
            if len(kept) == config.self_prompts:
                break
    path = config.work / SELF_PROMPTS_NAME
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in kept), encoding="utf-8")
    os.replace(tmp, path)
    summary = {"wanted": config.self_prompts, "kept": len(kept), "sampled": sampled, "dropped": counts,
               "tokens": tokens, "seconds": time.monotonic() - began}
    log.info("the target wrote %d requests of its own (%d sampled, %d tokens, %.0f s); dropped: %s", len(kept),
             sampled, tokens, summary["seconds"], counts)
    return summary


def read_self_prompts(work: Path) -> list[str] | None:
    """The requests write_self_prompts kept (None before it has run)."""
    path = work / SELF_PROMPTS_NAME
    if not path.exists():
        return None
    return prompts.read_prompt_file(path) if path.stat().st_size else []
