"""Paged attention: the torch reference against a dense computation built without the pool,
and the Triton kernel (under TRITON_INTERPRET=1, set by conftest), the SDPA backend and the
ops layer equal to the reference on irregular shapes."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from specdec.runtime.paged_attention import (
    REFERENCE,
    attention_backends,
    choose_attention_backend,
    paged_attention_reference,
    paged_attention_sdpa,
)
from target_worker.kernels import ops

REPO_ROOT = Path(__file__).resolve().parents[1]
# Contexts at and around block edges (block size 16), a long one, an empty one; new tokens
# 0 to 9 per session, with a session that has none.
CONTEXTS = (0, 1, 15, 16, 17, 255, 257)
NEW_TOKENS = (4, 1, 9, 0, 2, 5, 3)
# Block-table entries past a session's blocks: an index far outside any pool, so a read of one
# fails loudly.
DEAD_TABLE_ENTRY = 2**30


@dataclass
class PagedBatch:
    q: torch.Tensor  # [T, Hq, D]
    k_pool: torch.Tensor  # [num_blocks, block_size, Hkv, D], NaN in rows no session owns
    v_pool: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor  # [B, max_blocks] int32, DEAD_TABLE_ENTRY past live blocks
    context_lens: torch.Tensor  # [B] int32
    query_starts: torch.Tensor  # [B + 1] int32
    tree_mask: torch.Tensor | None  # [B, Qmax, Qmax] bool, True (garbage) past each n
    keys: list[torch.Tensor]  # per session [context + n, Hkv, D]: what the pool was filled from
    values: list[torch.Tensor]  # per session [context + n, Hkv, D]
    parents: list[list[int]] | None  # per session, the tree the mask was built from

    def args(self) -> tuple[torch.Tensor, ...]:
        return (self.q, self.k_pool, self.v_pool, self.block_tables, self.context_lens,
                self.query_starts, self.tree_mask)


def two_branch_parents(new: int) -> list[int]:
    """A tree of `new` tokens: a root (-1: it follows the cache), then two branches off it."""
    split = 1 + new // 2  # tokens 1 .. split - 1 on the first branch, the rest on the second
    parents = [-1] * min(new, 1)
    for token in range(1, new):
        parents.append(0 if token in (1, split) else token - 1)
    return parents


def make_paged_batch(
    contexts: tuple[int, ...] = CONTEXTS,
    new_tokens: tuple[int, ...] = NEW_TOKENS,
    *,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 16,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    tree: bool = False,
    seed: int = 0,
) -> PagedBatch:
    """Dense per-session K/V first, then scattered into a pool through shuffled block tables
    (a non-power-of-two number of blocks, spare ones included)."""
    generator = torch.Generator().manual_seed(seed)
    lengths = [c + n for c, n in zip(contexts, new_tokens)]
    keys = [torch.randn(n, kv_heads, head_dim, generator=generator).to(dtype) for n in lengths]
    values = [torch.randn(n, kv_heads, head_dim, generator=generator).to(dtype) for n in lengths]
    live_blocks = [-(-length // block_size) for length in lengths]
    num_blocks = sum(live_blocks) + 3
    num_blocks += num_blocks & (num_blocks - 1) == 0  # never a power of two
    physical = torch.randperm(num_blocks, generator=generator)  # shuffled: tables not contiguous
    block_tables = torch.full((len(lengths), max(live_blocks) + 2), DEAD_TABLE_ENTRY, dtype=torch.int32)
    k_pool = torch.full((num_blocks, block_size, kv_heads, head_dim), float("nan"), dtype=dtype)
    v_pool = torch.full_like(k_pool, float("nan"))
    used = 0
    for session, length in enumerate(lengths):
        blocks = physical[used : used + live_blocks[session]]
        used += live_blocks[session]
        block_tables[session, : len(blocks)] = blocks.to(torch.int32)
        positions = torch.arange(length)
        rows = blocks[positions // block_size] * block_size + positions % block_size  # [L]
        k_pool.view(-1, kv_heads, head_dim)[rows] = keys[session]
        v_pool.view(-1, kv_heads, head_dim)[rows] = values[session]
    query_starts = torch.tensor([0, *torch.tensor(new_tokens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(query_starts[-1]), heads, head_dim, generator=generator).to(dtype)
    parents = tree_mask = None
    if tree:
        parents = [two_branch_parents(n) for n in new_tokens]
        longest = max(new_tokens) + 1  # Qmax past every session's n: the padding is ignored
        tree_mask = torch.ones(len(lengths), longest, longest, dtype=torch.bool)
        for session, tokens in enumerate(parents):
            seen = torch.eye(len(tokens), dtype=torch.bool)
            for token, parent in enumerate(tokens):
                if parent >= 0:
                    seen[token] |= seen[parent]
            tree_mask[session, : len(tokens), : len(tokens)] = seen
    return PagedBatch(
        q, k_pool, v_pool, block_tables, torch.tensor(contexts, dtype=torch.int32), query_starts,
        tree_mask, keys, values, parents,
    )


def dense_attention(batch: PagedBatch, scale: float | None = None) -> torch.Tensor:
    """[T, Hq, D] float64: per new token, softmax attention over the positions it may see,
    listed from the parents (not the mask) and read from the dense K/V (not the pool)."""
    tokens, heads, head_dim = batch.q.shape
    kv_heads = batch.keys[0].shape[1]
    kv_head_of = torch.arange(heads) // (heads // kv_heads)  # [Hq]
    scale = 1 / math.sqrt(head_dim) if scale is None else scale
    out = torch.zeros(tokens, heads, head_dim, dtype=torch.float64)
    starts = batch.query_starts.tolist()
    for session, context in enumerate(batch.context_lens.tolist()):
        for row in range(starts[session + 1] - starts[session]):
            if batch.parents is None:
                ancestors = range(row + 1)
            else:
                ancestors, token = [], row
                while token >= 0:
                    ancestors.append(token)
                    token = batch.parents[session][token]
            visible = list(range(context)) + [context + a for a in sorted(ancestors)]
            k = batch.keys[session][visible].double()[:, kv_head_of]  # [L, Hq, D]
            v = batch.values[session][visible].double()[:, kv_head_of]  # [L, Hq, D]
            q = batch.q[starts[session] + row].double()  # [Hq, D]
            weights = torch.softmax(torch.einsum("lhd,hd->hl", k, q) * scale, dim=-1)  # [Hq, L]
            out[starts[session] + row] = torch.einsum("hl,lhd->hd", weights, v)
    return out


def implementation(name: str):
    """The reference, or the Triton kernel (skipping the test where triton is not installed)."""
    if name == "reference":
        return paged_attention_reference
    return pytest.importorskip("target_worker.kernels.paged_attention").paged_attention_triton


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 2), (8, 1)])
def test_reference_equals_dense_attention(tree: bool, heads: int, kv_heads: int) -> None:
    batch = make_paged_batch(heads=heads, kv_heads=kv_heads, tree=tree, seed=heads)
    got = paged_attention_reference(*batch.args())
    assert got.dtype == torch.float32 and got.shape == batch.q.shape
    torch.testing.assert_close(got.double(), dense_attention(batch), atol=1e-5, rtol=1e-5)


def test_reference_in_bf16_equals_dense_attention_to_bf16_rounding() -> None:
    batch = make_paged_batch(dtype=torch.bfloat16, tree=True, seed=11)
    got = paged_attention_reference(*batch.args())
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), dense_attention(batch), atol=1e-2, rtol=1e-2)


def test_reference_takes_a_scale() -> None:
    batch = make_paged_batch(seed=5)
    got = paged_attention_reference(*batch.args(), scale=0.3)
    torch.testing.assert_close(got.double(), dense_attention(batch, scale=0.3), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size", "dtype", "tree"),
    [
        (4, 2, 16, 16, torch.float32, False),
        (4, 2, 16, 16, torch.float32, True),
        (8, 1, 32, 16, torch.float32, False),
        (8, 1, 32, 16, torch.float32, True),
        (4, 2, 32, 16, torch.bfloat16, True),
        (8, 1, 16, 16, torch.bfloat16, False),
        (2, 2, 16, 8, torch.float16, False),  # no grouping; a tile spans 8 blocks
        (6, 2, 24, 32, torch.float32, True),  # a group of 3 and D = 24: both padded
    ],
)
def test_kernel_matches_reference(
    heads: int, kv_heads: int, head_dim: int, block_size: int,
    dtype: torch.dtype, tree: bool,
) -> None:
    batch = make_paged_batch(
        heads=heads, kv_heads=kv_heads, head_dim=head_dim, block_size=block_size, dtype=dtype,
        tree=tree, seed=heads * 10 + head_dim,
    )
    expected = paged_attention_reference(*batch.args())
    got = implementation("triton")(*batch.args())
    assert got.dtype == dtype and got.shape == batch.q.shape
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), expected.float(), atol=tolerance, rtol=tolerance)


def test_kernel_takes_a_scale() -> None:
    batch = make_paged_batch(seed=6)
    expected = paged_attention_reference(*batch.args(), scale=0.3)
    got = implementation("triton")(*batch.args(), scale=0.3)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_token_that_may_see_nothing_gets_zeros(impl: str) -> None:
    batch = make_paged_batch(contexts=(0, 3), new_tokens=(2, 2), tree=True, seed=7)
    batch.tree_mask[0, 1] = False  # session 0 has no context: its token 1 sees nothing
    got = implementation(impl)(*batch.args())
    assert torch.equal(got[1], torch.zeros_like(got[1]))
    assert got[[0, 2, 3]].abs().sum(dim=-1).min() > 0


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_no_new_tokens_at_all(impl: str) -> None:
    batch = make_paged_batch(contexts=(5, 0), new_tokens=(0, 0), seed=8)
    assert implementation(impl)(*batch.args()).shape == (0, 4, 16)


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_sdpa_backend_matches_reference(tree: bool) -> None:
    batch = make_paged_batch(heads=8, kv_heads=2, tree=tree, seed=9)
    if tree:
        batch.tree_mask[0, 1] = False  # session 0 has no context: its token 1 sees nothing
    expected = paged_attention_reference(*batch.args())
    got = paged_attention_sdpa(*batch.args())
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_cpu_serves_with_the_reference() -> None:
    assert attention_backends("cpu")[0] == REFERENCE
    assert choose_attention_backend(torch.device("cpu")) is paged_attention_reference


def test_ops_on_cpu_takes_the_reference(monkeypatch) -> None:
    batch = make_paged_batch(seed=10)
    calls = []

    def reference(*args, **kwargs):
        calls.append(args)
        return paged_attention_reference(*args, **kwargs)

    monkeypatch.setattr(ops, "paged_attention_reference", reference)
    ops.paged_attention(*batch.args())
    assert len(calls) == 1


def test_ops_accepts_int64_indices() -> None:
    batch = make_paged_batch(tree=True, seed=12)
    expected = paged_attention_reference(*batch.args())
    got = ops.paged_attention(
        batch.q, batch.k_pool, batch.v_pool, batch.block_tables.long(), batch.context_lens.long(),
        batch.query_starts.long(), batch.tree_mask,
    )
    assert torch.equal(got, expected)


def test_gpu_benchmark_dry_run_passes_on_cpu() -> None:
    """benchmarks/paged_attention_gpu.py --dry-run: its argument parsing, inputs, checks and
    report on tiny shapes, with the kernel under the interpreter."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO_ROOT)
    result = subprocess.run(
        [sys.executable, "benchmarks/paged_attention_gpu.py", "--dry-run"],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300, check=False,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout)
    assert report["all_match"] and len(report["results"]) == 5
