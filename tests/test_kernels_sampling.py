"""Rejection sampling and its randomness: hand-built cases as exact tensors, the Triton kernels
(under TRITON_INTERPRET=1, set by conftest) choosing exactly the reference's tokens for the
same uniforms on irregular shapes, both with draft probabilities and for one-hot drafts (the
coupled rule: the target's own draw at every position), and Philox4x32-10 against the
Random123 known answers. (Distributional correctness is tests/test_rejection_stats.py.)"""

from __future__ import annotations

import math

import pytest
import torch

from specdec.philox import (
    STREAM_ACCEPT,
    STREAM_SAMPLE,
    philox4x32_10,
    philox_uniforms,
    round_uniforms,
)
from target_worker.kernels import ops
from target_worker.kernels.rejection_sample_ref import (
    probability_weights,
    rejection_sample_ref,
    sample_weights,
)
from target_worker.kernels.sampled_match_ref import sampled_match_ref

triton_kernels = pytest.importorskip("target_worker.kernels.rejection_sample")
rejection_sample_triton = triton_kernels.rejection_sample_triton

IMPLEMENTATIONS = {"reference": rejection_sample_ref, "triton": rejection_sample_triton}


def make_dummy(
    batch: int, k: int, vocab: int, with_q: bool, seed: int
) -> dict[str, torch.Tensor | None]:
    """A valid batch: q close enough to p that acceptance lengths vary, tokens with
    p = 0 < q and q = 0 < p, drafts drawn from q (uniform ids when one-hot), ragged num_draft
    covering 0 and k, and uniforms from Philox at made-up positions."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, k + 1, vocab, generator=generator) * 2
    # A favourite token per position, as language models have: p(favourite) ~ 0.5 - 0.9.
    favourite = torch.randint(0, vocab, (batch, k + 1, 1), generator=generator)
    boost = math.log(vocab) + 3.0
    logits.scatter_add_(2, favourite, torch.full((batch, k + 1, 1), boost))
    p = torch.softmax(logits, dim=-1)  # [B, k + 1, V]
    p[..., 1::7] = 0.0  # p = 0 (q > 0 there, unless a favourite lands on it)
    p = p / p.sum(dim=-1, keepdim=True)
    q = None
    if with_q:
        noise = torch.randn(batch, k, vocab, generator=generator) * 0.7
        q = torch.softmax(logits[:, :k] + noise, dim=-1)  # [B, k, V]
        q[..., 2::5] = 0.0  # q = 0 (p > 0 at most of these)
        q = q / q.sum(dim=-1, keepdim=True)
        draft_tokens = torch.multinomial(q.reshape(-1, vocab), 1, generator=generator)
        draft_tokens = draft_tokens.view(batch, k)
    else:
        # One-hot drafts are usually the target's favourite, sometimes anything (even p = 0).
        draft_tokens = p[:, :k].argmax(dim=-1)
        other = torch.rand(batch, k, generator=generator) < 0.3
        draft_tokens[other] = torch.randint(0, vocab, (int(other.sum()),), generator=generator)
    num_draft = torch.randint(0, k + 1, (batch,), generator=generator)
    num_draft[0] = k
    if batch > 1:
        num_draft[1] = 0
    seeds = torch.randint(-(2**62), 2**62, (batch,), generator=generator)
    first_positions = torch.randint(0, 4000, (batch,), generator=generator)
    u_accept, u_sample = round_uniforms(seeds, first_positions, k)
    return {
        "target_probs": p,
        "draft_probs": q,
        "draft_tokens": draft_tokens,
        "num_draft": num_draft,
        "u_accept": u_accept,
        "u_sample": u_sample,
    }


# --- hand-built cases: k = 2, V = 4 ------------------------------------------------------


def hand_built(p_rows: list[list[float]], q_rows: list[list[float]] | None, drafts: list[int],
               num_draft: int, u_accept: list[float], u_sample: list[float]) -> dict:
    return {
        "target_probs": torch.tensor([p_rows]),
        "draft_probs": None if q_rows is None else torch.tensor([q_rows]),
        "draft_tokens": torch.tensor([drafts]),
        "num_draft": torch.tensor([num_draft]),
        "u_accept": torch.tensor([u_accept], dtype=torch.float64),
        "u_sample": torch.tensor([u_sample], dtype=torch.float64),
    }


P = [[0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25], [0.0, 0.0, 1.0, 0.0]]
HAND_BUILT = {
    # p == q: every draft accepted (u < 1); bonus from p_2 = one-hot on token 2.
    "all_accepted_bonus": (hand_built(P, P[:2], [3, 0], 2, [0.99, 0.99], [0.5, 0.5, 0.3]), 2, 2),
    # p_0(3)/q_0(3) = 0.4/0.8 = 0.5 < u: rejected; residual max(0, p - q) = [0, 0.1, 0.3, 0]
    # normalised [0, 0.25, 0.75, 0]; u = 0.4 lands in token 2.
    "rejected_residual": (
        hand_built(P, [[0.1, 0.1, 0.0, 0.8], P[1]], [3, 0], 2, [0.6, 0.0], [0.4, 0.0, 0.0]), 0, 2),
    # Same, u = 0.2 < 0.25: token 1.
    "rejected_residual_low": (
        hand_built(P, [[0.1, 0.1, 0.0, 0.8], P[1]], [3, 0], 2, [0.6, 0.0], [0.2, 0.0, 0.0]), 0, 1),
    # q = 0 < p at the drafted token: always accepted, even with u close to 1.
    "q_zero_accepts": (
        hand_built(P, [[0.5, 0.5, 0.0, 0.0], P[1]], [2, 1], 1, [0.999, 0.0], [0.0, 0.95, 0.0]),
        1, 3),
    # p = 0 < q: always rejected, even with u = 0; residual is p minus q, clipped.
    "p_zero_rejects": (
        hand_built([[0.0, 0.5, 0.5, 0.0], P[1], P[2]], [[0.5, 0.0, 0.0, 0.5], P[1]], [0, 1], 2,
                   [0.0, 0.0], [0.6, 0.0, 0.0]), 0, 2),
    # q a hair above p everywhere it matters: rejected, the integer residual is all zero,
    # so the token comes from p (u = 0.35 -> cumulative 0.1, 0.3, 0.6: token 2).
    "zero_residual_samples_p": (
        hand_built(P, [[0.1, 0.2, 0.3, 0.4000001], P[1]], [3, 0], 2, [1 - 2**-40, 0.0],
                   [0.35, 0.0, 0.0]), 0, 2),
    # Ragged: num_draft = 1 and its draft accepted: bonus from p_1 (not p_2), u = 0.6 -> token 2.
    "ragged_bonus": (hand_built(P, P[:2], [1, 3], 1, [0.5, 0.0], [0.0, 0.6, 0.0]), 1, 2),
    # num_draft = 0: bonus from p_0, u = 0.05 -> token 0.
    "no_drafts": (hand_built(P, P[:2], [1, 3], 0, [0.0, 0.0], [0.05, 0.6, 0.0]), 0, 0),
    # One-hot drafter, the coupled rule: the target draws y_i from p_i with u_sample[i] and a
    # draft is kept while it equals y_i. p_0 cumulative 0.1, 0.3, 0.6, 1.0: u = 0.65 draws 3,
    # the draft: accepted; then the bonus from p_1 (uniform), u = 0.1 -> token 0. u_accept
    # (0.99, which would reject under u < p_0(3) = 0.4) is not read.
    "one_hot_accepts": (hand_built(P, None, [3, 2], 1, [0.99, 0.99], [0.65, 0.1, 0.0]), 1, 0),
    # u = 0.2 draws 1, not the draft 3: rejected and the draw itself is emitted (u_accept = 0,
    # which would accept under u < p_0(3), is not read).
    "one_hot_rejects": (hand_built(P, None, [3, 2], 1, [0.0, 0.0], [0.2, 0.0, 0.0]), 0, 1),
    # Both drafts equal the draws (u = 0.9 -> 3, u = 0.3 -> 1); the bonus from p_2 is token 2.
    "one_hot_all_accepted_bonus": (
        hand_built(P, None, [3, 1], 2, [0.0, 0.0], [0.9, 0.3, 0.5]), 2, 2),
    # A draft with p = 0 never equals a draw: p_0 = one-hot on 2, draft 0 rejected, emits 2.
    "one_hot_p_zero_rejects": (
        hand_built([P[2], P[1], P[0]], None, [0, 1], 2, [0.0, 0.0], [0.0, 0.3, 0.0]), 0, 2),
    # num_draft = 0: the draft equals the draw at position 0 (u = 0.05 -> 0) but is padding,
    # so nothing is accepted and the draw is the bonus.
    "one_hot_no_drafts": (hand_built(P, None, [0, 1], 0, [0.0, 0.0], [0.05, 0.3, 0.0]), 0, 0),
    # An out-of-vocabulary draft (padding -1 inside num_draft) is simply rejected.
    "one_hot_out_of_vocab": (hand_built(P, None, [-1, 1], 2, [0.0, 0.0], [0.9, 0.3, 0.0]), 0, 3),
}


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("case", HAND_BUILT)
def test_hand_built(impl: str, case: str) -> None:
    inputs, accepted, next_token = HAND_BUILT[case]
    got = IMPLEMENTATIONS[impl](**inputs)
    assert got[0].tolist() == [accepted]
    assert got[1].tolist() == [next_token]


# --- kernel == reference ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("batch", "k", "vocab", "with_q", "block_v"),
    [
        (1, 1, 1031, True, None),  # one tile
        (7, 8, 1031, True, 256),  # multi-tile, partial last tile
        (7, 4, 49152, True, None),  # 12 tiles of 4096
        # One-hot drafts (a draw per position, then the accept step):
        (1, 1, 1031, False, None),  # one tile
        (7, 8, 1031, False, 128),  # multi-tile, partial last tile
        (7, 1, 1031, False, None),
        (1, 8, 49152, False, None),  # 12 tiles of 4096
        (7, 8, 49152, False, 16384),
        (9, 0, 1031, False, None),  # a draw per row alone (a step's sampled rows, in place)
    ],
)
def test_kernel_matches_reference(
    batch: int, k: int, vocab: int, with_q: bool, block_v: int | None
) -> None:
    inputs = make_dummy(batch, k, vocab, with_q, seed=batch * 10 + k)
    expected = rejection_sample_ref(**inputs)
    got = rejection_sample_triton(**inputs, block_v=block_v)
    assert torch.equal(got[0], expected[0]), (got[0], expected[0])
    assert torch.equal(got[1], expected[1]), (got[1], expected[1])


@pytest.mark.parametrize("with_q", [True, False])
def test_kernel_matches_reference_on_many_uniforms(with_q: bool) -> None:
    """Same p, q and drafts under 64 different uniform draws: acceptance lengths and residual
    draws all over the range, token for token."""
    inputs = make_dummy(1, 3, 97, with_q, seed=11)
    if not with_q:
        inputs["draft_tokens"] = inputs["target_probs"][:, :3].argmax(dim=-1)  # the favourites
    batch = 64
    for name in ("target_probs", "draft_probs", "draft_tokens", "num_draft"):
        if inputs[name] is not None:
            inputs[name] = inputs[name].expand(batch, *inputs[name].shape[1:]).contiguous()
    generator = torch.Generator().manual_seed(12)
    inputs["u_accept"] = torch.rand(batch, 3, generator=generator, dtype=torch.float64)
    inputs["u_sample"] = torch.rand(batch, 4, generator=generator, dtype=torch.float64)
    expected = rejection_sample_ref(**inputs)
    got = rejection_sample_triton(**inputs, block_v=32)
    assert len(set(expected[0].tolist())) >= 3  # the draw really varies
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


def test_one_hot_kernel_emits_the_targets_own_draws() -> None:
    """Coupling: every kept draft and the emitted token are what the target alone draws at
    that position with the same uniform; u_accept plays no part."""
    inputs = make_dummy(7, 8, 1031, with_q=False, seed=3)
    accepted, next_token = rejection_sample_triton(**inputs, block_v=256)
    inputs["u_accept"] = 1.0 - inputs["u_accept"]
    assert torch.equal(rejection_sample_triton(**inputs, block_v=256)[1], next_token)
    alone = sample_weights(  # [B, k + 1]: each position sampled by itself
        probability_weights(inputs["target_probs"].reshape(7 * 9, 1031)),
        inputs["u_sample"].reshape(-1),
    ).reshape(7, 9)
    rows = torch.arange(7)
    assert torch.equal(next_token, alone[rows, accepted])
    for position in range(8):
        kept = accepted > position
        assert torch.equal(inputs["draft_tokens"][kept, position], alone[kept, position])


def test_one_hot_kernel_reads_bf16_and_fp16() -> None:
    inputs = make_dummy(7, 3, 1031, with_q=False, seed=4)
    for dtype in (torch.bfloat16, torch.float16):
        inputs["target_probs"] = inputs["target_probs"].to(dtype)
        expected = rejection_sample_ref(**inputs)
        got = rejection_sample_triton(**inputs, block_v=512)
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1]), dtype


def test_ops_on_cpu_takes_the_reference(monkeypatch) -> None:
    inputs = make_dummy(7, 4, 1031, True, seed=5)
    calls = []

    def reference(*args):
        calls.append(args)
        return rejection_sample_ref(*args)

    monkeypatch.setattr(ops, "rejection_sample_ref", reference)
    ops.rejection_sample(**inputs)
    assert len(calls) == 1


def test_ops_casts_int32_indices() -> None:
    inputs = make_dummy(7, 4, 1031, True, seed=5)
    expected = rejection_sample_ref(**inputs)
    inputs["draft_tokens"] = inputs["draft_tokens"].int()
    inputs["num_draft"] = inputs["num_draft"].int()
    got = ops.rejection_sample(**inputs)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


def test_ops_sampled_match_is_the_one_hot_path() -> None:
    inputs = make_dummy(7, 4, 1031, False, seed=6)
    expected = rejection_sample_ref(**inputs)
    args = (inputs["target_probs"], inputs["draft_tokens"], inputs["num_draft"], inputs["u_sample"])
    for got in (sampled_match_ref(*args), ops.sampled_match(*args)):
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


# --- Philox4x32-10 ----------------------------------------------------------------------

# Random123's kat_vectors, "philox4x32 10" lines: counter (4 words), key (2 words), output.
RANDOM123_KAT = [
    ([0x00000000, 0x00000000, 0x00000000, 0x00000000], [0x00000000, 0x00000000],
     [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]),
    ([0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF], [0xFFFFFFFF, 0xFFFFFFFF],
     [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]),
    ([0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344], [0xA4093822, 0x299F31D0],
     [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]),
]


def test_philox_matches_random123_known_answers() -> None:
    counter = torch.tensor([c for c, _, _ in RANDOM123_KAT])
    key = torch.tensor([k for _, k, _ in RANDOM123_KAT])
    expected = torch.tensor([out for _, _, out in RANDOM123_KAT])
    assert torch.equal(philox4x32_10(counter, key), expected)


PHILOX_SEEDS = torch.tensor([7, -3, 2**40 + 5])
PHILOX_POSITIONS = torch.arange(12).view(3, 4) * 1000 + 17


def test_philox_uniforms_do_not_depend_on_the_batch_layout() -> None:
    u = philox_uniforms(PHILOX_SEEDS, PHILOX_POSITIONS, STREAM_ACCEPT)  # [3, 4]
    # The same (seed, position) in another batch layout gives the same number.
    alone = philox_uniforms(PHILOX_SEEDS[2:], PHILOX_POSITIONS[2:, 1:3].contiguous(), STREAM_ACCEPT)
    assert torch.equal(alone, u[2:, 1:3])


def test_philox_uniforms_differ_between_streams() -> None:
    u = philox_uniforms(PHILOX_SEEDS, PHILOX_POSITIONS, STREAM_ACCEPT)  # [3, 4]
    assert not torch.equal(philox_uniforms(PHILOX_SEEDS, PHILOX_POSITIONS, STREAM_SAMPLE), u)


def test_philox_uniforms_are_float64_in_the_unit_interval() -> None:
    u = philox_uniforms(PHILOX_SEEDS, PHILOX_POSITIONS, STREAM_ACCEPT)  # [3, 4]
    assert u.dtype == torch.float64 and bool(((u >= 0) & (u < 1)).all())


def test_philox_uniforms_are_uniform() -> None:
    u = philox_uniforms(torch.tensor([1234]), torch.arange(200_000)[None, :], STREAM_SAMPLE)
    counts = torch.histc(u, bins=10, min=0.0, max=1.0)
    # 20000 expected per bin, sd ~134: 5 sd either way.
    assert bool(((counts - 20_000).abs() < 700).all()), counts
    assert len(torch.unique(u)) == u.numel()


def test_round_uniforms_do_not_depend_on_where_rounds_split() -> None:
    seeds = torch.tensor([99, 100])
    u_accept, u_sample = round_uniforms(seeds, torch.tensor([10, 10]), k=4)  # positions 10..14
    later_accept, later_sample = round_uniforms(seeds, torch.tensor([12, 12]), k=2)  # 12..14
    assert torch.equal(later_accept, u_accept[:, 2:4])
    assert torch.equal(later_sample, u_sample[:, 2:5])
    assert not torch.equal(u_accept, u_sample[:, :4])  # the two streams differ


def test_a_steps_sampled_chains_decided_in_place_equal_the_padded_batch() -> None:
    """Verifier._sampled_rows (each scored row warped and drawn once, no padding) takes the
    tokens ops.sampled_match takes over the chains padded to the longest, with each round's
    own parameters and uniforms."""
    from specdec.sampling import Sampling
    from target_worker.verify import Verifier, _Decision

    vocab, generator = 1031, torch.Generator().manual_seed(11)
    lengths = [0, 5, 1, 0, 3, 2, 0]  # drafts per round, in step order
    every = torch.randn(sum(n + 1 for n in lengths), vocab, generator=generator) * 2  # [R, V]
    every[torch.arange(every.shape[0]), torch.randint(0, vocab, (every.shape[0],), generator=generator)] += 12.0
    rows, at = [], 0
    for i, n in enumerate(lengths):
        sampling = Sampling(temperature=0.7 + 0.1 * i, top_k=[0, 50, 5][i % 3], top_p=[1.0, 0.9][i % 2], seed=100 + i)
        target = every[at:at + n + 1].argmax(-1).tolist()
        drafts = target[:n] if i % 2 else [(t + 1) % vocab for t in target[:n]]  # kept, or not
        rows.append(_Decision(list(range(at, at + n + 1)), drafts, 40 + 3 * i, sampling))
        at += n + 1
    width = max(lengths)
    draft = torch.tensor([r.drafts + [0] * (width - len(r.drafts)) for r in rows])
    num_draft = torch.tensor(lengths)
    got = Verifier._sampled_rows(every, rows, draft, num_draft)

    index = torch.tensor([r.rows + [r.rows[0]] * (width + 1 - len(r.rows)) for r in rows])
    probs = ops.warp_probs(every[index], torch.tensor([r.sampling.temperature for r in rows]),
                           torch.tensor([r.sampling.top_k for r in rows]), torch.tensor([r.sampling.top_p for r in rows]))
    _, u_sample = round_uniforms(torch.tensor([r.sampling.seed for r in rows]),
                                 torch.tensor([r.first_position for r in rows]), width)
    expected = ops.sampled_match(probs, draft, num_draft, u_sample)
    assert got[0].tolist() == expected[0].tolist() and got[1].tolist() == expected[1].tolist()
    assert 0 < sum(got[0].tolist()) < sum(lengths)  # some drafts kept, some not
