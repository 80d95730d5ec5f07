"""The worker's model factory: how a loaded model becomes the CausalLM a worker serves, with
its load-time self-check (the served copy must give the plain model's logits)."""

from __future__ import annotations

import logging

import torch

from specdec.runtime.cpu import agrees, fast_cpu_model, new_cache
from specdec.runtime.lm import CausalLM
from specdec.runtime.precision import with_fp32_logits

log = logging.getLogger(__name__)


def serving_lm(model: torch.nn.Module, enabled: bool = True) -> CausalLM:
    """The CausalLM a worker serves `model` with: the fast path when enabled and the model
    can take it, else the model as it is (and always on a GPU: the fast path is oneDNN's).
    Either way its logits are float32: a bfloat16 or float16 model is served through a copy
    whose LM head projects in float32 (specdec.runtime.precision); `model` is not changed."""
    model = with_fp32_logits(model)
    if enabled and next(model.parameters()).device.type == "cpu":
        fast = fast_cpu_model(model)
        if fast is not model:
            if agrees(model, fast):
                return CausalLM(fast, new_cache=new_cache)
            log.warning("CPU fast path off for %s: its logits differ from the plain model's", type(model).__name__)
    return CausalLM(model)
