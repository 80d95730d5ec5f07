"""`specdec distill`: train a small draft model for a target by self-distillation.

A draft is only worth its cost if the target accepts what it proposes, and a draft accepts
well when it predicts the *target's* next token, not a corpus's. So the training text is
the target's own: it answers a built-in, diverse prompt set (specdec.train.prompts) —
greedily, then sampled for variety — and for every generated position the target's top-K
log-probabilities are stored. The draft then learns those distributions (a top-K
cross-entropy, i.e. the KL to the renormalised top-K teacher up to a constant) plus a
cross-entropy on the target's greedy token, which is what greedy acceptance rewards.
The teacher never runs during training.

Three phases, each resumable from the work directory (default: `<out>.work`):

1. data: the target generates in shards (batched, left-padded, KV-cached, on the CPU fast
   path) until the plan is done or the data time budget is spent; held-out prompts first.
2. training: AdamW, warmup then cosine decay over whichever bound ends training first
   (`--steps` or the wall-clock budget), bf16 autocast on CPU; checkpoints carry the model,
   the optimizer, the step and the data cursor; held-out agreement and the acceptance it
   implies are logged as training goes.
3. export: a plain Hugging Face LlamaForCausalLM directory in bfloat16 with the target's
   tokenizer files and generation config, loadable by `--draft DIR` and by HF assisted
   generation, plus `distill.json` (the command, data, time, metrics) and a README.

Why this draft: a Llama of a few narrow layers over the target's full vocabulary, tied
embeddings initialised from the principal directions of the target's output embeddings
(so the draft starts in the subspace the target's logits live in). On the 2-core CPU of
DESIGN.md a 2-layer, 256-wide draft costs c ≈ 0.07 of a SmolLM2-135M step and 4 layers
≈ 0.12 (most of it the 49152×256 output layer), inside the c ≤ 0.15 a useful draft needs.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import logging
import math
import os
import shlex
import shutil
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from specdec.train import prompts as distill_prompts
from specdec.train.prompts import HELDOUT, TRAIN

if TYPE_CHECKING:
    import torch

# torch is imported inside the functions that use it: the CLI builds this command's parser
# on every `specdec` call, and `specdec generate` should not pay for importing torch.
log = logging.getLogger(__name__)

GREEDY_SAMPLE = 0  # sample index 0 of a prompt is its greedy answer; 1.. are sampled
SAMPLING_POOL = 256  # sampling draws from the teacher's top tokens only (top-p applies within)
COMPACT_FRACTION = 0.25  # drop finished rows from a generation batch once this share is done
FINAL_RESERVE_S = 90.0  # of --max-minutes, kept for export, final evaluation and cost timing
COST_CONTEXT_TOKENS = 200  # context at which the draft/target step cost ratio c is measured
EVAL_K = 4  # draft tokens per round in the simulated acceptance
EVAL_BATCH = 16  # held-out sequences per evaluation forward
MIN_LR_RATIO = 0.1  # cosine decay ends at this fraction of --lr
WORK_SUFFIX = ".work"
MODEL, EAGLE = "model", "eagle"  # the kinds of draft `specdec distill` trains
RECORD_NAME = "distill.json"
# --self-prompts (Magpie, Xu et al. 2024, arXiv:2406.08464): an instruction-tuned target
# writes user requests itself when fed its chat template up to where a user's message begins.
SELF_PROMPTS_NAME = "self_prompts.jsonl"  # in the work dir, written once before any shard
SELF_PROMPT_MAX_TOKENS = 96  # a request not finished by its end-of-turn within this is dropped
SELF_PROMPT_TEMPERATURE = 1.0  # the target's own distribution over requests
SELF_PROMPT_TOP_P = 0.95
SELF_PROMPT_MIN_WORDS = 4
SELF_PROMPT_MAX_ATTEMPTS = 4  # rows sampled per wanted request, at most
SELF_PROMPT_SEED = 7_919  # offsets --seed for the request sampler (shards use seed·1000003 + index)


def _inference(fn):
    """torch.inference_mode() as a decorator that imports torch only when called."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        import torch

        with torch.inference_mode():
            return fn(*args, **kwargs)

    return wrapper


@dataclass
class DistillConfig:
    """What `specdec distill` runs; built from flags by `config_from_args`."""

    target: str
    """Target model spec (a HF directory, a .gguf file or a built-in name)."""
    out_dir: Path
    """Where the final Hugging Face draft directory is written."""
    work_dir: Path | None = None
    """Shards, checkpoints and metrics; default `<out_dir>.work` (keep it out of git)."""
    resume: bool = False
    """Continue from the work directory; without it a non-empty work directory is refused."""
    kind: str = "model"
    """"model": a standalone small causal LM; "eagle": a feature-level head that reads the
    target's hidden states (specdec.eagle)."""
    layers: int = 2
    """Decoder layers of the draft."""
    hidden: int = 256
    """Hidden width of the draft."""
    intermediate: int = 768
    """MLP width of the draft."""
    heads: int | None = None
    """Attention heads (default hidden // 64, at least 1)."""
    kv_heads: int | None = None
    """Key/value heads (default heads // 2, at least 1)."""
    train_prompts: int | None = None
    """Use only the first N training prompts of the built-in set (all by default)."""
    prompts_file: Path | None = None
    """More training prompts, the user's own (distill_prompts.read_prompt_file), after the built-in ones."""
    self_prompts: int = 0
    """More training prompts written by the target itself (write_self_prompts), after those."""
    heldout_prompts: int = 96
    """Held-out prompts answered (greedily) for evaluation, spread over the held-out set."""
    samples_per_prompt: int = 4
    """Answers per training prompt: the greedy one, then sampled ones."""
    temperature: float = 0.8
    """Sampling temperature of the sampled answers."""
    top_p: float = 0.95
    """Nucleus mass of the sampled answers."""
    max_new_tokens: int = 192
    """Longest answer generated per prompt."""
    gen_batch: int = 64
    """Prompts per teacher generation batch (larger amortises the weight reads on CPU)."""
    top_k: int = 32
    """Teacher log-probs stored per position."""
    data_minutes: float | None = None
    """Wall-clock budget of the data phase (default: half of --max-minutes)."""
    steps: int | None = None
    """Training steps (with --max-minutes, whichever ends first)."""
    batch_size: int = 16
    """Sequences per training step."""
    lr: float = 2e-3
    """Peak learning rate (AdamW)."""
    warmup_steps: int = 50
    """Linear warmup steps."""
    weight_decay: float = 0.01
    """AdamW weight decay of the matrices (not of embeddings or norms)."""
    hard_weight: float = 0.5
    """Weight of the cross-entropy on the target's greedy token, beside the top-K soft loss."""
    bf16: bool = True
    """bf16 autocast for the training forward/backward on CPU (weights stay fp32)."""
    teacher_dtype: str = "float32"
    """Dtype the target answers the training prompts in: "bfloat16" answers ~1.5x faster on a
    CPU with AVX512-BF16 (benchmarks/teacher_bf16.py) but differs from the fp32 target at
    near-ties; held-out answers always come from the target as loaded (what is served)."""
    bf16_logits: bool = False
    """--kind eagle: the head's draft-vocabulary LM head under bf16 autocast too (with bf16):
    1.19x faster steps, the same held-out agreement after 160 steps (benchmarks/head_train_step.py)."""
    log_every: int = 25
    """Steps between loss lines."""
    eval_every: int = 200
    """Steps between held-out evaluations."""
    checkpoint_every: int = 100
    """Steps between checkpoints."""
    max_minutes: float | None = None
    """Wall-clock bound of this invocation: data + training + export."""
    threads: int = 2
    """torch intra-op threads."""
    seed: int = 0
    """Seed of the prompt order, sampling, initialisation and data order."""
    progress: bool = True
    """Show progress bars on stderr."""
    command: str = ""
    """The command line, for the training record."""
    draft_vocab: int = 8192
    """--kind eagle: target tokens the head can propose (the most frequent in the data)."""
    unroll: int = 3
    """--kind eagle: drafting steps unrolled per training step (training-time test)."""
    single_step_fraction: float = 0.0
    """--kind eagle: the first this fraction of training (by the schedule's progress: steps or
    wall clock) unrolls one step only (~3x cheaper per step than --unroll 3), then --unroll
    steps: the head learns to read the target's features on many cheap steps and then to
    read its own; 0: --unroll from the start."""
    feature_weight: float = 1.0
    """--kind eagle: weight of the feature regression (smooth L1) beside the token losses."""
    feature_noise: float = 0.0
    """--kind eagle: uniform noise on the target features fed while training, U(-a, a) times
    each state's RMS (EAGLE-1's regulariser; distill_eagle.noisy_features); 0: none."""
    aux_layers: tuple[int, ...] = ()
    """--kind eagle: target decoder layers (0-based) whose states the head also reads."""
    init_from: Path | None = None
    """--kind eagle: a head directory whose weights start training (those it has)."""

    @property
    def work(self) -> Path:
        return self.work_dir or self.out_dir.with_name(self.out_dir.name + WORK_SUFFIX)


# ----------------------------------------------------------------------------- data


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
    import torch

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
    prompts = distill_prompts.build_prompts()
    train = [p.text for p in distill_prompts.split(prompts, TRAIN)][:config.train_prompts]
    heldout_all = [p.text for p in distill_prompts.split(prompts, HELDOUT)]
    count = min(config.heldout_prompts, len(heldout_all))
    heldout = [heldout_all[i * len(heldout_all) // count] for i in range(count)] if count else []
    extra = distill_prompts.read_prompt_file(config.prompts_file) if config.prompts_file is not None else []
    seen = set(train) | set(heldout)
    for text in [*extra, *self_written]:
        if text not in seen and not distill_prompts.excluded(text):  # never the bench's subjects
            seen.add(text)
            train.append(text)
    return train, heldout


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
    WORK/SELF_PROMPTS_NAME (JSONL, read back by distill_prompts.read_prompt_file). Kept: a
    request the target ended with its end-of-turn within SELF_PROMPT_MAX_TOKENS, of at least
    SELF_PROMPT_MIN_WORDS words, with no special tokens, not in `taken` nor already kept, and
    off the bench's subjects. Stops at the count, at SELF_PROMPT_MAX_ATTEMPTS rows per
    request, or at `deadline` (monotonic). Returns the phase's summary."""
    import torch

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
                      "bench_subject" if distill_prompts.excluded(text) else None)
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
    return distill_prompts.read_prompt_file(path) if path.stat().st_size else []


def chat_ids(tokenizer, text: str) -> list[int]:
    """One user message through the chat template, as the coordinator renders prompts."""
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)


@dataclass
class Generated:
    """A batch of teacher answers, per row: prompt ids, answer ids, and per answer position
    the teacher's top-K next-token log-probs."""

    prompts: list[list[int]]
    answers: list[list[int]]
    topk_ids: list[torch.Tensor]  # each [answer_len, K] int32
    topk_logprobs: list[torch.Tensor]  # each [answer_len, K] float16
    # With features=True: per row the target's last hidden state (after the final norm, what
    # its LM head reads) at every fed position, prompt then answer: [prompt + answer - 1, H]
    # float16 (the last answer token is never fed). Position p's feature predicts token p+1.
    features: list[torch.Tensor] | None = None
    # With aux_layers as well: the residual stream after those decoder layers at the same
    # positions, [prompt + answer - 1, H·len(aux_layers)] float16 (what distill_eagle.extract_aux
    # computes teacher-forced; stored beside the shard, not in it).
    aux: list[torch.Tensor] | None = None


def _sample(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator) -> torch.Tensor:
    """Temperature + nucleus sampling among the SAMPLING_POOL most likely tokens.
    logits: [b, V] -> [b] token ids."""
    import torch

    pool, pool_ids = torch.topk(logits, min(SAMPLING_POOL, logits.shape[-1]), dim=-1)  # [b, P] (sorted)
    probs = torch.softmax(pool / temperature, dim=-1)  # [b, P]
    outside = probs.cumsum(-1) - probs > top_p  # the mass before a token already covers top_p
    probs = probs.masked_fill(outside, 0.0)
    choice = torch.multinomial(probs, 1, generator=generator)  # [b, 1]
    return pool_ids.gather(1, choice)[:, 0]


@_inference
def teacher_generate(model, prompts: list[list[int]], *, pad_id: int, eos_ids: list[int], max_new_tokens: int,
                     top_k: int, sample: bool = False, temperature: float = 1.0, top_p: float = 1.0,
                     generator: torch.Generator | None = None, new_cache=None, features: bool = False,
                     aux_layers: tuple[int, ...] = ()) -> Generated:
    """The teacher answers a batch of prompts in lockstep: left-padded prefill, then one
    token per step for every unfinished row, recording the top-K log-probs of each step
    (with `features`, the final hidden states of every fed position, and with `aux_layers`
    too, the outputs of those decoder layers, captured by forward hooks in the same passes).

    Rows that hit EOS stop recording; once COMPACT_FRACTION of the live rows have finished,
    they are dropped from the batch (and from the KV cache) so they cost nothing more.
    """
    import torch

    from transformers import DynamicCache

    device = next(model.parameters()).device
    batch, longest = len(prompts), max(len(p) for p in prompts)
    ids = torch.full((batch, longest), pad_id, dtype=torch.long)  # [B, P], left-padded
    mask = torch.zeros((batch, longest), dtype=torch.long)  # [B, P]
    for row, prompt in enumerate(prompts):
        ids[row, longest - len(prompt):] = torch.tensor(prompt)
        mask[row, longest - len(prompt):] = 1
    ids, mask = ids.to(device), mask.to(device)
    positions = (mask.cumsum(-1) - 1).clamp_min(0)  # [B, P]: real tokens count from 0
    cache = new_cache(model.config) if new_cache is not None else DynamicCache(config=model.config)
    hidden_size = model.config.hidden_size
    out_features = torch.zeros((batch, max_new_tokens, hidden_size) if features else (0,), dtype=torch.float16)
    aux_layers = tuple(aux_layers) if features else ()
    aux_width = hidden_size * len(aux_layers)
    out_aux = torch.zeros((batch, max_new_tokens, aux_width) if aux_layers else (0,), dtype=torch.float16)
    captured: dict[int, torch.Tensor] = {}

    def hook(index):
        def capture(module, args, output):
            captured[index] = output[0] if isinstance(output, tuple) else output
        return capture

    handles = [model.model.layers[i].register_forward_hook(hook(i)) for i in aux_layers]
    from specdec.runtime.compat import cache_kwarg

    cache_key = cache_kwarg(model.model)

    def forward(input_ids, attention_mask, position_ids):
        """Logits of the last position [b, V], the last hidden states [b, n, H], and the aux
        layers' outputs [b, n, H·a] (None without aux layers)."""
        hidden = model.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             use_cache=True, **{cache_key: cache}).last_hidden_state  # [b, n, H]
        aux = torch.cat([captured.pop(i) for i in aux_layers], -1) if aux_layers else None
        return model.lm_head(hidden[:, -1]).float(), hidden, aux

    try:
        return _generate_loop(model, prompts, forward, cache, ids, mask, positions, longest, top_k=top_k,
                              max_new_tokens=max_new_tokens, sample=sample, temperature=temperature, top_p=top_p,
                              generator=generator, eos_ids=eos_ids, features=features, out_features=out_features,
                              out_aux=out_aux if aux_layers else None)
    finally:
        for handle in handles:
            handle.remove()


def _generate_loop(model, prompts, forward, cache, ids, mask, positions, longest: int, *, top_k: int,
                   max_new_tokens: int, sample: bool, temperature: float, top_p: float, generator, eos_ids,
                   features: bool, out_features, out_aux) -> Generated:
    """teacher_generate's prefill and decode steps (hooks, if any, are registered around it)."""
    import torch

    device = ids.device
    batch = len(prompts)
    out_tokens = torch.zeros((batch, max_new_tokens), dtype=torch.long)  # [B, N]
    out_ids = torch.zeros((batch, max_new_tokens, top_k), dtype=torch.int32)  # [B, N, K]
    out_logprobs = torch.zeros((batch, max_new_tokens, top_k), dtype=torch.float16)  # [B, N, K]
    lengths = torch.full((batch,), max_new_tokens, dtype=torch.long)  # [B]
    alive = torch.arange(batch)  # original row of each live batch row
    done = torch.zeros(batch, dtype=torch.bool)  # [b], live rows that emitted EOS
    eos = torch.tensor(eos_ids or [-1], device=device)

    logits, hidden, aux = forward(ids, mask, positions)
    prompt_features = [hidden[row, longest - len(p):].to(torch.float16).cpu() for row, p in enumerate(prompts)] \
        if features else []
    prompt_aux = [aux[row, longest - len(p):].to(torch.float16).cpu() for row, p in enumerate(prompts)] \
        if out_aux is not None else []
    for step in range(max_new_tokens):
        logprobs = torch.log_softmax(logits, dim=-1)  # [b, V]
        top = torch.topk(logprobs, top_k, dim=-1)  # [b, K]
        if sample:
            token = _sample(logits, temperature, top_p, generator)  # [b]
        else:
            token = top.indices[:, 0]  # [b]
        recording = alive[~done]
        out_ids[recording, step] = top.indices[~done].to(torch.int32).cpu()
        out_logprobs[recording, step] = top.values[~done].to(torch.float16).cpu()
        out_tokens[recording, step] = token[~done].cpu()
        finished = torch.isin(token, eos) & ~done  # [b]
        lengths[alive[finished.cpu()]] = step + 1
        done |= finished
        if step == max_new_tokens - 1 or bool(done.all()):
            break
        if int(done.sum()) >= max(1, int(COMPACT_FRACTION * len(alive))):
            keep = (~done).nonzero()[:, 0]  # [b']
            cache.batch_select_indices(keep)
            alive, token, mask, positions = alive[keep.cpu()], token[keep], mask[keep], positions[keep]
            done = done[keep]
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=-1)  # [b, P + step + 1]
        positions = positions[:, -1:] + 1  # [b, 1]
        logits, hidden, aux = forward(token[:, None], mask, positions)
        if features:  # the feature of answer token `step`, which was just fed
            out_features[alive, step] = hidden[:, -1].to(torch.float16).cpu()
        if out_aux is not None:
            out_aux[alive, step] = aux[:, -1].to(torch.float16).cpu()
    answers = [out_tokens[row, :lengths[row]].tolist() for row in range(batch)]
    return Generated([list(p) for p in prompts], answers,
                     [out_ids[row, :lengths[row]].clone() for row in range(batch)],
                     [out_logprobs[row, :lengths[row]].clone() for row in range(batch)],
                     [torch.cat([prompt_features[row], out_features[row, :lengths[row] - 1]])
                      for row in range(batch)] if features else None,
                     [torch.cat([prompt_aux[row], out_aux[row, :lengths[row] - 1]])
                      for row in range(batch)] if out_aux is not None else None)


def _teacher_for_generation(target, dtype: str = "float32"):
    """(model, cache factory) for generation: the CPU fast path (packed linears, buffered KV
    caches) when it applies and agrees with the plain model, else the model as it is; with
    dtype "bfloat16", a bfloat16 copy of the target (stock modules: the packing is fp32's)."""
    import copy

    import torch

    from specdec.runtime.cpu import agrees, fast_cpu_model, new_cache

    if dtype == "bfloat16":
        return copy.deepcopy(target).to(torch.bfloat16).eval(), None
    fast = fast_cpu_model(target)
    if fast is not target and agrees(target, fast):
        return fast, new_cache
    return target, None


def _atomic_save(obj, path: Path) -> None:
    import torch

    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def generate_data(config: DistillConfig, target, tokenizer, deadline: float) -> dict:
    """Runs the shard plan from where it stopped, until done or `deadline` (monotonic);
    returns and stores the data phase's summary in the work dir."""
    import torch

    from specdec.models import eos_token_ids

    data_dir = config.work / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    summary_path = config.work / "data.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {
        "shards_done": 0, "seconds": 0.0, "generated_tokens": 0, "prompt_tokens": 0}
    model, cache_factory = _teacher_for_generation(target, config.teacher_dtype)
    # Held-out answers measure agreement with the target as served: always from it.
    served = (model, cache_factory) if config.teacher_dtype == "float32" else _teacher_for_generation(target)
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
    bar = _progress(len(plan), config.progress, "teacher data", unit="shard", initial=len(plan) - len(todo))
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
            from specdec.train.distill_eagle import aux_path

            aux_file = aux_path(config.work, data_dir / shard.path_name, aux_layers)
            aux_file.parent.mkdir(parents=True, exist_ok=True)
            _atomic_save(stored["aux"], aux_file)
        del stored["aux"]
        _atomic_save(stored, data_dir / shard.path_name)
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


@dataclass
class Example:
    tokens: torch.Tensor  # [prompt + answer] int64
    prompt_len: int
    topk_ids: torch.Tensor  # [answer, K] int64
    topk_logprobs: torch.Tensor  # [answer, K] float32


def load_examples(work: Path, split: str) -> list[Example]:
    import torch

    examples = []
    for path in sorted((work / "data").glob(f"*-{split}-s*.pt")):
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
    import torch

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


# ----------------------------------------------------------------------------- loss


def topk_distill_loss(logits: torch.Tensor, ids: torch.Tensor,
                      probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, with logits [N, V] float32, ids [N, K] and probs [N, K] (rows summing to 1):
    soft = −Σ_k p_k log q(id_k) (the teacher's renormalised top-K against the student's
    full softmax q) and hard = −log q(id_0) (the teacher's greedy token). Returns ([N], [N]).

    Written out because autograd's log_softmax backward materialises several [N, V]
    buffers and measured ~2 s per step at N = 2400, V = 49152 here; the gradient is one
    softmax pass and two scatters: ∂/∂z = (g_s + g_h)·softmax(z) − g_s·p·[id_k] − g_h·[id_0].
    """
    return _topk_distill_function().apply(logits, ids, probs)


@functools.cache
def _topk_distill_function():
    import torch

    class TopKDistillLoss(torch.autograd.Function):
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

    return TopKDistillLoss


# ----------------------------------------------------------------------------- student


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
    import torch

    from transformers import LlamaConfig, LlamaForCausalLM

    from specdec.models import eos_token_ids, max_context

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


# ----------------------------------------------------------------------------- evaluation


def simulate_rounds(agree: list[bool], k: int) -> tuple[int, int, int]:
    """(rounds, proposed, accepted) of greedy speculative decoding along one reference
    answer, given agree[j]: the draft's argmax after reference[:j] equals reference[j].

    Exact under greedy decoding: a draft token is accepted only if all before it were, so
    every accepted token was predicted from the reference prefix itself (teacher forcing);
    each round commits its accepted tokens plus the target's correction or bonus token.
    """
    rounds = proposed = accepted = 0
    position, length = 0, len(agree)
    while position < length:
        block = min(k, length - position)
        run = 0
        while run < block and agree[position + run]:
            run += 1
        rounds += 1
        proposed += block
        accepted += run
        position += run + 1
    return rounds, proposed, accepted


def simulate_chains(chain_ok: list[list[bool]], prompt_len: int, length: int, k: int) -> tuple[int, int, int]:
    """(rounds, proposed, accepted) of greedy speculative decoding along a reference of
    `length` tokens (the first prompt_len the prompt), given chain_ok[s][c]: the draft's
    (s+1)-th token of a chain started after committed position c is the reference's."""
    rounds = proposed = accepted = 0
    last = prompt_len - 1  # the last committed position
    while last < length - 1:
        block = min(k, length - 1 - last)
        run = 0
        while run < block and chain_ok[run][last]:
            run += 1
        rounds, proposed, accepted = rounds + 1, proposed + block, accepted + run
        last += run + 1
    return rounds, proposed, accepted


@_inference
def evaluate(student, examples: list[Example], pad_id: int, k: int = EVAL_K) -> dict:
    """Held-out top-1 agreement with the teacher, and the acceptance it implies at k (fp32,
    as the draft is served)."""
    import torch

    from specdec.speedup import alpha_from_acceptance_rate

    was_training = student.training
    student.eval()
    agreed = total = rounds = proposed = accepted = 0
    for start in range(0, len(examples), EVAL_BATCH):
        chunk = examples[start:start + EVAL_BATCH]
        batch = collate(chunk, pad_id)
        hidden = student.model(input_ids=batch.input_ids).last_hidden_state  # [B, T, H]
        hidden = hidden.reshape(-1, hidden.shape[-1])[batch.rows]  # [N, H]
        predicted = student.lm_head(hidden).argmax(-1)  # [N]
        agree = (predicted == batch.topk_ids[:, 0]).tolist()
        agreed += sum(agree)
        total += len(agree)
        offset = 0
        for example in chunk:
            n = len(example.topk_ids)
            r, p, a = simulate_rounds(agree[offset:offset + n], k)
            rounds, proposed, accepted, offset = rounds + r, proposed + p, accepted + a, offset + n
    student.train(was_training)
    rate = accepted / proposed if proposed else 0.0
    return {"heldout_top1_agreement": agreed / total if total else 0.0, "sim_k": k,
            "sim_acceptance_rate": rate, "sim_alpha": alpha_from_acceptance_rate(rate, k),
            "sim_tokens_per_round": total / rounds if rounds else 0.0, "heldout_positions": total}


# ----------------------------------------------------------------------------- training


@dataclass
class TrainState:
    step: int = 0
    epoch: int = 0
    cursor: int = 0  # position in the epoch's permutation
    trained_s: float = 0.0  # training seconds over all invocations
    tokens_seen: int = 0
    history: list[dict] = field(default_factory=list)


def _lr(config: DistillConfig, step: int, progress: float) -> float:
    """Linear warmup, then cosine decay over `progress` (0..1) to MIN_LR_RATIO of the peak."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return config.lr * (MIN_LR_RATIO + (1 - MIN_LR_RATIO) * cosine)


def _optimizer(student, config: DistillConfig) -> torch.optim.Optimizer:
    import torch

    embedding = student.get_input_embeddings().weight if hasattr(student, "get_input_embeddings") else None
    decay = [p for p in student.parameters() if p.ndim == 2 and p is not embedding]
    rest = [p for p in student.parameters() if not (p.ndim == 2 and p is not embedding)]
    return torch.optim.AdamW([{"params": decay, "weight_decay": config.weight_decay},
                              {"params": rest, "weight_decay": 0.0}], lr=config.lr, betas=(0.9, 0.98))


def _permutation(n: int, seed: int, epoch: int) -> list[int]:
    import torch

    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 7919 + epoch)).tolist()


class _StopFlag:
    """SIGTERM/SIGINT end training at the next step boundary, then checkpoint and export."""

    def __init__(self):
        self.stopped = False
        self._previous = {}

    def __enter__(self):
        for signum in (signal.SIGTERM, signal.SIGINT):
            try:
                self._previous[signum] = signal.signal(signum, self._handle)
            except ValueError:  # not the main thread: no signal handling
                pass
        return self

    def _handle(self, signum, frame) -> None:
        log.warning("signal %d: stopping after this step (checkpoint and export follow)", signum)
        self.stopped = True

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


def _student_shape(student) -> dict:
    from specdec import eagle

    if isinstance(student, eagle.EagleHead):
        return {"kind": EAGLE, **asdict(student.config)}
    return {k: getattr(student.config, k) for k in ("num_hidden_layers", "hidden_size", "intermediate_size")}


def train(config: DistillConfig, student, train_set: list, heldout: list, pad_id: int,
          deadline: float, index_of=None) -> TrainState:
    """Trains from the checkpoint in the work dir if there is one; stops at --steps, at
    `deadline` (monotonic) or on a signal; returns the final state (checkpointed)."""
    import torch

    checkpoint_path = config.work / "checkpoint.pt"
    optimizer = _optimizer(student, config)
    state = TrainState()
    eagle_kind = config.kind == EAGLE
    if checkpoint_path.exists():
        saved = torch.load(checkpoint_path, weights_only=False)
        wanted = _student_shape(student)
        shape = {k: saved["student_config"].get(k, [] if k == "aux_layers" else None) for k in wanted}
        if shape != wanted:
            raise ValueError(f"--resume: the checkpoint's draft is {shape}, the flags ask for {wanted}")
        student.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        state = TrainState(**saved["state"])
        log.info("resumed at step %d (epoch %d, %.0f s trained)", state.step, state.epoch, state.trained_s)
    # The schedule follows whichever bound ends training first: the step count, or the
    # wall-clock budget (training seconds so far + what this invocation has left).
    budget_s = state.trained_s + max(0.0, deadline - time.monotonic()) if math.isfinite(deadline) else math.inf

    def save() -> None:
        _atomic_save({"model": student.state_dict(), "optimizer": optimizer.state_dict(),
                      "state": asdict(state), "student_config": _student_shape(student)}, checkpoint_path)

    def record(entry: dict) -> None:
        state.history.append(entry)
        with open(config.work / "metrics.jsonl", "a") as f:
            f.write(json.dumps(entry) + "\n")

    student.train()
    order = _permutation(len(train_set), config.seed, state.epoch)
    window: list[dict] = []
    bar = _progress(config.steps, config.progress, "training", unit="step", initial=state.step)
    with _StopFlag() as stop:
        while True:
            progress = max(state.step / config.steps if config.steps else 0.0,
                           state.trained_s / budget_s if math.isfinite(budget_s) else 0.0)
            if (config.steps and state.step >= config.steps) or time.monotonic() >= deadline or stop.stopped:
                break
            if state.cursor >= len(order):
                state.epoch, state.cursor = state.epoch + 1, 0
                order = _permutation(len(train_set), config.seed, state.epoch)
            picked = order[state.cursor:state.cursor + config.batch_size]
            lr = _lr(config, state.step, progress)
            for group in optimizer.param_groups:
                group["lr"] = lr
            began = time.monotonic()
            if eagle_kind:
                from specdec.train import distill_eagle

                batch = distill_eagle.collate([train_set[i] for i in picked], pad_id, index_of,
                                              student.config.hidden_size)
                noise = torch.Generator().manual_seed(config.seed * 1_000_003 + state.step)  # same on a resume
                unroll = config.unroll if progress >= config.single_step_fraction else 1
                loss, parts = distill_eagle.step_loss(student, batch, unroll, config.hard_weight,
                                                      config.feature_weight, config.bf16, config.bf16_logits,
                                                      config.feature_noise, noise)
            else:
                batch = collate([train_set[i] for i in picked], pad_id)
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=config.bf16):
                    hidden = student.model(input_ids=batch.input_ids).last_hidden_state  # [B, T, H]
                    hidden = hidden.reshape(-1, hidden.shape[-1])[batch.rows]  # [N, H]
                    logits = student.lm_head(hidden)  # [N, V]
                soft, hard = topk_distill_loss(logits.float(), batch.topk_ids, batch.topk_probs)  # [N], [N]
                loss = soft.mean() + config.hard_weight * hard.mean()
                parts = {"kl": (soft.detach() + batch.teacher_neg_entropy).mean().item(),
                         "ce_top1": hard.detach().mean().item()}
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
            optimizer.step()
            state.trained_s += time.monotonic() - began
            state.step += 1
            state.cursor += len(picked)
            state.tokens_seen += len(batch.rows)
            window.append({"loss": loss.item(), **parts, "tokens": len(batch.rows),
                           "seconds": time.monotonic() - began, **({"unroll": unroll} if eagle_kind else {})})
            bar.update(1)
            if state.step % config.log_every == 0:
                entry = _summarise(window, state, lr, len(train_set))
                record(entry)
                bar.set_postfix_str(f"loss {entry['loss']:.3f}")
                log.info("step %d epoch %.2f lr %.2e loss %.4f kl %.4f ce_top1 %.4f %.0f tok/s", state.step,
                         entry["epoch"], lr, entry["loss"], entry["kl"], entry["ce_top1"], entry["tokens_per_s"])
                window = []
            if state.step % config.eval_every == 0 and heldout:
                metrics = evaluate_kind(config, student, heldout, pad_id, index_of)
                record({"step": state.step, **metrics})
                log.info("step %d held-out: top-1 agreement %.3f, simulated k=%d acceptance %.3f (alpha %.3f), "
                         "%.2f tokens/round", state.step, metrics["heldout_top1_agreement"], EVAL_K,
                         metrics["sim_acceptance_rate"], metrics["sim_alpha"], metrics["sim_tokens_per_round"])
            if state.step % config.checkpoint_every == 0:
                save()
    bar.close()
    if window:
        record(_summarise(window, state, lr, len(train_set)))
    save()
    return state


def evaluate_kind(config: DistillConfig, student, heldout: list, pad_id: int, index_of=None) -> dict:
    if config.kind == EAGLE:
        from specdec.train import distill_eagle

        return distill_eagle.evaluate(student, heldout, pad_id, index_of, EVAL_K)
    return evaluate(student, heldout, pad_id)


def _summarise(window: list[dict], state: TrainState, lr: float, n_train: int) -> dict:
    tokens = sum(w["tokens"] for w in window)
    seconds = sum(w["seconds"] for w in window)
    return {"step": state.step, "epoch": state.epoch + state.cursor / max(1, n_train), "lr": lr,
            "loss": statistics.fmean(w["loss"] for w in window), "kl": statistics.fmean(w["kl"] for w in window),
            "ce_top1": statistics.fmean(w["ce_top1"] for w in window),
            **({"feature_l1": statistics.fmean(w["feature_l1"] for w in window)} if "feature_l1" in window[0] else {}),
            **({"unroll": window[-1]["unroll"]} if "unroll" in window[-1] else {}),
            "tokens_per_s": tokens / seconds if seconds else 0.0, "trained_s": state.trained_s}


# ----------------------------------------------------------------------------- export


def export(student, tokenizer, target, out_dir: Path) -> None:
    """Writes the draft as a plain HF directory (bfloat16 safetensors, the target's
    tokenizer files and generation config), replacing `out_dir` only once complete."""
    import torch

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".", dir=out_dir.parent))
    try:
        import copy

        exported = copy.deepcopy(student).to(torch.bfloat16).eval()
        exported.config.dtype = torch.bfloat16
        if getattr(target, "generation_config", None) is not None:
            exported.generation_config = copy.deepcopy(target.generation_config)
        exported.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private; the draft is meant to be shared
        for path in tmp.iterdir():
            path.chmod(0o644)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def measure_cost_ratio(target, draft, context: list[int]) -> dict:
    """c: one draft step over one target step, both on the serving path (specdec.runtime.cpu),
    1 new token on a cache holding `context`."""
    from specdec.runtime.costs import measure_draft_model, measure_target
    from specdec.runtime.load import serving_lm

    target_s = measure_target(serving_lm(target), context, 1).target_step_s
    draft_s = measure_draft_model(serving_lm(draft), context)
    return {"context_tokens": len(context), "target_step_s": target_s, "draft_step_s": draft_s,
            "c": draft_s / target_s}


def _dir_mb(path: Path) -> float:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 1e6


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


# ----------------------------------------------------------------------------- the command


def _prompts_digest(path: Path | None) -> str | None:
    """What a --prompts file contributes to the data's identity: its prompts, not its name."""
    if path is None:
        return None
    texts = distill_prompts.read_prompt_file(path)
    return hashlib.sha256("\n".join(texts).encode()).hexdigest()[:16]


def _prepare_work_dir(config: DistillConfig) -> None:
    work = config.work
    # What the teacher data depends on: a resume may change the student or the optimiser
    # settings until training has begun (a checkpoint of another shape is refused later).
    identity = {"target": config.target, "train_prompts": config.train_prompts, "heldout_prompts": config.heldout_prompts,
                "samples_per_prompt": config.samples_per_prompt, "temperature": config.temperature,
                "top_p": config.top_p, "max_new_tokens": config.max_new_tokens, "gen_batch": config.gen_batch,
                "top_k": config.top_k, "seed": config.seed, "features": config.kind == EAGLE,
                "prompts_file": _prompts_digest(config.prompts_file), "self_prompts": config.self_prompts,
                "teacher_dtype": config.teacher_dtype,
                "prompt_set": hashlib.sha256("\n".join(p.text for p in distill_prompts.build_prompts())
                                             .encode()).hexdigest()[:16]}
    meta_path = work / "meta.json"
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


def run(config: DistillConfig) -> dict:
    """The whole command; returns the training record (also written to out_dir)."""
    import torch

    from specdec.models import load_model

    if config.steps is None and config.max_minutes is None:
        raise ValueError("bound the training: give --steps, --max-minutes, or both")
    if config.self_prompts < 0:
        raise ValueError(f"--self-prompts {config.self_prompts}: expected 0 or more")
    if config.kind != EAGLE and (config.aux_layers or config.init_from is not None or config.feature_noise
                                 or config.single_step_fraction):
        raise ValueError("--aux-layers, --init-from, --feature-noise and --single-step-fraction apply to --kind eagle only")
    if not 0.0 <= config.single_step_fraction < 1.0:
        raise ValueError(f"--single-step-fraction {config.single_step_fraction}: expected 0 up to (not including) 1")
    if not 0.0 <= config.feature_noise < 10.0:
        raise ValueError(f"--feature-noise {config.feature_noise}: expected 0 (none) up to 10 (times each state's RMS)")
    torch.set_num_threads(config.threads)
    began = time.monotonic()
    end = began + config.max_minutes * 60 if config.max_minutes else math.inf
    data_minutes = config.data_minutes if config.data_minutes is not None else (
        config.max_minutes / 2 if config.max_minutes else math.inf)
    _prepare_work_dir(config)
    target, tokenizer = load_model(config.target)
    if config.kind == EAGLE and config.aux_layers:  # refuses layers the target lacks, before any data
        from specdec import eagle

        eagle.new_config(target, config.target, 1, aux_layers=tuple(config.aux_layers))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    checkpoint = config.work / "checkpoint.pt"
    if checkpoint.exists():  # training has begun: the data set is frozen
        data = json.loads((config.work / "data.json").read_text())
    else:
        data = generate_data(config, target, tokenizer, min(end, began + data_minutes * 60))
    if config.kind == EAGLE:
        return _run_eagle(config, target, tokenizer, data, began, end)
    train_set, heldout = load_examples(config.work, TRAIN), load_examples(config.work, HELDOUT)
    data["train_sequences"], data["train_positions"] = len(train_set), sum(len(e.topk_ids) for e in train_set)
    data["heldout_positions"] = sum(len(e.topk_ids) for e in heldout)
    if not train_set:
        raise ValueError("no training data: the data budget ended before the first training shard")
    log.info("data: %d training sequences (%d answer positions), %d held-out", len(train_set),
             data["train_positions"], len(heldout))
    student = build_student(target, tokenizer, config)
    state = train(config, student, train_set, heldout, pad_id, end - FINAL_RESERVE_S)

    export(student, tokenizer, target, config.out_dir)
    served, _ = load_model(str(config.out_dir))  # what `--draft DIR` loads: fp32 from the bf16 files
    final = evaluate(served, heldout, pad_id) if heldout else {}
    context = (heldout[0].tokens.tolist() if heldout else train_set[0].tokens.tolist())[:COST_CONTEXT_TOKENS]
    cost = measure_cost_ratio(target, served, context)
    losses = [h for h in state.history if "loss" in h]
    record = {
        "command": config.command, "target": config.target, "out_dir": str(config.out_dir),
        "work_dir": str(config.work),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(config).items()},
        "student": {"layers": config.layers, "hidden": config.hidden, "intermediate": config.intermediate,
                    "parameters": sum(p.numel() for p in served.parameters()), "dir_mb": _dir_mb(config.out_dir)},
        "data": data,
        "training": {"steps": state.step, "epochs": state.epoch + state.cursor / len(train_set),
                     "tokens_seen": state.tokens_seen, "trained_s": state.trained_s,
                     "first_loss": losses[0]["loss"] if losses else math.nan,
                     "final_loss": losses[-1]["loss"] if losses else math.nan},
        "final": final, "cost": cost, "history": state.history,
        "wall_s": time.monotonic() - began, "threads": config.threads,
        "torch": torch.__version__,
    }
    (config.out_dir / RECORD_NAME).write_text(json.dumps(record, indent=1))
    if final:
        _write_model_card(config.out_dir, record)
    log.info("wrote %s (%.1f MB): held-out agreement %.3f, simulated alpha %.3f, %.2f tokens/round, c %.3f",
             config.out_dir, record["student"]["dir_mb"], final.get("heldout_top1_agreement", math.nan),
             final.get("sim_alpha", math.nan), final.get("sim_tokens_per_round", math.nan), cost["c"])
    return record


def _run_eagle(config: DistillConfig, target, tokenizer, data: dict, began: float, end: float) -> dict:
    """The rest of `run` for a feature-level head (specdec.eagle)."""
    import torch

    from specdec import eagle
    from specdec.train import distill_eagle
    from specdec.models import eos_token_ids

    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    aux_layers = tuple(config.aux_layers)
    if aux_layers:  # teacher-forced, for shards generated before these layers were asked for
        data["aux_positions_computed"] = distill_eagle.extract_aux(config.work, target, aux_layers, end)
    train_set = distill_eagle.load_examples(config.work, TRAIN, aux_layers)
    heldout = distill_eagle.load_examples(config.work, HELDOUT, aux_layers)
    if not train_set:
        raise ValueError("no training data: the data budget ended before the first training shard")
    vocab_size = int(target.get_output_embeddings().weight.shape[0])
    vocab_path = config.work / "draft_vocab.pt"
    if vocab_path.exists():  # chosen when training began: a resume keeps it
        draft_vocab = torch.load(vocab_path, weights_only=True)
    else:
        draft_vocab = distill_eagle.choose_vocab(train_set, min(config.draft_vocab, vocab_size),
                                                 eos_token_ids(target, tokenizer), vocab_size)
        _atomic_save(draft_vocab, vocab_path)
    index_of = torch.full((vocab_size,), -1, dtype=torch.long)
    index_of[draft_vocab] = torch.arange(len(draft_vocab))
    data["train_sequences"], data["train_positions"] = len(train_set), sum(len(e.topk_ids) for e in train_set)
    data["heldout_positions"] = sum(len(e.topk_ids) for e in heldout)
    data["draft_vocab"] = len(draft_vocab)
    data["draft_vocab_coverage_train"] = distill_eagle.vocab_coverage(train_set, draft_vocab, vocab_size)
    data["draft_vocab_coverage_heldout"] = distill_eagle.vocab_coverage(heldout, draft_vocab, vocab_size)
    log.info("data: %d training sequences (%d answer positions), %d held-out; draft vocabulary %d tokens covers "
             "%.3f of the held-out greedy tokens", len(train_set), data["train_positions"], len(heldout),
             len(draft_vocab), data["draft_vocab_coverage_heldout"])
    head = eagle.build(eagle.new_config(target, config.target, len(draft_vocab), aux_layers=aux_layers), target,
                       draft_vocab)
    if config.init_from is not None and not (config.work / "checkpoint.pt").exists():
        eagle.warm_start(head, config.init_from)
        log.info("starting from the weights of %s", config.init_from)
    state = train(config, head, train_set, heldout, pad_id, end - FINAL_RESERVE_S, index_of=index_of)

    out_dir = config.out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".", dir=out_dir.parent))
    try:
        eagle.save(head, tmp)
        tmp.chmod(0o755)
        for path in tmp.iterdir():
            path.chmod(0o644)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    served = eagle.load(out_dir, target=target)  # what the draft worker loads: fp32 from the bf16 file
    final = distill_eagle.evaluate(served, heldout, pad_id, index_of, EVAL_K) if heldout else {}
    context = (heldout[0].tokens.tolist() if heldout else train_set[0].tokens.tolist())[:COST_CONTEXT_TOKENS]
    cost = distill_eagle.measure_cost_ratio(target, served, context)
    losses = [h for h in state.history if "loss" in h]
    trainable = sum(p.numel() for p in served.parameters())
    record = {
        "command": config.command, "kind": EAGLE, "target": config.target, "out_dir": str(out_dir),
        "work_dir": str(config.work),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(config).items()},
        "student": {"layers": 1, "hidden": served.config.hidden_size, "intermediate": served.config.intermediate_size,
                    "draft_vocab": len(draft_vocab), "parameters": trainable, "dir_mb": _dir_mb(out_dir),
                    "aux_layers": list(served.config.aux_layers),
                    "feature_bytes_per_token": served.config.hidden_size * eagle.FEATURE_BYTES},
        "data": data,
        "training": {"steps": state.step, "epochs": state.epoch + state.cursor / len(train_set),
                     "tokens_seen": state.tokens_seen, "trained_s": state.trained_s,
                     "first_loss": losses[0]["loss"] if losses else math.nan,
                     "final_loss": losses[-1]["loss"] if losses else math.nan},
        "final": final, "cost": cost, "history": state.history,
        "wall_s": time.monotonic() - began, "threads": config.threads, "torch": torch.__version__,
    }
    (out_dir / RECORD_NAME).write_text(json.dumps(record, indent=1))
    if final:
        _write_model_card(out_dir, record)
    log.info("wrote %s (%.1f MB): held-out agreement %.3f, simulated alpha %.3f, %.2f tokens/round, c %.3f",
             out_dir, record["student"]["dir_mb"], final.get("heldout_top1_agreement", math.nan),
             final.get("sim_alpha", math.nan), final.get("sim_tokens_per_round", math.nan), cost["c"])
    return record


class _NoBar:
    def update(self, n: int = 1) -> None: ...
    def set_postfix_str(self, text: str) -> None: ...
    def close(self) -> None: ...


def _progress(total: int | None, enabled: bool, description: str, unit: str, initial: int = 0):
    if not enabled:
        return _NoBar()
    from tqdm import tqdm

    # Logged to a file (nohup), a bar redrawn every 0.1 s would bury the log lines.
    interval = 0.1 if sys.stderr.isatty() else 30.0
    return tqdm(total=total, initial=initial, desc=description, unit=unit, dynamic_ncols=True, mininterval=interval)


# ----------------------------------------------------------------------------- flags


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = DistillConfig(target="", out_dir=Path("."))
    parser.add_argument("--target", required=True, help="target model spec (HF dir, .gguf, or built-in name)")
    parser.add_argument("--out", required=True, type=Path, help="output directory of the draft (a HF model dir)")
    parser.add_argument("--work", type=Path, default=None,
                        help="work directory: data shards, checkpoints, metrics (default OUT.work)")
    parser.add_argument("--resume", action="store_true", help="continue from the work directory")
    parser.add_argument("--layers", type=int, default=d.layers, help="draft decoder layers (default %(default)s)")
    parser.add_argument("--hidden", type=int, default=d.hidden, help="draft hidden width (default %(default)s)")
    parser.add_argument("--intermediate", type=int, default=d.intermediate,
                        help="draft MLP width (default %(default)s)")
    parser.add_argument("--heads", type=int, default=None, help="attention heads (default hidden/64)")
    parser.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default heads/2)")
    parser.add_argument("--train-prompts", type=int, default=None,
                        help="use only the first N built-in training prompts (default all)")
    parser.add_argument("--prompts", type=Path, default=None, metavar="FILE",
                        help="more training prompts, e.g. your own traffic: one per line, or .jsonl with a "
                             "\"prompt\" string per line; added after the built-in ones (held-out stays built-in)")
    parser.add_argument("--self-prompts", type=int, default=d.self_prompts, metavar="N",
                        help="more training prompts written by the target itself (Magpie-style: it continues its "
                             "chat template up to a user's message); kept ones are stored in the work dir "
                             "(default %(default)s)")
    parser.add_argument("--heldout-prompts", type=int, default=d.heldout_prompts,
                        help="held-out prompts for evaluation (default %(default)s)")
    parser.add_argument("--samples-per-prompt", type=int, default=d.samples_per_prompt,
                        help="answers per training prompt: greedy, then sampled (default %(default)s)")
    parser.add_argument("--temperature", type=float, default=d.temperature,
                        help="temperature of the sampled answers (default %(default)s)")
    parser.add_argument("--top-p", type=float, default=d.top_p,
                        help="top-p of the sampled answers (default %(default)s)")
    parser.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens,
                        help="longest teacher answer (default %(default)s)")
    parser.add_argument("--gen-batch", type=int, default=d.gen_batch,
                        help="prompts per teacher generation batch (default %(default)s)")
    parser.add_argument("--top-k", type=int, default=d.top_k,
                        help="teacher log-probs kept per position (default %(default)s)")
    parser.add_argument("--data-minutes", type=float, default=None,
                        help="time budget of the data phase (default half of --max-minutes)")
    parser.add_argument("--steps", type=int, default=None, help="training steps (default: until --max-minutes)")
    parser.add_argument("--batch-size", type=int, default=d.batch_size, help="sequences per step (default %(default)s)")
    parser.add_argument("--lr", type=float, default=d.lr, help="peak learning rate (default %(default)s)")
    parser.add_argument("--warmup-steps", type=int, default=d.warmup_steps, help="default %(default)s")
    parser.add_argument("--hard-weight", type=float, default=d.hard_weight,
                        help="weight of the cross-entropy on the target's greedy token (default %(default)s)")
    parser.add_argument("--no-bf16", action="store_true", help="train in fp32 (default: bf16 autocast)")
    parser.add_argument("--teacher-dtype", choices=("float32", "bfloat16"), default=d.teacher_dtype,
                        help="dtype the target answers the training prompts in (held-out: always as loaded; "
                             "default %(default)s)")
    parser.add_argument("--bf16-logits", action="store_true",
                        help="--kind eagle: the head's LM head in bf16 too (~1.2x faster steps; default: fp32)")
    parser.add_argument("--log-every", type=int, default=d.log_every, help="default %(default)s")
    parser.add_argument("--eval-every", type=int, default=d.eval_every, help="default %(default)s")
    parser.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every, help="default %(default)s")
    parser.add_argument("--max-minutes", type=float, default=None,
                        help="wall-clock bound of the whole run: data, training and export")
    parser.add_argument("--threads", type=int, default=d.threads, help="torch threads (default %(default)s)")
    parser.add_argument("--seed", type=int, default=d.seed, help="default %(default)s")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument("--kind", choices=(MODEL, EAGLE), default=d.kind,
                        help="model: a standalone small causal LM (default); eagle: a one-layer head over the "
                             "target's hidden states (--layers/--hidden/--intermediate do not apply)")
    parser.add_argument("--draft-vocab", type=int, default=d.draft_vocab,
                        help="eagle: tokens the head can propose (default %(default)s)")
    parser.add_argument("--unroll", type=int, default=d.unroll,
                        help="eagle: drafting steps unrolled in training (default %(default)s)")
    parser.add_argument("--single-step-fraction", type=float, default=d.single_step_fraction, metavar="F",
                        help="eagle: unroll one step only for the first F of training (steps or time), "
                             "then --unroll (default %(default)s)")
    parser.add_argument("--feature-weight", type=float, default=d.feature_weight,
                        help="eagle: weight of the feature regression loss (default %(default)s)")
    parser.add_argument("--feature-noise", type=float, default=d.feature_noise, metavar="A",
                        help="eagle: while training, add uniform noise U(-A, A) times each state's RMS to the target "
                             "features the head reads (EAGLE-1's regulariser; default %(default)s: none)")
    parser.add_argument("--aux-layers", type=_layer_list, default=(),
                        help="eagle: target decoder layers (0-based, comma-separated) whose outputs the head reads "
                             "beside the final hidden states, e.g. 1,14 (EAGLE-3's low/mid-level features; "
                             "the head then runs on the target worker only)")
    parser.add_argument("--init-from", type=Path, default=None,
                        help="eagle: start from this head directory's weights (a warm start; parameters it lacks, "
                             "such as new aux layers' projection, start as usual)")


def _layer_list(text: str) -> tuple[int, ...]:
    try:
        layers = tuple(sorted({int(part) for part in text.split(",") if part.strip()}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated layer indices, e.g. 1,14") from None
    if any(i < 0 for i in layers):
        raise argparse.ArgumentTypeError(f"{text!r}: layer indices count from 0")
    return layers


def config_from_args(args: argparse.Namespace, argv: list[str] | None = None) -> DistillConfig:
    # argv: the arguments after the program name, the subcommand included.
    command = "specdec " + shlex.join(argv if argv is not None else sys.argv[1:])
    return DistillConfig(
        target=args.target, out_dir=args.out, work_dir=args.work, resume=args.resume, layers=args.layers,
        hidden=args.hidden, intermediate=args.intermediate, heads=args.heads, kv_heads=args.kv_heads,
        train_prompts=args.train_prompts, prompts_file=args.prompts, self_prompts=args.self_prompts,
        heldout_prompts=args.heldout_prompts,
        samples_per_prompt=args.samples_per_prompt, temperature=args.temperature, top_p=args.top_p,
        max_new_tokens=args.max_new_tokens, gen_batch=args.gen_batch, top_k=args.top_k,
        data_minutes=args.data_minutes, steps=args.steps, batch_size=args.batch_size, lr=args.lr,
        warmup_steps=args.warmup_steps, hard_weight=args.hard_weight, bf16=not args.no_bf16, bf16_logits=args.bf16_logits,
        teacher_dtype=args.teacher_dtype,
        log_every=args.log_every, eval_every=args.eval_every, checkpoint_every=args.checkpoint_every,
        max_minutes=args.max_minutes, threads=args.threads, seed=args.seed, progress=not args.no_progress,
        command=command, kind=args.kind, draft_vocab=args.draft_vocab, unroll=args.unroll,
        single_step_fraction=args.single_step_fraction,
        feature_weight=args.feature_weight, feature_noise=args.feature_noise, aux_layers=args.aux_layers, init_from=args.init_from,
    )
