"""Proposing a block for a session (plain Python; the servicer is a thin shell)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from draft_worker.drafters.base import Drafter
from specdec.errors import InvalidArgument
from specdec.sessions import Resync, SessionStore


@dataclass(frozen=True)
class Proposal:
    tokens: list[int]
    compute_s: float


class Proposer:
    def __init__(self, drafter: Drafter, store: SessionStore, max_k: int):
        self.drafter = drafter
        self.store = store
        self.max_k = max_k

    def propose(self, session_id: str, start: int, tokens: list[int], k: int) -> Proposal | Resync:
        began = time.perf_counter()
        if not 1 <= k <= self.max_k:
            raise InvalidArgument(f"k must be in 1..{self.max_k}, got {k}")
        if any(t < 0 for t in tokens):
            raise InvalidArgument("delta.tokens: token ids must be non-negative")
        synced = self.store.sync(session_id, start, tokens)
        if isinstance(synced, Resync):
            return synced
        proposal = self.drafter.propose(synced, k)
        self.store.enforce_budget(keep=session_id)
        return Proposal(proposal, time.perf_counter() - began)
