"""A draft model: any causal LM sharing the target's tokenizer proposes k tokens greedily,
one forward pass per token on top of its own per-session KV cache. Draft tokens it fed
itself stay in the cache; the next round keeps those the target accepted and drops the
rest (specdec.sessions computes the agreeing prefix)."""

from __future__ import annotations

import torch

from specdec.lm import CausalLM
from specdec.sessions import SyncedContext


class ModelDrafter:
    def __init__(self, name: str, lm: CausalLM):
        self.name = name
        self.lm = lm
        self.bytes_per_token = lm.bytes_per_token
        self.vocab_size = int(lm.model.get_output_embeddings().weight.shape[0])
        self.max_context = int(getattr(lm.config, "max_position_embeddings", 0) or 1 << 30)

    def propose(self, synced: SyncedContext, k: int) -> list[int]:
        session = synced.session
        # A draft with a shorter context than the target proposes less near its end.
        k = min(k, self.max_context - len(synced.context))
        if k <= 0:
            return []
        feed = self.lm.prepare(synced)
        proposal: list[int] = []
        for _ in range(k):
            logits = self.lm.feed(session, feed, logits_to_keep=1)  # [1, V]
            token = int(torch.argmax(logits[-1]))
            proposal.append(token)
            feed = [token]
        return proposal
