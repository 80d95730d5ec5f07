"""A CausalLM whose sessions live in one paged KV pool: every step is ONE forward over all its
sessions' new tokens (specdec.runtime.paged_llama), and a session is a block table and a length
(specdec.runtime.paged), with prefix caching.

What changes against the buffered caches of specdec.runtime.lm, for its callers:

- `prepare` of a new session first takes the cached full blocks its context starts with
  (a system prompt, earlier turns, a resync after failover): those tokens are not fed again.
  A caller that needs every position's hidden state (a feature-level head) turns that off.
- A step reserves its blocks before it runs; where the pool is short, the worker's `evict`
  callback frees the least recently used sessions outside the step, and a step that still
  does not fit raises PoolExhausted (RESOURCE_EXHAUSTED) with the pool unchanged.
- `held_bytes` is the session's blocks × block bytes and `bytes_in_use` the pool's blocks in
  use × block bytes: the memory held, not tokens × bytes per token.
- Tree blocks: the chain (each node the child of the one before) is committed and its full
  blocks named for reuse; the alternatives after it are held unnamed (their K/V sit at tree
  positions, not a sequence's), and the caller's crop to the committed length drops them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from specdec.runtime.lm import CausalLM
from specdec.runtime.paged import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_KV_MEMORY_FRACTION,
    KVPool,
    KVShape,
    PagedKVCache,
    PagedSession,
    PoolExhausted,
    block_bytes,
    pool_blocks,
)
from specdec.runtime.graphs import GraphedForward, graph_safe
from specdec.runtime.paged_attention import (
    choose_attention_backend,
    paged_attention_reference,
    paged_attention_sdpa,
)
from specdec.runtime.paged_llama import PagedLlama
from specdec.runtime.paged_step import StepBuffers, StepLimits, StepRequest
from specdec.sessions import Session, SyncedContext

log = logging.getLogger(__name__)

# New tokens a step may carry beyond one whole context: the rounds of the other sessions.
STEP_TOKENS_BEYOND_CONTEXT = 64 * 256


def chain_length(parents: list[int] | None, n: int) -> int:
    """How many leading tokens of a block are a chain (token i the child of token i - 1)."""
    if parents is None:
        return n
    for i, parent in enumerate(parents):
        if parent != i - 1:
            return i
    return n


class PagedCausalLM(CausalLM):
    def __init__(self, model: torch.nn.Module, *, max_cache_bytes: int | None = None,
                 kv_memory_fraction: float = DEFAULT_KV_MEMORY_FRACTION, block_size: int = DEFAULT_BLOCK_SIZE,
                 attention: Callable[..., torch.Tensor] | None = None, namespace: str = "",
                 max_batch: int = 64, cuda_graphs: bool = False):
        """The pool is allocated here, once: from max_cache_bytes when given (CPU), else from
        kv_memory_fraction of the device's free memory after the weights (CUDA).
        namespace names the weights for prefix caching (the model's fingerprint).
        cuda_graphs: chain steps replay CUDA graphs (specdec.runtime.graphs) — on CUDA, with
        an attention that reads no device value on the host (the Triton kernel); otherwise
        the log says why not and every step runs eagerly."""
        super().__init__(model)
        self.runner = PagedLlama(model, attention or choose_attention_backend(self.device))
        shape = KVShape.of(model.config)
        per_block = block_bytes(shape, block_size, self.dtype)
        blocks = pool_blocks(per_block, self.device, max_cache_bytes, kv_memory_fraction)
        self.pool = KVPool(shape, blocks, block_size, self.dtype, self.device)
        self.cache = PagedKVCache(self.pool, namespace)
        context = int(getattr(model.config, "max_position_embeddings", 0) or 8192)
        self.buffers = StepBuffers(StepLimits(max_batch=max_batch, max_tokens=context + STEP_TOKENS_BEYOND_CONTEXT,
                                              max_blocks=-(-context // block_size) + 1), self.device)
        self.evict: Callable[[set[int]], bool] | None = None
        """Set by the worker: frees the least recently used session whose cache is not one of
        these (ids of PagedSession objects); False when there is none."""
        self._packed = True
        self._trees = True
        self.prefix_hit_tokens = 0
        """Context tokens new sessions took from the prefix cache instead of feeding them."""
        self._tree_from: dict[int, int] = {}  # id(PagedSession) -> where its unnamed tree tail starts
        # A step with a tree carries a [max_query, max_query] mask per session (StepLimits).
        self.max_tree_step_tokens = self.buffers.limits.max_query
        self.graphs: GraphedForward | None = None
        """Set: chain steps of up to its largest bucket run padded through it."""
        if cuda_graphs:
            reason = graph_safe(self.runner)
            if self.device.type != "cuda":
                reason = f"the model is on {self.device}"
            elif self.runner.attention in (paged_attention_reference, paged_attention_sdpa):
                reason = "the attention is the torch reference, which reads the step's sizes on the host"
            if reason is None:
                self.graphs = GraphedForward(self.runner, self.pool, self.buffers.limits)
            else:
                log.warning("CUDA graphs off: %s", reason)
        log.info("paged KV cache: %d blocks of %d tokens, %.1f MiB", blocks, block_size, self.pool.nbytes / 2**20)

    def bind(self, store) -> None:
        """The store's drops release blocks, its budget reads the pool's bytes in use, and a
        short pool evicts the store's least recently used sessions outside the step."""
        store.on_drop = self.forget
        store.measure = lambda: self.cache.bytes_in_use
        self.evict = lambda keep: store.evict_lru(lambda session: id(session.cache) in keep)

    @property
    def bytes_in_use(self) -> int:
        return self.cache.bytes_in_use

    def held_bytes(self, session: Session) -> int:
        return self.cache.held_bytes(session.cache) if session.cache is not None else 0

    def prepare(self, synced: SyncedContext, reuse_prefix: bool = True) -> list[int]:
        session = synced.session
        if session.cache is None:
            paged = PagedSession()
            session.cache = paged
            if reuse_prefix:
                self.prefix_hit_tokens += self.cache.match_prefix(paged, synced.context)
            session.ids = paged.token_ids
            return synced.context[paged.length:]
        keep = min(synced.reusable, len(synced.context) - 1)
        self.crop(session, keep)
        if reuse_prefix and keep == session.cache.length:
            # The next piece of a prompt fed in chunks may be cached already.
            self.prefix_hit_tokens += self.cache.match_prefix(session.cache, synced.context)
            keep = session.cache.length
        return synced.context[keep:]

    def forget(self, session: Session) -> None:
        """Releases the session's blocks (the named ones stay cached for reuse)."""
        paged = session.cache
        if isinstance(paged, PagedSession):
            self._tree_from.pop(id(paged), None)
            self.cache.release(paged)
        session.cache = None
        session.ids = []
        session.committed_len = 0

    def crop(self, session: Session, length: int) -> None:
        paged = session.cache
        if paged is None:
            return
        tail = self._tree_from.pop(id(paged), None)
        if tail is not None:
            length = min(length, tail)
        if length < paged.length:
            self.cache.truncate(paged, length)

    @torch.inference_mode()
    def capture_graphs(self, up_to: int, features: bool = False, aux_layers: tuple[int, ...] = ()) -> list[int]:
        """Runs a step at every bucket up to the one a step of up_to tokens takes, so that
        each graph is captured now (at load) rather than by the first step that needs it.
        Returns the sizes run. Each step is throwaway tokens of a session of its own, as few
        as the padding allows, padded to the size; their blocks are released after."""
        if self.graphs is None:
            return []
        plan = self.graphs.warm_up_sizes(up_to)
        session = PagedSession()
        try:
            self.cache.reserve(session, max((n for _, n in plan), default=0))  # never committed
            for size, n in plan:
                step = self.buffers.plan(self.cache, [StepRequest(session, [0] * n)], pad_to=size)
                self.graphs.run(step, features=features, aux_layers=tuple(aux_layers))
                if self.graphs.off is not None:
                    break
        finally:
            self.cache.release(session)
        return [size for size, _ in plan]

    @torch.inference_mode()
    def feed(self, session: Session, tokens: list[int], logits_to_keep: int,
             parents: list[int] | None = None) -> torch.Tensor:
        return self.feed_batch([session], [tokens], [logits_to_keep], parents=[parents])[0]

    @torch.inference_mode()
    def feed_batch(self, sessions: list[Session], token_lists: list[list[int]], logits_to_keep: list[int],
                   features: bool = False, aux_layers: tuple[int, ...] = (),
                   parents: list[list[int] | None] | None = None):
        """CausalLM.feed_batch, in ONE forward over the pool whatever the sessions."""
        assert len({id(s) for s in sessions}) == len(sessions), "a session appears twice in a batch"
        trees = parents if parents is not None else [None] * len(sessions)
        for session, tokens in zip(sessions, token_lists):
            assert tokens, "feed needs at least one token"
            self.crop(session, session.cache.length)  # an unnamed tree tail left uncropped goes
        self._reserve([s.cache for s in sessions], [len(t) for t in token_lists])
        requests = [StepRequest(s.cache, list(t), p, k)
                    for s, t, p, k in zip(sessions, token_lists, trees, logits_to_keep)]
        pad_to = None
        if self.graphs is not None:
            pad_to = self.graphs.bucket(sum(len(t) for t in token_lists), any(p is not None for p in trees))
        try:
            step = self.buffers.plan(self.cache, requests, pad_to=pad_to)
            if pad_to is not None:
                out = self.graphs.run(step, features=features, aux_layers=tuple(aux_layers))
            else:
                out = self.runner.forward(self.pool, step, features=features, aux_layers=tuple(aux_layers))
        except BaseException:
            for session in sessions:
                self.forget(session)
            raise
        for session, tokens, tree in zip(sessions, token_lists, trees):
            paged = session.cache
            chain = chain_length(tree, len(tokens))
            self.cache.commit(paged, tokens[:chain])
            if chain < len(tokens):  # the alternatives: held, never named
                self._tree_from[id(paged)] = paged.length
                paged.token_ids.extend(tokens[chain:])
                paged.length += len(tokens) - chain
            session.ids = paged.token_ids
        if features:
            return out.logits, out.features
        return out.logits

    def admit(self, sessions: list[Session], counts: list[int]) -> list[BaseException | None]:
        """Reserves each session's new positions in order, evicting sessions outside the step
        while the pool is short; a session that still does not fit gets PoolExhausted (its
        round alone fails RESOURCE_EXHAUSTED, the others run)."""
        keep = {id(s.cache) for s in sessions}
        outcome: list[BaseException | None] = []
        for session, n in zip(sessions, counts):
            self.crop(session, session.cache.length)  # an unnamed tree tail left uncropped goes
            try:
                self._reserve_one(session.cache, n, keep)
                outcome.append(None)
            except PoolExhausted as exc:
                outcome.append(exc)
        return outcome

    def _reserve_one(self, cache: PagedSession, n: int, keep: set[int]) -> None:
        while True:
            try:
                self.cache.reserve(cache, n)
                return
            except PoolExhausted:
                if self.evict is None or not self.evict(keep):
                    raise

    def _reserve(self, caches: list[PagedSession], counts: list[int]) -> None:
        """Reserves every session's new positions, evicting other sessions while the pool is
        short; all or nothing."""
        done: list[PagedSession] = []
        keep = {id(c) for c in caches}
        try:
            for cache, n in zip(caches, counts):
                self._reserve_one(cache, n, keep)
                done.append(cache)
        except PoolExhausted:
            for cache in done:  # give back the tail blocks this step reserved
                self.cache.truncate(cache, cache.length)
            raise
