"""A causal LM with per-session KV caches: feed new tokens, get logits, roll back.

Both workers run their model through this: the target to score a block, a model drafter
to propose one. It knows nothing of gRPC.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
import logging
from typing import Any

import torch

from specdec.runtime.compat import cache_kwarg
from specdec.runtime.memory import cache_held_bytes
from specdec.runtime.packed import packed_forward, supports_packed
from specdec.runtime.tree import supports_plain_trees, tree_mask, tree_positions
from specdec.sessions import Session, SyncedContext

log = logging.getLogger(__name__)


class CausalLM:
    def __init__(self, model: torch.nn.Module, new_cache: Callable[[Any], Any] | None = None):
        """new_cache(config) makes a session's KV cache; default: a transformers DynamicCache."""
        self.model = model
        self._cache_factory = new_cache
        self.config = model.config
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self._packed: bool | None = None  # whether feed_batch packs sessions; None: not yet checked
        self._trees: bool | None = None  # whether feed takes tree blocks; None: not yet checked
        self._cache_kwarg = cache_kwarg(model)

    @property
    def bytes_per_token(self) -> int:
        """KV-cache bytes per token of context (keys and values, every layer)."""
        cfg = self.config.get_text_config() if hasattr(self.config, "get_text_config") else self.config
        heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        element = torch.finfo(self.dtype).bits // 8
        return 2 * cfg.num_hidden_layers * heads * head_dim * element

    def held_bytes(self, session: Session) -> int:
        """The bytes this session keeps allocated: the storages its KV cache keeps alive,
        each counted once however many views share it (specdec.runtime.memory) — a buffered
        layer's whole capacity, a cropped layer's uncropped storage — not its tokens ×
        `bytes_per_token`. What the worker's cache budget counts (SessionStore.account, after
        every step that fed the session or rolled its cache back). Reads sizes only, no device
        synchronisation. A paged KV pool answers it as the session's blocks in use × block
        bytes."""
        return cache_held_bytes(session.cache)

    def _new_cache(self):
        if self._cache_factory is not None:
            cache = self._cache_factory(self.config)
        else:
            from transformers import DynamicCache

            cache = DynamicCache(config=self.config)
        # Sliding-window layers (Gemma 3) drop states beyond the window as they go, and then
        # cannot be cropped back after a rejected draft; recording keeps them until a crop.
        if hasattr(cache, "activate_past_recording"):
            cache.activate_past_recording()
        return cache

    def bind(self, store) -> None:
        """Ties the sessions' caches to the worker's SessionStore (a shared pool frees a
        session's memory when the store drops it); the caches here are the sessions' own."""

    def admit(self, sessions: list[Session], counts: list[int]) -> list[BaseException | None]:
        """Before a step: per session, None when its `counts[i]` new tokens will fit, else the
        error its round gets (a shared pool reserves here; the caches here grow as fed)."""
        return [None] * len(sessions)

    def prepare(self, synced: SyncedContext, reuse_prefix: bool = True) -> list[int]:
        """Rolls the session's cache back to the reusable prefix of the committed context and
        returns the committed tokens still to be fed (never empty: the last committed token
        is always fed, because its logits are the ones that predict what comes next).
        reuse_prefix: a new session may take cached blocks of its context's prefix instead
        of feeding them (a shared pool's prefix cache; a caller that needs every position's
        hidden state says False)."""
        session = synced.session
        keep = min(synced.reusable, len(synced.context) - 1)
        if session.cache is None:
            session.cache = self._new_cache()
            session.ids = []
            keep = 0
        self.crop(session, keep)
        return synced.context[keep:]

    @staticmethod
    def forget(session: Session) -> None:
        session.cache = None
        session.ids = []
        session.committed_len = 0

    def crop(self, session: Session, length: int) -> None:
        """Drops cache entries beyond `length` tokens."""
        if len(session.ids) > length:
            # transformers 5 takes the number of tokens to drop as a negative count.
            session.cache.crop(length - len(session.ids))
            del session.ids[length:]

    @property
    def feature_size(self) -> int:
        """Width of the features `feed_batch(..., features=True)` returns (the hidden size)."""
        cfg = self.config.get_text_config() if hasattr(self.config, "get_text_config") else self.config
        return int(cfg.hidden_size)

    @property
    def num_layers(self) -> int:
        """Decoder layers of the model (what `aux_layers` may name)."""
        layers = getattr(getattr(self.model, "model", None), "layers", None)
        return len(layers) if layers is not None else 0

    @contextmanager
    def _capturing_features(self, aux_layers: tuple[int, ...] = ()):
        """Collects the output of the model's final norm (the hidden states its LM head
        reads) for every position of the forward passes run inside, followed on the last
        dimension by the outputs of decoder layers `aux_layers` (the residual stream after
        each): one [batch, n, H·(1 + len(aux_layers))] tensor per forward pass."""
        inner = getattr(self.model, "model", None)
        norm = getattr(inner, "norm", None)
        if norm is None:
            raise ValueError(f"{type(self.model).__name__} has no model.norm to read features from")
        captured: list[torch.Tensor] = []
        layer_states: dict[int, torch.Tensor] = {}

        def keep_layer(index):
            def hook(module, args, output):
                layer_states[index] = output[0] if isinstance(output, tuple) else output
            return hook

        def keep_final(module, args, output):
            captured.append(torch.cat([output] + [layer_states.pop(i) for i in aux_layers], -1)
                            if aux_layers else output)

        handles = [inner.layers[i].register_forward_hook(keep_layer(i)) for i in aux_layers]
        handles.append(norm.register_forward_hook(keep_final))
        try:
            yield captured
        finally:
            for handle in handles:
                handle.remove()

    @torch.inference_mode()
    def feed(self, session: Session, tokens: list[int], logits_to_keep: int,
             parents: list[int] | None = None) -> torch.Tensor:
        """Runs `tokens` through the model on top of the session's cache in ONE forward pass
        and returns the logits of the last `logits_to_keep` positions: [logits_to_keep, V].
        With `parents` (specdec.runtime.tree; where runs_trees) the tokens are a
        tree: each at its depth, attending to the cache, its ancestors and itself."""
        assert tokens, "feed needs at least one token"
        assert session.cache.get_seq_length() == len(session.ids), "cache and ids out of step"
        input_ids = torch.tensor([tokens], dtype=torch.long, device=self.device)  # [1, n]
        tree = {}
        if parents is not None:
            past = len(session.ids)
            visible = tree_mask(parents, past, self.device)  # [1, 1, n, past + n] bool
            # Additive, in the model's dtype: what transformers' sdpa and eager attention add.
            mask = torch.zeros(visible.shape, dtype=self.dtype, device=self.device)
            tree = {"attention_mask": mask.masked_fill(~visible, torch.finfo(self.dtype).min),
                    "position_ids": tree_positions(parents, past, self.device)[None]}
        try:
            out = self.model(input_ids=input_ids, use_cache=True, logits_to_keep=logits_to_keep,
                             **tree, **{self._cache_kwarg: session.cache})
        except BaseException:
            # Some layers may have grown and others not: the cache is no longer trustworthy.
            # Forget it, so the next round asks the coordinator for a resync and rebuilds.
            self.forget(session)
            raise
        session.ids.extend(tokens)
        return out.logits[0].float()  # [logits_to_keep, V]

    @property
    def batches_in_one_pass(self) -> bool:
        """Whether feed_batch runs many sessions in one forward pass (else one by one)."""
        if self._packed is None:
            reason = supports_packed(self.model)
            self._packed = reason is None
            if reason is not None:
                log.info("batched rounds run one session at a time: %s", reason)
        return self._packed

    # The most tokens one session may feed in a step that carries a tree (None: no limit).
    max_tree_step_tokens: int | None = None

    @property
    def runs_trees(self) -> bool:
        """Whether feed and feed_batch take tree blocks (`parents`): in the packed forward,
        or one session at a time on a model whose attention takes a custom mask."""
        if self._trees is None:
            reason = None if self.batches_in_one_pass else supports_plain_trees(self.model)
            self._trees = reason is None
            if reason is not None:
                log.info("no tree blocks (a head's alternatives are not scored): %s", reason)
        return self._trees

    @torch.inference_mode()
    def feed_batch(self, sessions: list[Session], token_lists: list[list[int]], logits_to_keep: list[int],
                   features: bool = False, aux_layers: tuple[int, ...] = (),
                   parents: list[list[int] | None] | None = None):
        """feed() for many sessions at once: ONE forward pass over all their new tokens when
        the model allows it (specdec.runtime.packed), else one pass per session. Returns per session
        the logits of its last logits_to_keep[i] positions, [logits_to_keep[i], V]; with
        features=True, (those logits, per session the final hidden states of every fed
        position, [len(token_lists[i]), H], then the states after decoder layers aux_layers:
        [len(token_lists[i]), H·(1 + len(aux_layers))]). parents[i], when given, makes session
        i's tokens a tree (specdec.runtime.tree; only where runs_trees): all of
        them enter its cache, and the caller crops the ones not kept."""
        trees = parents is not None and any(p is not None for p in parents)
        if trees and not self.runs_trees:
            raise ValueError("tree blocks need the packed forward (specdec.runtime.packed) or an attention that takes a "
                             "custom mask, and this model has neither")
        if features:
            with self._capturing_features(tuple(aux_layers)) as captured:
                logits = self.feed_batch(sessions, token_lists, logits_to_keep, parents=parents)
            hidden = torch.cat([c[0] for c in captured], 0)  # [Σ n, H]: one pass, or one per session
            return logits, list(torch.split(hidden, [len(t) for t in token_lists]))
        assert len({id(s) for s in sessions}) == len(sessions), "a session appears twice in a batch"
        if (len(sessions) == 1 and not trees) or not self.batches_in_one_pass:
            trees_of = parents if trees else [None] * len(sessions)
            return [self.feed(s, t, k, p) for s, t, k, p in zip(sessions, token_lists, logits_to_keep, trees_of)]
        for session, tokens in zip(sessions, token_lists):
            assert tokens, "feed needs at least one token"
            assert session.cache.get_seq_length() == len(session.ids), "cache and ids out of step"
        try:
            logits = packed_forward(self.model, [s.cache for s in sessions], token_lists, logits_to_keep,
                                    parents if trees else None)
        except BaseException:
            # Some sessions' layers may have grown and others not: rebuild them all.
            for session in sessions:
                self.forget(session)
            raise
        for session, tokens in zip(sessions, token_lists):
            session.ids.extend(tokens)
        return logits
