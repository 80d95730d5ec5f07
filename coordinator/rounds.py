"""One request's speculative decoding loop (plain Python over the worker clients).

Per round: the draft worker proposes up to k tokens, the target worker verifies them in one
forward pass and returns how many it accepts plus its own next token, and the coordinator
commits draft[:accepted] + [next] — the committed sequence lives here and nowhere else.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from coordinator.adaptive import DrafterRecord
from coordinator.detokenizer import IncrementalDetokenizer, StopMatcher
from coordinator.workers import DraftClient, FeatureLog, TargetClient, WorkerSession
from specdec import metrics
from specdec.errors import Unavailable
from specdec.sampling import GREEDY, Sampling
from specdec.v1 import coordinator_pb2

log = logging.getLogger(__name__)

FinishReason = coordinator_pb2.FinishReason


@dataclass(frozen=True)
class GenerationPlan:
    """A validated request, ready to run."""

    request_id: str
    prompt_ids: list[int]
    max_new_tokens: int
    k: int
    speculate: bool
    stop: list[str]
    eos_ids: frozenset[int]
    max_context: int
    sampling: Sampling = GREEDY
    # Event-loop time by which the client wants the answer (its gRPC deadline); None: none.
    deadline: float | None = None


@dataclass
class Stats:
    rounds: int = 0
    proposed: int = 0
    accepted: int = 0
    generated: int = 0
    draft_failures: int = 0
    rejected_blocks: int = 0
    alternative_tokens: int = 0
    started: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None

    def to_proto(self, prompt_tokens: int, sessions: list[WorkerSession]) -> coordinator_pb2.GenerationStats:
        elapsed = time.perf_counter() - self.started
        draft = [s for s in sessions if s.session_id.endswith("/draft")]
        target = [s for s in sessions if s.session_id.endswith("/target")]
        return coordinator_pb2.GenerationStats(
            rounds=self.rounds,
            proposed=self.proposed,
            accepted=self.accepted,
            acceptance_rate=self.accepted / self.proposed if self.proposed else 0.0,
            tokens_per_round=self.generated / self.rounds if self.rounds else 0.0,
            ttft_s=(self.first_token_at - self.started) if self.first_token_at else 0.0,
            tokens_per_s=self.generated / elapsed if elapsed > 0 else 0.0,
            prompt_tokens=prompt_tokens,
            generated_tokens=self.generated,
            draft_s=sum(s.seconds for s in draft),
            verify_s=sum(s.seconds for s in target),
            wire_bytes=sum(s.wire_bytes for s in sessions),
            resyncs=sum(s.resyncs for s in sessions),
            rejected_blocks=self.rejected_blocks,
            alternative_tokens=self.alternative_tokens,
        )


class RoundRunner:
    def __init__(self, target: TargetClient, draft: DraftClient | None, tokenizer, target_vocab_size: int):
        self.target = target
        self.target_vocab_size = target_vocab_size
        self.draft = draft
        self.tokenizer = tokenizer
        self._background: set[asyncio.Task] = set()
        self.drafter_record = DrafterRecord()

    async def run(self, plan: GenerationPlan) -> AsyncIterator[coordinator_pb2.GenerateResponse]:
        """Yields one response per round with new tokens; the last carries finish and stats."""
        base = uuid.uuid4().hex
        target_session = WorkerSession(f"{base}/target", request_id=plan.request_id, deadline=plan.deadline)
        draft_session = WorkerSession(f"{base}/draft", request_id=plan.request_id, deadline=plan.deadline)
        sessions = [target_session, draft_session]
        stats = Stats()
        committed = list(plan.prompt_ids)
        detok = IncrementalDetokenizer(self.tokenizer, plan.prompt_ids)
        stopper = StopMatcher(plan.stop)
        finish = FinishReason.FINISH_REASON_UNSPECIFIED
        # A head on the target worker drafts each next round in the verification step
        # (target_worker.head): no Propose, no features on the wire. Rounds on a target
        # replica without a head (a fleet mid-rollout) ask the draft worker instead.
        use_draft = plan.speculate and self.draft is not None
        sampling = None if plan.sampling.greedy else plan.sampling.to_proto()
        adaptive = self.drafter_record.start(plan.k)
        # A drafter that reads the target's features (specdec.eagle) gets them from the
        # verdicts; it can draft once the target has seen the context (from round 2).
        features = FeatureLog(self.draft.feature_size) if use_draft and self.draft.feature_size else None
        ahead: list[int] = []  # with a head on the target: its draft for this round, from the last verdict
        ahead_asked = (0, False)  # the adaptive controller's (k, probing) it answered
        try:
            while finish == FinishReason.FINISH_REASON_UNSPECIFIED:
                remaining = plan.max_new_tokens - stats.generated
                room = plan.max_context - len(committed)
                # Never draft past what may be generated or what fits the context: the
                # target adds one token of its own per round.
                # Under load a draft token delays every request in the step: its price comes
                # from the target's measured step costs (coordinator.adaptive.StepCostModel).
                # Asking the drafter costs its measured round time (coordinator.adaptive).
                draft_next = 0
                if plan.speculate and self.target.runs_head(target_session):
                    # This round verifies what the head drafted last round; the head drafts
                    # the next one in this round's step (its cost is in the step's time).
                    drafts = self._valid(ahead[:max(0, min(remaining - 1, room - 1))])
                    asked = ahead_asked
                    draft_next = adaptive.next_k(self.target.draft_token_cost(target_session))
                    ahead_asked = (adaptive.asked, adaptive.probing)
                else:
                    k = (min(adaptive.next_k(self.target.draft_token_cost(target_session),
                                             self.target.propose_cost(target_session, self.draft.round_times)),
                             remaining - 1, room - 1)
                         if use_draft else 0)
                    if features is not None and features.count < len(committed) - 1:
                        k = 0
                    drafts = await self._propose(draft_session, committed, k, stats, features) if k > 0 else []
                    asked, ahead_asked = None, (0, False)
                verdict = await self.target.verify(target_session, committed, drafts, sampling, features, draft_next)
                ahead = list(verdict.next_drafts)
                stats.rounds += 1
                adaptive.update(len(drafts), verdict.accepted, asked)
                self.drafter_record.update(len(drafts), verdict.accepted)
                stats.proposed += len(drafts)
                stats.accepted += verdict.accepted
                stats.rejected_blocks += verdict.accepted < len(drafts)
                extra = list(verdict.extra_tokens)
                new, finish = self._commit(drafts[:verdict.accepted] + [verdict.next_token] + extra, plan, stats,
                                           room)
                if extra:  # the committed alternative (next_token) and the target's token after it
                    stats.alternative_tokens += max(0, len(new) - verdict.accepted)
                    metrics.ALTERNATIVE_TOKENS.inc(max(0, len(new) - verdict.accepted))
                metrics.ROUNDS.inc()
                metrics.PROPOSED.inc(len(drafts))
                metrics.ACCEPTED.inc(verdict.accepted)
                metrics.ACCEPTED_LENGTH.observe(verdict.accepted + 1)
                metrics.observe_round(len(drafts), verdict.accepted)
                metrics.GENERATED_TOKENS.inc(len(new))
                if stats.rounds == 1:
                    metrics.TTFT.observe(stats.first_token_at - stats.started)
                committed.extend(new)
                text = ""
                for token in new:
                    text += stopper.feed(detok.push(token))
                    if stopper.stopped:
                        finish = FinishReason.FINISH_REASON_STOP
                        break
                if finish != FinishReason.FINISH_REASON_UNSPECIFIED and not stopper.stopped:
                    text += stopper.feed(detok.flush()) + stopper.finish()
                    if stopper.stopped:
                        finish = FinishReason.FINISH_REASON_STOP
                response = coordinator_pb2.GenerateResponse(text=text, token_ids=new)
                if finish != FinishReason.FINISH_REASON_UNSPECIFIED:
                    response.finish_reason = finish
                    response.stats.CopyFrom(stats.to_proto(len(plan.prompt_ids), sessions))
                    response.stats.seed = plan.sampling.seed
                yield response
        finally:
            self.target.finished(target_session)  # no step waits for its next round
            self._release_later(target_session, draft_session if use_draft else None)

    @staticmethod
    def _commit(tokens: list[int], plan: GenerationPlan, stats: Stats, room: int):
        """Tokens of this round that are actually generated: cut after EOS, at
        max_new_tokens and at the end of the context."""
        if stats.first_token_at is None:
            stats.first_token_at = time.perf_counter()
        out: list[int] = []
        finish = FinishReason.FINISH_REASON_UNSPECIFIED
        for token in tokens:
            out.append(token)
            if token in plan.eos_ids:
                finish = FinishReason.FINISH_REASON_EOS
                break
            if stats.generated + len(out) >= plan.max_new_tokens or len(out) >= room:
                finish = FinishReason.FINISH_REASON_LENGTH
                break
        stats.generated += len(out)
        return out, finish

    async def _propose(self, session: WorkerSession, committed: list[int], k: int, stats: Stats,
                       features: FeatureLog | None = None) -> list[int]:
        """Draft tokens, or none when the draft worker is down: the target alone still
        gives the exact output, only slower (DESIGN.md principle 4)."""
        try:
            block = await self.draft.propose(session, committed, k, features)
        except (Unavailable, grpc.aio.AioRpcError) as exc:
            stats.draft_failures += 1
            log.warning("draft worker failed (%s); this round decodes with the target alone", exc)
            return []
        return self._valid(list(block.tokens[:k]))

    def _valid(self, drafts: list[int]) -> list[int]:
        """A drafter's ids are suggestions; one the target cannot score ends the block."""
        for i, token in enumerate(drafts):
            if not 0 <= token < self.target_vocab_size:
                return drafts[:i]
        return drafts

    def _release_later(self, target_session: WorkerSession, draft_session: WorkerSession | None) -> None:
        """Frees worker sessions without blocking (or being cancelled with) the request."""
        async def release() -> None:
            await self.target.release(target_session)
            if draft_session is not None and self.draft is not None:
                await self.draft.release(draft_session)

        task = asyncio.get_running_loop().create_task(release())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def drain(self) -> None:
        """Waits for pending releases (used at shutdown and by tests)."""
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
