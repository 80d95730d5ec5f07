"""Paged attention: the Triton kernel against its torch reference on one CUDA GPU; print JSON.

    python benchmarks/paged_attention_gpu.py [--quick] > paged_attention_gpu.json
    python benchmarks/paged_attention_gpu.py --dry-run   # CPU: tiny shapes, Triton interpreter

Shapes (a Llama-3-8B layer): Hq / Hkv = 32 / 8, D = 128, bf16, block size 16. 256 sessions
with contexts spread over 0 .. 8192 (a few at block edges, one at the top), each with 1 or 5
new tokens, the 5-token sessions as a chain or as a two-branch tree; the blocks of all sessions
are shuffled through one pool. Per case: the kernel's maximum absolute difference from the
reference, whether they agree (within bf16 rounding: the kernel rounds probabilities to bf16
before the second product), and the median time per call with CUDA events of the kernel, the
reference and the runtime's SDPA backend. Bandwidth is the bytes of K and V the sessions own,
read once, divided by the kernel's time (a session's new tokens re-read its blocks, mostly
from L2).

--dry-run runs the same code on CPU with the kernel under TRITON_INTERPRET=1 on shapes the
interpreter finishes in seconds, so the script's parsing, inputs, checks and report are tested
without a GPU (tests/test_kernels_paged.py). Needs no network.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

WARMUP = 3
REPEATS = 20
REFERENCE_REPEATS = 3  # the reference loops over sessions in Python: a few calls suffice
SEED = 0
# Agreement with the float32 reference: bf16 output rounding plus bf16 probabilities.
ATOL = RTOL = 2e-2


@dataclass(frozen=True)
class Shapes:
    sessions: int
    max_context: int
    heads: int
    kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype


GPU_SHAPES = Shapes(256, 8192, 32, 8, 128, 16, torch.bfloat16)
QUICK_SHAPES = Shapes(64, 2048, 32, 8, 128, 16, torch.bfloat16)
DRY_RUN_SHAPES = Shapes(6, 40, 8, 2, 32, 16, torch.bfloat16)
# (new tokens per session, tree): the chain is what decoding and chain verification send.
CASES = ((1, False), (5, False), (5, True), ("mixed", False), ("mixed", True))


def two_branch_tree(new: int) -> torch.Tensor:
    """[new, new] bool: a root, then two branches off it; each token sees its ancestors."""
    split = 1 + new // 2
    seen = torch.eye(new, dtype=torch.bool)
    for token in range(1, new):
        seen[token] |= seen[0 if token in (1, split) else token - 1]
    return seen


def make_inputs(shapes: Shapes, new_tokens: list[int], tree: bool, device: str) -> tuple:
    """(q, k_pool, v_pool, block_tables, context_lens, query_starts, tree_mask) on `device`."""
    generator = torch.Generator().manual_seed(SEED)
    contexts = torch.randint(0, shapes.max_context + 1, (shapes.sessions,), generator=generator)
    edges = [0, 1, shapes.block_size - 1, shapes.block_size, shapes.block_size + 1, shapes.max_context]
    contexts[: len(edges)] = torch.tensor(edges)
    new = torch.tensor(new_tokens)
    blocks_needed = (contexts + new + shapes.block_size - 1) // shapes.block_size  # [B]
    num_blocks = int(blocks_needed.sum()) + 7
    physical = torch.randperm(num_blocks, generator=generator).to(torch.int32)
    # Entries past a session's blocks hold -1: the kernel must never read them.
    block_tables = torch.full((shapes.sessions, int(blocks_needed.max()) + 1), -1, dtype=torch.int32)
    first = torch.cat([torch.zeros(1, dtype=torch.long), blocks_needed.cumsum(0)])
    for session in range(shapes.sessions):
        block_tables[session, : blocks_needed[session]] = physical[first[session] : first[session + 1]]
    pool_shape = (num_blocks, shapes.block_size, shapes.kv_heads, shapes.head_dim)
    k_pool = torch.randn(pool_shape, device=device, dtype=shapes.dtype)
    v_pool = torch.randn(pool_shape, device=device, dtype=shapes.dtype)
    query_starts = torch.cat([torch.zeros(1, dtype=torch.long), new.cumsum(0)]).to(torch.int32)
    q = torch.randn(int(query_starts[-1]), shapes.heads, shapes.head_dim, device=device, dtype=shapes.dtype)
    tree_mask = None
    if tree:
        longest = int(new.max())
        tree_mask = torch.zeros(shapes.sessions, longest, longest, dtype=torch.bool)
        for session, count in enumerate(new.tolist()):
            tree_mask[session, :count, :count] = two_branch_tree(count)
        tree_mask = tree_mask.to(device)
    indices = (block_tables, contexts.to(torch.int32), query_starts)
    return (q, k_pool, v_pool, *(index.to(device) for index in indices), tree_mask)


def time_ms(fn: Callable[[], object], repeats: int, cuda: bool) -> float:
    """Median wall time of one call, in milliseconds (CUDA events on a GPU)."""
    for _ in range(min(WARMUP, repeats)):
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


def bench_case(shapes: Shapes, new_tokens: int | str, tree: bool, device: str, repeats: int) -> dict:
    from specdec.runtime.paged_attention import (
        paged_attention_reference,
        paged_attention_sdpa,
    )
    from target_worker.kernels.paged_attention import paged_attention_triton

    generator = torch.Generator().manual_seed(SEED + 1)
    if new_tokens == "mixed":  # decoding sessions beside verifying ones
        counts = (1 + 4 * torch.randint(0, 2, (shapes.sessions,), generator=generator)).tolist()
    else:
        counts = [new_tokens] * shapes.sessions
    args = make_inputs(shapes, counts, tree, device)
    got = paged_attention_triton(*args)
    expected = paged_attention_reference(*args)
    match = bool(torch.isfinite(got).all()) and torch.allclose(
        got.float(), expected.float(), atol=ATOL, rtol=RTOL
    )
    cuda = device == "cuda"
    few = min(repeats, REFERENCE_REPEATS)
    triton_ms = time_ms(lambda: paged_attention_triton(*args), repeats, cuda)
    reference_ms = time_ms(lambda: paged_attention_reference(*args), few, cuda)
    context_lens, query_starts = args[4], args[5]
    positions = int(context_lens.sum()) + int(query_starts[-1])
    kv_bytes = positions * shapes.kv_heads * shapes.head_dim * args[1].element_size() * 2
    row = {
        "new_tokens": new_tokens, "tree": tree, "sessions": shapes.sessions,
        "tokens": int(query_starts[-1]), "max_context": int(context_lens.max()),
        "mean_context": round(float(context_lens.float().mean()), 1),
        "match": match, "max_abs_err": max_abs_diff(got, expected),
        "triton_ms": round(triton_ms, 4), "reference_ms": round(reference_ms, 3),
        "speedup_vs_reference": round(reference_ms / triton_ms, 1),
        "kv_bytes": kv_bytes, "triton_GBps": round(kv_bytes / triton_ms / 1e6, 1),
    }
    # The runtime's SDPA backend, for its place in attention_backends; not part of "match".
    try:
        row["sdpa_max_abs_err"] = max_abs_diff(paged_attention_sdpa(*args), expected)
        row["sdpa_ms"] = round(time_ms(lambda: paged_attention_sdpa(*args), few, cuda), 3)
    except Exception as error:  # noqa: BLE001  (report it; the kernel's result stands)
        row["sdpa_error"] = repr(error)[:300]
    return row


def max_abs_diff(got: torch.Tensor, expected: torch.Tensor) -> float:
    return (got.float() - expected.float()).abs().max().item() if got.numel() else 0.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="64 sessions, contexts up to 2048")
    mode.add_argument("--dry-run", action="store_true",
                      help="CPU, tiny shapes, the kernel under TRITON_INTERPRET=1 (no GPU)")
    options = parser.parse_args()
    if options.dry_run:
        # Read when a kernel is defined: set before the kernel module is first imported.
        os.environ["TRITON_INTERPRET"] = "1"
        device, shapes, repeats = "cpu", DRY_RUN_SHAPES, 1
    else:
        if os.environ.get("TRITON_INTERPRET") == "1":
            sys.exit("paged_attention_gpu.py: unset TRITON_INTERPRET (or pass --dry-run)")
        if not torch.cuda.is_available():
            sys.exit("paged_attention_gpu.py needs a CUDA GPU; --dry-run checks the script on CPU")
        device, shapes, repeats = "cuda", QUICK_SHAPES if options.quick else GPU_SHAPES, REPEATS
    try:
        import triton
    except ImportError:
        sys.exit("paged_attention_gpu.py needs triton (pip install 'specdec[triton]')")

    results = []
    for new_tokens, tree in CASES:
        results.append(bench_case(shapes, new_tokens, tree, device, repeats))
        print(json.dumps(results[-1]), file=sys.stderr, flush=True)
    report = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter)",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "shapes": {key: str(value) for key, value in vars(shapes).items()},
        "tolerance": {"atol": ATOL, "rtol": RTOL},
        "results": results,
        "all_match": all(r["match"] for r in results),
    }
    print(json.dumps(report, indent=1))
    return 0 if report["all_match"] else 1


if __name__ == "__main__":
    sys.exit(main())
