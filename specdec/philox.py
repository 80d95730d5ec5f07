"""Counter-based randomness: Philox4x32-10 in plain torch integer arithmetic.

A sampled token's randomness is a function of (request seed, absolute token position)
alone, so a seeded request gives the same text whether it was batched,
retried or moved to another replica. A counter-based generator gives exactly that: the
output is a pure function of (key, counter), with no state to carry between rounds.

Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011) maps a
128-bit counter and a 64-bit key to 128 random bits through 10 rounds of multiply/xor. Here:

    key     = the request seed (64 bits, split into two 32-bit words)
    counter = (position low word, position high word, stream, 0)

where ``stream`` separates independent draws at the same position (the accept-uniform and the
sample-uniform of one draft position must not be the same number).

Every 32-bit word is held in an int64 tensor and every product is split into 16-bit halves
so nothing overflows int64: the arithmetic is exact integer arithmetic, bit-identical on CPU
and GPU.
"""

from __future__ import annotations

import torch

# Philox4x32 round multipliers and Weyl key increments (Salmon et al. 2011, Random123).
PHILOX_M0 = 0xD2511F53
PHILOX_M1 = 0xCD9E8D57
PHILOX_W0 = 0x9E3779B9
PHILOX_W1 = 0xBB67AE85
PHILOX_ROUNDS = 10

MASK32 = 0xFFFFFFFF
MASK16 = 0xFFFF

# Streams: independent uniforms drawn at the same (seed, position).
STREAM_ACCEPT = 0  # the draft-token acceptance test
STREAM_SAMPLE = 1  # the recovered / bonus token draw
STREAM_DRAFT = 2  # a sampling draft model's own draw, kept apart from the target's
MAX_STREAM = MASK32

# A float64 uniform takes 53 random bits: 27 from word 0 and 26 from word 1 (the usual split,
# so every multiple of 2**-53 in [0, 1) is reachable and 1.0 never is).
_HIGH_BITS = 27
_LOW_BITS = 26
_UNIFORM_SCALE = 2.0**-53


def _mulhilo(multiplier: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low 32-bit words of ``multiplier * x`` for 32-bit ``x`` held in int64."""
    x_lo = x & MASK16
    x_hi = x >> 16
    low_product = multiplier * x_lo  # < 2**48
    middle = multiplier * x_hi + (low_product >> 16)  # < 2**49: the product >> 16
    lo = ((middle & MASK16) << 16) | (low_product & MASK16)
    hi = middle >> 16
    return hi, lo


def philox4x32_10(counter: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """Philox4x32-10 block function.

    counter: [..., 4] int64, each entry a 32-bit word in [0, 2**32)
    key:     [..., 2] int64, each entry a 32-bit word in [0, 2**32)
    returns: [..., 4] int64, 32-bit random words
    """
    assert counter.dtype == torch.int64 and key.dtype == torch.int64
    assert counter.shape[-1] == 4 and key.shape[-1] == 2
    c0, c1, c2, c3 = counter.unbind(-1)
    k0, k1 = key.unbind(-1)
    c0, c1, c2, c3 = torch.broadcast_tensors(c0, c1, c2, c3, k0)[:4]
    for round_index in range(PHILOX_ROUNDS):
        if round_index > 0:
            k0 = (k0 + PHILOX_W0) & MASK32
            k1 = (k1 + PHILOX_W1) & MASK32
        hi0, lo0 = _mulhilo(PHILOX_M0, c0)
        hi1, lo1 = _mulhilo(PHILOX_M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return torch.stack((c0, c1, c2, c3), dim=-1)


def philox_uniforms(seeds: torch.Tensor, positions: torch.Tensor, stream: int) -> torch.Tensor:
    """Uniforms in [0, 1) that depend only on (seed, absolute position, stream).

    seeds:     [B] int64, any 64-bit value (negative seeds use their two's-complement bits)
    positions: [B, n] int64, absolute token positions in the request (>= 0)
    stream:    which independent draw at that position (STREAM_ACCEPT, STREAM_SAMPLE, ...)
    returns:   [B, n] float64, 53 random bits each
    """
    assert seeds.dim() == 1 and positions.dim() == 2 and positions.shape[0] == seeds.shape[0]
    assert seeds.dtype == torch.int64 and positions.dtype == torch.int64
    assert 0 <= stream <= MAX_STREAM
    seeds = seeds.to(positions.device)
    key = torch.stack((seeds & MASK32, (seeds >> 32) & MASK32), dim=-1)  # [B, 2]
    key = key[:, None, :].expand(-1, positions.shape[1], -1)  # [B, n, 2]
    counter = torch.stack(
        (
            positions & MASK32,
            (positions >> 32) & MASK32,
            torch.full_like(positions, stream),
            torch.zeros_like(positions),
        ),
        dim=-1,
    )  # [B, n, 4]
    words = philox4x32_10(counter, key)  # [B, n, 4]
    high = words[..., 0] >> (32 - _HIGH_BITS)
    low = words[..., 1] >> (32 - _LOW_BITS)
    return ((high << _LOW_BITS) | low).to(torch.float64) * _UNIFORM_SCALE


def round_uniforms(
    seeds: torch.Tensor, first_positions: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The uniforms of one verify round, as ops.rejection_sample takes them.

    seeds:           [B] int64, the requests' seeds
    first_positions: [B] int64, absolute position of the round's first output token
                     (the committed length before the round)
    returns:         u_accept [B, k] and u_sample [B, k + 1], float64; column i belongs to
                     absolute position first_positions + i
    """
    positions = first_positions.to(torch.int64)[:, None] + torch.arange(
        k + 1, device=first_positions.device
    )  # [B, k + 1]
    u_accept = philox_uniforms(seeds, positions[:, :k], STREAM_ACCEPT)
    u_sample = philox_uniforms(seeds, positions, STREAM_SAMPLE)
    return u_accept, u_sample
