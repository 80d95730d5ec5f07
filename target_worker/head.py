"""A feature-level draft head run by the target worker itself (`specdec serve target --head`,
and what `specdec up --draft HEAD` does).

A head (specdec.eagle) reads the target's hidden states, which exist only on the target
worker; served by a draft worker, every committed position's features cross the wire twice
(target → coordinator → draft, 1,152 bytes per token on SmolLM2) and every round waits for a
Propose round trip before it can verify. Next to the target the head reads the states the
verification has just computed, and drafts the next round's block in the same step: the
verdict carries it (Verdict.next_drafts), so a round is one Verify call. A head step costs a
small fraction of a target step (specdec.eagle.fast_cpu_head; figures in
benchmarks/results/NOTES.md), so it does not change how the target scales; this is also how
EAGLE heads are served in one-process systems (vLLM and SGLang run the head in the target's
worker). Output is unaffected: the target verifies every
draft token exactly as it verifies a draft worker's.

Per target session the head keeps its own session (its KV cache — blocks of the head's
paged pool beside a paged target — and the ids fed to it) and the features of committed positions it has not yet been fed: rounds
that ask for no draft (a paused request, `--no-speculation`) only record them, and the next
drafting round feeds them all. The state lives on the target's session, so eviction drops
both together (`forget` gives the head's cache back), its bytes count toward the session's
under the worker's cache budget (`held_bytes`), and a session rebuilt from position 0
rebuilds the head's. Should the features ever have a gap (a session continued without its
earlier positions), the head state is dropped and that session gets no drafts until it is
rebuilt from 0: drafts only ever cost speed.

A step drafts for all its sessions at once (`draft_batch`, specdec.eagle.batched): one head
forward takes in every session's new committed positions, then one forward per draft depth
runs the sessions still drafting, with one host read per depth.

With each draft the head hands out it keeps its alternatives (second choices at some depths,
specdec.eagle.policy); the next round's verification scores them as tree leaves when
its draft tokens are that draft or a prefix of it (target_worker.verify).

A copy (an n-gram lookup the drafter proposes instead of its chain) is cut at the round's
price by how far the session's copies are accepted, judged at each ask against what the
context committed since (specdec.eagle.policy.Copier); its n-gram index is the session's
state too (`held_bytes`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from specdec import eagle
from specdec.eagle.batched import BatchedDrafter, HeadStorage
from specdec.eagle.policy import MIN_ALT_PROB, MIN_CHAIN_PROB, EagleDrafter, Features, copying_bytes
from specdec.errors import InvalidArgument
from specdec.runtime.memory import storage_bytes
from specdec.sessions import Resync, Session, SyncedContext, common_prefix_len

log = logging.getLogger(__name__)


@dataclass
class HeadState:
    session: Session  # the head's own: its PagedSession, fed ids, positions fed true features
    start: int  # position of the first row
    # float16 [nᵢ, F] pieces, in order, of the features of committed positions start … not yet
    # fed (F: feature_size). A step appends its piece without copying the others: a session
    # that drafts nothing for many steps would otherwise copy all it holds at every step.
    pieces: list[torch.Tensor]
    length: int  # rows in the pieces together
    # The last draft handed out and its alternatives, (depth, token): what the next round's
    # verification scores as tree leaves when its draft tokens are (a prefix of) that draft.
    drafted: tuple[int, ...] = ()
    alternatives: tuple[tuple[int, int], ...] = ()

    @property
    def rows(self) -> torch.Tensor:
        """[length, F]: the pieces as one tensor (joined once, when read)."""
        if len(self.pieces) > 1:
            self.pieces = [torch.cat(self.pieces)]
        return self.pieces[0]

    @rows.setter
    def rows(self, rows: torch.Tensor) -> None:
        self.pieces, self.length = [rows], len(rows)

    def append(self, rows: torch.Tensor) -> None:
        self.pieces.append(rows)
        self.length += len(rows)


class InlineHead:
    def __init__(self, drafter: EagleDrafter, fingerprint: str = ""):
        self.drafter = drafter
        self.name = drafter.name
        self.fingerprint = fingerprint  # of the head as loaded (specdec.eagle.fingerprint)
        self.hidden_size = drafter.head.config.hidden_size  # the target's, which the head predicts
        self.aux_layers = tuple(drafter.head.config.aux_layers)  # target layers it also reads
        self.feature_size = drafter.feature_size  # what record() takes per position
        self.bytes_per_token = drafter.bytes_per_token + 2 * drafter.feature_size
        self.batched: BatchedDrafter | None = None  # once `serve` gave the head its storage

    def serve(self, storage: HeadStorage) -> None:
        """Where the sessions' head caches live (specdec.eagle.batched): a paged pool beside a
        paged target, buffered caches beside a buffered one."""
        self.batched = BatchedDrafter(self.drafter, storage)

    def record(self, session: Session, start: int, rows: torch.Tensor) -> None:
        """The target computed these features (float16 [n, feature_size]) of committed positions
        start … start + n - 1."""
        if not len(rows):
            return
        state = session.head
        if state is None:
            if start == 0:  # the head can only start from the first position
                session.head = HeadState(Session(session.session_id + "/head"), 0, [rows], len(rows))
            return
        end = state.start + state.length
        if start > end:  # a gap: the head cannot be fed past it
            self.forget(session)
            return
        if start < state.start:
            state.start, state.rows = start, rows
        elif start == end:  # the next positions: every step of a session that drafts nothing
            state.append(rows)
        else:  # positions rolled back and computed again
            state.rows = torch.cat([state.rows[:start - state.start], rows])

    def forget(self, session: Session) -> None:
        """Drops the head's state for `session`, its blocks given back to the pool."""
        state = session.head
        if state is not None and self.batched is not None:
            self.batched.forget(state.session)
        session.head = None

    def held_bytes(self, session: Session) -> int:
        """The bytes the head's state for `session` keeps allocated: its blocks in the head's
        pool and the storage behind the features it has not yet been fed
        (specdec.runtime.memory)."""
        state = session.head
        if state is None:
            return 0
        cache = state.session.cache
        kv = self.batched.storage.held_bytes(cache) if cache is not None and self.batched is not None else 0
        return kv + storage_bytes(tuple(state.pieces)) + copying_bytes(state.session)

    def draft(self, session: Session, context: list[int], k: int) -> list[int]:
        """Up to k draft tokens continuing `context` (the committed sequence, its last token
        the target's own choice of this round)."""
        return self.draft_batch([session], [context], [k])[0]

    def draft_batch(self, sessions: list[Session], contexts: list[list[int]], ks: list[int],
                    min_probs: list[float] | None = None) -> list[list[int]]:
        """Per session, up to k draft tokens continuing its context, all sessions drafted
        together (specdec.eagle.paged). `min_probs`: per session, the least probability of
        being accepted, by the head's own estimate, at which it drafts a token or keeps an
        alternative (the coordinator's price of a draft row, VerifyRequest.min_draft_prob);
        the drafter's own cuts apply where it is lower."""
        if self.batched is None:
            raise RuntimeError("the head has no storage: call serve() first")
        drafts: list[list[int]] = [[] for _ in sessions]
        asked = [i for i, (session, k) in enumerate(zip(sessions, ks)) if session.head is not None and k > 0]
        synced, features = [], []
        for i in asked:
            state = sessions[i].head
            synced.append(SyncedContext(state.session, contexts[i], common_prefix_len(state.session.ids, contexts[i])))
            features.append(Features.from_rows(state.start, state.rows))
        floors = [min_probs[i] if min_probs is not None else 0.0 for i in asked]
        results = self.propose(synced, [ks[i] for i in asked], features, floors)
        for i, result in zip(asked, results):
            session, context = sessions[i], contexts[i]
            if isinstance(result, Resync):
                self.forget(session)
                continue
            state = session.head
            chain, alternatives = result
            state.drafted, state.alternatives = tuple(chain), tuple(alternatives)
            # The head now holds every position before the last; next time it needs features
            # from len(context) - 1 on at the earliest.
            drop = max(0, len(context) - 1 - state.start)
            state.rows, state.start = state.rows[drop:], state.start + drop
            drafts[i] = list(chain)
        return drafts

    def propose(self, synced: list[SyncedContext], ks: list[int], features: list[Features],
                min_probs: list[float] | None = None) -> list[tuple[list[int], list[tuple[int, int]]] | Resync]:
        """The batched drafter's chains and alternatives (a seam tests wrap)."""
        return self.batched.propose_tree(synced, ks, features, min_probs)

    @staticmethod
    def alternatives(session: Session, drafts: list[int]) -> list[tuple[int, int]]:
        """The alternatives (depth, token) the head proposed with `drafts`: those of its last
        draft when `drafts` is that draft or a prefix of it (the coordinator may cut a block
        short), at depths the drafts reach; none otherwise."""
        state = session.head
        if state is None or not drafts or tuple(drafts) != state.drafted[:len(drafts)]:
            return []
        return [(depth, token) for depth, token in state.alternatives if depth < len(drafts)]


def load_inline_head(spec: str | None, target, head=None, fast: bool = True,
                     min_chain_prob: float | None = None, min_alt_prob: float | None = None) -> InlineHead | None:
    """The head named by `spec` (a head directory or built-in name), or the given EagleHead,
    on top of the loaded `target` model, on its device (a head loaded here: in its dtype too);
    None when neither is given."""
    if head is None and not spec:
        return None
    if head is None:
        if not eagle.is_eagle_dir(spec):
            raise InvalidArgument(f"--head {spec!r} is not a feature-level head directory (config.json with "
                                  f"specdec_draft: {eagle.KIND!r})")
        # In the target's dtype: it reads the target's hidden states as they are computed.
        head = eagle.load(spec, target=target, dtype=next(target.parameters()).dtype)
    # The head reads the states the target's verification just computed: it runs where they are.
    head = head.to(next(target.parameters()).device)
    fingerprint = eagle.fingerprint(head)  # of the head itself, before any packed serving copy
    log.info("head %s: fingerprint %s", spec or "head", fingerprint)
    if fast:
        head = eagle.fast_cpu_head(head)
    chain = MIN_CHAIN_PROB if min_chain_prob is None else min_chain_prob
    alternative = MIN_ALT_PROB if min_alt_prob is None else min_alt_prob
    return InlineHead(EagleDrafter(spec or "head", head, min_chain_prob=chain, min_alt_prob=alternative),
                      fingerprint)
