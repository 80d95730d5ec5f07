"""A feature-level head (specdec.eagle) as a drafter: it reads the target's hidden states,
which the coordinator forwards from the target's verdicts with each Propose when a draft
worker serves the head, or which the target worker hands it directly when the head runs next
to the target (target_worker.head, the faster arrangement: no features on the wire, no
Propose round trip).

Per session the head keeps its own KV cache (specdec.eagle.HeadCache). Entries of committed
positions are fed with the target's true features and stay; entries of draft positions are
fed with the head's own predictions and are dropped at the next round, even when the target
accepted those tokens: the target's features for them have arrived by then, and the head was
trained to continue from true features (specdec.eagle's docstring). A round whose features
do not cover what must be fed asks for a resync from the first position it lacks.

Copying first: when the context's last `lookup_ngram` (or more, up to 3) tokens occurred
before, the tokens that followed them are proposed instead of the head's chain (n-gram
prompt lookup, specdec.ngram), and the chain is not run. A head trained on
open-ended answers predicts copied spans (summaries, rewrites, extraction, code edits)
worse than a lookup does, and the lookup costs nothing; Snowflake's Arctic Inference pairs
suffix decoding with a model speculator the same way (a match wins, the model otherwise).
The head still takes in every committed token, so it is ready for the next round.
A copy carries no probability of its own: each copy found is judged against what the
context commits after it, drafted or not, and a copy is cut at the price of a draft row by
its measured chance of being right (Copier, CopyRecord), as the chain is by the head's.

Stopping early: the chain ends where the head's own probability that the whole chain so far
is right (the product of its top-token probabilities over the draft vocabulary) falls below
`min_chain_prob`. A draft token costs a verification row whether or not it is accepted, and
the head's confidence is well calibrated on held-out chains, so a block cut where its
expected value drops below a row's cost gives more tokens per unit of work than any fixed k
— EAGLE-2's observation (Li et al. 2024, arXiv:2406.16858) applied to a chain; the default
cut (MIN_CHAIN_PROB) raises accepted/proposed for slightly fewer tokens per round
(`benchmarks/head_step.py`; figures in benchmarks/results/NOTES.md).

Alternatives (the head next to the target only): at each depth of the chain, the head's
second choice is also proposed when its probability of being right (the chain's so far
times that token's) is at least `min_alt_prob`. The target worker scores each such token
as a leaf of a tree in the same verification pass (it branches off the chain at its depth,
specdec.runtime.tree's blocks): when the chain is rejected at a depth whose alternative is
the target's own choice there, the target's token after the alternative is committed too.
The head's top-2 come from the softmax it computes anyway, so alternatives cost
verification rows but no head steps, and at the default threshold (MIN_ALT_PROB) they raise
tokens per round at the price of extra rows (`benchmarks/head_step.py`; figures in
benchmarks/results/NOTES.md)."""

from __future__ import annotations

import torch

from specdec.eagle.head import EagleHead
from specdec.errors import InvalidArgument
from specdec.ngram import DEFAULT_MAX_NGRAM, NgramIndex
from specdec.sessions import Resync, Session, SyncedContext, common_prefix_len


class Features:
    """The features a Propose carried: rows for positions start … start + len(rows) - 1."""

    def __init__(self, start: int, data: bytes, size: int):
        self.start = start
        count = len(data) // (2 * size) if size else 0
        if count * 2 * size != len(data):
            raise InvalidArgument(f"features: {len(data)} bytes is not a whole number of float16 rows of {size}")
        self.rows = torch.frombuffer(bytearray(data), dtype=torch.float16).view(count, size) if count else \
            torch.zeros((0, size), dtype=torch.float16)

    @classmethod
    def from_rows(cls, start: int, rows: torch.Tensor) -> Features:
        """Features already in a [n, H] tensor (a target worker's own)."""
        features = cls.__new__(cls)
        features.start, features.rows = start, rows
        return features

    def cover(self, first: int, end: int) -> torch.Tensor | None:
        """Rows of positions first … end - 1, or None when some are missing."""
        if first >= end:
            return self.rows[:0]
        if first < self.start or end > self.start + len(self.rows):
            return None
        return self.rows[first - self.start:end - self.start]


# Shortest repeated n-gram whose continuation is proposed instead of the head's (0: never).
LOOKUP_NGRAM = 2
# A copy's chance of being accepted at each depth (CopyRecord): the prior rate a replica's
# record starts from, as if COPY_PRIOR_TRIALS copies had reached every depth; a session's
# record starts from its replica's rates with that weight. Memory: a session's record
# decays by COPY_DECAY per copy it judges (~10 copies), a replica's by COPY_RECORD_DECAY
# (~50 copies over all its sessions).
COPY_PRIOR_RATE = 0.6
COPY_PRIOR_TRIALS = 2.0
COPY_DECAY = 0.9
COPY_RECORD_DECAY = 0.98
# The chain stops before a token that would bring the head's probability of the whole chain
# being right below this (0: always draft k).
MIN_CHAIN_PROB = 0.15
# An alternative (second-choice) token is proposed where the head's probability that it is
# right is at least this (1 or more: never).
MIN_ALT_PROB = 0.05


class CopyRecord:
    """How far copies (n-gram lookups, which carry no probability of their own) are accepted:
    per depth d, the decayed share of the copies that reached depth d (their first d tokens
    accepted) whose token d was accepted too. Their running product is a copy's chance of
    being right up to a depth, the quantity the head's chain is cut by, so a copy is held to
    the same price (`reach`). Fed by each session's Copier."""

    def __init__(self, prior: CopyRecord | None = None, decay: float = COPY_DECAY):
        self.decay = decay
        rates = prior.rates() if prior is not None else []
        self.hits = [rate * COPY_PRIOR_TRIALS for rate in rates]
        self.tries = [COPY_PRIOR_TRIALS] * len(rates)

    def rate(self, depth: int) -> float:
        """The chance that a copy's token at `depth` is accepted once the ones before it were."""
        if depth >= len(self.tries):
            return COPY_PRIOR_RATE
        return self.hits[depth] / self.tries[depth]

    def rates(self) -> list[float]:
        return [self.rate(depth) for depth in range(len(self.tries))]

    def observe(self, proposed: int, accepted: int) -> None:
        """A copy of `proposed` tokens of which the target accepted the first `accepted`: every
        depth up to the first rejected one was tried."""
        for depth in range(min(proposed, accepted + 1)):
            while depth >= len(self.tries):
                self.hits.append(COPY_PRIOR_RATE * COPY_PRIOR_TRIALS)
                self.tries.append(COPY_PRIOR_TRIALS)
            self.hits[depth] = self.decay * self.hits[depth] + (1.0 if depth < accepted else 0.0)
            self.tries[depth] = self.decay * self.tries[depth] + 1.0

    def reach(self, floor: float, k: int) -> int:
        """How many tokens of a copy to propose, at most k: the longest prefix whose chance of
        being right in full is at least `floor` (the price of a draft row; 0: all k)."""
        chance = 1.0
        for depth in range(k):
            chance *= self.rate(depth)
            if chance < floor:
                return depth
        return k


class Copier:
    """A session's copies (copying first, above): its n-gram index (specdec.ngram.NgramIndex,
    which takes in only the tokens committed since it last looked), the copy it found last
    (for the context of length `at`) and how far its copies are accepted (its CopyRecord,
    started from the drafter's record of every session, `replica`). Each ask first judges the
    copy found last against what the context has committed since — drafted or not, so copies
    the price stopped are still measured and come back when they would be right — then finds
    the next one and cuts it where the record's chance of the whole copy being right falls
    below the floor (the price of a draft row)."""

    def __init__(self, lookup_ngram: int, replica: CopyRecord):
        self.index = NgramIndex(max(DEFAULT_MAX_NGRAM, lookup_ngram), lookup_ngram)
        self.record = CopyRecord(replica)
        self.replica = replica
        self.candidate: tuple[int, ...] = ()
        self.at = -1

    def copy(self, context: list[int], k: int, floor: float) -> list[int]:
        """Up to k tokens copied for `context`, cut at `floor`; [] for none."""
        # The index covers the context the last copy was found for (`at` tokens): it is
        # judged only if the context still starts with that one.
        if self.index.sync(context):
            self._judge(context)
        found = self.index.lookup(k)
        self.candidate, self.at = tuple(found), len(context)
        return found[:self.record.reach(floor, len(found))]

    def _judge(self, context: list[int]) -> None:
        candidate, at = self.candidate, self.at
        if not candidate or len(context) <= at:
            return
        committed = context[at:at + len(candidate) + 1]
        right = common_prefix_len(list(candidate), committed)
        proposed = len(candidate) if right < len(committed) else right  # past the committed: unknown
        self.record.observe(proposed, right)
        self.replica.observe(proposed, right)

    def held_bytes(self) -> int:
        return self.index.held_bytes()


def copying_bytes(session: Session) -> int:
    """The bytes `session`'s copies hold (its Copier's index; 0 before its first ask)."""
    return session.copying.held_bytes() if session.copying is not None else 0


class EagleDrafter:
    def __init__(self, name: str, head: EagleHead, lookup_ngram: int = LOOKUP_NGRAM,
                 min_chain_prob: float = MIN_CHAIN_PROB, min_alt_prob: float = MIN_ALT_PROB):
        self.name = name
        self.head = head
        self.lookup_ngram = lookup_ngram
        self.min_chain_prob = min_chain_prob
        self.min_alt_prob = min_alt_prob
        config = head.config
        self.feature_size = config.feature_size
        element = torch.finfo(head.fc.weight.dtype).bits // 8
        self.bytes_per_token = 2 * config.num_kv_heads * config.head_dim * element
        self.vocab_size = int(head.embed.shape[0])
        self.max_context = config.max_position_embeddings
        self.copies = CopyRecord(decay=COPY_RECORD_DECAY)  # every session's copies: a new one starts here

    def copier(self, session: Session) -> Copier:
        """`session`'s copies (made at its first ask)."""
        if session.copying is None:
            session.copying = Copier(self.lookup_ngram, self.copies)
        return session.copying

    def propose(self, synced: SyncedContext, k: int, features: Features | None = None) -> list[int] | Resync:
        return self.propose_batch([synced], [k], [features])[0]

    @staticmethod
    def held_bytes(session: Session) -> int:
        """The bytes `session`'s head cache keeps allocated (specdec.eagle.HeadCache), and its copies' index."""
        return copying_bytes(session) + (0 if session.cache is None else session.cache.held_bytes())

    @torch.inference_mode()
    def propose_batch(self, synced: list[SyncedContext], ks: list[int],
                      features: list[Features | None] | None = None,
                      min_probs: list[float] | None = None) -> list[list[int] | Resync]:
        """One session at a time; `min_probs`: per session a floor on the chain's cut (the
        caller's price of a draft row; 1 or more: no draft, copies included)."""
        features = features or [None] * len(synced)
        floors = min_probs if min_probs is not None else [0.0] * len(synced)
        return [self._propose_one(s, min(k, self.max_context - len(s.context)), f, floor=floor)
                for s, k, f, floor in zip(synced, ks, features, floors)]

    @torch.inference_mode()
    def propose_tree(self, synced: SyncedContext, k: int,
                     features: Features | None = None) -> tuple[list[int], list[tuple[int, int]]] | Resync:
        """The chain, and the alternatives as (depth, token): a token proposed instead of
        chain[depth], continuing chain[:depth] (see the module's docstring)."""
        alternatives: list[tuple[int, int]] = []
        chain = self._propose_one(synced, min(k, self.max_context - len(synced.context)), features, alternatives)
        if isinstance(chain, Resync):
            return chain
        return chain, [(depth, token) for depth, token in alternatives if depth < len(chain)]

    def _propose_one(self, synced: SyncedContext, k: int, features: Features | None,
                     alternatives: list[tuple[int, int]] | None = None, floor: float = 0.0) -> list[int] | Resync:
        head, session, context = self.head, synced.session, synced.context
        cache = session.cache
        if cache is None:
            cache = session.cache = head.new_cache()
            cache.trusted = 0
            session.ids = []
        # Keep only entries of committed positions fed with true features (and never the
        # last committed token: its output is the first draft's prediction).
        keep = min(synced.reusable, cache.trusted, len(context) - 1)
        cache.crop(keep)
        cache.trusted = keep
        del session.ids[keep:]
        # Feeding positions keep … len-1 needs the features of keep-1 … len-2.
        rows = features.cover(max(keep - 1, 0), len(context) - 1) if features is not None else None
        if rows is None:
            return Resync(cached_len=keep)
        rows = rows.to(device=head.embed.device, dtype=head.fc.weight.dtype)
        if keep == 0:  # position 0 has no feature before it
            rows = torch.cat([rows.new_zeros((1, rows.shape[1])), rows])
        fed = context[keep:]
        out = head.extend(cache, rows, fed)  # [n, H]
        session.ids.extend(fed)
        cache.trusted = len(context)
        if self.lookup_ngram and k > 0 and floor < 1:
            copied = self.copier(session).copy(context, k, floor)
            if copied:
                return copied
        proposal: list[int] = []
        predicted = out[-1]
        chain = 1.0
        for step in range(k):
            top = torch.softmax(head.logits(predicted), -1).topk(2, -1)
            if alternatives is not None and chain * float(top.values[1]) >= max(self.min_alt_prob, floor):
                alternatives.append((step, int(head.draft_vocab[int(top.indices[1])])))
            chain *= float(top.values[0])
            if chain < max(self.min_chain_prob, floor):
                break
            token = int(head.draft_vocab[int(top.indices[0])])
            proposal.append(token)
            if step + 1 < k:
                predicted = head.extend(cache, predicted[None], [token])[0]
                session.ids.append(token)
        return proposal
