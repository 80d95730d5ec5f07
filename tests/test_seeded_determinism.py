"""DESIGN.md principle 2: a seeded row's tokens depend on (seed, position) only, not on the
batch it is verified in."""

from __future__ import annotations

import torch

from specdec.philox import round_uniforms
from target_worker.kernels import ops

VOCAB = 97
K = 4


def verify_batch(logits, drafts, seeds, first_positions):
    batch = logits.shape[0]
    probs = ops.warp_probs(logits, torch.full((batch,), 0.8), torch.full((batch,), 20), torch.full((batch,), 0.9))
    _, u_sample = round_uniforms(seeds, first_positions, K)
    return ops.sampled_match(probs, drafts, torch.full((batch,), K), u_sample)


def test_a_row_draws_the_same_tokens_alone_and_in_a_batch_of_seven():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(7, K + 1, VOCAB, generator=generator) * 3  # [7, k + 1, V]
    drafts = torch.randint(0, VOCAB, (7, K), generator=generator)  # [7, k]
    drafts[:, 0] = logits[:, 0].argmax(-1)  # some drafts get accepted
    seeds = torch.tensor([11, 12, 13, 14, 15, 16, 17])
    positions = torch.tensor([5, 50, 500, 7, 70, 700, 9])
    batched = verify_batch(logits, drafts, seeds, positions)
    for row in range(7):
        alone = verify_batch(logits[row:row + 1], drafts[row:row + 1], seeds[row:row + 1], positions[row:row + 1])
        assert (int(alone[0][0]), int(alone[1][0])) == (int(batched[0][row]), int(batched[1][row]))


def test_different_seeds_or_positions_draw_differently():
    logits = torch.zeros(1, K + 1, VOCAB)  # uniform: every draw is the uniform's doing
    drafts = torch.zeros(1, K, dtype=torch.long)
    draws = {int(verify_batch(logits, drafts, torch.tensor([seed]), torch.tensor([pos]))[1][0])
             for seed in range(4) for pos in (10, 20)}
    assert len(draws) > 4
