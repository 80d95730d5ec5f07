"""The target as teacher: it answers prompts (batched, left-padded, KV-cached, on the CPU fast
path where that agrees with the plain model), recording for every generated position its
top-K next-token log-probabilities and, for a feature-level head, its hidden states; and,
teacher-forced over stored sequences, the states of chosen decoder layers.
"""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import DynamicCache

from specdec import eagle
from specdec.runtime.compat import cache_kwarg
from specdec.runtime import cpu as runtime_cpu
from specdec.train.workdir import DATA_DIR, atomic_save, aux_path

log = logging.getLogger(__name__)

SAMPLING_POOL = 256  # sampling draws from the teacher's top tokens only (top-p applies within)
COMPACT_FRACTION = 0.25  # drop finished rows from a generation batch once this share is done
AUX_BATCH = 8  # sequences per teacher-forced pass


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
    # positions, [prompt + answer - 1, H·len(aux_layers)] float16 (what extract_aux
    # computes teacher-forced; stored beside the shard, not in it).
    aux: list[torch.Tensor] | None = None


def _sample(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator) -> torch.Tensor:
    """Temperature + nucleus sampling among the SAMPLING_POOL most likely tokens.
    logits: [b, V] -> [b] token ids."""
    pool, pool_ids = torch.topk(logits, min(SAMPLING_POOL, logits.shape[-1]), dim=-1)  # [b, P] (sorted)
    probs = torch.softmax(pool / temperature, dim=-1)  # [b, P]
    outside = probs.cumsum(-1) - probs > top_p  # the mass before a token already covers top_p
    probs = probs.masked_fill(outside, 0.0)
    choice = torch.multinomial(probs, 1, generator=generator)  # [b, 1]
    return pool_ids.gather(1, choice)[:, 0]


@torch.inference_mode()
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


def teacher_for_generation(target, dtype: str = "float32"):
    """(model, cache factory) for generation: the CPU fast path (packed linears, buffered KV
    caches) when it applies and agrees with the plain model, else the model as it is; with
    dtype "bfloat16", a bfloat16 copy of the target (stock modules: the packing is fp32's)."""
    if dtype == "bfloat16":
        return copy.deepcopy(target).to(torch.bfloat16).eval(), None
    fast = runtime_cpu.fast_cpu_model(target)
    if fast is not target and runtime_cpu.agrees(target, fast):
        return fast, runtime_cpu.new_cache
    return target, None


class _Enough(Exception):
    """Stops a forward pass once the deepest wanted layer has run."""


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
    features agree with a teacher-forced pass up to float rounding."""
    fast = runtime_cpu.fast_cpu_model(target)
    model = fast if fast is not target and runtime_cpu.agrees(target, fast) else target
    shards = sorted((work / DATA_DIR).glob("*-s*.pt"))
    todo = [p for p in shards if not aux_path(work, p, aux_layers).exists()]
    aux_path(work, shards[0], aux_layers).parent.mkdir(parents=True, exist_ok=True) if shards else None
    done = 0
    for path in todo:
        if time.monotonic() > deadline:
            raise TimeoutError(f"aux features: {len(todo)} shards left when the time budget ended "
                               "(rerun with --resume)")
        began = time.monotonic()
        shard = torch.load(path, weights_only=True)
        sequences = [(p + a)[:-1] for p, a in zip(shard["prompts"], shard["answers"])]
        states = aux_states(model, sequences, aux_layers)
        atomic_save(states, aux_path(work, path, aux_layers))
        n = sum(len(s) for s in sequences)
        done += n
        log.info("aux features of %s: %d positions in %.1f s", path.name, n, time.monotonic() - began)
    return done


