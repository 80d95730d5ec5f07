"""Greedy block verification on the target (plain Python; the servicer is a thin shell).

One round: the committed tokens the cache lacks plus the k draft tokens go through the
target in ONE forward pass. Logits at the position of the last committed token and of each
draft token give the target's own greedy choice at every draft position; the longest
prefix of drafts that equals those choices is accepted, and the target's choice right after
it is the next token (the correction, or the bonus when all k were accepted). The cache is
then cropped to the new committed length, minus that next token, whose keys are computed
when it is fed in the next round.

With a head on this worker (target_worker.head), a greedy round may also score the head's
alternatives: second-choice tokens at some depths of the draft it handed out, each run as a
leaf of a tree that branches off the chain at its depth (specdec.runtime.tree's blocks: same
position, attending to the chain before it). Where the chain is cut at depth d and the
alternative at d is the target's own choice there, the target's token after that
alternative is committed too (Verdict.extra): every committed token is still the target's
greedy choice given the tokens before it. The leaves enter the cache after the chain and
are cropped with it; a committed alternative is fed again next round, like the next token.
Sampled rounds take alternatives the same way: the target's token at a position is its own
draw (Philox, keyed by seed and absolute position) from its distribution given the tokens
before, so where that draw at the cut is the alternative, its draw at the next position
from the alternative's leaf is what the target alone would draw there — no multi-draft
acceptance rule is needed when drafts carry no probabilities (kernels/rejection_sample.py).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch

from specdec.errors import InvalidArgument, SpecdecError
from specdec.runtime.lm import CausalLM
from specdec.philox import round_uniforms
from specdec.sampling import GREEDY, Sampling
from specdec.sessions import Resync, SessionStore
from target_worker.kernels import ops


@dataclass(frozen=True)
class Round:
    """One session's round as the coordinator sent it."""

    session_id: str
    start: int
    tokens: list[int]
    drafts: list[int]
    sampling: Sampling = GREEDY
    features: bool = False  # return the committed positions' features
    draft_next: int = 0  # with a head on this worker: draft this many for the next round


@dataclass(frozen=True)
class Verdict:
    accepted: int
    next_token: int
    cached_len: int
    compute_s: float
    # With Round.features: float16 bytes of the final hidden states of positions
    # feature_start … cached_len - 1 (the committed positions this round fed).
    feature_start: int = 0
    features: bytes = b""
    # With Round.draft_next and a head on this worker: its draft for the next round.
    next_drafts: tuple[int, ...] = ()
    # Tokens after next_token the target also chose in this step (a head's alternative was
    # its choice at the depth the chain was cut): commit drafts[:accepted], next_token, these.
    extra: tuple[int, ...] = ()


@dataclass(frozen=True)
class BatchOutcome:
    results: list  # per round: Verdict | Resync | the exception that round raised
    step_s: float  # wall time of the whole step
    rows: int  # tokens run through the model (uncached committed + drafts, all sessions)


class Verifier:
    def __init__(self, lm: CausalLM, store: SessionStore, max_draft_tokens: int, head=None):
        self.lm = lm
        self.head = head  # target_worker.head.InlineHead or None
        self.store = store
        self.max_draft_tokens = max_draft_tokens
        self.vocab_size = int(lm.model.get_output_embeddings().weight.shape[0])
        self.max_context = int(getattr(lm.config, "max_position_embeddings", 0) or 1 << 30)

    def _check_ids(self, name: str, ids: list[int]) -> None:
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidArgument(f"{name}: token id {bad[0]} outside the vocabulary 0..{self.vocab_size - 1}")

    def verify(self, session_id: str, start: int, tokens: list[int], drafts: list[int],
               sampling: Sampling = GREEDY, features: bool = False, draft_next: int = 0) -> Verdict | Resync:
        """One round alone (the unary Verify rpc); errors raise."""
        result = self.verify_batch([Round(session_id, start, tokens, drafts, sampling, features,
                                          draft_next)]).results[0]
        if isinstance(result, BaseException):
            raise result
        return result

    def verify_batch(self, rounds: list[Round]) -> BatchOutcome:
        """Many sessions' rounds in ONE forward pass (specdec.runtime.packed). Each result is what
        the round alone would give: a Verdict, a Resync, or the error that round alone
        would raise (an invalid round never fails the others)."""
        began = time.perf_counter()
        results: list[Verdict | Resync | BaseException | None] = [None] * len(rounds)
        ready: list[tuple[int, object, list[int]]] = []  # (index, synced, tokens to feed)
        leaves: list[list[tuple[int, int]]] = []  # per ready round: the alternatives fed after its drafts
        seen: set[str] = set()
        for i, rnd in enumerate(rounds):
            try:
                if rnd.session_id in seen:
                    raise InvalidArgument(f"session {rnd.session_id!r} has more than one round in the batch")
                seen.add(rnd.session_id)
                self._validate(rnd)
                synced = self.store.sync(rnd.session_id, rnd.start, rnd.tokens)
            except SpecdecError as exc:
                results[i] = exc
                continue
            if isinstance(synced, Resync):
                results[i] = synced
                continue
            alternatives = self._alternatives(rnd, synced.session)
            ready.append((i, synced, self.lm.prepare(synced) + rnd.drafts + [t for _, t in alternatives]))
            leaves.append(alternatives)
        rows = sum(len(fed) for _, _, fed in ready)
        hidden: list = [None] * len(ready)
        if ready:
            try:
                sessions, fed = [synced.session for _, synced, _ in ready], [fed for _, _, fed in ready]
                keep = [len(rounds[i].drafts) + 1 + len(alt) for (i, _, _), alt in zip(ready, leaves)]
                parents = [self._tree(len(f) - len(alt), len(rounds[i].drafts), alt) if alt else None
                           for (i, _, f), alt in zip(ready, leaves)]
                parents = parents if any(p is not None for p in parents) else None
                if self.head is not None or any(rounds[i].features for i, _, _ in ready):
                    aux = tuple(self.head.aux_layers) if self.head is not None else ()
                    logits, hidden = self.lm.feed_batch(sessions, fed, keep, features=True, aux_layers=aux,
                                                        parents=parents)
                else:
                    logits = self.lm.feed_batch(sessions, fed, keep)
                # The chain's rows first; the alternatives' after them.
                leaf_logits = [logits_i[len(rounds[i].drafts) + 1:] for (i, _, _), logits_i in zip(ready, logits)]
                decisions = self._decide_batch([logits_i[:len(rounds[i].drafts) + 1]
                                                for (i, _, _), logits_i in zip(ready, logits)],
                                               [rounds[i] for i, _, _ in ready],
                                               [len(synced.context) for _, synced, _ in ready])
            except Exception as exc:  # noqa: BLE001 - every round of the step failed alike
                # feed_batch forgot the sessions' caches; each round is retried by its request.
                for i, _, _ in ready:
                    results[i] = exc
                ready = []
                decisions = []
            for (i, synced, fed), (accepted_n, next_id), states, alt, alt_logits in zip(
                    ready, decisions, hidden, leaves, leaf_logits if ready else []):
                committed = len(synced.context) + accepted_n
                # Leaves sit after the chain in the cache: this crop drops them too.
                self.lm.crop(synced.session, committed)
                feature_start, feature_bytes, next_drafts = 0, b"", ()
                # Cut at depth accepted_n: the alternative there, if the target chose it, and
                # the target's choice after it (its leaf's logits) are committed as well.
                leaf = next((j for j, (depth, token) in enumerate(alt)
                             if depth == accepted_n < len(rounds[i].drafts) and token == next_id), None)
                extra = (self._decide(alt_logits[leaf:leaf + 1], [], len(synced.context) + accepted_n + 1,
                                      rounds[i].sampling)[1],) if leaf is not None else ()
                if states is not None:
                    # The fed committed tokens, then the accepted drafts: all now committed.
                    fed_chain = len(fed) - len(alt)
                    fed_committed = fed_chain - len(rounds[i].drafts)
                    feature_start = len(synced.context) - fed_committed
                    if leaf is not None:  # then the committed alternative's
                        states = torch.cat([states[:fed_committed + accepted_n], states[fed_chain + leaf:][:1]])
                    states = states[:fed_committed + accepted_n + len(extra)].to(torch.float16).contiguous()
                    if self.head is not None:
                        self.head.record(synced.session, feature_start, states)
                        if rounds[i].draft_next:
                            context = synced.context + rounds[i].drafts[:accepted_n] + [next_id] + list(extra)
                            next_drafts = tuple(self.head.draft(synced.session, context, rounds[i].draft_next))
                    # On the wire: the final hidden states only (what WorkerInfo.feature_size says).
                    feature_bytes = states[:, :self.lm.feature_size].cpu().contiguous().numpy().tobytes() \
                        if rounds[i].features else b""
                    feature_start = feature_start if rounds[i].features else 0
                results[i] = Verdict(accepted_n, next_id, committed, 0.0, feature_start, feature_bytes, next_drafts,
                                     extra)
            for i, synced, _ in ready:
                self.store.enforce_budget(keep=synced.session.session_id)
        step_s = time.perf_counter() - began
        results = [dataclasses.replace(r, compute_s=step_s) if isinstance(r, Verdict) else r for r in results]
        return BatchOutcome(results, step_s, rows)

    def _alternatives(self, rnd: Round, session) -> list[tuple[int, int]]:
        """The head's alternatives (depth, token) to score with this round's drafts: rounds
        that verify the head's own draft, on a model that runs tree blocks."""
        if self.head is None or not rnd.drafts or rnd.features or not self.lm.runs_trees:
            return []
        return self.head.alternatives(session, rnd.drafts)

    @staticmethod
    def _tree(fed_chain: int, drafts: int, alternatives: list[tuple[int, int]]) -> list[int]:
        """Parents (specdec.runtime.tree) of a block of fed_chain tokens, the
        last `drafts` of them the draft, followed by the alternatives: an alternative at
        depth d branches off where draft token d does."""
        committed = fed_chain - drafts
        return list(range(-1, fed_chain - 1)) + [committed + depth - 1 for depth, _ in alternatives]

    def _validate(self, rnd: Round) -> None:
        if len(rnd.drafts) > self.max_draft_tokens:
            raise InvalidArgument(f"draft_tokens: {len(rnd.drafts)} exceeds the limit of {self.max_draft_tokens}")
        if rnd.draft_next > self.max_draft_tokens:
            raise InvalidArgument(f"draft_next: {rnd.draft_next} exceeds the limit of {self.max_draft_tokens}")
        self._check_ids("delta.tokens", rnd.tokens)
        self._check_ids("draft_tokens", rnd.drafts)
        if rnd.start + len(rnd.tokens) + len(rnd.drafts) > self.max_context:
            raise InvalidArgument(
                f"delta: {rnd.start + len(rnd.tokens) + len(rnd.drafts)} tokens exceed the model context of "
                f"{self.max_context}"
            )

    def _decide_batch(self, logits: list[torch.Tensor], rounds: list[Round],
                      first_positions: list[int]) -> list[tuple[int, int]]:
        """(accepted, next token) per round: the greedy rounds in one greedy_verify call and
        the sampled ones in one warp + sampled_match call, each over a ragged batch padded
        to its longest block (the kernels read num_draft and never look past it)."""
        out: list[tuple[int, int] | None] = [None] * len(rounds)
        greedy = [i for i, r in enumerate(rounds) if r.sampling.greedy]
        sampled = [i for i, r in enumerate(rounds) if not r.sampling.greedy]
        for group in (greedy, sampled):
            if not group:
                continue
            if len(group) == 1:  # the common single-session case, without padding
                i = group[0]
                out[i] = self._decide(logits[i], rounds[i].drafts, first_positions[i], rounds[i].sampling)
                continue
            width = max(len(rounds[i].drafts) for i in group)
            vocab = logits[group[0]].shape[-1]
            device = logits[group[0]].device
            padded = logits[group[0]].new_zeros((len(group), width + 1, vocab))  # [B, K + 1, V]
            draft = torch.zeros((len(group), max(width, 1)), dtype=torch.long, device=device)  # [B, K]
            num_draft = torch.tensor([len(rounds[i].drafts) for i in group], dtype=torch.long, device=device)  # [B]
            for row, i in enumerate(group):
                n = len(rounds[i].drafts)
                padded[row, :n + 1] = logits[i]
                if n:
                    draft[row, :n] = torch.tensor(rounds[i].drafts, dtype=torch.long, device=device)
            draft = draft[:, :width] if width else draft[:, :0]
            if group is greedy:
                accepted, next_token = ops.greedy_verify(padded, draft, num_draft)
            else:
                params = [rounds[i].sampling for i in group]
                probs = ops.warp_probs(padded, torch.tensor([p.temperature for p in params]),
                                       torch.tensor([p.top_k for p in params]), torch.tensor([p.top_p for p in params]))
                _, u_sample = round_uniforms(torch.tensor([p.seed for p in params]),
                                             torch.tensor([first_positions[i] for i in group]), width)
                accepted, next_token = ops.sampled_match(probs, draft, num_draft, u_sample)
            for row, i in enumerate(group):
                out[i] = (int(accepted[row]), int(next_token[row]))
        return out

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
