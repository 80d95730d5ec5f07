"""A draft model: any causal LM sharing the target's tokenizer proposes k tokens greedily,
one forward pass per token on top of its own per-session KV cache. Draft tokens it fed
itself stay in the cache; the next round keeps those the target accepted and drops the
rest (specdec.sessions computes the agreeing prefix)."""

from __future__ import annotations

import torch

from specdec.runtime.lm import CausalLM
from specdec.sessions import Session, SyncedContext


class ModelDrafter:
    def __init__(self, name: str, lm: CausalLM):
        self.name = name
        self.lm = lm
        self.bytes_per_token = lm.bytes_per_token
        self.vocab_size = int(lm.model.get_output_embeddings().weight.shape[0])
        self.max_context = int(getattr(lm.config, "max_position_embeddings", 0) or 1 << 30)

    def propose(self, synced: SyncedContext, k: int) -> list[int]:
        return self.propose_batch([synced], [k])[0]

    def held_bytes(self, session: Session) -> int:
        return self.lm.held_bytes(session)

    def propose_batch(self, synced: list[SyncedContext], ks: list[int]) -> list[list[int]]:
        """Greedy proposals for many sessions: draft step j is ONE forward pass over every
        session still drafting (its uncached committed tokens at step 0, its last draft
        token after), so a batch of B sessions costs k passes, not B·k."""
        # A draft with a shorter context than the target proposes less near its end.
        ks = [min(k, self.max_context - len(s.context)) for s, k in zip(synced, ks)]
        proposals: list[list[int]] = [[] for _ in synced]
        active = [i for i, k in enumerate(ks) if k > 0]
        feeds = {i: self.lm.prepare(synced[i]) for i in active}
        while active:
            logits = self.lm.feed_batch([synced[i].session for i in active], [feeds[i] for i in active],
                                        [1] * len(active))  # per session [1, V]
            for i, row in zip(active, logits):
                token = int(torch.argmax(row[-1]))
                proposals[i].append(token)
                feeds[i] = [token]
            active = [i for i in active if len(proposals[i]) < ks[i]]
        return proposals
