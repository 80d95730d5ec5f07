"""Whether a Triton kernel compiles, launches and computes here: one tiny kernel, before the GPU
check's long parts (benchmarks/gpu_check.sh). On first launch Triton builds the kernel's
launcher with the machine's C compiler and Python's headers; where either is missing every
kernel fails, and this says so in one line instead of in every part.

    python benchmarks/triton_preflight.py            # CUDA
    TRITON_INTERPRET=1 python benchmarks/triton_preflight.py --device cpu   # the script itself, on CPU

Exits 0 when the kernel's output is right, non-zero with the reason otherwise.
"""

from __future__ import annotations

import argparse
import sys

import torch


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    device = parser.parse_args().device
    try:
        import triton
        import triton.language as tl
    except ImportError as error:
        return f"triton_preflight.py: triton is not importable: {error}"

    @triton.jit
    def double(x, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(x + i, tl.load(x + i, mask=i < n) * 2, mask=i < n)

    try:
        x = torch.arange(100, dtype=torch.float32, device=device)
        double[(1,)](x, 100, BLOCK=128)
        if x.is_cuda:
            torch.cuda.synchronize()
    except Exception as error:  # noqa: BLE001 - the reason, in one line, is the point
        return f"triton_preflight.py: a Triton kernel does not launch on {device}: {type(error).__name__}: {error}"
    if not torch.equal(x.cpu(), torch.arange(100, dtype=torch.float32) * 2):
        return f"triton_preflight.py: the kernel ran on {device} and computed the wrong thing"
    print(f"triton {triton.__version__}: a kernel compiled, launched and computed on {device}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
