"""A paged KV cache: every session's keys and values live in fixed-size blocks of one pool
preallocated per model, found through the session's block table (vLLM's PagedAttention,
Kwon et al., arXiv 2309.06180), with prefix caching by block hashes (vLLM and SGLang's
automatic prefix caching; RadixAttention, arXiv 2312.07104, shares prefixes the same way
through a radix tree).

Logical position p of a session is row p % block_size of block block_table[p // block_size];
its flat slot in a layer's pool is block * block_size + row. A session grows block by block,
so it holds at most one partly filled block, and memory is handed back the moment a draft is
rejected or a session ends.

Prefix caching. A FULL block is named by a chained hash: that of the previous block and its
own token ids (the first block's chain starts from the cache's namespace: the model, and a
tenant where cache hits must not cross tenants), so equal names mean equal token prefixes
and hence equal keys and values. A new session whose prompt starts with cached blocks takes
them (`match_prefix`, reference count + 1) instead of recomputing them. A cached block nobody
references stays in the pool, in an LRU, until a fresh block is needed; blocks are evicted
oldest first, and a session's blocks enter the LRU tail first, so a prefix outlives its
continuations (vLLM frees a request's blocks in reverse order for the same reason).

Invariants (BlockAllocator, PagedKVCache):
- every usable block is in exactly one of: the free list, the LRU (hashed, referenced by
  nobody), in use (reference count ≥ 1);
- a block registered under a hash holds exactly the keys and values of the tokens it names;
- a block is never written while shared (reference count > 1) or registered: `reserve` first
  copies it (copy-on-write) or, when the session alone holds it, drops its hash;
- a session's positions [length, writable_end) lie in blocks it alone holds, unhashed: only
  those are written by a step (specdec.runtime.paged_step) or made committed (`commit`).

The protocol of one step: `reserve(session, n)` (may raise PoolExhausted, changing nothing),
the forward writes the n new tokens' K/V at positions length..length + n - 1, then
`commit(session, accepted_ids)` for a chain, or `compact(session, length, kept)` then
`commit` for a tree. Reserved blocks past the committed tokens stay with the session for its
next step; `truncate(session, session.length)` hands them back, `truncate` to fewer tokens
rolls committed ones back, `release` ends the session. Not thread-safe: one step at a time.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import pairwise

import torch

from specdec.errors import ResourceExhausted

# Block 0 is never handed to a session: padded rows of a fixed-size step write into it and
# padded block-table entries name it (specdec.runtime.paged_step), so a captured graph never
# writes into a live block.
PAD_BLOCK = 0
DEFAULT_BLOCK_SIZE = 16
# The fraction of the GPU memory free after loading the weights that the pool may take.
DEFAULT_KV_MEMORY_FRACTION = 0.9
_HASH_ROOT_TAG = b"specdec-prefix-cache\0"


class PoolExhausted(ResourceExhausted):
    """The KV pool cannot hold a step's new blocks, even after evicting every cached block
    nobody references. Nothing was allocated."""


@dataclass(frozen=True)
class KVShape:
    """Per-token cache geometry of a model: decoder layers, key/value heads, head size."""

    layers: int
    kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, config) -> KVShape:
        cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return cls(int(cfg.num_hidden_layers), int(heads), int(head_dim))


def block_bytes(shape: KVShape, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block over all layers, keys and values."""
    return 2 * shape.layers * block_size * shape.kv_heads * shape.head_dim * dtype.itemsize


def pool_blocks(bytes_per_block: int, device: str | torch.device, max_cache_bytes: int | None = None,
                kv_memory_fraction: float = DEFAULT_KV_MEMORY_FRACTION) -> int:
    """How many blocks the pool gets: on CUDA (without max_cache_bytes) a fraction of the GPU
    memory free now, so call it after the weights are loaded; elsewhere, or when given, the
    byte budget (`--max-cache-mb`). Includes PAD_BLOCK."""
    device = torch.device(device)
    if max_cache_bytes is None:
        if device.type != "cuda":
            raise ValueError("a pool off CUDA is sized by a byte budget (max_cache_bytes)")
        if not 0.0 < kv_memory_fraction <= 1.0:
            raise ValueError(f"kv_memory_fraction must be in (0, 1], got {kv_memory_fraction}")
        free, _total = torch.cuda.mem_get_info(device)
        budget = int(free * kv_memory_fraction)
    else:
        budget = int(max_cache_bytes)
    blocks = budget // bytes_per_block
    if blocks < 2:
        raise ValueError(f"a budget of {budget} bytes holds {blocks} blocks of {bytes_per_block} bytes; "
                         "the pool needs at least 2 (one is the pad block)")
    return blocks


class KVPool:
    """Keys and values of every layer, allocated once: two tensors
    [layers, num_blocks, block_size, kv_heads, head_dim]; `layer(i)` gives that layer's
    pools [num_blocks, block_size, kv_heads, head_dim] as views. Not initialised: nothing
    reads a position before a step wrote it (the attention reads a session's first
    context + n positions only, and a kernel masks its loads past them), and untouched pages
    of a large pool cost no memory on CPU until blocks are used."""

    def __init__(self, shape: KVShape, num_blocks: int, block_size: int = DEFAULT_BLOCK_SIZE,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        if num_blocks < 2 or block_size < 1:
            raise ValueError(f"a pool needs at least 2 blocks of at least 1 token, got {num_blocks} × {block_size}")
        self.shape, self.num_blocks, self.block_size = shape, num_blocks, block_size
        dims = (shape.layers, num_blocks, block_size, shape.kv_heads, shape.head_dim)
        self.keys = torch.empty(dims, dtype=dtype, device=device)
        self.values = torch.empty(dims, dtype=dtype, device=device)
        self.dtype, self.device = dtype, self.keys.device  # "cuda" resolved to "cuda:N"

    @classmethod
    def for_model(cls, config, num_blocks: int, block_size: int = DEFAULT_BLOCK_SIZE,
                  dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> KVPool:
        return cls(KVShape.of(config), num_blocks, block_size, dtype, device)

    @property
    def block_bytes(self) -> int:
        return block_bytes(self.shape, self.block_size, self.dtype)

    @property
    def nbytes(self) -> int:
        """What the pool holds allocated, in use or not."""
        return self.num_blocks * self.block_bytes

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[index], self.values[index]  # each [num_blocks, block_size, kv_heads, head_dim]

    @torch.no_grad()
    def copy_block(self, source: int, target: int) -> None:
        """Every layer's rows of block `source` into block `target`."""
        self.keys[:, target] = self.keys[:, source]
        self.values[:, target] = self.values[:, source]

    @torch.no_grad()
    def move_slots(self, sources: Sequence[int], targets: Sequence[int]) -> None:
        """Every layer's keys and values at flat slots `sources` into `targets`. The sources
        are read before any target is written, so the two may overlap."""
        src = torch.tensor(sources, dtype=torch.long, device=self.device)
        dst = torch.tensor(targets, dtype=torch.long, device=self.device)
        for pool in (self.keys, self.values):
            flat = pool.view(pool.shape[0], -1, *pool.shape[3:])  # [layers, blocks · block_size, kv_heads, d]
            flat[:, dst] = flat[:, src]


class BlockAllocator:
    """Block ids, their reference counts and the prefix cache's names; no tensors.

    The free list is a stack, so a block freed by a rollback is the next one handed out
    (the refeed writes the same memory it just left)."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, PAD_BLOCK, -1))  # pop() takes the lowest id first
        self._refs = [0] * num_blocks
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; oldest first
        self._by_hash: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}

    @property
    def usable(self) -> int:
        return self.num_blocks - 1

    @property
    def available(self) -> int:
        """Blocks a fresh allocation can take: free ones and cached ones nobody references."""
        return len(self._free) + len(self._lru)

    @property
    def in_use(self) -> int:
        return self.usable - self.available

    @property
    def cached(self) -> int:
        """Cached blocks nobody references (evictable)."""
        return len(self._lru)

    def refcount(self, block: int) -> int:
        return self._refs[block]

    def hash_of(self, block: int) -> bytes | None:
        return self._hash_of.get(block)

    def lookup(self, block_hash: bytes) -> int | None:
        return self._by_hash.get(block_hash)

    def allocate(self) -> int:
        """A fresh block (reference count 1, no name): a free one, else the oldest cached one."""
        if self._free:
            block = self._free.pop()
        elif self._lru:
            block, _ = self._lru.popitem(last=False)
            self.unregister(block)
        else:
            raise PoolExhausted("KV pool exhausted: no free or evictable block")
        self._refs[block] = 1
        return block

    def share(self, block: int) -> None:
        """One more reference to a cached block (leaving the LRU if nobody held it)."""
        if self._refs[block] == 0:
            del self._lru[block]
        self._refs[block] += 1

    def drop(self, block: int) -> None:
        """One reference fewer; an unreferenced block goes to the LRU if named, else is free."""
        assert self._refs[block] > 0, f"block {block} dropped more often than taken"
        self._refs[block] -= 1
        if self._refs[block] == 0:
            if block in self._hash_of:
                self._lru[block] = None
            else:
                self._free.append(block)

    def register(self, block: int, block_hash: bytes) -> bool:
        """Names `block` by `block_hash`; False (and nothing changes) when another block
        already has that name or this one has a name."""
        if block_hash in self._by_hash or block in self._hash_of:
            return False
        self._by_hash[block_hash] = block
        self._hash_of[block] = block_hash
        return True

    def unregister(self, block: int) -> None:
        block_hash = self._hash_of.pop(block, None)
        if block_hash is not None:
            del self._by_hash[block_hash]

    def state(self) -> tuple:
        """Everything the allocator holds, for tests that check an operation changed nothing."""
        return (tuple(self._free), tuple(self._refs), tuple(self._lru), tuple(sorted(self._hash_of.items())))


@dataclass
class PagedSession:
    """One sequence in the pool. block_table[b] holds positions b·block_size ..
    (b + 1)·block_size - 1; `length` tokens are committed (their ids in `token_ids`),
    `hashes[b]` names full block b of them; positions [length, writable_end) were reserved."""

    block_table: list[int] = field(default_factory=list)
    length: int = 0
    token_ids: list[int] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)
    writable_end: int = 0


class PagedKVCache:
    """The pool, its allocator and the prefix cache: what every session of one model shares."""

    def __init__(self, pool: KVPool, namespace: str = "", prefix_caching: bool = True):
        """namespace: what must match besides the tokens for a cached block to be reused (the
        model's fingerprint; a tenant too where hits must not cross tenants). Without
        prefix_caching no block is ever named: `match_prefix` finds nothing and a released
        block is free at once (a cache whose entries depend on more than the token ids,
        like a draft head's, fed the target's features)."""
        self.pool = pool
        self.prefix_caching = prefix_caching
        self.blocks = BlockAllocator(pool.num_blocks)
        self._root = hashlib.sha256(_HASH_ROOT_TAG + namespace.encode()).digest()

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    @property
    def bytes_in_use(self) -> int:
        """Blocks referenced by some session × block bytes: what the cache-bytes metric reports.
        Cached blocks nobody references are not counted (they are evicted on demand)."""
        return self.blocks.in_use * self.pool.block_bytes

    def held_bytes(self, session: PagedSession) -> int:
        """The bytes of the blocks this session references (a shared block counts for each)."""
        return len(session.block_table) * self.pool.block_bytes

    def _chain(self, parent: bytes | None, tokens: Sequence[int]) -> bytes:
        return hashlib.sha256((parent or self._root) + array("q", tokens).tobytes()).digest()

    def match_prefix(self, session: PagedSession, token_ids: Sequence[int]) -> int:
        """Extends the session with the cached full blocks that follow its committed tokens
        in `token_ids` and returns how many tokens they add (a multiple of block_size): a new
        session takes a cached prefix, and one fed a prompt piece by piece (chunked prefill)
        takes each next piece another session already computed. Only where the session ends
        on a named block boundary and `token_ids` starts with its tokens; else 0. The last
        token is always left to feed (its logits are what the caller feeds it for): when a
        cached block ends with it, the session takes the block and rolls back one token, and
        its next step writes that position into a copy (reserve's copy-on-write)."""
        size, start = self.block_size, session.length
        if (not self.prefix_caching or start % size or len(session.hashes) != start // size
                or list(token_ids[:start]) != session.token_ids):
            return 0
        if len(session.block_table) > start // size:
            self.truncate(session, start)  # a reserved, unwritten tail block goes back
        parent = session.hashes[-1] if session.hashes else None
        for begin in range(start, len(token_ids) - size + 1, size):
            block_hash = self._chain(parent, token_ids[begin:begin + size])
            block = self.blocks.lookup(block_hash)
            if block is None:
                break
            self.blocks.share(block)
            session.block_table.append(block)
            session.hashes.append(block_hash)
            parent = block_hash
        session.length = session.writable_end = len(session.block_table) * size
        session.token_ids.extend(token_ids[start:session.length])  # in place: callers alias the list
        if session.length and session.length == len(token_ids):
            self.truncate(session, session.length - 1)
        return session.length - start

    def reserve(self, session: PagedSession, n_new: int) -> None:
        """Makes positions length .. length + n_new - 1 writable: allocates the blocks they
        need (evicting cached blocks nobody references, oldest first) and copies a shared
        block they touch (copy-on-write). All or nothing: raises PoolExhausted and leaves the
        pool and the session unchanged when the blocks do not fit."""
        if n_new < 1:
            raise ValueError(f"reserve needs at least one new token, got {n_new}")
        size = self.block_size
        first = session.length // size  # the first block the step writes into
        wanted = -(-(session.length + n_new) // size)  # blocks the table must have
        copies = [b for b in range(first, len(session.block_table))
                  if self.blocks.refcount(session.block_table[b]) > 1]
        needed = max(0, wanted - len(session.block_table)) + len(copies)
        if needed > self.blocks.available:
            raise PoolExhausted(f"KV pool exhausted: a step needs {needed} blocks, {self.blocks.available} of "
                                f"{self.blocks.usable} are free or evictable")
        for b in copies:
            shared = session.block_table[b]
            fresh = self.blocks.allocate()
            self.pool.copy_block(shared, fresh)
            self.blocks.drop(shared)
            session.block_table[b] = fresh
        for b in range(first, len(session.block_table)):
            # Held alone now; its name would no longer describe it once written.
            self.blocks.unregister(session.block_table[b])
        while len(session.block_table) < wanted:
            session.block_table.append(self.blocks.allocate())
        session.writable_end = len(session.block_table) * size

    def commit(self, session: PagedSession, token_ids: Sequence[int]) -> None:
        """Appends `token_ids`, whose K/V a step wrote at positions length.., to the session's
        committed tokens, and names every block they complete."""
        end = session.length + len(token_ids)
        if end > session.writable_end:
            raise ValueError(f"commit of {len(token_ids)} tokens at {session.length}: only positions up to "
                             f"{session.writable_end} were reserved")
        session.token_ids.extend(token_ids)
        session.length = end
        size = self.block_size
        if not self.prefix_caching:
            return
        for b in range(len(session.hashes), end // size):
            parent = session.hashes[-1] if session.hashes else None
            block_hash = self._chain(parent, session.token_ids[b * size:(b + 1) * size])
            session.hashes.append(block_hash)
            # Another session may have computed the same block first: ours then stays
            # unnamed and is freed, not cached, when released.
            self.blocks.register(session.block_table[b], block_hash)

    def truncate(self, session: PagedSession, length: int) -> None:
        """Rolls the session back to its first `length` committed tokens (a rejected draft, a
        resync): blocks past them are dropped (free at once when unnamed, else cached) and the
        next step must reserve again. A kept block stays named; `reserve` copies or unnames
        it before it is written."""
        if not 0 <= length <= session.length:
            raise ValueError(f"truncate to {length} tokens of a session of {session.length}")
        keep = -(-length // self.block_size)
        for block in reversed(session.block_table[keep:]):
            self.blocks.drop(block)
        del session.block_table[keep:]
        del session.token_ids[length:]
        del session.hashes[length // self.block_size:]
        session.length = session.writable_end = length

    def release(self, session: PagedSession) -> None:
        """Ends the session: drops its blocks, tail first, so its prefix is evicted last."""
        self.truncate(session, 0)

    def compact(self, session: PagedSession, context_len: int, kept: Sequence[int]) -> None:
        """After a tree step wrote n nodes at positions context_len .. context_len + n - 1 (in
        block order), moves the K/V of nodes `kept` (indices among the new tokens, a root-to-
        leaf path: increasing) to positions context_len, context_len + 1, ... Then
        commit(session, their token ids). A node's K/V depend only on its ancestors, so the
        moved entries are those a chain feed of the path writes (up to float rounding)."""
        if context_len != session.length:
            raise ValueError(f"compact at {context_len}, but the session has {session.length} committed tokens")
        if any(b <= a for a, b in pairwise(kept)) or (kept and kept[0] < 0):
            raise ValueError(f"kept nodes must be increasing indices, got {list(kept)}")
        if kept and context_len + kept[-1] >= session.writable_end:
            raise ValueError(f"node {kept[-1]} lies beyond the reserved positions")
        moves = [(k, i) for i, k in enumerate(kept) if k != i]
        if moves:
            sources = self.slots_of(session, [context_len + k for k, _ in moves])
            targets = self.slots_of(session, [context_len + i for _, i in moves])
            self.pool.move_slots(sources, targets)

    def slots_of(self, session: PagedSession, positions: Sequence[int]) -> list[int]:
        """Flat pool slots (block · block_size + row) of the session's `positions`."""
        size, table = self.block_size, session.block_table
        return [table[p // size] * size + p % size for p in positions]
