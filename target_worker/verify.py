"""Block verification on the target (plain Python; the servicer is a thin shell).

One round: the committed tokens the cache lacks plus the k draft tokens go through the
target in ONE forward pass. The logits at the position of the last committed token and of
each draft token decide how many drafts are accepted and the target's next token (the
correction, or the bonus when all k were accepted), by the acceptance rule, greedy or
sampled, that kernels/rejection_sample.py states and cites; this module gathers the logits
and calls the kernel ops (kernels/ops.py). The cache is then cropped to the new committed
length, minus that next token, whose keys are computed when it is fed in the next round.

With a head on this worker (target_worker.head), a greedy round may also score the head's
alternatives: second-choice tokens at some depths of the draft it handed out, each run as a
leaf of a tree that branches off the chain at its depth (specdec.runtime.tree's blocks: same
position, attending to the chain before it). Where the chain is cut at depth d and the
alternative at d is the target's own choice there, the target's token after that
alternative is committed too (Verdict.extra): every committed token is still the target's
greedy choice given the tokens before it. The leaves enter the cache after the chain and
are cropped with it; a committed alternative is fed again next round, like the next token.
Sampled rounds take alternatives the same way: for drafts without probabilities the
target's token at every position is its own seeded draw (the coupled rule of
kernels/rejection_sample.py), so where its draw at the cut is the alternative, its draw from
the alternative's leaf is what the target alone would draw next — no multi-draft acceptance
rule is needed.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from dataclasses import dataclass

import torch

from specdec.errors import InvalidArgument, SpecdecError
from specdec.eagle.batched import BufferedHead
from specdec.eagle.paged import PagedHead, head_pool_blocks
from specdec.philox import STREAM_SAMPLE, philox_uniforms
from specdec.runtime.lm import CausalLM
from specdec.sampling import GREEDY, Sampling
from specdec.sessions import Resync, Session, SessionStore, SyncedContext
from target_worker.kernels import ops
from target_worker.kernels.greedy_verify_ref import accept_ref

log = logging.getLogger(__name__)


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
    # With draft_next: the least probability of being accepted (the head's own estimate) at
    # which the head drafts a token or keeps an alternative (VerifyRequest.min_draft_prob).
    min_draft_prob: float = 0.0


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
    draft_s: float = 0.0  # of step_s, the head drafting the next round's blocks


@dataclass(frozen=True)
class _Block:
    """A round ready to run: its synced session and the tokens it feeds."""

    index: int  # in the batch
    round: Round
    synced: SyncedContext
    fed: list[int]  # the committed tokens the cache lacks, the drafts, then the alternatives' tokens
    alternatives: list[tuple[int, int]]  # (depth, token) of each alternative, fed as a tree leaf

    @property
    def session(self) -> Session:
        return self.synced.session

    @property
    def context_len(self) -> int:
        """The committed length: the position of the round's first output token."""
        return len(self.synced.context)

    @property
    def chain_len(self) -> int:
        """Fed tokens before the alternatives: the uncached committed ones and the drafts."""
        return len(self.fed) - len(self.alternatives)

    @property
    def chain_rows(self) -> int:
        """Logit rows that decide the chain: the last committed token's and each draft's."""
        return len(self.round.drafts) + 1

    def parents(self) -> list[int] | None:
        """The block as a tree (specdec.runtime.tree) when it has alternatives: an alternative
        at depth d branches off where draft token d does."""
        if not self.alternatives:
            return None
        committed = self.chain_len - len(self.round.drafts)
        return list(range(-1, self.chain_len - 1)) + [committed + depth - 1 for depth, _ in self.alternatives]


@dataclass(frozen=True)
class _Score:
    """One round's share of the forward pass: the target's decision on its chain, its token
    after each alternative, and (when needed) the hidden states of what it fed."""

    accepted: int
    next_token: int
    after_leaves: tuple[int, ...]  # per alternative: the target's token after it
    states: torch.Tensor | None  # [len(fed), F]


@dataclass(frozen=True)
class _Decision:
    """One row of the step's decision: a chain of drafts (none for a plain step or for an
    alternative's leaf, whose next token is decided alone) over logit rows `rows`."""

    rows: list[int]  # in the step's concatenated logits: the chain's len(drafts) + 1 rows
    drafts: list[int]
    first_position: int  # absolute position of the first output token (the sampling key)
    sampling: Sampling


class Verifier:
    def __init__(self, lm: CausalLM, store: SessionStore, max_draft_tokens: int, head=None):
        self.lm = lm
        self.head = head  # target_worker.head.InlineHead or None
        self.store = store
        self.max_draft_tokens = max_draft_tokens
        self.vocab_size = int(lm.model.get_output_embeddings().weight.shape[0])
        self.max_context = int(getattr(lm.config, "max_position_embeddings", 0) or 1 << 30)
        if head is not None:
            self._serve_head(head)
        self._capture_graphs()

    def _capture_graphs(self) -> None:
        """Where steps replay CUDA graphs, captures them at load for every step a batch of
        rounds can make (max batch × (max drafts + 1) tokens), the head's too, so no request
        waits on a capture; larger steps (prefill chunks) are captured when first run."""
        graphs = getattr(self.lm, "graphs", None)
        if graphs is None:  # (with graphs that do not capture, as in the CPU tests: padded steps run)
            return
        began = time.perf_counter()
        up_to = self.lm.buffers.limits.max_batch * (self.max_draft_tokens + 1)
        if self.head is None:
            sizes = self.lm.capture_graphs(up_to)
        else:
            sizes = self.lm.capture_graphs(up_to, features=True, aux_layers=tuple(self.head.aux_layers))
            storage = self.head.batched.storage
            if isinstance(storage, PagedHead):
                storage.capture_graphs(up_to)
        log.info("CUDA graphs captured at %d sizes up to %d tokens in %.1f s%s", len(sizes), up_to,
                 time.perf_counter() - began, f" ({graphs.off})" if graphs.off else "")

    def _serve_head(self, head) -> None:
        """Gives the head its storage, like the target's: beside a paged target a paged pool
        sized for what the target's pool holds, else buffered caches; and has the store give
        a session's head cache back whenever the session leaves."""
        lm, store = self.lm, self.store
        if head.batched is None:
            pool = getattr(lm, "pool", None)  # the target's paged pool, when it has one
            if pool is not None:
                blocks = head_pool_blocks(pool.num_blocks * pool.block_size, store.max_sessions,
                                          self.max_draft_tokens, pool.block_size)
                # The head's steps replay CUDA graphs where the target's do.
                graphs = lm.graphs.capture if lm.graphs is not None else None
                head.serve(PagedHead(head.drafter.head, blocks, pool.block_size, lm.runner.attention,
                                     lm.buffers.limits.max_batch, graphs=graphs))
            else:
                head.serve(BufferedHead(head.drafter.head))
        dropped = store.on_drop

        def on_drop(session: Session) -> None:
            if dropped is not None:
                dropped(session)
            head.forget(session)

        store.on_drop = on_drop

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
        blocks = self._prepare(rounds, results)
        fed = [block.session for block in blocks]
        rows = sum(len(block.fed) for block in blocks)
        try:
            scores = self._score(blocks)
        except Exception as exc:  # noqa: BLE001 - every round of the step failed alike
            # feed_batch forgot the sessions' caches; each round is retried by its request.
            for block in blocks:
                results[block.index] = exc
            blocks, scores = [], []
        concluded = [self._conclude(block, score) for block, score in zip(blocks, scores)]
        drafting = time.perf_counter()
        next_drafts = self._head_drafts(blocks, concluded)
        draft_s = time.perf_counter() - drafting if any(b.round.draft_next for b in blocks) else 0.0
        for block, verdict, drafts in zip(blocks, concluded, next_drafts):
            results[block.index] = dataclasses.replace(verdict, next_drafts=drafts) if drafts else verdict
        # What each session holds after its step (fed, rolled back, or forgotten on a
        # failure), before the budget is enforced on the store's total.
        for session in fed:
            self.store.account(session, self.held_bytes(session))
        for block in blocks:
            self.store.enforce_budget(keep=block.session.session_id)
        step_s = time.perf_counter() - began
        results = [dataclasses.replace(r, compute_s=step_s) if isinstance(r, Verdict) else r for r in results]
        return BatchOutcome(results, step_s, rows, draft_s)

    def held_bytes(self, session: Session) -> int:
        """The bytes `session` keeps allocated on this worker: the target's KV cache
        (CausalLM.held_bytes) and, with a head here, the head's state for it."""
        held = self.lm.held_bytes(session)
        return held + self.head.held_bytes(session) if self.head is not None else held

    def _prepare(self, rounds: list[Round], results: list) -> list[_Block]:
        """Validates and syncs every round: one that fails or must resync gets its result here,
        the others a block to feed."""
        blocks: list[_Block] = []
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
            # A head here, or the wire, needs the states of every position the session feeds.
            reuse = self.head is None and not rnd.features
            fed = self.lm.prepare(synced, reuse_prefix=reuse) + rnd.drafts + [token for _, token in alternatives]
            blocks.append(_Block(i, rnd, synced, fed, alternatives))
        limit = self.lm.max_tree_step_tokens
        if limit is not None and any(b.alternatives for b in blocks) and any(len(b.fed) > limit for b in blocks):
            # A session feeding more than a tree step holds (a prompt, a resync) rides in
            # this step without trees: the alternatives are dropped (they only add speed).
            blocks = [dataclasses.replace(b, fed=b.fed[:b.chain_len], alternatives=[]) for b in blocks]
        # Room in the cache before the step: a round that cannot fit fails alone.
        refused = self.lm.admit([block.session for block in blocks], [len(block.fed) for block in blocks])
        for block, error in zip(blocks, refused):
            if error is not None:
                results[block.index] = error
        return [block for block, error in zip(blocks, refused) if error is None]

    def _score(self, blocks: list[_Block]) -> list[_Score]:
        """ONE forward pass over every block, then each round's decision (one host read)."""
        if not blocks:
            return []
        logits, states = self._forward(blocks)
        decisions = self._decide_step(blocks, logits)
        return [_Score(accepted, next_token, after, states_i)
                for (accepted, next_token, after), states_i in zip(decisions, states)]

    def _forward(self, blocks: list[_Block]) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """Per block the logits of its last committed token, drafts and alternatives, and the
        hidden states of every position it fed when the head or the wire needs them."""
        sessions, fed = [block.session for block in blocks], [block.fed for block in blocks]
        keep = [block.chain_rows + len(block.alternatives) for block in blocks]
        if self.head is None and not any(block.round.features for block in blocks):
            return self.lm.feed_batch(sessions, fed, keep), [None] * len(blocks)
        parents = [block.parents() for block in blocks]
        aux = tuple(self.head.aux_layers) if self.head is not None else ()
        return self.lm.feed_batch(sessions, fed, keep, features=True, aux_layers=aux,
                                  parents=parents if any(p is not None for p in parents) else None)

    def _conclude(self, block: _Block, score: _Score) -> Verdict:
        """The round's verdict: its cache cropped to the committed length, a chosen alternative
        committed, the committed positions' states handed to the head and the wire."""
        accepted, next_token = score.accepted, score.next_token
        cached_len = block.context_len + accepted
        # Leaves sit after the chain in the cache: this crop drops them too.
        self.lm.crop(block.session, cached_len)
        leaf, extra = self._chosen_alternative(block, score)
        feature_start, feature_bytes = 0, b""
        if score.states is not None:
            feature_start, states = self._committed_states(block, score.states, accepted, leaf, len(extra))
            if self.head is not None:
                self.head.record(block.session, feature_start, states)
            if block.round.features:
                # On the wire: the final hidden states only (what WorkerInfo.feature_size says).
                feature_bytes = states[:, :self.lm.feature_size].cpu().contiguous().numpy().tobytes()
            else:
                feature_start = 0
        return Verdict(accepted, next_token, cached_len, 0.0, feature_start, feature_bytes, (), extra)

    def _chosen_alternative(self, block: _Block, score: _Score) -> tuple[int | None, tuple[int, ...]]:
        """(leaf, extra): where the chain is cut at depth `accepted` and the alternative there is
        the target's own next token, that leaf's index and the target's token after it (from
        the leaf's logits), committed as well; (None, ()) otherwise."""
        leaf = next((j for j, (depth, token) in enumerate(block.alternatives)
                     if depth == score.accepted < len(block.round.drafts) and token == score.next_token), None)
        if leaf is None:
            return None, ()
        return leaf, (score.after_leaves[leaf],)

    @staticmethod
    def _committed_states(block: _Block, states: torch.Tensor, accepted: int, leaf: int | None,
                          extra: int) -> tuple[int, torch.Tensor]:
        """(position of the first, float16 [n, F] states) of the positions this round fed and
        committed: the fed committed tokens, the accepted drafts, then a committed alternative."""
        fed_committed = block.chain_len - len(block.round.drafts)
        if leaf is not None:
            states = torch.cat([states[:fed_committed + accepted], states[block.chain_len + leaf:][:1]])
        # A copy of its own even when the model computes in float16: a view would keep the
        # whole step's states alive for as long as the head holds these rows.
        states = states[:fed_committed + accepted + extra].to(torch.float16, copy=True).contiguous()
        return block.context_len - fed_committed, states

    def _head_drafts(self, blocks: list[_Block], verdicts: list[Verdict]) -> list[tuple[int, ...]]:
        """With a head on this worker: the next round's draft of every round that asked for
        one, all drafted together after this round's committed tokens."""
        if self.head is None:
            return [()] * len(blocks)
        asked = [i for i, block in enumerate(blocks) if block.round.draft_next]
        contexts = []
        for i in asked:
            block, verdict = blocks[i], verdicts[i]
            contexts.append(block.synced.context + block.round.drafts[:verdict.accepted] + [verdict.next_token]
                            + list(verdict.extra))
        drafts = self.head.draft_batch([blocks[i].session for i in asked], contexts,
                                       [blocks[i].round.draft_next for i in asked],
                                       [blocks[i].round.min_draft_prob for i in asked])
        out: list[tuple[int, ...]] = [()] * len(blocks)
        for i, draft in zip(asked, drafts):
            out[i] = tuple(draft)
        return out

    def _alternatives(self, rnd: Round, session) -> list[tuple[int, int]]:
        """The head's alternatives (depth, token) to score with this round's drafts: rounds
        that verify the head's own draft, on a model that runs tree blocks."""
        if self.head is None or not rnd.drafts or rnd.features or not self.lm.runs_trees:
            return []
        return self.head.alternatives(session, rnd.drafts)

    def _validate(self, rnd: Round) -> None:
        if len(rnd.drafts) > self.max_draft_tokens:
            raise InvalidArgument(f"draft_tokens: {len(rnd.drafts)} exceeds the limit of {self.max_draft_tokens}")
        if rnd.draft_next > self.max_draft_tokens:
            raise InvalidArgument(f"draft_next: {rnd.draft_next} exceeds the limit of {self.max_draft_tokens}")
        if not (math.isfinite(rnd.min_draft_prob) and rnd.min_draft_prob >= 0):
            raise InvalidArgument(f"min_draft_prob: {rnd.min_draft_prob} is not a finite number >= 0")
        self._check_ids("delta.tokens", rnd.tokens)
        self._check_ids("draft_tokens", rnd.drafts)
        if rnd.start + len(rnd.tokens) + len(rnd.drafts) > self.max_context:
            raise InvalidArgument(
                f"delta: {rnd.start + len(rnd.tokens) + len(rnd.drafts)} tokens exceed the model context of "
                f"{self.max_context}"
            )

    def _decide_step(self, blocks: list[_Block], logits: list[torch.Tensor]) -> list[tuple[int, int, tuple[int, ...]]]:
        """(accepted, next token, the token after each alternative) per block, in ONE host
        read for the whole step. Each alternative's leaf is decided as a round of its own
        with no drafts: the target's token at the position after it, keyed (when sampled) by
        that position — the one it is committed at when the chain is cut at its depth."""
        rows: list[_Decision] = []
        offset = 0
        for block, logits_i in zip(blocks, logits):
            chain = block.chain_rows
            rows.append(_Decision(list(range(offset, offset + chain)), block.round.drafts, block.context_len,
                                  block.round.sampling))
            rows.extend(_Decision([offset + chain + j], [], block.context_len + depth + 1, block.round.sampling)
                        for j, (depth, _) in enumerate(block.alternatives))
            offset += logits_i.shape[0]
        accepted, next_token = self._decide_rows(logits, rows)
        out, row = [], 0
        for block in blocks:
            leaves = len(block.alternatives)
            out.append((accepted[row], next_token[row], tuple(next_token[row + 1:row + 1 + leaves])))
            row += 1 + leaves
        return out

    @staticmethod
    def _decide_rows(logits: list[torch.Tensor], rows: list[_Decision]) -> tuple[list[int], list[int]]:
        """(accepted, next token) per decision row, each row of the step's logits read once
        whatever the chains' lengths (no batch padded to the longest chain): the greedy rows
        in one greedy_verify_rows call over the logits where the forward wrote them (pad
        entries of the row table repeat a row of the chain and are never read), the sampled
        ones through _sampled_rows; then one host read of all results."""
        groups = [[i for i, r in enumerate(rows) if r.sampling.greedy],
                  [i for i, r in enumerate(rows) if not r.sampling.greedy]]
        device = logits[0].device
        every = _joined(logits)  # [R, V]: the step's rows
        results: list[torch.Tensor] = []
        for group in groups:
            if not group:
                continue
            width = max(len(rows[i].drafts) for i in group)
            index = torch.tensor([rows[i].rows + [rows[i].rows[0]] * (width + 1 - len(rows[i].rows)) for i in group],
                                 dtype=torch.long, device=device)  # [N, K + 1]
            draft = torch.tensor([rows[i].drafts + [0] * (width - len(rows[i].drafts)) for i in group],
                                 dtype=torch.long, device=device).reshape(len(group), width)  # [N, K]
            num_draft = torch.tensor([len(rows[i].drafts) for i in group], dtype=torch.long, device=device)  # [N]
            if group is groups[0]:
                accepted, next_token = ops.greedy_verify_rows(every, index, draft, num_draft)
            else:
                accepted, next_token = Verifier._sampled_rows(every, [rows[i] for i in group], draft, num_draft)
            results += [accepted, next_token]
        values = torch.cat(results).tolist()  # the step's one host read
        accepted_out, next_out = [0] * len(rows), [0] * len(rows)
        at = 0
        for group in groups:
            if not group:
                continue
            n = len(group)
            for j, i in enumerate(group):
                accepted_out[i], next_out[i] = values[at + j], values[at + n + j]
            at += 2 * n
        return accepted_out, next_out

    @staticmethod
    def _sampled_rows(every: torch.Tensor, rows: list[_Decision], draft: torch.Tensor,
                      num_draft: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(accepted [N], next token [N]) of sampled decisions: each scored position's row
        warped with its round's parameters and drawn once with the uniform of its absolute
        position (one warp_probs and one sampled_match call over those rows alone), then the
        drafts kept while they equal the draws — the coupled one-hot rule of
        ops.sampled_match, position for position, without padding the chains."""
        device = every.device
        pairs = [(g, j) for g, row in enumerate(rows) for j in range(len(row.drafts) + 1)]
        at = torch.tensor([rows[g].rows[j] for g, j in pairs], dtype=torch.long, device=device)  # [M]
        params = [rows[g].sampling for g, _ in pairs]
        probs = ops.warp_probs(every[at], torch.tensor([p.temperature for p in params]),
                               torch.tensor([p.top_k for p in params]), torch.tensor([p.top_p for p in params]))
        u_sample = philox_uniforms(torch.tensor([p.seed for p in params]),
                                   torch.tensor([[rows[g].first_position + j] for g, j in pairs]), STREAM_SAMPLE)
        none = torch.zeros(len(pairs), dtype=torch.long, device=device)
        _, drawn_flat = ops.sampled_match(probs[:, None], none[:, None][:, :0], none, u_sample)  # [M]
        drawn = torch.zeros(len(rows), draft.shape[1] + 1, dtype=torch.long, device=device)  # [N, K + 1]
        drawn[torch.tensor([g for g, _ in pairs], device=device), torch.tensor([j for _, j in pairs], device=device)] = \
            drawn_flat
        return accept_ref(drawn, draft, num_draft)


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    """The [R, V] rows of `parts` ([rᵢ, V] each) as one tensor: a view where they are
    consecutive slices of one contiguous tensor (as a forward's per-session split returns
    them), else a copy."""
    first = parts[0]
    if len(parts) == 1:
        return first
    width = first.shape[1]
    at = first.storage_offset()
    for part in parts:
        if (not part.is_contiguous() or part.shape[1] != width or part.storage_offset() != at
                or part.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()):
            return torch.cat(parts)
        at += part.numel()
    return first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(),
                                   (sum(part.shape[0] for part in parts), width), (width, 1))
