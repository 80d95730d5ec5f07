"""The n-gram drafter of the draft worker: prompt lookup (specdec.ngram) over the session's
committed context; no model."""

from __future__ import annotations

import torch

from specdec.models import weights_fingerprint
from specdec.ngram import DEFAULT_MAX_NGRAM, DEFAULT_MIN_NGRAM, ID_BYTES, NgramIndex
from specdec.sessions import Session, SyncedContext


class NgramDrafter:
    name = "ngram"
    bytes_per_token = 0

    def __init__(self, max_ngram: int = DEFAULT_MAX_NGRAM, min_ngram: int = DEFAULT_MIN_NGRAM):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    @property
    def fingerprint(self) -> str:
        """What identifies this drafter where a model's weights fingerprint identifies a model
        (specdec.models.weights_fingerprint): it has no weights, only its n-gram sizes."""
        config = {"drafter": self.name, "max_ngram": self.max_ngram, "min_ngram": self.min_ngram}
        return weights_fingerprint(torch.nn.Module(), config)

    @staticmethod
    def held_bytes(session: Session) -> int:
        """No tensors: the session's ids and its n-gram index."""
        index = session.cache.held_bytes() if isinstance(session.cache, NgramIndex) else 0
        return len(session.ids) * ID_BYTES + index

    def propose(self, synced: SyncedContext, k: int) -> list[int]:
        session = synced.session
        # The session's ids are its "cache": the committed context, kept so that steady
        # rounds only send what is new. Its n-gram index takes in only what is new too.
        session.ids = list(synced.context)
        if not isinstance(session.cache, NgramIndex):
            session.cache = NgramIndex(self.max_ngram, self.min_ngram)
        session.cache.sync(session.ids)
        return session.cache.lookup(k)

    def propose_batch(self, synced: list[SyncedContext], ks: list[int]) -> list[list[int]]:
        # A lookup per session: no model, nothing to batch.
        return [self.propose(s, k) for s, k in zip(synced, ks)]
