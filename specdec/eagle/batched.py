"""A feature-level head drafting for all sessions of a step at once: one head pass takes in
the committed positions every session must still be fed, then one pass per draft depth runs
the sessions still drafting, with one host read per depth (their tokens and stop decisions,
taken together). The target worker's head (target_worker.head) drafts this way.

What it drafts is what EagleDrafter.propose_tree drafts for each session alone (the policy:
specdec.eagle.policy — copying first, the chain cut at MIN_CHAIN_PROB, alternatives at
MIN_ALT_PROB, both raised per session to the caller's floor where it gives one: the price of
a draft row under load, target_worker.head); only the arithmetic is batched, so a draft can differ from the one-session
head's at a float rounding near-tie, never in kind. Drafts only ever cost speed: the target
verifies every token.

Per session the head keeps a Session: its cache (the storage's), its ids (the tokens fed) and
`trusted`, how many of those were fed with the target's true features (entries of draft
positions, fed the head's own predictions, are rolled back at the next round, as in
specdec.eagle.policy). A target worker's head keeps that Session beside the target's
(target_worker.head); a draft worker serving a head drafts on its store's sessions
(`BatchedEagleDrafter`).

Storage (`HeadStorage`): where the sessions' head keys and values live, chosen like the
target's (`--kv-cache`): a paged pool of its own beside a paged target (specdec.eagle.paged:
one forward per step, attention through the paged contract, the GPU's layout), or one
contiguous buffer per session beside a buffered target (`BufferedHead`: the layer's linears
still run once over every session, attention per session through SDPA, which on a CPU at a
few sessions costs less than gathering blocks). A session that finds no room in a paged
pool gets no draft that round and its head state is dropped (drafts only cost speed).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from specdec.eagle.head import EagleHead, HeadCache
from specdec.eagle.policy import EagleDrafter, Features, copying_bytes
from specdec.runtime.paged import PoolExhausted
from specdec.sessions import Resync, Session, SyncedContext


class HeadStorage(Protocol):
    """Where a head's per-session keys and values live (PagedHead, BufferedHead)."""

    max_batch: int  # sessions one step may carry
    nbytes: int  # preallocated bytes (a pool), 0 when caches grow per session

    def new_cache(self): ...

    def length(self, cache) -> int: ...

    def held_bytes(self, cache) -> int: ...

    def reserve(self, cache, n: int) -> None: ...  # PoolExhausted: no room, nothing changed

    def truncate(self, cache, length: int) -> None: ...

    def release(self, cache) -> None: ...

    def step(self, caches: Sequence, features: torch.Tensor, tokens: Sequence[Sequence[int]]) -> torch.Tensor: ...


class BufferedHead:
    """Head storage of one growing contiguous buffer per session (specdec.eagle.HeadCache)."""

    max_batch = 1 << 30
    nbytes = 0

    def __init__(self, head: EagleHead):
        self.head = head

    def new_cache(self) -> HeadCache:
        return self.head.new_cache()

    @staticmethod
    def length(cache: HeadCache) -> int:
        return cache.length

    @staticmethod
    def held_bytes(cache: HeadCache) -> int:
        return cache.held_bytes()

    def reserve(self, cache: HeadCache, n: int) -> None:
        """Buffers grow as they are written."""

    @staticmethod
    def truncate(cache: HeadCache, length: int) -> None:
        cache.crop(length)

    def release(self, cache: HeadCache) -> None:
        """The buffers go with the last reference to the cache."""

    @torch.inference_mode()
    def step(self, caches: Sequence[HeadCache], features: torch.Tensor,
             tokens: Sequence[Sequence[int]]) -> torch.Tensor:
        return self.head.extend_many(list(caches), features, [list(t) for t in tokens])


class BatchedDrafter:
    """EagleDrafter's policy over a head storage, for all sessions of a step at once."""

    def __init__(self, drafter: EagleDrafter, storage: HeadStorage):
        self.drafter = drafter
        self.storage = storage
        self.head = drafter.head

    def forget(self, session: Session) -> None:
        """Gives a head session's storage back."""
        if session.cache is not None:
            self.storage.release(session.cache)
        session.cache, session.ids, session.trusted = None, [], 0

    @torch.inference_mode()
    def propose_tree(self, synced: Sequence[SyncedContext], ks: Sequence[int],
                     features: Sequence[Features], min_probs: Sequence[float] | None = None,
                     ) -> list[tuple[list[int], list[tuple[int, int]]] | Resync]:
        """Per session, its chain and alternatives (EagleDrafter.propose_tree), or Resync from
        the first position whose features are missing — or from 0 when the pool had no room
        for it (its head state must then be dropped). `min_probs`: per session, a floor on
        both cuts (a chain token or an alternative is proposed only where the head's
        probability that it is right is at least this; 0: the drafter's cuts only; 1 or
        more: no draft, copies included; a copy is cut at the floor by its record: Copier)."""
        results: list = [None] * len(synced)
        ready: list[int] = []
        fed_rows: list[torch.Tensor] = []
        fed_tokens: list[list[int]] = []
        limits: list[int] = []
        for i, (sync, k, feats) in enumerate(zip(synced, ks, features)):
            k = max(0, min(k, self.drafter.max_context - len(sync.context)))
            prepared = self._catch_up(sync, feats, k)
            if isinstance(prepared, Resync):
                results[i] = prepared
                continue
            rows, fed = prepared
            ready.append(i)
            fed_rows.append(rows)
            fed_tokens.append(fed)
            limits.append(k)
        if not ready:
            return results
        sessions = [synced[i].session for i in ready]
        predicted = self._run(sessions, torch.cat(fed_rows), fed_tokens)  # [B, H]: each session's last fed row
        for i, session in zip(ready, sessions):
            session.trusted = len(synced[i].context)
        floors = min_probs if min_probs is not None else [0.0] * len(synced)
        drafting: list[int] = []  # indices into `ready`
        for j, (i, k) in enumerate(zip(ready, limits)):
            wanted = self.drafter.lookup_ngram and k > 0 and floors[i] < 1
            copied = self.drafter.copier(sessions[j]).copy(synced[i].context, k, floors[i]) if wanted else []
            if copied or k == 0:
                results[i] = (copied, [])
            else:
                drafting.append(j)
        chains = self._chains([sessions[j] for j in drafting], predicted[drafting] if drafting else predicted[:0],
                              [limits[j] for j in drafting], [floors[ready[j]] for j in drafting])
        for j, chain in zip(drafting, chains):
            results[ready[j]] = chain
        return results

    def _catch_up(self, sync: SyncedContext, features: Features, k: int):
        """The session's head cache rolled back to its entries of committed positions, and
        (feature rows, tokens) of the committed positions it must still take in; or Resync."""
        session, context, storage = sync.session, sync.context, self.storage
        if session.cache is None:
            session.cache, session.ids, session.trusted = storage.new_cache(), [], 0
        # Entries of committed positions fed with true features stay; never the last
        # committed token's: its output is the first draft's prediction.
        keep = min(sync.reusable, session.trusted, len(context) - 1, storage.length(session.cache))
        storage.truncate(session.cache, keep)
        del session.ids[keep:]
        session.trusted = keep
        rows = features.cover(max(keep - 1, 0), len(context) - 1)
        if rows is None:
            return Resync(cached_len=keep)
        if keep == 0:  # position 0 has no feature before it
            rows = torch.cat([rows.new_zeros((1, rows.shape[1])), rows])
        fed = context[keep:]
        try:  # the step's positions and the draft's, so no later depth can run short
            storage.reserve(session.cache, len(fed) + k)
        except PoolExhausted:
            return Resync(cached_len=0)
        return rows, fed

    def _run(self, sessions: list[Session], rows: torch.Tensor, tokens: list[list[int]]) -> torch.Tensor:
        """Feeds the sessions their tokens (rows [T, F]: the feature rows, packed in order),
        one head forward per max_batch sessions; the predicted features of each session's
        last fed position, [B, H]."""
        out: list[torch.Tensor] = []
        size, offset = self.storage.max_batch, 0
        for begin in range(0, len(sessions), size):
            part = tokens[begin:begin + size]
            count = sum(len(t) for t in part)
            predicted = self.storage.step([s.cache for s in sessions[begin:begin + size]],
                                          rows[offset:offset + count], part)
            if count > len(part):  # some session fed more than one token: its last row only
                predicted = predicted[torch.tensor(tokens_ends(part), device=predicted.device)]
            out.append(predicted)
            offset += count
        for session, fed in zip(sessions, tokens):
            session.ids.extend(fed)
        return out[0] if len(out) == 1 else torch.cat(out)

    def _chains(self, sessions: list[Session], predicted: torch.Tensor, limits: list[int],
                floors: list[float]) -> list[tuple[list[int], list[tuple[int, int]]]]:
        """The chain and alternatives of each session, depth by depth: the head's logits of
        every session still drafting in one call, one host read of their top-2 tokens and
        stop decisions, and one head step feeding each continuing chain its token. `floors`:
        each session's minimum probability for both cuts (propose_tree)."""
        drafter, head = self.drafter, self.head
        chains: list[list[int]] = [[] for _ in sessions]
        alternatives: list[list[tuple[int, int]]] = [[] for _ in sessions]
        active = list(range(len(sessions)))
        chain_prob = torch.ones(len(sessions), device=predicted.device)
        floor = torch.tensor(floors, dtype=chain_prob.dtype, device=predicted.device)
        chain_cut = floor.clamp(min=drafter.min_chain_prob)
        alt_cut = floor.clamp(min=drafter.min_alt_prob)
        depth = 0
        while active:
            top = torch.softmax(head.logits(predicted), -1).topk(2, -1)  # values, indices [A, 2]
            with_alternative = chain_prob * top.values[:, 1] >= alt_cut
            chain_prob = chain_prob * top.values[:, 0]
            going_on = chain_prob >= chain_cut
            tokens = head.draft_vocab[top.indices]  # [A, 2] target ids
            first, second, alt, go = torch.stack(
                [tokens[:, 0], tokens[:, 1], with_alternative.long(), going_on.long()]).tolist()  # the depth's one read
            continuing: list[int] = []  # rows of this depth
            for row, s in enumerate(active):
                if alt[row]:
                    alternatives[s].append((depth, second[row]))
                if not go[row]:
                    continue
                chains[s].append(first[row])
                if len(chains[s]) < limits[s]:
                    continuing.append(row)
            if not continuing:
                break
            if len(continuing) < len(active):  # drop the rows of chains that ended
                keep = torch.tensor(continuing, device=predicted.device)
                predicted, chain_prob = predicted[keep], chain_prob[keep]
                chain_cut, alt_cut = chain_cut[keep], alt_cut[keep]
                active = [active[row] for row in continuing]
            predicted = self._run([sessions[s] for s in active], predicted, [[chains[s][-1]] for s in active])
            depth += 1
        return [(chain, [(d, t) for d, t in alts if d < len(chain)]) for chain, alts in zip(chains, alternatives)]


def tokens_ends(tokens: Sequence[Sequence[int]]) -> list[int]:
    """Row of each list's last token in their concatenation."""
    ends, total = [], 0
    for fed in tokens:
        total += len(fed)
        ends.append(total - 1)
    return ends


class BatchedEagleDrafter:
    """A head as a draft worker serves it (features from the wire): EagleDrafter's interface
    for draft_worker.propose, drafting every session of a step together over buffered
    caches. Chains only: a draft worker's drafts carry no alternatives."""

    def __init__(self, drafter: EagleDrafter, storage: HeadStorage | None = None):
        self.drafter = drafter
        self.name = drafter.name
        self.head = drafter.head
        self.feature_size = drafter.feature_size
        self.bytes_per_token = drafter.bytes_per_token
        self.batched = BatchedDrafter(drafter, storage or BufferedHead(drafter.head))

    def held_bytes(self, session: Session) -> int:
        return copying_bytes(session) + (0 if session.cache is None else self.batched.storage.held_bytes(session.cache))

    def propose_batch(self, synced: list[SyncedContext], ks: list[int],
                      features: list[Features | None] | None = None,
                      min_probs: list[float] | None = None) -> list[list[int] | Resync]:
        """Per session up to k tokens; `min_probs`: per session the least probability of
        acceptance, by the head's own estimate, at which it drafts (the caller's price of a
        draft row; the drafter's own cut applies where it is higher)."""
        # A round without features can only draft what its cache already covers.
        empty = Features.from_rows(0, torch.zeros((0, self.feature_size), dtype=torch.float16))
        features = [f if f is not None else empty for f in (features or [None] * len(synced))]
        results = self.batched.propose_tree(synced, ks, features, min_probs)
        return [result if isinstance(result, Resync) else result[0] for result in results]
