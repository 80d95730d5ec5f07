"""What every kernel launcher checks before a launch.

Imported only where triton is installed (the kernel modules import it); ops.py guards that.
"""

from __future__ import annotations

import torch
from triton.runtime.interpreter import InterpretedFunction

# Rows are walked in tiles of at most this many vocabulary entries; V = 262144 is 64 tiles.
DEFAULT_BLOCK_V = 4096


def is_interpreted(kernel: object) -> bool:
    """True when TRITON_INTERPRET=1 was set as ``kernel`` was defined: it then runs on CPU."""
    return isinstance(kernel, InterpretedFunction)


def assert_launchable(kernel: object, *tensors: torch.Tensor) -> None:
    """All tensors contiguous, on one device, and that device is one the kernel can run on."""
    device = tensors[0].device
    for tensor in tensors:
        assert tensor.is_contiguous(), "kernel inputs must be contiguous"
        assert tensor.device == device, f"tensors on {tensor.device} and {device}"
    assert device.type == "cuda" or is_interpreted(kernel), (
        f"compiled Triton kernels need CUDA tensors, got {device}"
    )


def block_size(vocab_size: int, block_v: int | None) -> int:
    """Tile width: the caller's (tests force the multi-tile path) or one tile up to the cap."""
    if block_v is None:
        block_v = min(DEFAULT_BLOCK_V, next_power_of_2(vocab_size))
    assert block_v > 0 and block_v & (block_v - 1) == 0, "BLOCK_V must be a power of two"
    return block_v


def next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()
