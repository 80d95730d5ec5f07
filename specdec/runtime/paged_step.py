"""One forward's inputs over a paged KV cache (specdec.runtime.paged), packed for every session
at once and held in static buffers.

The new tokens of B sessions form one packed row of T = Σ nᵢ tokens (the varlen layout of
vLLM's PagedAttention, arXiv 2309.06180). Per token: its id, its RoPE position (context + j
for a chain, context + depth for a tree node) and the flat pool slot its K/V are written to
(block · block_size + row of logical position context + j: tree nodes take consecutive
slots in block order, whatever their depth). Per session: its block table, its context
length (tokens in the pool before the step), where its rows start, and, when some session of
the step is a tree, a [Qmax, Qmax] mask (a chain's rows are causal).
specdec.runtime.paged_attention states what the attention reads.

Built for CUDA graphs: every field is a view into ONE preallocated byte arena sized by
StepLimits, filled on the host and copied to the device in one transfer per step (the same
arena on CPU: no copy); the fields keep their addresses from step to step. Past a step's T
tokens and B sessions the buffers hold padding a captured graph can run on: padded sessions
have no tokens and a zero context, and padded tokens write into PAD_BLOCK. A plan may pad the
step to a fixed token count (`pad_to`, specdec.runtime.graphs): its StepInputs then span every
session slot and the padded tokens belong to one more session, the arena's last slot
(PAD_SESSION: no block but PAD_BLOCK in its table, zero context), so every per-session loop or
grid covers exactly the padded tokens. Otherwise StepInputs gives the forward views cut to the
step's exact T and B. Either way the forward takes every size from the host, never from a
tensor's value.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from specdec.runtime.paged import PAD_BLOCK, PagedKVCache, PagedSession
from specdec.runtime.tree import check_tree

# Each field of the arena starts at a multiple of this many bytes (int64 alignment, with room).
ARENA_ALIGN = 16
_INT64, _INT32, _BOOL = np.dtype(np.int64), np.dtype(np.int32), np.dtype(np.bool_)
_TORCH = {_INT64: torch.int64, _INT32: torch.int32, _BOOL: torch.bool}


@dataclass(frozen=True)
class StepLimits:
    """The most one step may hold; the arena is sized for it once."""

    max_batch: int = 64
    """Sessions in a step."""
    max_tokens: int = 2048
    """New tokens in a step, all sessions together."""
    max_blocks: int = 256
    """Blocks of one session (its context + new tokens, over block_size)."""
    max_query: int = 64
    """New tokens of one session in a step that carries a tree mask (the mask is
    [max_batch, max_query, max_query])."""


@dataclass
class StepRequest:
    """One session's part of a step: its new tokens, fed on top of its committed ones."""

    session: PagedSession
    tokens: list[int]
    parents: list[int] | None = None
    """A tree (specdec.runtime.tree): per token its parent's index in `tokens`, -1 for none."""
    logits_to_keep: int = 1
    """Logits wanted for the last this many of `tokens` (all of them for a tree to verify)."""


@dataclass
class StepInputs:
    """A step's inputs on the model's device, cut to its T tokens and B sessions."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, RoPE positions
    slot_mapping: torch.Tensor  # [T] int64, flat pool slot of each new token's K/V
    logit_rows: torch.Tensor  # [R] int64, rows of the packed T whose logits are returned
    block_tables: torch.Tensor  # [B, max_blocks] int32, PAD_BLOCK past a session's blocks
    context_lens: torch.Tensor  # [B] int32
    query_starts: torch.Tensor  # [B + 1] int32
    tree_mask: torch.Tensor | None  # [B, max_query, max_query] bool; None when no session is a tree
    lengths: list[int]  # nᵢ per session (host)
    logits_to_keep: list[int]  # per session (host); Σ = R


def _layout(limits: StepLimits) -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
    """The arena's fields in order: name → (dtype, shape). Small fields first, the tree mask
    last: a chain-only step copies the arena up to the end of its block tables, a tree step
    up to the end of its masks. Per-session fields have a slot more than max_batch: the
    padding session of a padded step (its block-table row is never written: PAD_BLOCK)."""
    slots = limits.max_batch + 1
    return {
        "input_ids": (_INT64, (limits.max_tokens,)),
        "positions": (_INT64, (limits.max_tokens,)),
        "slot_mapping": (_INT64, (limits.max_tokens,)),
        "logit_rows": (_INT64, (limits.max_tokens,)),
        "context_lens": (_INT32, (slots,)),
        "query_starts": (_INT32, (slots + 1,)),
        "block_tables": (_INT32, (slots, limits.max_blocks)),
        "tree_mask": (_BOOL, (limits.max_batch, limits.max_query, limits.max_query)),
    }


class StepBuffers:
    """The static arena of a step's inputs and the planning that fills it. The StepInputs
    of a plan are views of the arena: the next plan overwrites them, so a step's forward
    must be issued before the next step is planned."""

    def __init__(self, limits: StepLimits, device: str | torch.device = "cpu"):
        self.limits = limits
        self.device = torch.device(device)
        self._offsets: dict[str, int] = {}
        layout = _layout(limits)
        size = 0
        for name, (dtype, shape) in layout.items():
            self._offsets[name] = size
            size += -(-int(np.prod(shape)) * dtype.itemsize // ARENA_ALIGN) * ARENA_ALIGN
        on_cuda = self.device.type == "cuda"
        self._host = torch.zeros(size, dtype=torch.uint8, pin_memory=on_cuda)
        self._device = torch.zeros(size, dtype=torch.uint8, device=self.device) if on_cuda else self._host
        self.device = self._device.device  # "cuda" resolved to "cuda:N"
        # The last host→device copy; the host arena is not refilled until it has run.
        self._copied = torch.cuda.Event() if on_cuda else None
        host_bytes = self._host.numpy()
        self.host: dict[str, np.ndarray] = {}
        self.static: dict[str, torch.Tensor] = {}
        for name, (dtype, shape) in layout.items():
            start, count = self._offsets[name], int(np.prod(shape)) * dtype.itemsize
            self.host[name] = host_bytes[start:start + count].view(dtype).reshape(shape)
            self.static[name] = self._device[start:start + count].view(_TORCH[dtype]).view(shape)
        self.host["query_starts"][:] = 0
        self.host["block_tables"][:] = PAD_BLOCK
        self._to_device(size)  # the padding session's block-table row, PAD_BLOCK for good

    def _end_of(self, name: str, rows: int) -> int:
        """The arena byte just past the first `rows` rows of field `name`."""
        array = self.host[name]
        return self._offsets[name] + rows * array[0].nbytes

    def plan(self, cache: PagedKVCache, requests: list[StepRequest], pad_to: int | None = None) -> StepInputs:
        """Packs the step (each session must have reserved its tokens: PagedKVCache.reserve)
        and copies it to the device. pad_to: a chain-only step padded to that many tokens, its
        StepInputs over every session slot, the padding session's included (module doc); its
        logit_rows, lengths and logits_to_keep are the real sessions' (no logits of padding)."""
        limits, size = self.limits, cache.block_size
        lengths = [len(r.tokens) for r in requests]
        total, batch = sum(lengths), len(requests)
        trees = any(r.parents is not None for r in requests)
        if not 1 <= batch <= limits.max_batch or total > limits.max_tokens:
            raise ValueError(f"a step of {batch} sessions and {total} tokens exceeds the limits {limits}")
        if pad_to is not None and (trees or not total <= pad_to <= limits.max_tokens):
            raise ValueError(f"a step of {total} tokens{' with a tree' if trees else ''} cannot be padded to "
                             f"{pad_to} (at most {limits.max_tokens}, chains only)")
        if len({id(r.session) for r in requests}) != batch:
            raise ValueError("a session appears twice in a step")
        for r, n in zip(requests, lengths):
            s = r.session
            if n < 1 or not 1 <= r.logits_to_keep <= n:
                raise ValueError(f"a session feeds {n} tokens and keeps logits of {r.logits_to_keep}")
            if s.length + n > s.writable_end:
                raise ValueError(f"{n} tokens at {s.length}, but only positions up to {s.writable_end} "
                                 "were reserved (PagedKVCache.reserve)")
            if len(s.block_table) > limits.max_blocks:
                raise ValueError(f"a session of {len(s.block_table)} blocks exceeds max_blocks {limits.max_blocks}")
            if trees and n > limits.max_query:
                raise ValueError(f"{n} tokens of a session in a tree step exceed max_query {limits.max_query}")
            if r.parents is not None:
                if len(r.parents) != n:
                    raise ValueError(f"a tree of {len(r.parents)} parents for {n} tokens")
                check_tree(r.parents)
        if self._copied is not None:
            self._copied.synchronize()
        h = self.host
        offset, row = 0, 0
        h["query_starts"][0] = 0
        for i, (r, n) in enumerate(zip(requests, lengths)):
            s = r.session
            table = np.asarray(s.block_table, dtype=np.int64)
            logical = np.arange(s.length, s.length + n)  # [n] positions the K/V go to
            h["input_ids"][offset:offset + n] = r.tokens
            h["slot_mapping"][offset:offset + n] = table[logical // size] * size + logical % size
            depth = logical - s.length if r.parents is None else _depths(r.parents)
            h["positions"][offset:offset + n] = s.length + depth
            keep = r.logits_to_keep
            h["logit_rows"][row:row + keep] = np.arange(offset + n - keep, offset + n)
            h["context_lens"][i] = s.length
            h["query_starts"][i + 1] = offset + n
            h["block_tables"][i, :len(table)] = table
            h["block_tables"][i, len(table):] = PAD_BLOCK
            if trees:
                mask = h["tree_mask"][i]
                mask[:] = False
                mask[:n, :n] = np.tril(np.ones((n, n), dtype=np.bool_)) if r.parents is None else _ancestry(r.parents)
            offset, row = offset + n, row + keep
        # Padding a graph captured at the full size runs on; nothing reads it eagerly.
        for name in ("input_ids", "positions"):
            h[name][offset:] = 0
        h["logit_rows"][row:] = 0
        h["slot_mapping"][offset:] = PAD_BLOCK * size
        h["context_lens"][batch:] = 0
        h["query_starts"][batch + 1:] = offset
        d = self.static
        if pad_to is not None:
            h["query_starts"][-1] = pad_to  # the padding session holds the padded tokens
            self._to_device(self._end_of("block_tables", batch))
            return StepInputs(
                input_ids=d["input_ids"][:pad_to], positions=d["positions"][:pad_to],
                slot_mapping=d["slot_mapping"][:pad_to], logit_rows=d["logit_rows"][:row],
                block_tables=d["block_tables"], context_lens=d["context_lens"], query_starts=d["query_starts"],
                tree_mask=None, lengths=lengths, logits_to_keep=[r.logits_to_keep for r in requests],
            )
        self._to_device(self._end_of("tree_mask", batch) if trees else self._end_of("block_tables", batch))
        return StepInputs(
            input_ids=d["input_ids"][:total], positions=d["positions"][:total],
            slot_mapping=d["slot_mapping"][:total], logit_rows=d["logit_rows"][:row],
            block_tables=d["block_tables"][:batch], context_lens=d["context_lens"][:batch],
            query_starts=d["query_starts"][:batch + 1], tree_mask=d["tree_mask"][:batch] if trees else None,
            lengths=lengths, logits_to_keep=[r.logits_to_keep for r in requests],
        )

    def _to_device(self, end: int) -> None:
        """The one host→device copy of a step: the arena's first `end` bytes."""
        if self._device is self._host:
            return
        self._device[:end].copy_(self._host[:end], non_blocking=True)
        self._copied.record()


def _depths(parents: list[int]) -> np.ndarray:
    depth: list[int] = []
    for parent in parents:
        depth.append(depth[parent] + 1 if parent >= 0 else 0)
    return np.asarray(depth, dtype=np.int64)


def _ancestry(parents: list[int]) -> np.ndarray:
    """[n, n] bool: row r is True at r and at each of its ancestors."""
    seen = np.eye(len(parents), dtype=np.bool_)
    for row, parent in enumerate(parents):
        if parent >= 0:
            seen[row] |= seen[parent]
    return seen
