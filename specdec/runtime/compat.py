"""Shims over transformers releases and model families: what the runtime must ask a model
instead of assuming (the cache keyword its forward takes, whether every layer attends to the
whole context)."""

from __future__ import annotations

import inspect

import torch


def cache_kwarg(model: torch.nn.Module) -> str:
    """The keyword a model's forward takes its KV cache by: `cache` in recent transformers 5
    releases, `past_key_values` before (both are 5.x, which pyproject allows). An unknown
    keyword is swallowed by the forward's **kwargs and the cache silently not used — every
    round then fails with "cache and ids out of step" — so ask the signature."""
    parameters = inspect.signature(model.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def full_attention_only(config) -> str | None:
    """None when every layer of a decoder-only model attends to the whole context; otherwise
    why not (encoder-decoder, sliding-window or other non-full attention layers)."""
    if getattr(config, "is_encoder_decoder", False):
        return "encoder-decoder models are not supported"
    layer_types = getattr(config, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types):
        return "the model has sliding-window or other non-full attention layers"
    window = getattr(config, "sliding_window", None)
    if window and getattr(config, "use_sliding_window", True) and window < getattr(config, "max_position_embeddings", 0):
        return "the model uses a sliding window"
    return None
