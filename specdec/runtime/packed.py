"""Continuous batching inside one forward pass: the new tokens of many sessions, each on top
of its own KV cache, run through the model as ONE packed sequence.

The tokens of all sessions are concatenated into a single row, [1, T] with T = Σ nᵢ, and
go through the model once: every linear layer, norm and MLP (nearly all the weights, which
is what a decoding step on CPU or GPU pays to read) runs once over all T rows. Only
attention is per session: at each layer, session i's nᵢ keys and values are appended to its
own cache (`PackedCache.update`) and its nᵢ queries attend to that cache alone, causally
(`packed_attention`). No padding, no copying caches into a batch tensor, and sessions of any
context length and any number of new tokens mix freely — the varlen layout vLLM and
FlashAttention use, done with one SDPA call per session and layer.

Positions are given per token (each session continues at its own cache length), so rotary
embeddings are those of the session alone; the causal mask inside a session's block is the
same as in a one-session forward. A session's block may also be a tree (`parents`, specdec.runtime.tree) — several
candidate continuations of one prefix scored in the same pass (target_worker.verify's
alternative draft tokens). Tree tokens come after the chain they branch from, so dropping
them is a crop of the cache's tail. The result equals running each session alone up to float
rounding of the batched matrix products (tests/test_batching.py compares them).

This works for decoder-only models whose attention goes through transformers'
`ALL_ATTENTION_FUNCTIONS` and a cache's `update` — the Llama family (SmolLM2, Llama, Qwen2/3,
Mistral without a sliding window, …) — when served with specdec's attention function
(`SPECDEC_ATTENTION`, registered by specdec.runtime.cpu). Models with sliding-window layers (Gemma 3) are run one
session at a time instead (`CausalLM.feed_batch` falls back); the result is the same.
"""


from __future__ import annotations

import contextvars
from dataclasses import dataclass, field

import torch

from specdec.runtime import attention_threads
from specdec.runtime.compat import cache_kwarg, full_attention_only
from specdec.runtime.paged import KVShape
from specdec.runtime.tree import tree_mask, tree_positions

# The attention implementation name registered with transformers for served models: in-SDPA
# grouped-query attention, and per-session attention inside a packed forward.
SPECDEC_ATTENTION = "specdec_cpu_sdpa"

# The batch being run by the forward pass in progress on this thread, if any.
_ACTIVE: contextvars.ContextVar[PackedBatch | None] = contextvars.ContextVar("specdec_packed_batch", default=None)


@dataclass
class PackedBatch:
    """One packed forward: per session its cache, the offset and count of its new tokens in
    the packed row, and its cache length before the step."""

    caches: list  # per session: a transformers Cache with per-layer `layers`
    offsets: list[int]  # start of session i's tokens in the packed row
    lengths: list[int]  # nᵢ, new tokens of session i (≥ 1)
    past: list[int]  # tokens in session i's cache before the step
    # Per layer, per session: (keys, values) after appending, [1, kv_heads, pastᵢ + nᵢ, d].
    current: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict)
    # Per session: the causal mask of its block against its cache, None when nᵢ = 1.
    masks: list[torch.Tensor | None] = field(default_factory=list)
    # Per session: None for a causal block, or per new token the index of its parent in the
    # block (-1: none, it follows the cache directly), parents before children.
    parents: list[list[int] | None] | None = None

    def _parents(self, i: int) -> list[int] | None:
        return self.parents[i] if self.parents is not None else None

    @property
    def total(self) -> int:
        return sum(self.lengths)

    def position_ids(self, device: torch.device) -> torch.Tensor:
        """[1, T]: each session's tokens continue at its own cache length (a tree's at their
        depth)."""
        parts = []
        for i, (p, n) in enumerate(zip(self.past, self.lengths)):
            parents = self._parents(i)
            parts.append(torch.arange(p, p + n, device=device) if parents is None else
                         tree_positions(parents, p, device))
        return torch.cat(parts)[None]

    def build_masks(self, device: torch.device) -> None:
        self.masks = []
        for i, (past, n) in enumerate(zip(self.past, self.lengths)):
            parents = self._parents(i)
            if parents is not None:
                self.masks.append(tree_mask(parents, past, device))
                continue
            if n == 1:
                self.masks.append(None)  # one query attends to everything cached
                continue
            # Query r (absolute position past + r) sees keys 0..past + r.
            rows = torch.arange(n, device=device)[:, None]  # [n, 1]
            cols = torch.arange(past + n, device=device)[None, :]  # [1, past + n]
            self.masks.append((cols <= past + rows)[None, None])  # [1, 1, n, past + n] bool


class PackedCache:
    """What the model sees as its cache during a packed forward: `update` splits the packed
    keys and values per session and appends each part to that session's own cache layer."""

    is_compileable = False

    def __init__(self, batch: PackedBatch):
        self.batch = batch

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        # key_states, value_states: [1, kv_heads, T, head_dim] for the packed row.
        batch = self.batch
        parts = []
        for cache, offset, n in zip(batch.caches, batch.offsets, batch.lengths):
            parts.append(cache.layers[layer_idx].update(key_states[:, :, offset:offset + n],
                                                        value_states[:, :, offset:offset + n]))
        batch.current[layer_idx] = parts
        # The attention function reads the per-session parts; these are returned unused.
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0


def active() -> PackedBatch | None:
    return _ACTIVE.get()


def packed_attention(module: torch.nn.Module, query: torch.Tensor, scaling: float | None) -> torch.Tensor:
    """Per-session causal attention of a packed query row against each session's own cache.

    query: [1, heads, T, head_dim]. Returns [1, T, heads, head_dim]."""
    batch = _ACTIVE.get()
    parts = batch.current[module.layer_idx]
    outputs = []
    for (keys, values), offset, n, mask in zip(parts, batch.offsets, batch.lengths, batch.masks):
        q = query[:, :, offset:offset + n]  # [1, heads, n, d]
        out = attention_threads.sdpa(q, keys, values, attn_mask=mask, scale=scaling,
                                     enable_gqa=q.shape[1] != keys.shape[1])  # [1, heads, n, d]
        outputs.append(out)
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous()  # [1, T, heads, d]


def supports_packed(model: torch.nn.Module) -> str | None:
    """None when `model` can run packed batches; otherwise why not."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) != SPECDEC_ATTENTION:
        return "the model is not served with specdec's attention function"
    return full_attention_only(config)


@torch.inference_mode()
def packed_forward(model: torch.nn.Module, caches: list, token_lists: list[list[int]],
                   keep: list[int], parents: list[list[int] | None] | None = None) -> list[torch.Tensor]:
    """Runs every session's new tokens in one forward pass; returns per session the logits
    of its last keep[i] positions, [keep[i], V] float32. Each cache must hold exactly the
    session's past (its get_seq_length()). parents[i], when given, makes session i's block
    a tree (PackedBatch.parents); its tokens all enter the cache, in block order."""
    device = next(model.parameters()).device
    lengths = [len(tokens) for tokens in token_lists]
    offsets = [sum(lengths[:i]) for i in range(len(lengths))]
    if parents is not None:
        for tokens, tree in zip(token_lists, parents):
            if tree is not None and len(tree) != len(tokens):
                raise ValueError(f"a tree of {len(tree)} parents for {len(tokens)} tokens")
    batch = PackedBatch(caches=caches, offsets=offsets, lengths=lengths,
                        past=[cache.get_seq_length() for cache in caches], parents=parents)
    batch.build_masks(device)
    input_ids = torch.tensor([[t for tokens in token_lists for t in tokens]], dtype=torch.long, device=device)
    # Rows whose logits are wanted: the last keep[i] of each session's block.
    rows = torch.tensor([o + n - k + j for o, n, k in zip(offsets, lengths, keep) for j in range(k)],
                        dtype=torch.long, device=device)
    # A ready 4D mask makes transformers skip building one; packed_attention masks per session.
    placeholder_mask = torch.ones((1, 1, 1, 1), dtype=torch.bool, device=device)
    shape = KVShape.of(model.config)
    token = _ACTIVE.set(batch)
    try:
        with attention_threads.batched_step(shape.kv_heads, shape.head_dim, lengths,
                                            [p + n for p, n in zip(batch.past, lengths)]):
            out = model(input_ids=input_ids, use_cache=True, position_ids=batch.position_ids(device),
                        attention_mask=placeholder_mask, logits_to_keep=rows,
                        **{cache_kwarg(model): PackedCache(batch)})
    finally:
        _ACTIVE.reset(token)
    logits = out.logits[0].float()  # [Σ keep, V]
    return list(torch.split(logits, keep))
