"""Per-session KV caches on a worker, and the delta protocol that keeps them in step with
the coordinator (the coordinator owns the committed tokens; workers only hold caches).

A session's cache covers `ids`: the committed tokens the worker has seen plus, on a draft
worker, the speculative tokens it fed itself. A round brings a delta (start, tokens): the
committed sequence is ids[:start] + tokens. The worker keeps the longest prefix of its cache
that agrees with that sequence (accepted draft tokens are reused, rejected ones dropped) and
asks for a resync when it holds fewer than `start` tokens (restart, eviction, expiry, new
replica).

A session no round has touched for the store's TTL is expired (`SessionStore.expire`): its
coordinator is most likely gone (a crash ends a request without a Release). Expiry frees it
exactly as eviction does, so a coordinator that was only slow gets the same resync.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from specdec.errors import InvalidArgument, ResourceExhausted

MAX_SESSION_ID_BYTES = 128


@dataclass
class Session:
    session_id: str
    # Token ids whose keys/values are in `cache`, in order.
    ids: list[int] = field(default_factory=list)
    # Length of the committed sequence as last sent by the coordinator; ids beyond it are
    # speculative and never reported as held.
    committed_len: int = 0
    # The model's cache object (e.g. a transformers DynamicCache); None for drafters that
    # keep no tensors (n-gram).
    cache: Any = None
    # On a target worker that runs a draft head: the head's state for this session
    # (target_worker.head.HeadState), dropped with the session.
    head: Any = None
    # A feature-level head's copies of this session (specdec.eagle.policy.Copier).
    copying: Any = None
    # A feature-level head's cache (specdec.eagle.batched): how many leading entries were
    # fed the target's true features (the rest, its own predictions, are rolled back).
    trusted: int = 0
    # The store's clock when a round (or a prefill chunk) last synced the session.
    touched: float = 0.0
    # Bytes its caches (and a head's state) keep allocated, as last measured after a step
    # that changed them (SessionStore.account); the store's total is the sum of these.
    held: int = 0


@dataclass(frozen=True)
class Resync:
    """The worker does not hold the session's first `start` tokens."""

    cached_len: int


@dataclass(frozen=True)
class SyncedContext:
    """The committed sequence after applying a delta, and how much of the cache is reusable."""

    session: Session
    # The full committed sequence.
    context: list[int]
    # Leading tokens of ids (== context[:reusable] when reusable <= len(context)) whose cache
    # entries are still valid; the caller crops the cache to this length.
    reusable: int


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if isinstance(a, list) and isinstance(b, list):
        # Compared in C: a session's whole context is compared every step it drafts.
        if a[:n] == b[:n]:
            return n
        low, high = 0, n  # a[:low] == b[:low], a[:high] != b[:high]
        while high - low > 1:
            middle = (low + high) // 2
            if a[low:middle] == b[low:middle]:
                low = middle
            else:
                high = middle
        return low
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class SessionStore:
    """Sessions by id, least recently used first, bounded by count and by cache bytes.

    The bytes are those the sessions' caches keep allocated, not their tokens: the worker
    measures a session after each step that fed it or rolled its cache back
    (specdec.runtime.lm.CausalLM.held_bytes) and reports it (`account`). The store keeps the
    running total, so `cache_bytes` is O(1) and no step walks every session; every way a
    session leaves (release, eviction, expiry) subtracts exactly what it added.

    `ttl_s` > 0: `expire` frees sessions idle that long (0: sessions live until evicted or
    released).

    Not thread-safe: a worker touches it from its single model thread only.
    """

    def __init__(self, max_sessions: int, max_cache_bytes: int, bytes_per_token: int, ttl_s: float = 0.0,
                 clock: Callable[[], float] = time.monotonic):
        self.max_sessions = max_sessions
        self.max_cache_bytes = max_cache_bytes
        self.bytes_per_token = bytes_per_token
        self.ttl_s = ttl_s
        self.clock = clock
        self._sessions: OrderedDict[str, Session] = OrderedDict()
        self._held = 0  # Σ session.held over the sessions in the store
        self.evictions = 0
        self.expirations = 0
        self.on_drop: Callable[[Session], None] | None = None
        """Called with every session that leaves (release, eviction, expiry): a paged KV
        pool gives its blocks back there."""
        self.measure: Callable[[], int] | None = None
        """Where set, what `cache_bytes` reports and the budget reads: the memory a shared
        pool really holds (blocks shared by sessions counted once)."""

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._sessions

    def get(self, session_id: str) -> Session | None:
        """The session, if held; its recency is unchanged."""
        return self._sessions.get(session_id)

    def cache_bytes(self) -> int:
        """Bytes the sessions' caches keep allocated, as last accounted (or measured)."""
        return self.measure() if self.measure is not None else self._held

    def account(self, session: Session, held: int | None = None) -> None:
        """Records what `session` holds now: `held` bytes as the worker measured them after a
        step that changed its caches, or by default len(ids) × bytes_per_token (a session
        that keeps nothing but its ids). A session no longer in the store (released or
        evicted while its step ran) counts for nothing."""
        if self._sessions.get(session.session_id) is not session:
            return
        if held is None:
            held = len(session.ids) * self.bytes_per_token
        self._held += held - session.held
        session.held = held

    def sync(self, session_id: str, start: int, tokens: list[int]) -> Resync | SyncedContext:
        """Applies a delta. Unknown session + start 0 creates it; start beyond what is held
        asks for a resync; otherwise returns the committed context and the reusable prefix."""
        if not session_id or len(session_id.encode()) > MAX_SESSION_ID_BYTES:
            raise InvalidArgument(f"delta.session_id must be 1..{MAX_SESSION_ID_BYTES} bytes")
        if not tokens:
            raise InvalidArgument("delta.tokens must not be empty")
        session = self._sessions.get(session_id)
        if session is None:
            if start != 0:
                return Resync(cached_len=0)
            session = self._admit(session_id)
        held = min(len(session.ids), session.committed_len)
        if start > held:
            return Resync(cached_len=held)
        self._sessions.move_to_end(session_id)
        session.touched = self.clock()
        context = session.ids[:start] + list(tokens)
        reusable = start + common_prefix_len(session.ids[start:], tokens)
        session.committed_len = len(context)
        return SyncedContext(session=session, context=context, reusable=reusable)

    def _admit(self, session_id: str) -> Session:
        while len(self._sessions) >= self.max_sessions:
            self._evict_oldest()
        session = Session(session_id, touched=self.clock())
        self._sessions[session_id] = session
        return session

    def _evict_oldest(self) -> None:
        if not self._sessions:
            raise ResourceExhausted("no session slot free on this worker")
        self._drop(next(iter(self._sessions)))
        self.evictions += 1

    def _drop(self, session_id: str) -> Session | None:
        session = self._sessions.pop(session_id, None)
        if session is not None:
            self._held -= session.held
            if self.on_drop is not None:
                self.on_drop(session)
        return session

    def evict_lru(self, keep: Callable[[Session], bool]) -> bool:
        """Evicts the least recently used session `keep` does not hold on to; False when
        every session is kept."""
        victim = next((sid for sid, session in self._sessions.items() if not keep(session)), None)
        if victim is None:
            return False
        self._drop(victim)
        self.evictions += 1
        return True

    def enforce_budget(self, keep: str | None = None) -> None:
        """Evicts least recently used sessions (never `keep`) until under the byte budget."""
        while self.cache_bytes() > self.max_cache_bytes and len(self._sessions) > 1:
            oldest = next(iter(self._sessions))
            if oldest == keep:
                self._sessions.move_to_end(oldest)
                oldest = next(iter(self._sessions))
                if oldest == keep:
                    break
            self._drop(oldest)
            self.evictions += 1

    def release(self, session_id: str) -> bool:
        return self._drop(session_id) is not None

    def expire(self) -> int:
        """Frees every session no round has synced for more than ttl_s seconds; returns how
        many. A round of an expired session finds it unknown and asks for a resync, as after
        an eviction."""
        if self.ttl_s <= 0:
            return 0
        cutoff = self.clock() - self.ttl_s
        idle = [session_id for session_id, session in self._sessions.items() if session.touched < cutoff]
        for session_id in idle:
            self._drop(session_id)
        self.expirations += len(idle)
        return len(idle)
