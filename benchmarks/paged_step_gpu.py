"""The paged serving step on one CUDA GPU: PagedCausalLM (one forward over one paged KV pool,
the Triton attention) against the old per-session path (CausalLM: a transformers DynamicCache
per session, one forward per session); print JSON.

    python benchmarks/paged_step_gpu.py [--quick] > paged_step_gpu.json
    python benchmarks/paged_step_gpu.py --dry-run   # CPU: tiny shapes, reference attention

1. Correctness, float32 and bfloat16, on a small random Llama: the paged LM with the Triton
   attention (target_worker.kernels.ops.paged_attention) and with the torch reference
   (specdec.runtime.paged_attention), each against the old path, over
   - chain: sessions with contexts 0 .. 300 and 1 .. 9 new tokens, all in ONE step;
   - tree: a tree of new tokens per session (`parents`) against a forward of each node's path;
   - rollback: a step, a crop back, another step: the blocks the crop freed are the ones the
     second step takes (the allocator's free list is a stack) and its logits equal a cold run;
   - prefix: a second session sharing 16 full blocks with a first one feeds only the rest,
     and its logits equal a cold run.
   float32 must agree in every argmax and within 1e-4 in every logit; bfloat16 reports its
   largest difference and its argmax agreement (two orders of bf16 arithmetic may swap a
   near-tie: docs/gpu.md, "Precision"). A third paged LM, "ops+graphs", replays its chain
   steps from CUDA graphs (specdec.runtime.graphs; on --dry-run the padded steps run
   eagerly) and must have replayed some.
2. Step time on a random-weight model of Llama-3.1-8B's shape in bf16, every session at a
   1,024-token context: a verification step of 5 tokens (feed 5, keep 5 logits, crop back to
   the context) at B = 1, 8, 32, 128, the paged path (one forward) against the old path
   (B forwards), and the same paged LM again with CUDA graphs ("graphs": each step padded to
   its bucket and replayed; the capture happens in the warm-up). The contexts are prefilled
   once, outside the timing; CUDA events around feed + crop after a warm-up, median. The weights are built on the meta device and
   initialised in place on the GPU: no download, seconds.
3. The HBM roofline: bandwidth of a device-to-device copy (bytes read + written over its
   time); a batch-1 step reads every weight once, so it takes at least weight bytes /
   bandwidth (weight bytes: the parameters'; the served step also reads the float32 copy of
   the LM head, specdec.runtime.precision).
4. Memory: the peak allocated in each of 100 paged steps at B = 8 stays flat (no leak), and
   so does the pool's count of blocks in use; the same with CUDA graphs.
5. Targets, each printed with pass / fail: identical argmax; step(B=32) <= 2 × step(B=1);
   >= 15 × the old path's throughput at B = 32; batch-1 step <= 2.5 × the roofline, and
   <= 1.3 × with CUDA graphs.

Exits 1 only when a correctness check fails (a float32 mismatch, a block not reused, a prefix
fed again, memory that grows) or the timed part raises; a missed speed target is reported, not
failed. On SIGTERM (a time cap: `timeout`) it stops, prints what it measured so far and exits 124. Where the GPU is too small for the model or a batch, the report says so and skips it.

--dry-run runs every part on CPU at tiny shapes (a 2-layer model for the 8B one, the reference
attention, B = 1, 2), so the script is tested without a GPU (tests/test_gpu_scripts.py).
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import os
import signal
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdec.runtime.graphs import GraphedForward
from specdec.runtime.lm import CausalLM
from specdec.runtime.paged import DEFAULT_BLOCK_SIZE, KVShape, block_bytes
from specdec.runtime.paged_attention import paged_attention_reference
from specdec.runtime.paged_lm import PagedCausalLM
from specdec.runtime.precision import with_fp32_logits
from specdec.sessions import Session, SessionStore
from target_worker.kernels import ops

SEED = 0
FP32_TOLERANCE = 1e-4  # largest |paged - old| of a float32 logit
# Correctness cases (block size 16): contexts at and around block edges, up to 300 tokens.
CHAIN_CONTEXTS = (0, 1, 15, 16, 17, 100, 255, 257, 300)  # session i feeds i + 1 new tokens
TREE_CONTEXTS = (1, 16, 150, 300)
TREE_NODES = 7
ROLLBACK_CONTEXT, ROLLBACK_NEW = 40, 9  # 40 + 9 crosses into a fourth block
PREFIX_SHARED_BLOCKS, PREFIX_OWN, PREFIX_NEW = 16, 44, 5
LOGIT_SHARPENING = 8.0  # scales the LM head so argmax ties are rare (tests.factories does so too)
INIT_STD = 0.02  # random weights of the large model: normal(0, INIT_STD), norms 1
NEW_TOKENS = 5  # a verification step: k = 4 drafts and the bonus position
PREFILL_SESSIONS = 8  # sessions per prefill step of the paged path
MEMORY_STEPS, MEMORY_WINDOW = 100, 10
MEMORY_TOLERANCE_BYTES = 4 << 20
ACTIVATION_MARGIN_BYTES = 4 << 30  # prefill activations, logits, the allocator's slack
VOCAB_TOKENS = (3, 1000)  # token ids are drawn from this range: the small model's vocabulary
# Targets.
MAX_B32_OVER_B1 = 2.0
MIN_THROUGHPUT_RATIO = 15.0
MAX_ROOFLINE_RATIO = 2.5
MAX_GRAPHS_ROOFLINE_RATIO = 1.3


@dataclass(frozen=True)
class Plan:
    """What one run measures, and where."""

    device: str
    attention: Callable[..., torch.Tensor]  # the paged LM's attention in the timed steps
    perf_shape: dict  # LlamaConfig arguments of the model the steps are timed on
    context: int  # tokens of each session's context in the timed steps
    batches: tuple[int, ...]
    target_batch: int  # the B of the step(B) / step(1) and throughput targets
    repeats: int
    old_repeats: int  # the old path's B forwards per step are slow: fewer repeats
    warmup: int
    copy_bytes: int  # the bandwidth copy

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"


# The correctness model: Hq / Hkv = 8 / 2 (grouped-query), head_dim 32.
SMALL = {"vocab_size": VOCAB_TOKENS[1], "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
         "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 512}
# Llama-3.1-8B's shape (its config.json), rope scaling included.
LLAMA_31_8B = {
    "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-5,
    "max_position_embeddings": 131072, "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
}
# --dry-run's stand-in for it.
TINY = {"vocab_size": 320, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 2048}


def make_plan(options) -> Plan:
    if options.dry_run:
        return Plan("cpu", paged_attention_reference, TINY, context=64, batches=(1, 2), target_batch=2,
                    repeats=2, old_repeats=2, warmup=1, copy_bytes=64 << 20)
    attention = ops.paged_attention
    if options.quick:
        return Plan("cuda", attention, LLAMA_31_8B, context=1024, batches=(1, 8, 32), target_batch=32,
                    repeats=10, old_repeats=2, warmup=2, copy_bytes=1 << 30)
    return Plan("cuda", attention, LLAMA_31_8B, context=1024, batches=(1, 8, 32, 128), target_batch=32,
                repeats=20, old_repeats=3, warmup=3, copy_bytes=2 << 30)


def say(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def token_ids(seed: int, n: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(*VOCAB_TOKENS, (n,), generator=generator).tolist()


def random_tree(seed: int, n: int) -> list[int]:
    """Parents of an n-node tree: each node's parent an earlier node or -1."""
    generator = torch.Generator().manual_seed(seed)
    return [int(torch.randint(-1, j, (1,), generator=generator)) for j in range(n)]


def path_to(parents: list[int], node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def fresh_rotary(model: torch.nn.Module, device: str) -> None:
    """Rebuilds the rotary embedding's float32 inverse frequencies (buffers that neither a
    dtype cast nor an empty allocation may keep)."""
    inner = model.model
    with torch.device(device):
        inner.rotary_emb = type(inner.rotary_emb)(config=model.config)


# ---------------------------------------------------------------------------------------------
# 1. Correctness


def small_model(plan: Plan, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    config = LlamaConfig(**SMALL, tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(LOGIT_SHARPENING)
    model = model.to(device=plan.device, dtype=dtype).eval()
    fresh_rotary(model, plan.device)
    return model


@dataclass
class Served:
    """An LM and the store its sessions live in."""

    lm: CausalLM
    store: SessionStore

    @classmethod
    def of(cls, lm: CausalLM) -> Served:
        store = SessionStore(1 << 16, 1 << 60, lm.bytes_per_token)
        lm.bind(store)
        return cls(lm, store)

    def open(self, session_id: str, ids: list[int]) -> tuple[Session, list[int]]:
        """A new session over `ids`, and the tokens of them still to feed."""
        synced = self.store.sync(session_id, 0, list(ids))
        return synced.session, self.lm.prepare(synced)


def old_run(old: Served, name: str, context: list[int], new: list[int], keep: int) -> torch.Tensor:
    """The old path, cold: context then new in a fresh session; [keep, V]."""
    session, feed = old.open(name, context or new)
    if context:
        old.lm.feed(session, feed, 1)
        feed = new
    logits = old.lm.feed(session, feed, keep)
    old.store.release(name)
    old.lm.forget(session)
    return logits


def compare(name: str, got: list[torch.Tensor], expected: list[torch.Tensor], dtype: torch.dtype,
            **checks: bool) -> dict:
    """Argmax agreement and largest difference of per-session logits [n, V]; `checks` are the
    case's structural conditions."""
    got_all, expected_all = torch.cat(got).float().cpu(), torch.cat(expected).float().cpu()
    assert got_all.shape == expected_all.shape, (got_all.shape, expected_all.shape)
    same = (got_all.argmax(-1) == expected_all.argmax(-1))
    diff = (got_all - expected_all).abs().max().item()
    row = {"case": name, "rows": int(same.numel()), "argmax_agreement": round(same.float().mean().item(), 4),
           "argmax_identical": bool(same.all()), "max_abs_diff": diff, **checks}
    exact = dtype != torch.float32 or (row["argmax_identical"] and diff <= FP32_TOLERANCE)
    row["pass"] = bool(exact and all(checks.values()))
    return row


def chain_case(paged: Served, old: Served) -> tuple[list, list, dict]:
    sessions, step_tokens, expected = [], [], []
    prefill: list[tuple[Session, list[int]]] = []
    for i, context_len in enumerate(CHAIN_CONTEXTS):
        context, new = token_ids(100 + i, context_len), token_ids(200 + i, i + 1)
        session, feed = paged.open(f"chain-{i}", context or new)
        if context:
            prefill.append((session, feed))
        sessions.append(session)
        step_tokens.append(new)
        expected.append(old_run(old, f"chain-{i}", context, new, len(new)))
    paged.lm.feed_batch([s for s, _ in prefill], [f for _, f in prefill], [1] * len(prefill))
    got = paged.lm.feed_batch(sessions, step_tokens, [len(t) for t in step_tokens])
    lengths = [s.cache.length for s in sessions]
    return got, expected, {"committed": lengths == [c + i + 1 for i, c in enumerate(CHAIN_CONTEXTS)]}


def tree_case(paged: Served, old: Served) -> tuple[list, list, dict]:
    sessions, contexts, trees, nodes = [], [], [], []
    for i, context_len in enumerate(TREE_CONTEXTS):
        context = token_ids(300 + i, context_len)
        session, feed = paged.open(f"tree-{i}", context)
        paged.lm.feed(session, feed, 1)
        sessions.append(session)
        contexts.append(context)
        trees.append(random_tree(400 + i, TREE_NODES))
        nodes.append(token_ids(500 + i, TREE_NODES))
    got = paged.lm.feed_batch(sessions, nodes, [TREE_NODES] * len(sessions), parents=trees)
    expected = []
    for i, (context, tokens, parents) in enumerate(zip(contexts, nodes, trees)):
        session, feed = old.open(f"tree-{i}", context)
        old.lm.feed(session, feed, 1)
        rows = []
        for node in range(len(tokens)):  # the node's path, on top of the context, then back
            rows.append(old.lm.feed(session, [tokens[j] for j in path_to(parents, node)], 1))
            old.lm.crop(session, len(context))
        expected.append(torch.cat(rows))
        old.store.release(f"tree-{i}")
        old.lm.forget(session)
    for session, context in zip(sessions, contexts):
        paged.lm.crop(session, len(context))  # the tree tail goes
    return got, expected, {"tail_dropped": all(s.cache.length == len(c) for s, c in zip(sessions, contexts))}


def rollback_case(paged: Served, old: Served) -> tuple[list, list, dict]:
    lm = paged.lm
    context = token_ids(600, ROLLBACK_CONTEXT)
    first, second = token_ids(601, ROLLBACK_NEW), token_ids(602, ROLLBACK_NEW)
    session, feed = paged.open("rollback", context)
    lm.feed(session, feed, 1)
    lm.feed(session, first, ROLLBACK_NEW)
    table, in_use = list(session.cache.block_table), lm.cache.blocks.in_use
    lm.crop(session, len(context))
    in_use_cropped = lm.cache.blocks.in_use
    got = lm.feed(session, second, ROLLBACK_NEW)
    checks = {"block_freed": in_use_cropped < in_use,
              "blocks_reused": list(session.cache.block_table) == table and lm.cache.blocks.in_use == in_use}
    return [got], [old_run(old, "rollback", context, second, ROLLBACK_NEW)], checks


def prefix_case(paged: Served, old: Served) -> tuple[list, list, dict]:
    lm = paged.lm
    shared = token_ids(700, PREFIX_SHARED_BLOCKS * lm.cache.block_size)
    first_context = shared + token_ids(701, PREFIX_OWN)
    context, new = shared + token_ids(702, PREFIX_OWN), token_ids(703, PREFIX_NEW)
    session, feed = paged.open("prefix-first", first_context)
    lm.feed(session, feed, 1)
    hits = lm.prefix_hit_tokens
    session, feed = paged.open("prefix-second", context)
    got = [lm.feed(session, feed, 1), lm.feed(session, new, PREFIX_NEW)]
    expected = [old_run(old, "prefix-cold", [], context, 1), old_run(old, "prefix-cold", context, new, PREFIX_NEW)]
    checks = {"fed_fewer": len(feed) == PREFIX_OWN < len(context),
              "hit_tokens": lm.prefix_hit_tokens - hits == len(shared)}
    return got, expected, checks


CASES = {"chain": chain_case, "tree": tree_case, "rollback": rollback_case, "prefix": prefix_case}


def with_graphs(plan: Plan, lm: PagedCausalLM) -> PagedCausalLM:
    """`lm` replaying its chain steps from CUDA graphs (on CPU, --dry-run: running them
    padded, eagerly)."""
    lm.graphs = GraphedForward(lm.runner, lm.pool, lm.buffers.limits, capture=plan.cuda)
    return lm


def correctness(plan: Plan) -> list[dict]:
    backends = {"ops": ops.paged_attention, "reference": paged_attention_reference, "ops+graphs": ops.paged_attention}
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        model = small_model(plan, dtype)
        served = with_fp32_logits(model)
        per_block = block_bytes(KVShape.of(model.config), DEFAULT_BLOCK_SIZE, dtype)
        for backend, attention in backends.items():
            lm = PagedCausalLM(served, max_cache_bytes=512 * per_block, attention=attention,
                               namespace=f"small-{dtype}-{backend}")
            paged = Served.of(with_graphs(plan, lm) if backend.endswith("graphs") else lm)
            old = Served.of(CausalLM(served))
            for name, case in CASES.items():
                replays = lm.graphs.replays if lm.graphs is not None else 0
                got, expected, checks = case(paged, old)
                if lm.graphs is not None and name != "tree":  # a tree step runs eagerly
                    checks["replayed"] = lm.graphs.replays > replays
                row = compare(name, got, expected, dtype, **checks)
                row.update(dtype=str(dtype).removeprefix("torch."), attention=backend)
                rows.append(row)
                say(f"correctness {row['dtype']:8s} {backend:9s} {name:8s}: pass={row['pass']} "
                    f"argmax {row['argmax_agreement']:.4f} max|diff| {row['max_abs_diff']:.2e}")
    return rows


# ---------------------------------------------------------------------------------------------
# 2–4. Speed, roofline, memory


def time_ms(fn: Callable[[], object], warmup: int, repeats: int, cuda: bool) -> float:
    """Median wall time of one call in milliseconds (CUDA events on a GPU: the host's work
    before the first kernel counts when the GPU waits for it)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            began = time.perf_counter()
            fn()
            times.append((time.perf_counter() - began) * 1e3)
    return statistics.median(times)


def bandwidth(plan: Plan) -> dict:
    """A device-to-device copy of copy_bytes: GB/s = (bytes read + bytes written) / time."""
    source = torch.empty(plan.copy_bytes, dtype=torch.uint8, device=plan.device)
    target = torch.empty_like(source)
    ms = time_ms(partial(target.copy_, source), 2, 10, plan.cuda)
    return {"bytes": plan.copy_bytes, "ms": round(ms, 4), "GBps": round(2 * plan.copy_bytes / ms / 1e6, 1)}


def meta_model(plan: Plan, dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    """The perf model on the meta device: shapes and dtypes, no memory."""
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**plan.perf_shape, tie_word_embeddings=False))
    return model.to(dtype)


def materialise(model: torch.nn.Module, device: str) -> torch.nn.Module:
    """Random weights allocated empty on `device` and initialised in place there (no host
    copy of 16 GB): normal(0, INIT_STD), RMSNorm weights 1."""
    model.to_empty(device=device)
    torch.manual_seed(SEED)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 1:
                parameter.fill_(1.0)
            else:
                parameter.normal_(0.0, INIT_STD)
    fresh_rotary(model, device)
    return model.eval()


def contexts_for(plan: Plan, sessions: int, vocab: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(SEED + 1)
    return torch.randint(3, vocab, (sessions, plan.context), generator=generator).tolist()


def step_tokens_for(sessions: int, vocab: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(SEED + 2)
    return torch.randint(3, vocab, (sessions, NEW_TOKENS), generator=generator).tolist()


def verification_step(lm: CausalLM, sessions: list[Session], tokens: list[list[int]], context: int) -> None:
    """Feed NEW_TOKENS per session, keep their logits, crop back: the context stays put."""
    lm.feed_batch(sessions, tokens, [NEW_TOKENS] * len(sessions))
    for session in sessions:
        lm.crop(session, context)


def free_bytes(plan: Plan) -> int | None:
    return torch.cuda.mem_get_info()[0] if plan.cuda else None


def release() -> None:
    """Frees what the caller let go of (the LMs' store callbacks form reference cycles)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def paged_path(plan: Plan, model: torch.nn.Module, batches: tuple[int, ...],
               notes: list[str]) -> tuple[list, dict, list, dict]:
    """Rows of {B, ms, tokens_per_s} of the paged path and its memory check, then the same
    with CUDA graphs."""
    config, vocab = model.config, model.config.vocab_size
    per_block = block_bytes(KVShape.of(config), DEFAULT_BLOCK_SIZE, next(model.parameters()).dtype)
    blocks_per_session = -(-(plan.context + NEW_TOKENS) // DEFAULT_BLOCK_SIZE)
    most = max(batches)
    lm = PagedCausalLM(with_fp32_logits(model), max_cache_bytes=(most * blocks_per_session + 2) * per_block,
                       attention=plan.attention, namespace="perf", max_batch=most)
    served = Served.of(lm)
    default_batch = inspect.signature(PagedCausalLM).parameters["max_batch"].default
    if most > default_batch:
        notes.append(f"paged path: step buffers sized for B={most}; a worker's PagedCausalLM takes at most "
                     f"{default_batch} sessions a step")
    contexts, tokens = contexts_for(plan, most, vocab), step_tokens_for(most, vocab)
    sessions = []
    began = time.perf_counter()
    for first in range(0, most, PREFILL_SESSIONS):
        opened = [served.open(f"perf-{i}", contexts[i]) for i in range(first, min(first + PREFILL_SESSIONS, most))]
        lm.feed_batch([s for s, _ in opened], [f for _, f in opened], [1] * len(opened))
        sessions += [s for s, _ in opened]
    if plan.cuda:
        torch.cuda.synchronize()
    notes.append(f"paged path: {most} contexts of {plan.context} tokens prefilled in "
                 f"{time.perf_counter() - began:.1f} s ({PREFILL_SESSIONS} sessions per step)")
    timed = {}
    for path in ("paged", "graphs"):
        if path == "graphs":
            with_graphs(plan, lm)
            began = time.perf_counter()
            sizes = lm.capture_graphs(most * NEW_TOKENS)  # as a target worker does at load
            notes.append(f"graphs: {len(sizes)} sizes up to {sizes[-1]} tokens captured at load in "
                         f"{time.perf_counter() - began:.1f} s (a worker's start-up cost)")
        rows = []
        for batch in batches:
            step = partial(verification_step, lm, sessions[:batch], tokens[:batch], plan.context)
            ms = time_ms(step, plan.warmup, plan.repeats, plan.cuda)
            rows.append({"B": batch, "ms": round(ms, 3), "tokens_per_s": round(batch * NEW_TOKENS / ms * 1e3, 1)})
            say(f"{path:6s} step B={batch:3d}: {ms:8.3f} ms, {rows[-1]['tokens_per_s']:10.1f} tokens/s")
        timed[path] = rows, memory_check(plan, lm, sessions[:min(8, most)], tokens)
    notes.append(f"graphs: captured at {lm.graphs.captured} tokens in {lm.graphs.capture_s:.1f} s, "
                 f"{lm.graphs.replays} steps replayed")
    return (*timed["paged"], *timed["graphs"])


def memory_check(plan: Plan, lm: PagedCausalLM, sessions: list[Session], tokens: list[list[int]]) -> dict:
    """The peak allocated in each of MEMORY_STEPS steps, and the blocks in use after each."""
    peaks, blocks = [], []
    for _ in range(MEMORY_STEPS):
        if plan.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        verification_step(lm, sessions, tokens[:len(sessions)], plan.context)
        if plan.cuda:
            torch.cuda.synchronize()
            peaks.append(torch.cuda.max_memory_allocated())
        blocks.append(lm.cache.blocks.in_use)
    row = {"B": len(sessions), "steps": MEMORY_STEPS, "tolerance_bytes": MEMORY_TOLERANCE_BYTES,
           "blocks_in_use_first": blocks[0], "blocks_in_use_last": blocks[-1],
           "peak_first10_bytes": max(peaks[:MEMORY_WINDOW]) if peaks else None,
           "peak_last10_bytes": max(peaks[-MEMORY_WINDOW:]) if peaks else None}
    grown = row["peak_last10_bytes"] - row["peak_first10_bytes"] if peaks else 0
    row["flat"] = bool(len(set(blocks)) == 1 and abs(grown) <= MEMORY_TOLERANCE_BYTES)
    say(f"memory over {MEMORY_STEPS} steps at B={len(sessions)}: first {row['peak_first10_bytes']} "
        f"last {row['peak_last10_bytes']} blocks {blocks[0]}..{blocks[-1]}: flat={row['flat']}")
    return row


def old_path(plan: Plan, model: torch.nn.Module, batches: tuple[int, ...], notes: list[str]) -> list:
    """Rows of {B, ms, tokens_per_s} of the old path (one forward per session)."""
    lm = CausalLM(with_fp32_logits(model))
    served = Served.of(lm)
    vocab = model.config.vocab_size
    per_session = (plan.context + NEW_TOKENS) * lm.bytes_per_token
    free = free_bytes(plan)
    if free is not None:
        fitting = tuple(b for b in batches if b * per_session + ACTIVATION_MARGIN_BYTES <= free)
        if fitting != batches:
            notes.append(f"old path: B={sorted(set(batches) - set(fitting))} skipped: their DynamicCaches need "
                         f"{per_session / 2**30:.2f} GiB a session, {free / 2**30:.1f} GiB free")
        batches = fitting
    if not batches:
        return []
    most = max(batches)
    contexts, tokens = contexts_for(plan, most, vocab), step_tokens_for(most, vocab)
    sessions = []
    began = time.perf_counter()
    for i in range(most):
        session, feed = served.open(f"old-{i}", contexts[i])
        lm.feed(session, feed, 1)
        sessions.append(session)
    if plan.cuda:
        torch.cuda.synchronize()
    notes.append(f"old path: {most} contexts prefilled in {time.perf_counter() - began:.1f} s (one forward each)")
    rows = []
    for batch in batches:
        repeats = plan.old_repeats if batch > 8 else plan.repeats
        step = partial(verification_step, lm, sessions[:batch], tokens[:batch], plan.context)
        ms = time_ms(step, 1, repeats, plan.cuda)
        rows.append({"B": batch, "ms": round(ms, 3), "tokens_per_s": round(batch * NEW_TOKENS / ms * 1e3, 1),
                     "repeats": repeats})
        say(f"old step   B={batch:3d}: {ms:8.3f} ms, {rows[-1]['tokens_per_s']:10.1f} tokens/s")
    return rows


def performance(plan: Plan, report: dict) -> None:
    """Parts 2–4 into `report`: bandwidth, model, steps, roofline, memory (and notes on what
    did not fit)."""
    notes = report["notes"]
    release()
    report["bandwidth"] = bandwidth(plan)
    release()  # its buffers would count as used in the free memory read next
    say(f"bandwidth {report['bandwidth']['GBps']} GB/s")
    model = meta_model(plan)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    head_fp32 = model.lm_head.weight.numel() * 4  # the served float32 copy of the LM head
    per_session = -(-(plan.context + NEW_TOKENS) // DEFAULT_BLOCK_SIZE) * \
        block_bytes(KVShape.of(model.config), DEFAULT_BLOCK_SIZE, model.dtype)
    batches = plan.batches
    free = free_bytes(plan)
    if free is not None:
        base = weight_bytes + head_fp32 + ACTIVATION_MARGIN_BYTES
        fitting = tuple(b for b in batches if base + b * per_session <= free)
        if fitting != batches:
            notes.append(f"memory short: {free / 2**30:.1f} GiB free, the model and its float32 LM head take "
                         f"{(weight_bytes + head_fp32) / 2**30:.1f} GiB and a session's blocks "
                         f"{per_session / 2**30:.3f} GiB; skipped B={sorted(set(batches) - set(fitting))}")
        batches = fitting
    if not batches:
        notes.append("memory short: the step timings, roofline and memory check were skipped")
        return
    began = time.perf_counter()
    model = materialise(model, plan.device)
    if plan.cuda:
        torch.cuda.synchronize()
    report["model"] = {"shape": dict(plan.perf_shape), "dtype": str(model.dtype).removeprefix("torch."),
                       "weight_bytes": weight_bytes, "lm_head_fp32_bytes": head_fp32,
                       "build_s": round(time.perf_counter() - began, 2)}
    say(f"model built: {weight_bytes / 1e9:.2f} GB of weights in {report['model']['build_s']} s")
    new_rows, report["memory"], graph_rows, report["memory_graphs"] = paged_path(plan, model, batches, notes)
    release()  # the pool goes before the old path's caches come
    old_rows = old_path(plan, model, batches, notes)
    release()
    old_ms = {r["B"]: r["ms"] for r in old_rows}
    report["steps"] = {
        "context": plan.context, "new_tokens": NEW_TOKENS, "paged": new_rows, "graphs": graph_rows,
        "old": old_rows,
        "throughput_ratio": [{"B": r["B"], "paged_over_old": round(old_ms[r["B"]] / r["ms"], 2)}
                             for r in new_rows if r["B"] in old_ms],
    }
    step_one = next((r["ms"] for r in new_rows if r["B"] == 1), None)
    graphs_one = next((r["ms"] for r in graph_rows if r["B"] == 1), None)
    roofline_ms = weight_bytes / (report["bandwidth"]["GBps"] * 1e6)
    report["roofline"] = {"weight_bytes": weight_bytes, "GBps": report["bandwidth"]["GBps"],
                          "roofline_ms": round(roofline_ms, 3), "step_B1_ms": step_one,
                          "step_over_roofline": round(step_one / roofline_ms, 2) if step_one else None,
                          "graphs_step_B1_ms": graphs_one,
                          "graphs_step_over_roofline": round(graphs_one / roofline_ms, 2) if graphs_one else None}


# ---------------------------------------------------------------------------------------------
# 5. Targets


def targets(plan: Plan, report: dict) -> dict:
    fp32 = [r for r in report["correctness"] if r["dtype"] == "float32"]
    bf16 = [r for r in report["correctness"] if r["dtype"] == "bfloat16"]
    steps = report.get("steps", {})
    paged = {r["B"]: r for r in steps.get("paged", [])}
    old = {r["B"]: r for r in steps.get("old", [])}
    top = plan.target_batch

    def target(value, limit, passed) -> dict:
        return {"value": value, "limit": limit, "pass": passed}

    b_ratio = paged[top]["ms"] / paged[1]["ms"] if top in paged and 1 in paged else None
    t_ratio = old[top]["ms"] / paged[top]["ms"] if top in paged and top in old else None
    roof = report.get("roofline", {}).get("step_over_roofline")
    graphs_roof = report.get("roofline", {}).get("graphs_step_over_roofline")
    flat = [report[m].get("flat") for m in ("memory", "memory_graphs") if m in report]
    memory_flat = all(flat) if flat else None
    return {
        "argmax_identical_fp32": target(all(r["argmax_identical"] for r in fp32), True,
                                        all(r["argmax_identical"] for r in fp32)),
        "argmax_agreement_bf16": target(min((r["argmax_agreement"] for r in bf16), default=None), None, None),
        f"step_B{top}_over_B1": target(_round(b_ratio), f"<= {MAX_B32_OVER_B1}",
                                       None if b_ratio is None else b_ratio <= MAX_B32_OVER_B1),
        f"throughput_over_old_B{top}": target(_round(t_ratio), f">= {MIN_THROUGHPUT_RATIO}",
                                              None if t_ratio is None else t_ratio >= MIN_THROUGHPUT_RATIO),
        "step_B1_over_roofline": target(roof, f"<= {MAX_ROOFLINE_RATIO}",
                                        None if roof is None else roof <= MAX_ROOFLINE_RATIO),
        "step_B1_graphs_over_roofline": target(graphs_roof, f"<= {MAX_GRAPHS_ROOFLINE_RATIO}",
                                               None if graphs_roof is None else graphs_roof <= MAX_GRAPHS_ROOFLINE_RATIO),
        "memory_flat": target(memory_flat, True, memory_flat),
    }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="B = 1, 8, 32 and fewer repeats")
    mode.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, reference attention (no GPU)")
    options = parser.parse_args()
    if not options.dry_run:
        if os.environ.get("TRITON_INTERPRET") == "1":
            sys.exit("paged_step_gpu.py: unset TRITON_INTERPRET (or pass --dry-run)")
        if not torch.cuda.is_available():
            sys.exit("paged_step_gpu.py needs a CUDA GPU; --dry-run checks the script on CPU")
        if not ops.TRITON_AVAILABLE:
            sys.exit("paged_step_gpu.py needs triton (pip install 'specdec[triton]')")
        # IEEE float32 products, as the worker runs them (torch's default; the 1e-4 check is not TF32's).
        torch.backends.cuda.matmul.allow_tf32 = False
    plan = make_plan(options)
    import transformers

    report: dict = {
        "device": torch.cuda.get_device_name() if plan.cuda else "cpu (dry run)",
        "torch": torch.__version__, "transformers": transformers.__version__,
        "mode": "dry-run" if options.dry_run else "quick" if options.quick else "full",
        "ops_attention": "triton" if plan.cuda else "reference (ops on CPU)",
        "tolerance_fp32": FP32_TOLERANCE, "notes": [],
    }
    began = time.perf_counter()
    signal.signal(signal.SIGTERM, _time_cap)  # `timeout` in gpu_check.sh: report what was measured
    cut = False
    try:
        report["correctness"] = correctness(plan)
    except TimeCap:
        report["correctness"], cut = [], True
        report["notes"].append("cut short by the time cap during the correctness checks")
    failed = None
    try:
        if not cut:
            performance(plan, report)
    except TimeCap:
        cut = True
        report["notes"].append("cut short by the time cap in the timed part: the steps timed before it are in its log")
        say(report["notes"][-1])
    except torch.cuda.OutOfMemoryError as error:  # a smaller GPU: say so, keep what was measured
        report["notes"].append(f"out of GPU memory in the timed part: {str(error)[:300]}")
        say(report["notes"][-1])
    except Exception:  # noqa: BLE001  (the report still comes out, and the run fails)
        failed = traceback.format_exc()[-3000:]
        report["error"] = failed
        say(failed)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # measuring is over: the report always comes out
    report["targets"] = targets(plan, report)
    memory_flat = all(report[m]["flat"] for m in ("memory", "memory_graphs") if m in report)
    report["all_correct"] = (all(r["pass"] for r in report["correctness"]) and memory_flat and failed is None
                             and bool(report["correctness"]))
    report["seconds"] = round(time.perf_counter() - began, 1)
    for name, t in report["targets"].items():
        verdict = "not measured" if t["pass"] is None and t["limit"] is not None else \
            "report" if t["limit"] is None else "PASS" if t["pass"] else "FAIL"
        say(f"target {name:28s} {t['value']!s:>10} (limit {t['limit']}): {verdict}")
    for note in report["notes"]:
        say(f"note: {note}")
    print(json.dumps(report, indent=1))
    return 124 if cut else 0 if report["all_correct"] else 1


class TimeCap(Exception):
    """SIGTERM arrived: the caller's time cap (`timeout`) is reached."""


def _time_cap(signum, frame) -> None:
    raise TimeCap()


if __name__ == "__main__":
    sys.exit(main())
