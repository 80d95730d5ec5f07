"""Greedy verification: hand-built cases as exact tensors, and the Triton kernel (under
TRITON_INTERPRET=1, set by conftest) equal to its torch reference on irregular shapes."""

from __future__ import annotations

import pytest
import torch

from target_worker.kernels import ops
from target_worker.kernels.greedy_verify_ref import greedy_verify_ref

triton_kernels = pytest.importorskip("target_worker.kernels.greedy_verify")
greedy_verify_triton = triton_kernels.greedy_verify_triton

IMPLEMENTATIONS = {"reference": greedy_verify_ref, "triton": greedy_verify_triton}


def logits_with_argmax(argmax: list[list[int]], vocab: int) -> torch.Tensor:
    """[B, k + 1, V] logits whose argmax at [b, j] is argmax[b][j] (one clear winner)."""
    logits = torch.zeros(len(argmax), len(argmax[0]), vocab)
    for b, row in enumerate(argmax):
        for j, token in enumerate(row):
            logits[b, j, token] = 5.0
    return logits


def make_dummy(
    batch: int, k: int, vocab: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random logits, drafts that follow the argmax with ~20% mistakes, ragged num_draft
    covering 0 and k, and garbage padding past num_draft."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, k + 1, vocab, generator=generator).to(dtype)
    draft_tokens = logits.argmax(dim=-1)[:, :k].clone()  # [B, k]
    wrong = torch.rand(batch, k, generator=generator) < 0.2
    draft_tokens[wrong] = torch.randint(0, vocab, (int(wrong.sum()),), generator=generator)
    num_draft = torch.randint(0, k + 1, (batch,), generator=generator)
    num_draft[0] = k
    if batch > 1:
        num_draft[1] = 0
    padding = torch.arange(k)[None, :] >= num_draft[:, None]
    draft_tokens[padding] = -7
    return logits, draft_tokens, num_draft


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_hand_built_rows(impl: str) -> None:
    # target argmax per position (k = 3, so positions 0..3)
    argmax = [
        [4, 2, 7, 1],  # drafts all match: 3 accepted, bonus 1
        [4, 2, 7, 1],  # mismatch at position 1: 1 accepted, correction 2
        [4, 2, 7, 1],  # num_draft = 0: correction 4
        [4, 2, 7, 1],  # num_draft = 2, both match: bonus from position 2 (7); padding ignored
        [4, 2, 7, 1],  # mismatch at position 0: correction 4
    ]
    logits = logits_with_argmax(argmax, vocab=9)
    draft_tokens = torch.tensor([[4, 2, 7], [4, 3, 7], [0, 0, 0], [4, 2, 5], [8, 2, 7]])
    num_draft = torch.tensor([3, 3, 0, 2, 3])
    accepted, next_token = IMPLEMENTATIONS[impl](logits, draft_tokens, num_draft)
    assert accepted.tolist() == [3, 1, 0, 2, 0]
    assert next_token.tolist() == [1, 2, 4, 7, 4]
    assert accepted.dtype == next_token.dtype == torch.int64


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_ties_break_to_lowest_id_across_tiles(impl: str) -> None:
    vocab = 1031
    logits = torch.zeros(3, 2, vocab)
    logits[0, 0, [900, 300, 600]] = 2.0  # three tied maxima in different 128-wide tiles
    logits[1, 0] = float("-inf")  # all -inf: id 0, as torch.argmax
    logits[2, 0, [5, 700]] = float("nan")  # a NaN wins, the first one
    logits[2, 0, 3] = float("inf")
    logits[:, 1, 1030] = 1.0  # the last id of an odd vocabulary
    draft_tokens = torch.tensor([[300], [0], [5]])
    num_draft = torch.tensor([1, 1, 1])
    kwargs = {"block_v": 128} if impl == "triton" else {}
    accepted, next_token = IMPLEMENTATIONS[impl](logits, draft_tokens, num_draft, **kwargs)
    assert accepted.tolist() == [1, 1, 1]
    assert next_token.tolist() == [1030, 1030, 1030]
    no_drafts = torch.zeros(3, dtype=torch.int64)
    accepted, next_token = IMPLEMENTATIONS[impl](logits, draft_tokens, no_drafts, **kwargs)
    assert next_token.tolist() == [300, 0, 5]


@pytest.mark.parametrize(
    ("batch", "k", "vocab", "dtype", "block_v"),
    [
        (1, 1, 1031, torch.float32, None),  # one tile
        (7, 8, 1031, torch.bfloat16, 256),  # multi-tile, partial last tile
        (7, 1, 1031, torch.float16, 128),
        (7, 8, 49152, torch.bfloat16, None),  # 12 tiles of 4096
        (1, 8, 49152, torch.float32, None),
    ],
)
def test_kernel_matches_reference(
    batch: int, k: int, vocab: int, dtype: torch.dtype, block_v: int | None
) -> None:
    logits, draft_tokens, num_draft = make_dummy(batch, k, vocab, dtype, seed=batch * 100 + k)
    expected = greedy_verify_ref(logits, draft_tokens, num_draft)
    got = greedy_verify_triton(logits, draft_tokens, num_draft, block_v=block_v)
    assert torch.equal(got[0], expected[0])
    assert torch.equal(got[1], expected[1])


def test_kernel_with_no_draft_positions() -> None:
    logits, _, _ = make_dummy(7, 0, 1031, torch.float32, seed=3)
    draft_tokens = torch.empty(7, 0, dtype=torch.int64)
    num_draft = torch.zeros(7, dtype=torch.int64)
    accepted, next_token = greedy_verify_triton(logits, draft_tokens, num_draft)
    assert accepted.tolist() == [0] * 7
    assert torch.equal(next_token, logits[:, 0].argmax(dim=-1))


def test_ops_on_cpu_takes_the_reference(monkeypatch) -> None:
    logits, draft_tokens, num_draft = make_dummy(7, 4, 1031, torch.float32, seed=5)
    calls = []

    def reference(*args):
        calls.append(args)
        return greedy_verify_ref(*args)

    monkeypatch.setattr(ops, "greedy_verify_ref", reference)
    ops.greedy_verify(logits, draft_tokens, num_draft)
    assert len(calls) == 1


def test_ops_accepts_int32_indices() -> None:
    logits, draft_tokens, num_draft = make_dummy(7, 4, 1031, torch.float32, seed=5)
    expected = greedy_verify_ref(logits, draft_tokens, num_draft)
    got = ops.greedy_verify(logits, draft_tokens.int(), num_draft.int())
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


def ragged(batch: int, k: int, vocab: int, dtype: torch.dtype, seed: int):
    """Ragged chains packed as a step writes them ([R, V], each chain's num_draft + 1 rows
    in turn, in a shuffled order of chains), their row table padded past num_draft with rows
    of other chains, and the same chains as a padded [B, k + 1, V] batch."""
    padded, draft_tokens, num_draft = make_dummy(batch, k, vocab, dtype, seed)
    generator = torch.Generator().manual_seed(seed + 1)
    order = torch.randperm(batch, generator=generator).tolist()
    starts, at = [0] * batch, 0
    for b in order:
        starts[b], at = at, at + int(num_draft[b]) + 1
    packed = torch.empty(at, vocab, dtype=dtype)
    rows = torch.randint(0, at, (batch, k + 1), generator=generator)  # garbage past num_draft
    for b in range(batch):
        n = int(num_draft[b]) + 1
        packed[starts[b]:starts[b] + n] = padded[b, :n]
        rows[b, :n] = torch.arange(starts[b], starts[b] + n)
    return packed, rows, padded, draft_tokens, num_draft


@pytest.mark.parametrize(
    ("batch", "k", "vocab", "dtype", "block_v"),
    [
        (1, 0, 1031, torch.float32, None),
        (9, 5, 1031, torch.float32, 256),  # one long chain among short ones, multi-tile
        (7, 8, 49152, torch.bfloat16, None),
        (33, 1, 1031, torch.float16, 128),
    ],
)
def test_ragged_rows_equal_the_padded_batch(batch: int, k: int, vocab: int, dtype: torch.dtype,
                                            block_v: int | None) -> None:
    from target_worker.kernels.greedy_verify_ref import greedy_verify_rows_ref

    packed, rows, padded, draft_tokens, num_draft = ragged(batch, k, vocab, dtype, seed=batch + k)
    expected = greedy_verify_ref(padded, draft_tokens, num_draft)
    for got in (greedy_verify_rows_ref(packed, rows, draft_tokens, num_draft),
                triton_kernels.greedy_verify_rows_triton(packed, rows, draft_tokens, num_draft, block_v=block_v),
                ops.greedy_verify_rows(packed, rows.int(), draft_tokens.int(), num_draft.int())):
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
