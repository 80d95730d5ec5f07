"""Greedy block verification on the target (plain Python; the servicer is a thin shell).

One round: the committed tokens the cache lacks plus the k draft tokens go through the
target in ONE forward pass. Logits at the position of the last committed token and of each
draft token give the target's own greedy choice at every draft position; the longest
prefix of drafts that equals those choices is accepted, and the target's choice right after
it is the next token (the correction, or the bonus when all k were accepted). The cache is
then cropped to the new committed length, minus that next token, whose keys are computed
when it is fed in the next round.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from specdec.errors import InvalidArgument
from specdec.lm import CausalLM
from specdec.philox import round_uniforms
from specdec.sampling import GREEDY, Sampling
from specdec.sessions import Resync, SessionStore
from target_worker.kernels import ops


@dataclass(frozen=True)
class Verdict:
    accepted: int
    next_token: int
    cached_len: int
    compute_s: float


class Verifier:
    def __init__(self, lm: CausalLM, store: SessionStore, max_draft_tokens: int):
        self.lm = lm
        self.store = store
        self.max_draft_tokens = max_draft_tokens
        self.vocab_size = int(lm.model.get_output_embeddings().weight.shape[0])
        self.max_context = int(getattr(lm.config, "max_position_embeddings", 0) or 1 << 30)

    def _check_ids(self, name: str, ids: list[int]) -> None:
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidArgument(f"{name}: token id {bad[0]} outside the vocabulary 0..{self.vocab_size - 1}")

    def verify(self, session_id: str, start: int, tokens: list[int], drafts: list[int],
               sampling: Sampling = GREEDY) -> Verdict | Resync:
        began = time.perf_counter()
        if len(drafts) > self.max_draft_tokens:
            raise InvalidArgument(f"draft_tokens: {len(drafts)} exceeds the limit of {self.max_draft_tokens}")
        self._check_ids("delta.tokens", tokens)
        self._check_ids("draft_tokens", drafts)
        if start + len(tokens) + len(drafts) > self.max_context:
            raise InvalidArgument(
                f"delta: {start + len(tokens) + len(drafts)} tokens exceed the model context of {self.max_context}"
            )
        synced = self.store.sync(session_id, start, tokens)
        if isinstance(synced, Resync):
            return synced
        session = synced.session
        fed = self.lm.prepare(synced) + drafts
        k = len(drafts)
        logits = self.lm.feed(session, fed, logits_to_keep=k + 1)  # [k + 1, V]
        accepted_n, next_id = self._decide(logits, drafts, len(synced.context), sampling)
        committed = len(synced.context) + accepted_n
        self.lm.crop(session, committed)
        self.store.enforce_budget(keep=session_id)
        return Verdict(accepted_n, next_id, committed, time.perf_counter() - began)

    @staticmethod
    def _decide(logits: torch.Tensor, drafts: list[int], first_position: int, sampling: Sampling) -> tuple[int, int]:
        """(accepted, next token) for one session: greedy, or sampled with uniforms keyed by
        (seed, absolute position) — first_position is the committed length, the position of
        the round's first output token."""
        k = len(drafts)
        device = logits.device
        if sampling.greedy and k == 0:  # a plain decoding step
            return 0, int(torch.argmax(logits[0]))
        draft = torch.tensor([drafts], dtype=torch.long, device=device).reshape(1, k)  # [1, k]
        num_draft = torch.tensor([k], dtype=torch.long, device=device)  # [1]
        if sampling.greedy:
            accepted, next_token = ops.greedy_verify(logits[None], draft, num_draft)
        else:
            probs = ops.warp_probs(
                logits[None],  # [1, k + 1, V]
                torch.tensor([sampling.temperature]), torch.tensor([sampling.top_k]), torch.tensor([sampling.top_p]),
            )
            _, u_sample = round_uniforms(torch.tensor([sampling.seed]), torch.tensor([first_position]), k)
            accepted, next_token = ops.sampled_match(probs, draft, num_draft, u_sample)
        return int(accepted[0]), int(next_token[0])
