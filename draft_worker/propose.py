"""Proposing a block for a session (plain Python; the servicer is a thin shell)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from draft_worker.drafters.base import Drafter
from specdec.eagle.policy import Features
from specdec.errors import InvalidArgument, SpecdecError
from specdec.sessions import Resync, SessionStore


@dataclass(frozen=True)
class Proposal:
    tokens: list[int]
    compute_s: float


@dataclass(frozen=True)
class Request:
    """One session's round as the coordinator sent it."""

    session_id: str
    start: int
    tokens: list[int]
    k: int
    # For a drafter that reads target features: (feature_start, float16 bytes).
    features: tuple[int, bytes] | None = None
    # The least probability of acceptance at which a drafter with probabilities drafts a
    # token (ProposeRequest.min_draft_prob).
    min_draft_prob: float = 0.0


@dataclass(frozen=True)
class BatchOutcome:
    results: list  # per round: Proposal | Resync | the exception that round raised
    step_s: float


class Proposer:
    def __init__(self, drafter: Drafter, store: SessionStore, max_k: int):
        self.drafter = drafter
        self.store = store
        self.max_k = max_k
        # Width of the target features the drafter reads (0: none).
        self.feature_size = int(getattr(drafter, "feature_size", 0) or 0)

    def propose(self, session_id: str, start: int, tokens: list[int], k: int,
                features: tuple[int, bytes] | None = None, min_draft_prob: float = 0.0) -> Proposal | Resync:
        """One round alone (the unary Propose rpc); errors raise."""
        result = self.propose_batch([Request(session_id, start, tokens, k, features, min_draft_prob)]).results[0]
        if isinstance(result, BaseException):
            raise result
        return result

    def propose_batch(self, requests: list[Request]) -> BatchOutcome:
        """Many sessions' rounds at once; each result is what the round alone would give
        (an invalid round gets its own error and never fails the others)."""
        began = time.perf_counter()
        results: list = [None] * len(requests)
        ready: list[tuple[int, object]] = []
        seen: set[str] = set()
        for i, req in enumerate(requests):
            try:
                if req.session_id in seen:
                    raise InvalidArgument(f"session {req.session_id!r} has more than one round in the batch")
                seen.add(req.session_id)
                if not 1 <= req.k <= self.max_k:
                    raise InvalidArgument(f"k must be in 1..{self.max_k}, got {req.k}")
                if not (math.isfinite(req.min_draft_prob) and req.min_draft_prob >= 0):
                    raise InvalidArgument(f"min_draft_prob: {req.min_draft_prob} is not a finite number >= 0")
                if any(t < 0 for t in req.tokens):
                    raise InvalidArgument("delta.tokens: token ids must be non-negative")
                features = None
                if self.feature_size:
                    start, data = req.features or (0, b"")
                    features = Features(start, data, self.feature_size)
                synced = self.store.sync(req.session_id, req.start, req.tokens)
            except SpecdecError as exc:
                results[i] = exc
                continue
            if isinstance(synced, Resync):
                results[i] = synced
            else:
                ready.append((i, synced, features))
        if ready:
            sessions = [synced.session for _, synced, _ in ready]
            try:
                if self.feature_size:
                    # A feature-level head: the one drafter with probabilities of its own here.
                    proposals = self.drafter.propose_batch([s for _, s, _ in ready], [requests[i].k for i, _, _ in ready],
                                                           [f for _, _, f in ready],
                                                           [requests[i].min_draft_prob for i, _, _ in ready])
                else:
                    proposals = self.drafter.propose_batch([s for _, s, _ in ready],
                                                           [requests[i].k for i, _, _ in ready])
            except Exception as exc:  # noqa: BLE001 - every round of the step failed alike
                for i, synced, _ in ready:
                    results[i] = exc
                    self.store.release(synced.session.session_id)  # its cache is suspect
                ready, proposals = [], []
            elapsed = time.perf_counter() - began
            for (i, synced, _), proposal in zip(ready, proposals):
                # A drafter lacking the features it must feed asks for them (Resync).
                results[i] = proposal if isinstance(proposal, Resync) else Proposal(proposal, elapsed)
            # What each session holds after its step, before the budget is enforced on the
            # store's total (a released one counts for nothing).
            for session in sessions:
                self.store.account(session, self.drafter.held_bytes(session))
            for _, synced, _ in ready:
                self.store.enforce_budget(keep=synced.session.session_id)
        return BatchOutcome(results, time.perf_counter() - began)
