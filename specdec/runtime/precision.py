"""The precision a worker serves in: the weights' dtype (`--dtype`) and logits always in float32.

Weights may be bfloat16 or float16 (`WorkerConfig.dtype`; "auto": bfloat16 on CUDA, float32
elsewhere). Logits are not: the final projection onto the vocabulary — the target's LM head,
a draft model's, a feature-level head's draft-vocabulary rows — is computed here, in float32,
from hidden states upcast to float32 and a float32 copy of the projection's weight. Greedy
verification takes an argmax over those logits and sampling warps them, so the only reduced
precision the output sees is in the hidden states; logits rounded to bfloat16 (8 bits of
mantissa) would turn near-ties into exact ties, broken by token id. (On CPU a head's packed
serving copy projects with its own bfloat16 oneDNN weights, float32 out: specdec.eagle.cpu;
it only drafts.)

What stays reduced: a verification pass runs k + 1 tokens through the model in one pass, the
target alone one, and the two orders of arithmetic can swap two tokens whose logits are nearly
tied, so in bfloat16 speculative output can part from the target alone's at a near-tie
(docs/gpu.md, "Precision"). A float32 model is served exactly as before: nothing here changes it.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

# The --dtype names (specdec.config.DTYPES) → torch dtypes; AUTO is resolved per device.
AUTO = "auto"
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def serving_dtype(name: str, device: str) -> torch.dtype:
    """The weights' dtype for `--dtype name` on `device`: "auto" is bfloat16 on CUDA (its
    tensor cores compute it natively, at half the bytes per weight) and float32 elsewhere."""
    if name == AUTO:
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    try:
        return TORCH_DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype {name!r} is not one of {', '.join([AUTO, *TORCH_DTYPES])}") from None


def fp32_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """hidden [..., H] projected by weight [V, H] (and bias [V]) in float32: [..., V] float32.
    What a reduced-precision model's LM head (Fp32LMHead) and a feature-level head's
    draft-vocabulary projection (specdec.eagle.EagleHead.logits) compute. A float32 model's
    own LM head, packed on CPU (specdec.runtime.cpu), already takes and gives float32."""
    return F.linear(hidden.float(), weight.float(), None if bias is None else bias.float())


class Fp32LMHead(torch.nn.Module):
    """An LM head (nn.Linear [V, H]) that projects in float32: its weight copied once to
    float32 (a buffer: `parameters()` still give the model's own dtype), any input upcast."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("weight", linear.weight.detach().float(), persistent=False)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float(),
                             persistent=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., V] float32
        return fp32_logits(hidden, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, float32"


def with_fp32_logits(model: torch.nn.Module) -> torch.nn.Module:
    """`model` itself when its LM head is already float32 (or it has none); otherwise a
    shallow copy whose LM head is an Fp32LMHead. The copy shares every other module with
    `model`, which is left unchanged (its fingerprint and its own logits stay as loaded)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if type(head) is not torch.nn.Linear or head.weight.dtype == torch.float32:
        return model
    name = next((n for n, child in model._modules.items() if child is head), None)
    if name is None:
        raise ValueError(f"{type(model).__name__}: its LM head is not a direct child module")
    served = copy.copy(model)
    served._modules = {**model._modules, name: Fp32LMHead(head)}
    return served
