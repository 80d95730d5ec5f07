"""What a session's caches keep allocated, in bytes: the measure a worker's cache budget
counts (`--max-cache-mb`, specdec.sessions.SessionStore, `specdec_worker_cache_bytes`).

A tensor keeps its whole storage alive, not only the elements it views: a BufferedLayer
(specdec.runtime.cpu) holds its whole buffer, however few tokens it has filled, and a
cropped transformers DynamicLayer still holds its uncropped keys and values until the next
update copies them. So the bytes a cache holds are those of the distinct storages behind its
tensors, each counted once however many views share it. A storage's size is metadata: reading
it neither synchronises with a device nor touches the data.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one storage count it once)."""
    sizes: dict[tuple[torch.device, int], int] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        sizes[(storage.device, storage.data_ptr())] = storage.nbytes()
    return sum(sizes.values())


def tensors_of(parts: Iterable[Any]) -> Iterable[torch.Tensor]:
    """Every tensor attribute of each object in `parts` (a cache's layers, a cache itself)."""
    for part in parts:
        for value in vars(part).values():
            if isinstance(value, torch.Tensor):
                yield value


def cache_held_bytes(cache: Any) -> int:
    """The bytes `cache` keeps allocated: its own count where it keeps one (a `held_bytes()`
    method: specdec.runtime.cpu.BufferedCache, specdec.eagle.HeadCache), else the storages of
    the tensors its layers hold (a transformers Cache) or it holds itself; 0 for None."""
    if cache is None:
        return 0
    own = getattr(cache, "held_bytes", None)
    if own is not None:
        return int(own())
    layers = getattr(cache, "layers", None)
    return storage_bytes(tensors_of(layers if layers is not None else [cache]))
