"""A feature-level head's KV cache for many sessions in one paged pool of its own
(specdec.runtime.paged): the head's storage beside a paged target (`--kv-cache paged`, the
default on CUDA). specdec.eagle.batched drafts over it (or over buffered per-session caches
beside a buffered target) for all sessions of a step at once.

Blocks are never shared between sessions and never named: a head entry depends on the
target's features, not only on the token ids. The pool is sized once, at load
(`head_pool_blocks`): as many tokens as the target's cache holds, plus each session's partly
filled block and its draft positions.

Shapes of one step: T packed tokens of B sessions (specdec.runtime.paged_step), the head's
one decoder layer run once over the [1, T, H] row, its keys and values written at the
step's slots and read through the paged attention contract (specdec.runtime.paged_attention;
on CUDA the worker hands it the Triton kernel). Nothing in a step branches on a tensor's
value, so a depth step is graph-capturable: beside a target whose steps replay CUDA graphs,
the head's steps do too (specdec.runtime.graphs.StepGraphs), padded like the target's, their
features copied into static rows first.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from specdec.eagle.head import EagleHead
from specdec.runtime.paged import DEFAULT_BLOCK_SIZE, KVPool, KVShape, PagedKVCache, PagedSession
from specdec.runtime.paged_attention import choose_attention_backend
from specdec.runtime.graphs import StepGraphs
from specdec.runtime.paged_step import StepBuffers, StepInputs, StepLimits, StepRequest

# New tokens one head step may carry beyond a whole context: the other sessions' rounds.
STEP_TOKENS_BEYOND_CONTEXT = 64 * 256


def head_pool_blocks(target_tokens: int, max_sessions: int, max_draft: int,
                     block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """Blocks a head pool needs to hold what the target's cache can (target_tokens over all
    sessions), each of max_sessions sessions' partly filled block and its max_draft draft
    positions, and the pad block."""
    per_session = 1 + -(-(max_draft + 1) // block_size)
    return -(-target_tokens // block_size) + max_sessions * per_session + 1


class PagedHead:
    """The head's one decoder layer over a paged pool: `step` feeds many sessions' tokens in
    one forward. A session's cache is a PagedSession (the storage interface
    specdec.eagle.batched.HeadStorage names)."""

    def __init__(self, head: EagleHead, num_blocks: int, block_size: int = DEFAULT_BLOCK_SIZE,
                 attention: Callable[..., torch.Tensor] | None = None, max_batch: int = 64,
                 graphs: bool | None = None):
        """graphs: steps replayed from CUDA graphs at padded token counts (StepGraphs; the
        attention must read no device value on the host: the Triton kernel); False: the
        padded steps run eagerly (how the CPU tests check the padding); None: no padding."""
        config = head.config
        self.head = head
        self.device = head.embed.device
        # The dtype the head's activations (and so its keys and values) are computed in.
        self.dtype = head.fc.weight.dtype
        self.pool = KVPool(KVShape(1, config.num_kv_heads, config.head_dim), num_blocks, block_size,
                           self.dtype, self.device)
        self.cache = PagedKVCache(self.pool, prefix_caching=False)
        context = int(config.max_position_embeddings)
        self.buffers = StepBuffers(StepLimits(max_batch=max_batch, max_tokens=context + STEP_TOKENS_BEYOND_CONTEXT,
                                              max_blocks=-(-context // block_size) + 1), self.device)
        self.attention = attention or choose_attention_backend(self.device)
        self.scale = 1.0 / math.sqrt(config.head_dim)  # what the one-session head's SDPA uses
        self.graphs = None if graphs is None else StepGraphs(self.device, self.buffers.limits, block_size,
                                                              capture=graphs)
        # Per feature width, the static rows a padded step reads its features from.
        self._features: dict[int, torch.Tensor] = {}

    @property
    def max_batch(self) -> int:
        return self.buffers.limits.max_batch

    @property
    def nbytes(self) -> int:
        return self.pool.nbytes

    @staticmethod
    def new_cache() -> PagedSession:
        return PagedSession()

    @staticmethod
    def length(session: PagedSession) -> int:
        return session.length

    def held_bytes(self, session: PagedSession) -> int:
        return self.cache.held_bytes(session)

    def in_use(self) -> int:
        """Blocks held by some session."""
        return self.cache.blocks.in_use

    def reserve(self, session: PagedSession, n: int) -> None:
        """Makes n more positions of the session writable; PoolExhausted changes nothing."""
        self.cache.reserve(session, n)

    def truncate(self, session: PagedSession, length: int) -> None:
        self.cache.truncate(session, min(length, session.length))

    def release(self, session: PagedSession) -> None:
        self.cache.release(session)

    @torch.inference_mode()
    def step(self, sessions: Sequence[PagedSession], features: torch.Tensor,
             tokens: Sequence[Sequence[int]]) -> torch.Tensor:
        """Feeds session i its tokens[i] on top of its cache, each with the feature row of the
        position before it (features [T, H or feature_size], packed in the sessions' order);
        returns the predicted features [T, H] of every fed position. The positions must fit
        the session's reservation or a new one (PoolExhausted otherwise, nothing fed)."""
        for session, fed in zip(sessions, tokens):
            self.cache.reserve(session, len(fed))
        total = sum(len(t) for t in tokens)
        pad_to = self.graphs.bucket(total, trees=False) if self.graphs is not None else None
        step = self.buffers.plan(self.cache, [StepRequest(s, list(t)) for s, t in zip(sessions, tokens)],
                                 pad_to=pad_to)
        features = features.to(device=self.device, dtype=self.dtype)
        out = self._body(step, features)[0] if pad_to is None else self._padded(step, features, pad_to)
        for session, fed in zip(sessions, tokens):
            self.cache.commit(session, list(fed))
        assert out.shape[0] == total
        return out

    def _padded(self, step: StepInputs, features: torch.Tensor, pad_to: int) -> torch.Tensor:
        """The step planned with pad_to, through self.graphs: its real rows' predictions."""
        total, width = features.shape
        if width not in self._features:
            self._features[width] = torch.zeros(self.graphs.buckets[-1], width, dtype=self.dtype, device=self.device)
        rows = self._features[width][:pad_to]  # past `total`: stale rows, padding's own
        rows[:total].copy_(features)
        # A replay's output is the next one's too: what the step returns is a copy.
        return self.graphs.replay((pad_to, width), lambda: self._body(step, rows))[0][:total].clone()

    @torch.inference_mode()
    def capture_graphs(self, up_to: int) -> list[int]:
        """PagedCausalLM.capture_graphs for the head's steps, at both widths of features it
        reads (the target's, then its own predictions)."""
        if self.graphs is None:
            return []
        plan = self.graphs.warm_up_sizes(up_to)
        widths = sorted({self.head.config.feature_size, self.head.config.hidden_size})
        session = PagedSession()
        try:
            self.cache.reserve(session, max((n for _, n in plan), default=0))  # never committed
            for size, n in plan:
                for width in widths:
                    step = self.buffers.plan(self.cache, [StepRequest(session, [0] * n)], pad_to=size)
                    self._padded(step, torch.zeros(n, width, dtype=self.dtype, device=self.device), size)
                if self.graphs.off is not None:
                    break
        finally:
            self.cache.release(session)
        return [size for size, _ in plan]

    def _body(self, step: StepInputs, features: torch.Tensor) -> tuple[torch.Tensor]:
        """The head's layer over the step's packed tokens: (predicted features [T, H],). Sizes
        come from shapes alone, so a CUDA graph can capture it."""
        head = self.head
        total = step.input_ids.shape[0]
        x = head.inputs(features[None], step.input_ids[None])  # [1, T, H]
        q, k, v = head.qkv(x, step.positions)  # q [1, Hq, T, d]; k, v [1, Hkv, T, d]
        q, k, v = (t[0].transpose(0, 1) for t in (q, k, v))  # [T, heads, d]
        k_pool, v_pool = self.pool.layer(0)  # [num_blocks, block_size, Hkv, d]
        kv_heads, head_dim = k.shape[1], k.shape[2]
        k_pool.view(-1, kv_heads, head_dim).index_copy_(0, step.slot_mapping, k.to(self.dtype))
        v_pool.view(-1, kv_heads, head_dim).index_copy_(0, step.slot_mapping, v.to(self.dtype))
        attended = self.attention(q.to(self.dtype).contiguous(), k_pool, v_pool, step.block_tables,
                                  step.context_lens, step.query_starts, None, scale=self.scale)  # [T, Hq, d]
        out = head.finish(x, attended.transpose(0, 1)[None])  # [1, T, H]
        return (out[0],)


