"""The fast CPU path for serving: what makes a (k + 1)-token verification cost little more
than a 1-token step on CPU, which is the ratio speculation lives on.

On the stock MKL path a forward pass over a handful of new tokens costs markedly more than
a 1-token step on a small CPU: MKL's fp32 GEMM for a handful of rows is slow there, the large
output layer most of all. oneDNN's packed-weight linear (`mkldnn._reorder_linear_weight`
once, `mkldnn._linear_pointwise` per call) is as fast at 1 row and nearly flat in rows
(figures in benchmarks/results/NOTES.md). Three things are
done, each exact in intent and each checked token for token against the plain model by the
tests (tests/test_runtime_cpu.py):

1. every `nn.Linear` becomes a `PackedLinear` (oneDNN blocked weights, fp32 in and out) —
   or, where the serving machine's stock MKL GEMM measures faster at some row counts (on
   some CPUs it is, at a decoding step's single row), a `MixedLinear` that serves those row
   counts by MKL on the plain weight and the others by the packed one (`choose_linears`
   times both at load, per weight shape and row count);
2. grouped-query attention runs inside SDPA (`enable_gqa=True`) instead of copying the keys
   and values `num_heads / num_kv_heads` times per layer per verification (transformers
   does that copy whenever a mask is passed, i.e. for every multi-token block with a cache;
   the results are bit-identical, it only saves the copies);
3. KV caches grow into preallocated buffers (`BufferedLayer`, made by `new_cache`) instead of
   `torch.cat`-ing the whole context onto itself every step. A session then holds its
   buffers' capacity, not its length: that is what its cache budget counts
   (`BufferedCache.held_bytes`, specdec.runtime.memory).

Packed linears do change float rounding (a different GEMM kernel sums in a different order):
logits move by float32 rounding, the same order as MKL's own difference between a batched and
a step-by-step forward; a greedy choice can only flip at a near-exact tie, and `serving_lm`
checks the copy against the plain model at load time.
`torch.compile` is not used (not tried): a 1-token step is bound by reading the fp32 weights,
which leaves little for fusing the small ops to win against a recompile per context length.
`benchmarks/cpu_fast_path.py` measures each stage.

`fast_cpu_model` never modifies the model it is given: it returns a copy whose modules are
new objects sharing the original's parameters, except that linear weights are held only in
packed form, so the caller can keep the plain model as a reference (and a worker that drops
it holds each weight once).
"""

from __future__ import annotations

import copy
import logging
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, DynamicCache
from transformers.cache_utils import DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from specdec.runtime import packed
from specdec.runtime.memory import storage_bytes, tensors_of
from specdec.runtime.packed import SPECDEC_ATTENTION, packed_attention

log = logging.getLogger(__name__)

# KV buffers grow to the next multiple of this many tokens, with headroom of GROWTH×.
KV_BLOCK_TOKENS = 256
KV_GROWTH = 1.5
PACKABLE_DTYPES = (torch.float32,)
# Row counts whose kernel `choose_linears` times at load: a decoding step's one row and a
# verification's few; from this many rows on the packed weights serve (flat in rows).
CHOSEN_ROWS = 8
# Stock MKL serves a row count only when it measured at least this much faster there (one
# timing at load on a busy machine is noisy; the packed path is the default).
STOCK_MARGIN = 0.05
TIMING_REPEATS = 7
# The load-time self-check: tokens run through both models, and the largest logit difference
# allowed relative to the largest logit (packed linears differ by float32 rounding only).
SELF_CHECK_TOKENS = 8
SELF_CHECK_TOLERANCE = 1e-3


class PackedLinear(torch.nn.Module):
    """y = x Wᵀ + b with W reordered once into oneDNN's blocked layout."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        # The batch-size hint picks the blocking; None packs for any number of rows: no slower
        # than a hint of 1 at one row, faster at a verification's few rows.
        packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)
        self.register_buffer("packed_weight", packed, persistent=False)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach(), persistent=False)
        # Readers of `.weight` (the vocabulary size) find its shape; the plain weight is not
        # kept, so a worker that drops the plain model frees it (no doubled memory).
        self.weight = torch.empty(linear.weight.shape, dtype=linear.weight.dtype, device="meta")

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class MixedLinear(torch.nn.Module):
    """A linear served by MKL's stock GEMM on the plain weight for the row counts in
    `stock_rows` and by the packed oneDNN weight (PackedLinear) for all others. Holds both
    weights: the plain one is the model's own parameter."""

    def __init__(self, linear: torch.nn.Linear, stock_rows: frozenset[int]):
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.stock_rows = frozenset(stock_rows)
        self.packed = PackedLinear(linear)
        self.weight = linear.weight
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        if x.numel() // self.in_features in self.stock_rows:
            return F.linear(x, self.weight, self.bias)
        return self.packed(x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, stock_rows={sorted(self.stock_rows)}"


def linear_shape(linear: torch.nn.Linear) -> tuple[int, int, bool]:
    return linear.in_features, linear.out_features, linear.bias is not None


@torch.inference_mode()
def choose_linears(model: torch.nn.Module, timer: Callable[[Callable[[], object]], float] | None = None,
                   ) -> dict[tuple[int, int, bool], frozenset[int]]:
    """Per linear weight shape of `model`, the row counts (of 1 … CHOSEN_ROWS) that stock MKL
    serves faster than the packed oneDNN weight by STOCK_MARGIN, timed here, on the machine
    that serves (the two kernels rank differently on different CPUs). `timer(fn)` returns
    seconds per call (default: the median of TIMING_REPEATS interleaved calls)."""
    if can_pack(model) is not None:
        return {}
    representatives: dict[tuple[int, int, bool], torch.nn.Linear] = {}
    for module in model.modules():
        if type(module) is torch.nn.Linear:
            representatives.setdefault(linear_shape(module), module)
    out: dict[tuple[int, int, bool], frozenset[int]] = {}
    for shape, linear in representatives.items():
        packed = PackedLinear(linear)
        stock_rows = set()
        for rows in range(1, CHOSEN_ROWS + 1):
            x = torch.randn(rows, linear.in_features)
            stock_s, packed_s = _time_pair(lambda: F.linear(x, linear.weight, linear.bias), lambda: packed(x), timer)
            if stock_s < (1.0 - STOCK_MARGIN) * packed_s:
                stock_rows.add(rows)
        out[shape] = frozenset(stock_rows)
    return out


def _time_pair(first: Callable[[], object], second: Callable[[], object],
               timer: Callable[[Callable[[], object]], float] | None) -> tuple[float, float]:
    if timer is not None:
        return timer(first), timer(second)
    first(), second()  # warm-up: oneDNN builds its kernel for the shape
    samples: tuple[list[float], list[float]] = ([], [])
    for _ in range(TIMING_REPEATS):
        for fn, seen in ((first, samples[0]), (second, samples[1])):
            began = time.perf_counter()
            fn()
            seen.append(time.perf_counter() - began)
    return statistics.median(samples[0]), statistics.median(samples[1])


def can_pack(model: torch.nn.Module) -> str | None:
    """None when the model can take packed linears; otherwise why not."""
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN (mkldnn)"
    params = list(model.parameters())
    if not params:
        return "the model has no parameters"
    if any(p.device.type != "cpu" for p in params):
        return "the model is not on CPU"
    if any(p.dtype not in PACKABLE_DTYPES for p in params if p.is_floating_point()):
        return f"only {', '.join(map(str, PACKABLE_DTYPES))} weights are packed"
    return None


def _clone_tree(module: torch.nn.Module, swap) -> torch.nn.Module:
    """A copy of the module tree: every module a new object (attributes shared, so the
    parameters are the original's), each child passed through swap(name, child) first."""
    clone = copy.copy(module)
    clone._modules = {}
    for name, child in module._modules.items():
        if child is None:
            clone._modules[name] = None
            continue
        replaced = swap(name, child)
        clone._modules[name] = replaced if replaced is not None else _clone_tree(child, swap)
    return clone


def _register_attention() -> None:
    AttentionInterface.register(SPECDEC_ATTENTION, gqa_sdpa_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(SPECDEC_ATTENTION, sdpa_mask)


def gqa_sdpa_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                       is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention, with grouped-query heads handled inside SDPA.

    query: [batch, heads, q, head_dim]; key, value: [batch, kv_heads, kv, head_dim];
    attention_mask: bool [batch, 1, q, kv] or None. Returns [batch, q, heads, head_dim].
    Inside a packed multi-session forward (specdec.runtime.packed) each session attends to its own
    cache instead.
    """
    if packed.active() is not None:  # a packed multi-session forward (specdec.runtime.packed)
        return packed_attention(module, query, scaling), None
    q_length, kv_length = query.shape[2], key.shape[2]
    # Without a mask, SDPA's top-left causal alignment is right only when q == kv (a prefill);
    # a single query attends to everything. transformers drops the mask exactly then; any
    # other case (soft-capping, position bias, dropout) goes to transformers' own SDPA path.
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    causal = bool(attention_mask is None and q_length > 1 and is_causal)
    if (kwargs.get("softcap") is not None or kwargs.get("position_bias") is not None or dropout
            or (causal and q_length != kv_length)):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling,
                                         is_causal=causal, enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None  # [batch, q, heads, head_dim]


def fast_cpu_model(model: torch.nn.Module, pack_linears: bool = True, gqa_attention: bool = True,
                   stock_rows: dict[tuple[int, int, bool], frozenset[int]] | None = None) -> torch.nn.Module:
    """The serving copy of a model: packed linears (CPU fp32 only) and specdec's attention
    function (in-SDPA GQA, and packed multi-session batches: specdec.runtime.packed), which also
    serves GPU models. Returns `model` itself, unchanged, when neither applies.

    stock_rows (choose_linears' answer): per weight shape, the row counts MKL's stock GEMM
    serves instead of the packed weight (a MixedLinear); none given, every linear is packed."""
    reason = can_pack(model)
    if reason is not None and pack_linears:
        log.info("packed linears off for %s: %s", type(model).__name__, reason)
        pack_linears = False
    if not pack_linears and not gqa_attention:
        return model

    def swap(name: str, child: torch.nn.Module):
        if not pack_linears or type(child) is not torch.nn.Linear:
            return None
        rows = (stock_rows or {}).get(linear_shape(child))
        return MixedLinear(child, rows) if rows else PackedLinear(child)

    with torch.no_grad():
        fast = _clone_tree(model, swap)
    packed = sum(isinstance(m, PackedLinear) for m in fast.modules())  # a MixedLinear holds one
    mixed = sorted({f"{m.in_features}x{m.out_features} at {sorted(m.stock_rows)} rows"
                    for m in fast.modules() if isinstance(m, MixedLinear)})
    if mixed:
        log.info("CPU fast path: stock MKL measured faster for %s", "; ".join(mixed))
    config = getattr(model, "config", None)
    uses_sdpa = config is not None and getattr(config, "_attn_implementation", None) == "sdpa"
    if not packed and not uses_sdpa:
        return model
    if gqa_attention and uses_sdpa:
        _register_attention()
        fast_config = copy.copy(config)
        fast_config._attn_implementation_internal = SPECDEC_ATTENTION
        # Modules hold the config they were built with; the copies get the copy, so the
        # original model keeps its own attention implementation.
        for module in fast.modules():
            if getattr(module, "config", None) is config:
                module.config = fast_config
    log.info("CPU fast path: %d linear layers packed for oneDNN; attention %s", packed,
             getattr(getattr(fast, "config", None), "_attn_implementation", None))
    return fast


@torch.inference_mode()
def agrees(model: torch.nn.Module, fast: torch.nn.Module) -> bool:
    """A load-time check of the copy on a short input: logits within SELF_CHECK_TOLERANCE
    of the largest; False also when the copy fails to run (say, a model that reads a
    linear's `.weight` itself instead of calling the module)."""
    try:
        vocab = model.get_input_embeddings().num_embeddings
        ids = torch.arange(SELF_CHECK_TOKENS)[None] % vocab  # [1, n]
        plain_logits = model(input_ids=ids).logits.float()  # [1, n, V]
        fast_logits = fast(input_ids=ids).logits.float()
    except Exception as exc:  # noqa: BLE001 - any failure means "do not serve the copy"
        log.warning("CPU fast path self-check failed: %s", exc)
        return False
    scale = plain_logits.abs().max().clamp_min(1e-6)
    return bool((plain_logits - fast_logits).abs().max() <= SELF_CHECK_TOLERANCE * scale)


def new_cache(config):
    """A transformers DynamicCache whose full-attention layers are BufferedLayers."""
    return BufferedCache(config)


class Footprint:
    """The bytes the buffers of one cache's BufferedLayers hold: each layer adds what it
    allocates and subtracts what it lets go."""

    __slots__ = ("bytes",)

    def __init__(self):
        self.bytes = 0


class BufferedCache(DynamicCache):
    """A DynamicCache whose full-attention layers are BufferedLayers. They report every
    buffer they allocate to the cache's `footprint`, so `held_bytes` reads a running count
    instead of every layer's tensors; other layers (sliding-window ones) are measured as
    they are (specdec.runtime.memory)."""

    def __init__(self, config):
        super().__init__(config=config)
        self.footprint = Footprint()
        self.layers = [BufferedLayer(self.footprint) if type(layer) is DynamicLayer else layer
                       for layer in self.layers]
        self._unbuffered = [layer for layer in self.layers if not isinstance(layer, BufferedLayer)]

    def held_bytes(self) -> int:
        """The bytes this cache keeps allocated: its buffers' capacity, not its length."""
        return self.footprint.bytes + (storage_bytes(tensors_of(self._unbuffered)) if self._unbuffered else 0)


def _nbytes(tensor: torch.Tensor | None) -> int:
    return 0 if tensor is None else tensor.untyped_storage().nbytes()


class BufferedLayer(DynamicLayer):
    """A DynamicLayer whose keys and values are views into buffers with headroom: appending
    n tokens writes n rows instead of copying the whole context (DynamicLayer's torch.cat).
    Cropping (DynamicLayer.crop) narrows the views; the next update overwrites the rows.
    Invariant: `footprint` (shared with the other layers of its cache) includes exactly the
    bytes of the two buffers this layer holds."""

    def __init__(self, footprint: Footprint | None = None):
        super().__init__()
        self.footprint = footprint if footprint is not None else Footprint()
        self._key_buffer = self._value_buffer = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._set_buffers(None, None)

    def _set_buffers(self, keys: torch.Tensor | None, values: torch.Tensor | None) -> None:
        self.footprint.bytes += (_nbytes(keys) + _nbytes(values)
                                 - _nbytes(self._key_buffer) - _nbytes(self._value_buffer))
        self._key_buffer, self._value_buffer = keys, values

    def _capacity(self) -> int:
        return 0 if self._key_buffer is None else self._key_buffer.shape[-2]

    def _views_are_ours(self, key_states: torch.Tensor) -> bool:
        # reorder_cache, batch_select_indices and friends reassign keys to fresh tensors.
        return (self._key_buffer is not None and self.keys.numel() > 0
                and self.keys.data_ptr() == self._key_buffer.data_ptr()
                and self.values.data_ptr() == self._value_buffer.data_ptr()
                and self._key_buffer.shape[:-2] == key_states.shape[:-2])

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        # key_states, value_states: [batch, kv_heads, n, head_dim]
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        length = self.get_seq_length()
        needed = length + key_states.shape[-2]
        if needed > self._capacity() or not self._views_are_ours(key_states):
            self._grow(length, needed, key_states, value_states)
        self._key_buffer[..., length:needed, :] = key_states
        self._value_buffer[..., length:needed, :] = value_states
        self.keys = self._key_buffer[..., :needed, :]  # [batch, kv_heads, needed, head_dim]
        self.values = self._value_buffer[..., :needed, :]
        return self.keys, self.values

    def _grow(self, length: int, needed: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        capacity = max(needed, int(self._capacity() * KV_GROWTH))
        capacity = -(-capacity // KV_BLOCK_TOKENS) * KV_BLOCK_TOKENS
        keys = key_states.new_empty((*key_states.shape[:-2], capacity, key_states.shape[-1]))
        values = value_states.new_empty((*value_states.shape[:-2], capacity, value_states.shape[-1]))
        if length:
            keys[..., :length, :] = self.keys
            values[..., :length, :] = self.values
        self._set_buffers(keys, values)

