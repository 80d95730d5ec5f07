"""The head as served on CPU: its linears packed once into oneDNN's blocked layout, in
bfloat16 where the CPU computes it natively, and warmed up so the first rounds do not pay
oneDNN's kernel compilation."""

from __future__ import annotations

import copy

import torch

from specdec.eagle.head import EagleHead, HeadCache


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


LINEARS = ("fc", "q", "k", "v", "o", "gate", "up", "down")


def fast_cpu_dtype() -> torch.dtype | None:
    """The dtype the head's packed weights take on this CPU, or None: no oneDNN."""
    if not torch.backends.mkldnn.is_available():
        return None
    return torch.bfloat16 if torch.ops.mkldnn._is_mkldnn_bf16_supported() else torch.float32


def fast_cpu_head(head: EagleHead, dtype: torch.dtype | None = None) -> EagleHead:
    """The head as the draft worker serves it on CPU: a copy (the given head is untouched)
    whose eight linears and draft-vocabulary LM head are packed oneDNN weights, bfloat16
    where the CPU has native bfloat16 dot products (AVX512-BF16/AMX), else fp32.

    A head step is a handful of one-row matrix-vector products, bound by reading weights, so
    packed weights make it cheaper than the stock fp32 path, and packed bfloat16 weights
    several times cheaper (`benchmarks/head_step.py`; figures in benchmarks/results/NOTES.md).
    bfloat16 rounds the head's activations, so a draft can differ from the fp32 head's at a
    near-tie; the target decides every token, so only the acceptance can move. Heads not on
    CPU, or a torch without oneDNN, are returned as they are."""
    dtype = dtype or fast_cpu_dtype()
    if dtype is None or head.fc.weight.device.type != "cpu":
        return head
    fast = copy.copy(head)
    fast._modules = dict(head._modules)
    for name in LINEARS + (("aux_fc",) if head.config.aux_layers else ()):
        fast._modules[name] = PackedHeadLinear(getattr(head, name).weight, dtype)
    fast.lm_head = PackedHeadLinear(head.head, dtype)
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
