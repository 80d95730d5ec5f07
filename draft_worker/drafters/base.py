"""What every drafter offers the draft worker."""

from __future__ import annotations

from typing import Protocol

from specdec.sessions import Session, SyncedContext


class Drafter(Protocol):
    #: Model spec for WorkerInfo ("ngram" for the n-gram drafter).
    name: str
    #: KV-cache bytes per token of context (0 when the drafter keeps no tensors).
    bytes_per_token: int

    def propose(self, synced: SyncedContext, k: int) -> list[int]:
        """Up to k token ids that continue synced.context. May return fewer, even none."""
        ...

    def propose_batch(self, synced: list[SyncedContext], ks: list[int]) -> list[list[int]]:
        """propose() for many sessions at once (distinct sessions), batched where the
        drafter can; the i-th proposal is what propose(synced[i], ks[i]) returns."""
        ...

    def held_bytes(self, session: Session) -> int:
        """The bytes `session` keeps allocated on this drafter (what the worker's cache budget
        counts: specdec.sessions.SessionStore.account)."""
        ...
