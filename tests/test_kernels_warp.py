"""Temperature / top-k / top-p: hand-built cases of the ties rule as exact kept sets, and the
Triton kernel (under TRITON_INTERPRET=1, set by conftest) against its torch reference.

Tolerances: the kept set (which tokens get probability > 0) must be identical; probabilities
within rtol 1e-5, atol 1e-7 (exp and the normalising sum are float32 on both sides, summed in
different orders; the observed worst is ~4e-7 relative).
"""

from __future__ import annotations

import math

import pytest
import torch

from target_worker.kernels import ops
from target_worker.kernels.warp_ref import warp_probs_ref

triton_kernels = pytest.importorskip("target_worker.kernels.warp")
warp_probs_triton = triton_kernels.warp_probs_triton

IMPLEMENTATIONS = {"reference": warp_probs_ref, "triton": warp_probs_triton}
RTOL = 1e-5
ATOL = 1e-7


def params(
    temperature: list[float], top_k: list[int], top_p: list[float]
) -> dict[str, torch.Tensor]:
    return {
        "temperature": torch.tensor(temperature, dtype=torch.float32),
        "top_k": torch.tensor(top_k, dtype=torch.int64),
        "top_p": torch.tensor(top_p, dtype=torch.float32),
    }


def kept(probs: torch.Tensor) -> list[list[int]]:
    return [torch.nonzero(row > 0).flatten().tolist() for row in probs]


# --- the ties rule, by hand ----------------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_top_k_keeps_every_token_tied_at_the_kth_logit(impl: str) -> None:
    logits = torch.tensor([[3.0, 1.0, 3.0, 2.0, 1.0]] * 4)
    probs = IMPLEMENTATIONS[impl](logits, **params([1.0] * 4, [1, 2, 3, 4], [1.0] * 4))
    # k = 1 and 2 keep both 3s; k = 3 adds the 2; the 4th largest is a 1, so k = 4 keeps all.
    assert kept(probs) == [[0, 2], [0, 2], [0, 2, 3], [0, 1, 2, 3, 4]]
    assert torch.allclose(probs[0], torch.tensor([0.5, 0.0, 0.5, 0.0, 0.0]))


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_top_p_keeps_the_smallest_head_reaching_p_with_its_ties(impl: str) -> None:
    distributions = [[0.4, 0.3, 0.2, 0.1], [0.3, 0.1, 0.3, 0.3], [0.4, 0.3, 0.2, 0.1]]
    logits = torch.tensor(distributions).log()
    probs = IMPLEMENTATIONS[impl](logits, **params([1.0] * 3, [0, 0, 0], [0.65, 0.5, 0.0]))
    # 0.4 + 0.3 >= 0.65; the three tied 0.3s go together (0.9); top_p = 0 keeps the maximum.
    assert kept(probs) == [[0, 1], [0, 2, 3], [0]]
    torch.testing.assert_close(probs[0], torch.tensor([4 / 7, 3 / 7, 0.0, 0.0]))


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_top_p_applies_to_the_top_k_survivors(impl: str) -> None:
    logits = torch.tensor([[0.4, 0.3, 0.2, 0.1]]).log()
    probs = IMPLEMENTATIONS[impl](logits, **params([1.0], [3], [0.8]))
    # top-k leaves 0.4, 0.3, 0.2 (mass 0.9); 0.8 of that is 0.72 > 0.7, so all three stay.
    assert kept(probs) == [[0, 1, 2]]


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_temperature_alone_is_a_softmax(impl: str) -> None:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 101, generator=generator) * 4
    probs = IMPLEMENTATIONS[impl](logits, **params([0.5, 1.0, 2.5], [0, 0, 0], [1.0, 1.0, 1.0]))
    expected = torch.softmax(logits / torch.tensor([[0.5], [1.0], [2.5]]), dim=-1)
    torch.testing.assert_close(probs, expected, rtol=RTOL, atol=ATOL)


# --- kernel == reference ------------------------------------------------------------------

# Per-row settings cycled over the batch: off, top-k only, top-p only, both, extremes.
ROW_SETTINGS = [
    (1.0, 0, 1.0),
    (0.7, 1, 1.0),
    (1.3, 0, 0.9),
    (0.9, 50, 0.8),
    (1.0, 10**6, 0.0),  # top_k beyond V is off; top_p = 0 keeps the maximum
    (2.0, 7, 0.95),
    (0.5, 2000, 0.5),
]


def make_dummy(rows: int, vocab: int, dtype: torch.dtype, seed: int, ties: bool = False):
    generator = torch.Generator().manual_seed(seed)
    if ties:  # few distinct values: every threshold lands on a run of ties
        logits = torch.randint(-6, 6, (rows, vocab), generator=generator).float() / 2
    else:
        logits = torch.randn(rows, vocab, generator=generator) * 3
    settings = [ROW_SETTINGS[i % len(ROW_SETTINGS)] for i in range(rows)]
    temperature, top_k, top_p = (list(column) for column in zip(*settings))
    return logits.to(dtype), params(temperature, top_k, top_p)


@pytest.mark.parametrize(
    ("rows", "vocab", "dtype", "block_v", "ties"),
    [
        (7, 1031, torch.float32, None, False),  # one tile
        (7, 1031, torch.bfloat16, 256, False),  # multi-tile, partial last tile
        (1, 1031, torch.float16, 128, True),
        (7, 1031, torch.float32, 512, True),
        (3, 49152, torch.bfloat16, None, False),  # 12 tiles of 4096
    ],
)
def test_kernel_matches_reference(
    rows: int, vocab: int, dtype: torch.dtype, block_v: int | None, ties: bool
) -> None:
    logits, row_params = make_dummy(rows, vocab, dtype, seed=rows * 31 + vocab, ties=ties)
    expected = warp_probs_ref(logits, **row_params)
    got = warp_probs_triton(logits, **row_params, block_v=block_v)
    assert kept(got) == kept(expected)
    torch.testing.assert_close(got, expected, rtol=RTOL, atol=ATOL)
    assert torch.allclose(got.sum(dim=-1), torch.ones(rows), atol=1e-5)


def test_ops_broadcasts_per_request_parameters_over_positions() -> None:
    logits, row_params = make_dummy(3, 1031, torch.float32, seed=1)
    batched = logits.view(3, 1, 1031).expand(3, 4, 1031)  # [B, k + 1, V]
    probs = ops.warp_probs(batched, **row_params)
    assert probs.shape == (3, 4, 1031)
    expected = warp_probs_ref(logits, **row_params)
    assert torch.equal(probs, expected[:, None, :].expand(3, 4, 1031))


def test_ops_refuses_temperature_zero() -> None:
    logits, row_params = make_dummy(1, 11, torch.float32, seed=2)
    row_params["temperature"] = torch.zeros(1)
    with pytest.raises(AssertionError, match="greedy"):
        ops.warp_probs(logits, **row_params)
    assert math.isfinite(float(ops.warp_probs(logits, **params([1.0], [0], [1.0])).sum()))
