"""The head as served on CPU: for each of its linears and each number of rows a pass feeds,
the kernel timed fastest on the machine that serves — MKL's stock fp32 GEMM on the plain
weight, or the weight packed once into oneDNN's blocked layout in fp32 or (where this
oneDNN has it) bfloat16 — and warmed up so the first rounds do not pay oneDNN's kernel
compilation.

Timed rather than assumed because the kernels rank differently from CPU to CPU: one-row
passes read weights, so packed bfloat16 halves their cost where the CPU has native
bfloat16 dot products (AVX512-BF16/AMX), while on a CPU without them oneDNN emulates
bfloat16 and a pass of several rows (many sessions drafting together) costs more than in
fp32 (benchmarks/head_step.py, benchmarks/head_batch.py; figures in
benchmarks/results/NOTES.md).
"""

from __future__ import annotations

import bisect
import copy
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from specdec.eagle.head import EagleHead, HeadCache

# Row counts timed per linear when the served head is made: a drafting depth feeds one row
# per session still drafting, a catch-up pass every position committed since the session
# last drafted; a pass between two timed counts takes the kernel of the smaller.
TIMED_ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
# A packed kernel replaces the stock GEMM only when faster by this share (timing noise).
PACKED_MARGIN = 0.05
TIMING_REPEATS = 7


class PackedHeadLinear(torch.nn.Module):
    """y = x Wᵀ with W held once in oneDNN's blocked layout, in `dtype` (bfloat16 where the
    CPU computes it natively); fp32 in and out."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype
        self.out_features = weight.shape[0]
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().to(dtype).contiguous(), None)
        self.register_buffer("packed_weight", packed, persistent=False)
        # What readers of `.weight` learn: the shape and the dtype activations are kept in.
        self.weight = torch.empty(weight.shape, dtype=torch.float32, device="meta")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, shape[-1]).to(self.dtype), self.packed_weight, None,
                                               "none", [], "")
        return y.to(torch.float32).view(*shape[:-1], self.out_features)


class ChosenHeadLinear(torch.nn.Module):
    """y = x Wᵀ (fp32 in and out) by the kernel chosen for the number of rows: `kernels`
    maps a name to a callable, `choice[i]` names the one for TIMED_ROWS[i] rows up to the
    next timed count (and beyond the last)."""

    def __init__(self, weight: torch.Tensor, kernels: dict[str, Callable], choice: tuple[str, ...]):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.choice = choice
        self.kernels = {name: kernels[name] for name in set(choice)}  # only those used are kept
        for name, kernel in self.kernels.items():
            if isinstance(kernel, torch.nn.Module):
                self.add_module(f"packed_{name}", kernel)
        self.weight = torch.empty(weight.shape, dtype=torch.float32, device="meta")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        return self.kernels[self.choice[max(0, bisect.bisect_right(TIMED_ROWS, rows) - 1)]](x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, choice={list(self.choice)}"


def head_kernels(weight: torch.Tensor) -> dict[str, Callable]:
    """The kernels a head linear of this weight may take on this CPU: stock fp32, packed
    fp32, and packed bfloat16 where this oneDNN has it."""
    plain = weight.detach().float()
    kernels: dict[str, Callable] = {"stock": lambda x: F.linear(x, plain),
                                    "fp32": PackedHeadLinear(plain, torch.float32)}
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        kernels["bf16"] = PackedHeadLinear(plain, torch.bfloat16)
    return kernels


def choose_kernels(kernels: dict[str, Callable], in_features: int,
                   timer: Callable[[Callable[[], object]], float] | None = None) -> tuple[str, ...]:
    """Per row count of TIMED_ROWS, the fastest kernel, timed here (`timer(fn)`: seconds
    per call; default the median of TIMING_REPEATS interleaved calls); the stock GEMM
    unless a packed one beats it by PACKED_MARGIN."""
    choice = []
    for rows in TIMED_ROWS:
        x = torch.randn(rows, in_features)
        calls = {name: (lambda kernel=kernel: kernel(x)) for name, kernel in kernels.items()}
        seconds = {name: timer(call) for name, call in calls.items()} if timer else _time_all(calls)
        best = min(seconds, key=seconds.get)
        if best != "stock" and seconds[best] >= (1.0 - PACKED_MARGIN) * seconds["stock"]:
            best = "stock"
        choice.append(best)
    return tuple(choice)


def _time_all(calls: dict[str, Callable[[], object]]) -> dict[str, float]:
    for call in calls.values():
        call()  # warm-up: oneDNN builds its kernel for the shape
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(TIMING_REPEATS):
        for name, call in calls.items():
            began = time.perf_counter()
            call()
            samples[name].append(time.perf_counter() - began)
    return {name: statistics.median(seen) for name, seen in samples.items()}


LINEARS = ("fc", "q", "k", "v", "o", "gate", "up", "down")


def fast_cpu_dtype() -> torch.dtype | None:
    """bfloat16 where this oneDNN computes in it (natively, or emulated on AVX-512 without
    AVX512-BF16), else float32; None: no oneDNN, so no packed head."""
    if not torch.backends.mkldnn.is_available():
        return None
    return torch.bfloat16 if torch.ops.mkldnn._is_mkldnn_bf16_supported() else torch.float32


@torch.inference_mode()
def fast_cpu_head(head: EagleHead, dtype: torch.dtype | None = None,
                  timer: Callable[[Callable[[], object]], float] | None = None) -> EagleHead:
    """The head as the workers serve it on CPU: a copy (the given head is untouched) whose
    eight linears and draft-vocabulary LM head each run, per number of rows, the kernel
    timed fastest here (`choose_kernels`; linears of one shape share a choice). With
    `dtype`, every linear is packed in that dtype instead, at every row count.

    Kernels differ in rounding (bfloat16 rounds the head's activations to ~3 significant
    digits), so a draft can differ from the plain fp32 head's at a near-tie, and with
    chosen kernels a pass's row count — how many sessions draft together — picks them;
    the target decides every token, so only the acceptance can move. Heads not on CPU, or
    a torch without oneDNN, are returned as they are."""
    if fast_cpu_dtype() is None or head.fc.weight.device.type != "cpu":
        return head
    fast = copy.copy(head)
    fast._modules = dict(head._modules)
    names = LINEARS + (("aux_fc",) if head.config.aux_layers else ())
    weights = {name: getattr(head, name).weight for name in names} | {"lm_head": head.head}
    chosen: dict[tuple[int, ...], tuple[str, ...]] = {}
    for name, weight in weights.items():
        if dtype is not None:
            linear = PackedHeadLinear(weight, dtype)
        else:
            kernels = head_kernels(weight)
            shape = tuple(weight.shape)
            if shape not in chosen:
                chosen[shape] = choose_kernels(kernels, weight.shape[1], timer)
            linear = ChosenHeadLinear(weight, kernels, chosen[shape])
        if name == "lm_head":
            fast.lm_head = linear  # the serving copy's LM head (EagleHead.logits)
        else:
            fast._modules[name] = linear
    warm_up(fast)
    return fast


# Row counts run once when a packed head is made: oneDNN compiles a kernel the first time it
# sees a shape (a slow first step), and a round feeds as many rows as were committed since the
# head last drafted.
WARM_ROWS = 64


@torch.inference_mode()
def warm_up(head: EagleHead, rows: int = WARM_ROWS) -> None:
    """Runs every feed size 1 … rows once on a scratch cache (and the LM head on one row)."""
    cache = HeadCache(head.config.num_kv_heads, head.config.head_dim, torch.float32)
    zeros = torch.zeros((rows, head.config.feature_size))
    for n in range(1, rows + 1):
        head.extend(cache, zeros[:n], [0] * n)
        cache.crop(0)
    head.logits(zeros[0, :head.config.hidden_size])
