"""The worker's model factory: how a loaded model becomes the CausalLM a worker serves, with
its load-time self-check (the served copy must give the plain model's logits)."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from specdec.config import KV_CACHES
from specdec.runtime.cpu import agrees, choose_linears, fast_cpu_model, new_cache
from specdec.runtime.lm import CausalLM
from specdec.runtime.paged import DEFAULT_BLOCK_SIZE, DEFAULT_KV_MEMORY_FRACTION
from specdec.runtime.paged_llama import supports_paged
from specdec.runtime.paged_lm import PagedCausalLM
from specdec.runtime.precision import with_fp32_logits

log = logging.getLogger(__name__)


def kv_cache_kind(kind: str, device: torch.device | str) -> str:
    """"auto": the paged pool on CUDA, the buffered caches of the CPU fast path elsewhere."""
    if kind not in KV_CACHES:
        raise ValueError(f"kv cache {kind!r} is not one of {', '.join(KV_CACHES)}")
    if kind == "auto":
        return "paged" if torch.device(device).type == "cuda" else "buffered"
    return kind


def serving_lm(model: torch.nn.Module, enabled: bool = True, kv_cache: str = "buffered", *,
               max_cache_bytes: int | None = None, kv_memory_fraction: float = DEFAULT_KV_MEMORY_FRACTION,
               block_size: int = DEFAULT_BLOCK_SIZE, attention: Callable[..., torch.Tensor] | None = None,
               namespace: str = "", max_batch: int = 64, cuda_graphs: bool = False) -> CausalLM:
    """The CausalLM a worker serves `model` with: the fast path when enabled and the model
    can take it (each linear's kernel per row count chosen by timing both here:
    specdec.runtime.cpu.choose_linears), else the model as it is (and always on a GPU: the
    fast path is oneDNN's).
    Either way its logits are float32: a bfloat16 or float16 model is served through a copy
    whose LM head projects in float32 (specdec.runtime.precision); `model` is not changed.

    kv_cache "paged" (or "auto" on CUDA): one paged KV pool for every session and one forward
    per step (specdec.runtime.paged_lm), sized from max_cache_bytes (else kv_memory_fraction
    of the free device memory), attending through `attention` (default: the runtime's
    choice for the device), up to max_batch sessions a step (the worker's batch limit), its
    chain steps replayed from CUDA graphs with cuda_graphs (specdec.runtime.graphs); a model
    the paged forward does not cover is served with the buffered caches, and the log says why."""
    model = with_fp32_logits(model)
    device = next(model.parameters()).device
    if kv_cache_kind(kv_cache, device) == "paged":
        reason = supports_paged(model)
        if reason is None:
            served = model
            if enabled and device.type == "cpu":
                fast = fast_cpu_model(model, stock_rows=choose_linears(model))
                served = fast if fast is not model and agrees(model, fast) else model
            return PagedCausalLM(served, max_cache_bytes=max_cache_bytes, kv_memory_fraction=kv_memory_fraction,
                                 block_size=block_size, attention=attention, namespace=namespace,
                                 max_batch=max_batch, cuda_graphs=cuda_graphs)
        log.warning("paged KV cache off for %s: %s", type(model).__name__, reason)
    if enabled and device.type == "cpu":
        fast = fast_cpu_model(model, stock_rows=choose_linears(model))
        if fast is not model:
            if agrees(model, fast):
                return CausalLM(fast, new_cache=new_cache)
            log.warning("CPU fast path off for %s: its logits differ from the plain model's", type(model).__name__)
    return CausalLM(model)


def paged_pool_bytes(config) -> int | None:
    """The paged pool's size from a WorkerConfig: its cache budget on CPU; None on CUDA, where
    the pool takes kv_memory_fraction of the memory the weights leave."""
    return None if torch.device(config.device).type == "cuda" else config.max_cache_bytes
