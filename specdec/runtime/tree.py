"""Tree blocks: several candidate continuations of one prefix scored in the same forward.

A block's tokens are given with `parents`: per token the index of its parent in the block
(-1: it follows the cache directly), parents before children. Each token sits at its depth
(its position is past + depth) and attends to every cached token, its ancestors and itself.
Tree tokens come after the chain they branch from, so dropping them is a crop of the cache's
tail.
"""

from __future__ import annotations

import torch

from specdec.runtime.compat import full_attention_only

# A tree token whose parent is this follows the session's cache directly (no parent in the block).
ROOT_PARENT = -1


def check_tree(parents: list[int]) -> None:
    """A block's parent list must name only earlier tokens (or -1, the cache)."""
    for row, parent in enumerate(parents):
        if not -1 <= parent < row:
            raise ValueError(f"tree token {row} has parent {parent}: parents must come before their children")


def tree_mask(parents: list[int], past: int, device: torch.device) -> torch.Tensor:
    """[1, 1, n, past + n] bool: token r sees every cached token, its ancestors and itself."""
    check_tree(parents)
    n = len(parents)
    seen = torch.eye(n, dtype=torch.bool)
    for row, parent in enumerate(parents):
        if parent >= 0:
            seen[row] |= seen[parent]
    cached = torch.ones((n, past), dtype=torch.bool)
    return torch.cat([cached, seen], 1)[None, None].to(device)


def tree_positions(parents: list[int], past: int, device: torch.device) -> torch.Tensor:
    """[n]: each tree token's absolute position, past + its depth."""
    depth: list[int] = []
    for parent in parents:
        depth.append(depth[parent] + 1 if parent >= 0 else 0)
    return torch.tensor(depth, dtype=torch.long, device=device) + past


def supports_plain_trees(model: torch.nn.Module) -> str | None:
    """None when `model`, served as it is (no packed forward), can run a tree block alone:
    its attention takes a ready additive 4D mask (transformers' sdpa and eager do) and every
    layer attends to the whole context; otherwise why not."""
    config = getattr(model, "config", None)
    implementation = getattr(config, "_attn_implementation", None)
    if implementation not in ("sdpa", "eager"):
        return f"attention {implementation!r} does not take a custom mask"
    return full_attention_only(config)
