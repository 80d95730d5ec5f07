"""One request's speculative decoding loop (plain Python over the worker clients).

Per round: the draft worker proposes up to k tokens, the target worker verifies them in one
forward pass and returns how many it accepts plus its own next token, and the coordinator
commits draft[:accepted] + [next] — the committed sequence lives here and nowhere else. The
acceptance rule is the target's (stated in target_worker/kernels/rejection_sample.py); this
loop only chooses k, asks, commits and streams.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from coordinator.adaptive import AdaptiveK, DrafterRecord
from coordinator.detokenizer import IncrementalDetokenizer, StopMatcher, text_decoder
from coordinator.workers import DraftClient, FeatureLog, TargetClient, WorkerSession
from specdec import metrics
from specdec.errors import InvalidArgument, ResourceExhausted, Unavailable
from specdec.sampling import GREEDY, Sampling
from specdec.v1 import common_pb2, coordinator_pb2, target_pb2

log = logging.getLogger(__name__)

FinishReason = coordinator_pb2.FinishReason
# Looked up once: a protobuf enum's attribute lookup is not free, and `done` is read per round.
UNFINISHED = FinishReason.FINISH_REASON_UNSPECIFIED


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
    # A resumed request: the tokens its broken stream already delivered (resume_token_ids).
    resumed: list[int] = field(default_factory=list)


@dataclass
class Stats:
    rounds: int = 0
    proposed: int = 0
    accepted: int = 0
    generated: int = 0
    draft_failures: int = 0
    rejected_blocks: int = 0
    alternative_tokens: int = 0
    resumed: int = 0  # of `generated`: delivered by an earlier stream of a resumed request
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
            tokens_per_round=(self.generated - self.resumed) / self.rounds if self.rounds else 0.0,
            ttft_s=(self.first_token_at - self.started) if self.first_token_at else 0.0,
            tokens_per_s=(self.generated - self.resumed) / elapsed if elapsed > 0 else 0.0,
            prompt_tokens=prompt_tokens,
            generated_tokens=self.generated,
            draft_s=sum(s.seconds for s in draft),
            verify_s=sum(s.seconds for s in target),
            wire_bytes=sum(s.wire_bytes for s in sessions),
            resyncs=sum(s.resyncs for s in sessions),
            rejected_blocks=self.rejected_blocks,
            alternative_tokens=self.alternative_tokens,
        )


@dataclass
class Generation:
    """One request between its rounds. The committed sequence lives here and nowhere else."""

    plan: GenerationPlan
    target: WorkerSession
    draft: WorkerSession
    # Rounds may ask the draft worker. A head on the target worker drafts each next round in
    # the verification step (target_worker.head): no Propose, no features on the wire; rounds
    # on a target replica without a head (a fleet mid-rollout) ask the draft worker instead.
    use_draft: bool
    sampling: common_pb2.SamplingParams | None  # None: greedy
    adaptive: AdaptiveK
    # A drafter that reads the target's features (specdec.eagle) gets them from the verdicts;
    # it can draft once the target has seen the context (from round 2).
    features: FeatureLog | None
    committed: list[int]
    detok: IncrementalDetokenizer
    stopper: StopMatcher
    stats: Stats = field(default_factory=Stats)
    finish: int = UNFINISHED
    answered: int = 0  # responses sent to the client
    ahead: list[int] = field(default_factory=list)  # with a head on the target: its draft for this round
    ahead_asked: tuple[int, bool] = (0, False)  # the adaptive controller's (k, probing) that draft answered
    # The controller's (k, probing) for the head's next block, decided while the target ran
    # the rounds ahead and not yet used by a round (None: none pending).
    decided: tuple[int, bool] | None = None

    @property
    def done(self) -> bool:
        return self.finish != UNFINISHED

    @property
    def sessions(self) -> list[WorkerSession]:
        return [self.target, self.draft]

    @property
    def draft_room(self) -> int:
        """Most draft tokens this round: never past what may be generated or what fits the
        context, as the target adds one token of its own per round (may be negative)."""
        return min(self.plan.max_new_tokens - self.stats.generated, self.plan.max_context - len(self.committed)) - 1


class RoundRunner:
    def __init__(self, target: TargetClient, draft: DraftClient | None, tokenizer, target_vocab_size: int):
        self.target = target
        self.target_vocab_size = target_vocab_size
        self.draft = draft
        self.tokenizer = tokenizer
        self._decode = text_decoder(tokenizer)
        self._background: set[asyncio.Task] = set()
        self.drafter_record = DrafterRecord()

    async def run(self, plan: GenerationPlan) -> AsyncIterator[coordinator_pb2.GenerateResponse]:
        """Yields one response per round with new tokens; the last carries finish and stats.

        The next round is queued before this round's response goes to the client: what a
        round sends depends on the committed tokens alone, never on the client having
        received them. So writing to the client — and everything between a step's answer
        and the client's stream — runs while the next step is gathered, sent and computed,
        and under load a step no longer waits for every request's write before it can leave
        (the split's cost per round: benchmarks/round_cost.py). Where the next round goes
        straight to the target, it is queued even before this round's text is decoded, and
        the rest waits for the step carrying it to leave; a stop string found in that text
        then finishes the request and cancels the round (sent, it still runs on the worker,
        and the session is released after it). The coordinator runs at most one round ahead
        of its client; a target replica running the rounds ahead (TargetClient.verify) runs
        at most `run_ahead` rounds past the last one the coordinator sent, their verdicts
        waiting here until committed."""
        gen = self._start(plan)
        ahead: asyncio.Task | None = None
        try:
            while not gen.done:
                if ahead is None:
                    drafts, asked, verdict = await self._round(gen)
                else:
                    drafts, asked, verdict = await ahead
                    ahead = None
                self._record(gen, drafts, verdict, asked)
                new = self._commit(gen, drafts, verdict)
                running = self.target.running_ahead(gen.target)  # then its next round is the replica's
                if not running and not gen.done and self._straight_to_target(gen):
                    # Its next round queues at once, and the work below waits for the step
                    # carrying it to leave: under load that step waits for every request it
                    # answered, so what each one does for its client runs while it computes.
                    ahead = asyncio.get_running_loop().create_task(self._round(gen))
                    await self.target.step_left(gen.target)
                text, new = self._stream(gen, new)
                self._observe(gen, drafts, verdict, new, first=gen.answered == 0)
                # Rounds the replica ran whose verdicts are here already go in the same
                # response, each committed and streamed in turn (a stop string ends them): a
                # coordinator that falls behind writes less, not later.
                while running and not gen.done and self._keeps_running(gen):
                    ran = await self._ran_ahead(gen, wait=False)
                    if ran is None:
                        break
                    drafts, asked, verdict = ran
                    self._record(gen, drafts, verdict, asked)
                    more_text, more = self._stream(gen, self._commit(gen, drafts, verdict))
                    self._observe(gen, drafts, verdict, more)
                    text, new = text + more_text, new + more
                response = self._response(gen, new, text)
                gen.answered += 1
                if ahead is None and not gen.done and not self.target.running_ahead(gen.target):
                    # Queued before the client's write; a round the replica runs ahead is
                    # running already, and is awaited here after the write, task-free.
                    ahead = asyncio.get_running_loop().create_task(self._round(gen))
                yield response
        finally:
            if ahead is not None:
                ahead.cancel()  # the client is gone or the request failed: its round goes too
            self.target.finished(gen.target)  # no step waits for its next round
            self._release_later(gen.target, gen.draft if gen.use_draft else None, ahead)

    def _straight_to_target(self, gen: Generation) -> bool:
        """Whether the request's next round goes to the target without asking the draft
        worker first (speculation off, or drafted by a head on the target): queueing it is
        then immediate."""
        return not gen.use_draft or (gen.plan.speculate and self.target.runs_head(gen.target))

    async def _round(self, gen: Generation) -> tuple[list[int], tuple[int, bool] | None, target_pb2.Verdict]:
        """One round: its drafts, the controller's (k, probing) they answer, the verdict.
        Where the target replica runs the request's rounds ahead, the round is the next one
        it ran: committed only if it continues the sequence held here."""
        if self._keeps_running(gen):
            ran = await self._ran_ahead(gen)
            if ran is not None:
                return ran
        self.target.end_run(gen.target)
        drafts, asked, draft_next = await self._draft(gen)
        return drafts, asked, await self._verify(gen, drafts, draft_next)

    def _keeps_running(self, gen: Generation) -> bool:
        """Whether the request's next round is the one the target replica runs ahead. With a
        head, the adaptive controller still decides every round's next block, as _head_draft
        would. Another k than the run's goes to the replica (TargetClient.change_run) and the
        run goes on: its next round is computed already, so the new k drafts from the one
        after (the decision comes a round later than without a run, and no round is thrown
        away). A probe ends the run: it goes with the round the coordinator then sends. Each
        decision that keeps the run tops it up once half its rounds are used
        (TargetClient.run_grant), so the run lasts as long as the request."""
        if not self.target.running_ahead(gen.target):
            return False
        if not self._straight_to_target(gen):  # its replica no longer runs a head: ask the drafter
            self.target.end_run(gen.target)
            return False
        k, changed = 0, False  # nothing is drafted: nothing to decide but the rounds it may run
        if gen.plan.speculate and self.target.runs_head(gen.target):
            k, probing = self._decide(gen)
            if probing:
                self.target.end_run(gen.target)
                return False
            changed = k != gen.ahead_asked[0]
        grant = self.target.run_grant(gen.target)
        if changed or grant:
            sent = self.target.change_run(gen.target, k, self._draft_price(gen) if k else 0.0, grant)
            if changed and not sent:
                self.target.end_run(gen.target)
                return False
        if changed:
            gen.ahead_asked = gen.decided
        return True

    async def _ran_ahead(self, gen: Generation, wait: bool = True):
        """The next round the target replica ran ahead (wait=False: only one already here),
        as _round returns it, if it continues the sequence held here; None otherwise (the
        run then ends, or goes on when nothing was here yet)."""
        ran = await self.target.next_ahead(gen.target, len(gen.committed), wait)
        if ran is None:
            return None
        verdict = ran.result.verdict
        gen.ahead = list(verdict.next_drafts)
        gen.decided = None  # the run's round followed the decision
        metrics.ROUNDS_RUN_AHEAD.inc()
        # Drafted by the head with the k the worker says (the head drafts from the target's
        # own vocabulary: nothing for _valid to cut); a run never probes.
        return list(ran.draft_tokens), (ran.drafted_with, False), verdict

    def _start(self, plan: GenerationPlan) -> Generation:
        base = uuid.uuid4().hex
        use_draft = plan.speculate and self.draft is not None
        gen = Generation(
            plan=plan,
            target=WorkerSession(f"{base}/target", request_id=plan.request_id, deadline=plan.deadline),
            draft=WorkerSession(f"{base}/draft", request_id=plan.request_id, deadline=plan.deadline),
            use_draft=use_draft,
            sampling=None if plan.sampling.greedy else plan.sampling.to_proto(),
            adaptive=self.drafter_record.start(plan.k),
            features=FeatureLog(self.draft.feature_size) if use_draft and self.draft.feature_size else None,
            committed=list(plan.prompt_ids),
            detok=IncrementalDetokenizer(self.tokenizer, plan.prompt_ids, self._decode),
            stopper=StopMatcher(plan.stop),
        )
        if plan.resumed:
            self._replay(gen, plan.resumed)
        return gen

    @staticmethod
    def _replay(gen: Generation, resumed: list[int]) -> None:
        """A resumed request continues where its broken stream stopped: the tokens it had
        delivered are committed, and the detokenizer and stop matcher are brought to the
        state they had after those tokens. Both advance one token at a time (never per
        round), so their state is a function of the tokens alone and the text streamed from
        here on is exactly what the broken stream would have sent next."""
        gen.committed.extend(resumed)
        gen.stats.generated = gen.stats.resumed = len(resumed)
        for token in resumed:
            gen.stopper.feed(gen.detok.push(token))
            if gen.stopper.stopped:
                raise InvalidArgument("resume_token_ids: their text already contains a stop string: the "
                                      "request had finished")

    async def _draft(self, gen: Generation) -> tuple[list[int], tuple[int, bool] | None, int]:
        """This round's draft tokens; the adaptive controller's (k, probing) they answer when
        that was asked a round earlier (None: asked now); how many the head on the target
        should draft for the next round."""
        if gen.plan.speculate and self.target.runs_head(gen.target):
            return self._head_draft(gen)
        gen.ahead_asked = (0, False)
        k = self._choose_k(gen)
        drafts = (await self._propose(gen.draft, gen.committed, k, gen.stats, gen.features, self._draft_price(gen))
                  if k > 0 else [])
        return drafts, None, 0

    def _head_draft(self, gen: Generation) -> tuple[list[int], tuple[int, bool], int]:
        """This round verifies what the head drafted last round; the head drafts the next one
        in this round's step, which its drafting time lengthens (measured by the worker)."""
        drafts = self._valid(gen.ahead[:max(0, gen.draft_room)])
        asked = gen.ahead_asked
        gen.ahead_asked, gen.decided = self._decide(gen), None
        return drafts, asked, gen.ahead_asked[0]

    def _decide(self, gen: Generation) -> tuple[int, bool]:
        """The adaptive controller's (k, probing) for the head's next block: decided once per
        round, kept in gen.decided until a round uses it; no block while the replica pauses
        drafting (TargetClient.drafting_paused)."""
        if gen.decided is None and self.target.drafting_paused(gen.target):
            gen.decided = (0, False)  # the controller is not asked: nothing is learnt from the round
        if gen.decided is None:
            k = gen.adaptive.next_k(self.target.draft_token_cost(gen.target), self.target.head_cost(gen.target))
            gen.decided = (k, gen.adaptive.probing)
        return gen.decided

    def _draft_price(self, gen: Generation) -> float:
        """The least chance of being accepted at which a head (on the target, or on a draft
        worker) should draft a
        token: what a draft row costs, in steps (coordinator.adaptive.StepCostModel). A token
        accepted with probability p is worth p of a round's one token per step, so below its
        price it lowers the request's tokens per step. At one request a row is nearly free
        and the head's own cuts decide; under load, when every row of a step computes, only
        the tokens the head is nearly sure of are drafted, and alternatives stop."""
        return self.target.draft_token_cost(gen.target)

    def _choose_k(self, gen: Generation) -> int:
        """Draft tokens to ask the draft worker for (coordinator.adaptive). Under load a draft
        token delays every request in the step: its price comes from the target's measured
        step costs; asking the drafter costs its measured round time."""
        if not gen.use_draft or self.target.drafting_paused(gen.target):
            return 0
        k = min(gen.adaptive.next_k(self.target.draft_token_cost(gen.target),
                                    self.target.propose_cost(gen.target, self.draft.round_times)),
                gen.draft_room)
        if gen.features is not None and gen.features.count < len(gen.committed) - 1:
            return 0  # the drafter lacks the features of the context so far
        return k

    async def _verify(self, gen: Generation, drafts: list[int], draft_next: int) -> target_pb2.Verdict:
        # A round whose successors need nothing but its verdict may run ahead on the replica,
        # unless the head's next block is the adaptive controller's probe (asked once, not
        # once per round of a run).
        room = gen.draft_room + 1 if self._straight_to_target(gen) and not gen.ahead_asked[1] else 0
        verdict = await self.target.verify(gen.target, gen.committed, drafts, gen.sampling, gen.features, draft_next,
                                           room, gen.plan.eos_ids, self._draft_price(gen) if draft_next else 0.0)
        gen.ahead = list(verdict.next_drafts)
        return verdict

    def _record(self, gen: Generation, drafts: list[int], verdict: target_pb2.Verdict,
                asked: tuple[int, bool] | None) -> None:
        """The round's outcome, for the request's stats and both drafting records."""
        gen.stats.rounds += 1
        self.target.observe_round(gen.target, verdict.accepted + 1 + len(verdict.extra_tokens))
        gen.adaptive.update(len(drafts), verdict.accepted, asked)
        self.drafter_record.update(len(drafts), verdict.accepted)
        gen.stats.proposed += len(drafts)
        gen.stats.accepted += verdict.accepted
        gen.stats.rejected_blocks += verdict.accepted < len(drafts)

    def _commit(self, gen: Generation, drafts: list[int], verdict: target_pb2.Verdict) -> list[int]:
        """Commits what the target decided (its acceptance rule: target_worker/kernels/
        rejection_sample.py): drafts[:accepted], its next token, and with a committed
        alternative (the next token) the target's token after it; returns what was committed."""
        room = gen.plan.max_context - len(gen.committed)
        extra = list(verdict.extra_tokens)
        new, gen.finish = self._cut(drafts[:verdict.accepted] + [verdict.next_token] + extra, gen.plan, gen.stats,
                                    room)
        if extra:
            gen.stats.alternative_tokens += max(0, len(new) - verdict.accepted)
        gen.committed.extend(new)
        return new

    @staticmethod
    def _cut(tokens: list[int], plan: GenerationPlan, stats: Stats, room: int):
        """Tokens of this round that are actually generated: cut after EOS, at
        max_new_tokens and at the end of the context."""
        if stats.first_token_at is None:
            stats.first_token_at = time.perf_counter()
        out: list[int] = []
        finish = UNFINISHED
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

    @staticmethod
    def _observe(gen: Generation, drafts: list[int], verdict: target_pb2.Verdict, new: list[int],
                 first: bool = False) -> None:
        """The round in the coordinator's metrics; first: the request's first round."""
        if verdict.extra_tokens:
            metrics.ALTERNATIVE_TOKENS.inc(max(0, len(new) - verdict.accepted))
        metrics.ROUNDS.inc()
        metrics.PROPOSED.inc(len(drafts))
        metrics.ACCEPTED.inc(verdict.accepted)
        metrics.ACCEPTED_LENGTH.observe(verdict.accepted + 1)
        metrics.observe_round(len(drafts), verdict.accepted)
        metrics.GENERATED_TOKENS.inc(len(new))
        metrics.vllm.round(len(drafts), verdict.accepted)
        metrics.vllm.generation_tokens.inc(len(new))
        if first:
            metrics.TTFT.observe(gen.stats.first_token_at - gen.stats.started)
            metrics.vllm.ttft.observe(gen.stats.first_token_at - gen.stats.started)

    @staticmethod
    def _stream(gen: Generation, new: list[int]) -> tuple[str, list[int]]:
        """The new tokens' text, ending at a stop string (which then finishes the request);
        when the request ends otherwise, also what the detokenizer and stop matcher held back.
        Returns the text and the tokens generated: a stop string cuts them after the token
        whose text completed it, so token_ids and generated_tokens do not depend on how many
        tokens the round happened to commit (speculation or not)."""
        text = ""
        for i, token in enumerate(new):
            text += gen.stopper.feed(gen.detok.push(token))
            if gen.stopper.stopped:
                gen.finish = FinishReason.FINISH_REASON_STOP
                cut = len(new) - (i + 1)
                if cut:
                    del gen.committed[-cut:]
                    gen.stats.generated -= cut
                return text, new[:i + 1]
        if gen.done:
            text += gen.stopper.feed(gen.detok.flush()) + gen.stopper.finish()
            if gen.stopper.stopped:
                gen.finish = FinishReason.FINISH_REASON_STOP
        return text, new

    @staticmethod
    def _response(gen: Generation, new: list[int], text: str) -> coordinator_pb2.GenerateResponse:
        response = coordinator_pb2.GenerateResponse(text=text, token_ids=new)
        if gen.answered == 0:  # what a client needs to resume the request
            response.request_id = gen.plan.request_id
            response.seed = gen.plan.sampling.seed
        if gen.done:
            response.finish_reason = gen.finish
            response.stats.CopyFrom(gen.stats.to_proto(len(gen.plan.prompt_ids), gen.sessions))
            response.stats.seed = gen.plan.sampling.seed
        return response

    async def _propose(self, session: WorkerSession, committed: list[int], k: int, stats: Stats,
                       features: FeatureLog | None = None, min_draft_prob: float = 0.0) -> list[int]:
        """Draft tokens, or none when the draft worker is down: the target alone still
        gives the exact output, only slower (drafts are suggestions; the target decides).
        A head on the draft worker drafts only tokens worth `min_draft_prob`, the price of a
        draft row (_draft_price)."""
        try:
            block = await self.draft.propose(session, committed, k, features, min_draft_prob)
        except (Unavailable, ResourceExhausted, grpc.aio.AioRpcError) as exc:
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

    def _release_later(self, target_session: WorkerSession, draft_session: WorkerSession | None,
                       ahead: asyncio.Task | None = None) -> None:
        """Frees worker sessions without blocking (or being cancelled with) the request;
        after `ahead`, the request's round cancelled with it, has ended (its queued round
        left the queue, or the step carrying it is in flight and is waited for), so no
        Release overtakes it."""
        async def release() -> None:
            if ahead is not None:
                await asyncio.wait({ahead})  # neither raises its error nor cancels it
                if not ahead.cancelled():
                    ahead.exception()  # retrieved: a round nobody awaits any more may have failed
            await self.target.release(target_session)
            if draft_session is not None and self.draft is not None:
                await self.draft.release(draft_session)

        task = asyncio.get_running_loop().create_task(release())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def drain(self) -> None:
        """Waits for pending releases (used at shutdown and by tests), those of hedged
        rounds' losing calls included."""
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        await self.target.drain()
