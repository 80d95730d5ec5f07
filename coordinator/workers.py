"""gRPC clients of the draft and target workers, with the delta protocol's coordinator
side: send what a worker lacks, resend from what it holds when it asks (restart, eviction,
another replica), and move a session to another replica when its own fails.

Bounds, so nothing hangs: a call waits at most `timeout_s`; a round tries at most
`retries + 1` times, sleeping `backoff_s`, 2·backoff_s, … in between (default 0.2 s doubling
over 5 retries: ~6 s of back-off) and then fails UNAVAILABLE (RESOURCE_EXHAUSTED when the
last replica tried was too full for the round). The draft side is impatient by
design: if no draft replica can answer at once, the round goes on with the target alone.
A target round a replica holds past the tail of the pool's latencies may also be sent to a
second replica, the first answer winning (coordinator.hedging).

With batching on, a replica's batched steps go over one long-lived stream to it
(coordinator.step_stream), which fails a step exactly as the unary call would have; with
`streams` off, or to a replica that predates the streams, each step is a unary call."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from dataclasses import dataclass, field

import grpc

from coordinator.adaptive import DRAFT_TOKEN_COST, PROPOSE_COST, RoundTimes, StepCostModel
from coordinator.hedging import HedgePolicy, Hedger
from coordinator.pool import EjectionPolicy, Replica, WorkerPool, resolve_dns
from coordinator.scheduler import RoundFailed, StepBatcher
from coordinator.step_stream import StepStream, StreamUnsupported, rpc_error
from specdec import metrics
from specdec.errors import DeadlineExceeded, FailedPrecondition, ResourceExhausted, Unavailable
from specdec.logs import REQUEST_ID_KEY
from specdec.serving import MIN_PING_INTERVAL_S
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc

log = logging.getLogger(__name__)

# CANCELLED reaches the coordinator as an error only when the *worker* cancelled the call
# (it was stopped mid-call); the coordinator's own cancellations surface as CancelledError.
TRANSIENT = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}
# A replica's own fault (a bug, out of memory, a full cache): its state for the session is
# suspect, so the session is released there and rebuilt from scratch, on another replica
# when there is one (the coordinator owns the committed tokens; a worker's cache is only an
# optimisation, rebuilt from them).
REPLICA_FAULT = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.RESOURCE_EXHAUSTED,
                 grpc.StatusCode.DATA_LOSS}
# A replica too full for a round right now (its KV pool, its session slots) refused that
# round alone and changed nothing (`busy`; a whole call failing RESOURCE_EXHAUSTED, e.g. over
# gRPC's message size, is a fault as above): it is loaded, not broken, and never counts
# toward taking it out or ejecting it. The session moves to another serving replica when there is one
# (its copy on the full one is released, giving its blocks back; at once the first time in
# a round, after the back-off when that one is full too), else the round is retried there
# after the back-off — a target round; a draft round is not waited for: the target decodes
# that round alone.
BUSY = grpc.StatusCode.RESOURCE_EXHAUSTED


def busy(exc: BaseException) -> bool:
    """Whether a round's error is its replica refusing it for room (see BUSY): a batched
    round's own RoundError, or an unbatched call the worker answered RESOURCE_EXHAUSTED
    (not gRPC's message-size limit)."""
    if isinstance(exc, RoundFailed):
        return exc.refused and exc.code() == BUSY
    return (isinstance(exc, grpc.aio.AioRpcError) and exc.code() == BUSY
            and "larger than max" not in (exc.details() or ""))

# A whole step failing so is the replica's failure whoever's rounds it carried; a step past
# its deadline may be the clients' deadlines, which its rounds tell apart.
STEP_FAULT = (TRANSIENT | REPLICA_FAULT) - {grpc.StatusCode.DEADLINE_EXCEEDED}
# A worker asking for a resync twice in a row for the same call is broken, not restarted.
MAX_RESYNCS_PER_CALL = 2
# Releases run in the background, queued behind the worker's rounds: give them time.
RELEASE_TIMEOUT_S = 30.0
INFO_TIMEOUT_S = 2.0
DRAFT_TIMEOUT_S = 10.0
MIN_KEEPALIVE_S = 2 * MIN_PING_INTERVAL_S


def model_shape(info: common_pb2.WorkerInfo) -> tuple:
    """What every replica of a target must agree on, beyond the vocabulary."""
    return (info.vocab_hash, info.model_vocab_size, info.max_context, tuple(sorted(info.eos_token_ids)))


def refused(kind: str, reason: str) -> bool:
    """Counts a replica refused admission (never given a round); False, for `_admit`."""
    metrics.REPLICAS_REFUSED.labels(kind, reason).inc()
    return False


def channel_options(max_message_bytes: int, keepalive_s: float = 0.0,
                    keepalive_timeout_s: float = 5.0) -> list[tuple[str, int]]:
    """A worker channel's options. keepalive_s > 0: the channel pings the worker after that
    long without hearing from it, idle or not, and closes the connection when a ping is
    unanswered for keepalive_timeout_s, failing its calls UNAVAILABLE — so a silent network
    partition ends a call within about keepalive_s + keepalive_timeout_s, not at its
    deadline (gRPC's keepalive, https://grpc.io/docs/guides/keepalive/). keepalive_s is at
    least MIN_KEEPALIVE_S, twice as long as the workers let pings come
    (specdec.serving.MIN_PING_INTERVAL_S), so that no ping is "too many"."""
    options = [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        # Reconnect quickly to a restarted worker instead of backing off for up to 2 min.
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1000),
    ]
    if keepalive_s > 0:
        if keepalive_s < MIN_KEEPALIVE_S or keepalive_timeout_s <= 0:
            raise ValueError(f"--worker-keepalive-s must be 0 (off) or at least {MIN_KEEPALIVE_S:g} "
                             f"(got {keepalive_s:g}), and --worker-keepalive-timeout-s above 0 "
                             f"(got {keepalive_timeout_s:g})")
        options += [
            ("grpc.keepalive_time_ms", round(keepalive_s * 1000)),
            ("grpc.keepalive_timeout_ms", round(keepalive_timeout_s * 1000)),
            # gRPC core times every ping out, keepalive pings included, after this transport
            # argument (default 60 s) and not after keepalive_timeout_ms alone: set it too.
            ("grpc.http2.ping_timeout_ms", round(keepalive_timeout_s * 1000)),
            ("grpc.keepalive_permit_without_calls", 1),  # an idle link is checked too
            ("grpc.http2.max_pings_without_data", 0),  # no cap on pings between data frames
        ]
    return options


@dataclass
class WorkerSession:
    """The coordinator's view of one session on one worker kind."""

    session_id: str
    # The client request's id, sent along as x-request-id metadata for the workers' logs.
    request_id: str = ""
    # Event-loop time of the client's deadline: no worker call outlives it.
    deadline: float | None = None
    # Committed tokens the worker was last sent (it holds them unless it lost the session).
    sent: int = 0
    # Address of the replica holding the session's cache; every replica it has used.
    replica: str | None = None
    used: set[str] = field(default_factory=set)
    resyncs: int = 0
    moves: int = 0
    # Rounds also sent to a second replica (coordinator.hedging).
    hedges: int = 0
    wire_bytes: int = 0
    seconds: float = 0.0

    @property
    def key(self) -> str:
        """The generation this session belongs to (its target and draft sessions share it)."""
        return self.session_id.rpartition("/")[0] or self.session_id


class FeatureLog:
    """One generation's target features (float16 rows of `size`), by position: what the
    target's verdicts returned, for a drafter that reads them (specdec.eagle)."""

    def __init__(self, size: int):
        self.row = 2 * size
        self.data = bytearray()

    @property
    def count(self) -> int:
        """Positions 0 … count-1 are known."""
        return len(self.data) // self.row

    def put(self, start: int, data: bytes) -> None:
        if not data:
            return
        if start > self.count or len(data) % self.row:
            log.warning("features of positions from %d do not continue the %d known; dropped", start, self.count)
            return
        del self.data[start * self.row:]
        self.data += data

    def rows(self, first: int, end: int) -> bytes:
        return bytes(self.data[first * self.row:end * self.row])


class Rechunk(Exception):
    """A round's session must be resent from `session.sent` (a fault, a move, a resync), and
    that is more than one chunk: the caller prefills it in chunks again (TargetClient.verify)."""


class WorkerClient:
    kind = ""
    service_name = ""
    # Whether a round waits (with back-off) for a replica when none can answer.
    patient = True
    # Whether a step waits briefly for the requests the last one answered (scheduler).
    gathers = False

    def __init__(self, endpoints: str, timeout_s: float, retries: int, backoff_s: float, max_message_bytes: int,
                 resolve_interval_s: float = 5.0, health_interval_s: float = 1.0, resolver=resolve_dns,
                 tls=None, batching: bool = True, step_token_budget: int = 512, max_batch_rounds: int = 32,
                 ejection: EjectionPolicy | None = None, keepalive_s: float = 0.0, keepalive_timeout_s: float = 5.0,
                 streams: bool = True):
        self.timeout_s = timeout_s
        # The draft's deadline is short: waiting long for a suggestion defeats its purpose.
        self.call_timeout_s = min(timeout_s, DRAFT_TIMEOUT_S) if not self.patient else timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        # What a replica must serve to be admitted: vocabulary hashes it may have, and (for
        # targets) the model's shape; None: not known yet (admit anything).
        self.accepted_vocab_hashes: set[str] | None = None
        self.expected_shape: tuple | None = None
        # The weights fingerprints every replica must serve, by what they cover ("weights"; for
        # targets also "head_weights"): pinned from the first replica admitted (pin_weights).
        self.fingerprints: dict[str, str] = {}
        # The target's feature width: a draft replica reading features of another is refused.
        self.target_feature_size = 0
        self.pool = WorkerPool(self.kind, endpoints, self.service_name,
                               channel_options(max_message_bytes, keepalive_s, keepalive_timeout_s),
                               resolve_interval_s, health_interval_s, resolver, admit=self._admit, tls=tls,
                               ejection=ejection)
        self._stubs: dict[str, object] = {}
        # Continuous batching (coordinator.scheduler): one StepBatcher per replica address.
        self.batching = batching
        self.step_token_budget = step_token_budget
        self.max_batch_rounds = max_batch_rounds
        self.round_times = RoundTimes()  # rounds that got an answer, retries included
        self._batchers: dict[str, StepBatcher] = {}
        # Steps go over one long-lived stream per replica (coordinator.step_stream) unless
        # off, or the replica predates the streams (then unary calls, for good).
        self.streams = streams
        self._streams: dict[str, StepStream] = {}
        # Hedged rounds (coordinator.hedging; targets only, None: off), and the background
        # releases of the sessions their losing calls left behind.
        self.hedger: Hedger | None = None
        self._background: set[asyncio.Task] = set()

    def _make_stub(self, channel):
        raise NotImplementedError

    def stub(self, replica: Replica):
        stub = self._stubs.get(replica.address)
        if stub is None or stub[0] is not replica.channel:
            stub = self._stubs[replica.address] = (replica.channel, self._make_stub(replica.channel))
        return stub[1]

    async def start(self) -> None:
        await self.pool.start()

    async def drain(self) -> None:
        """Waits for the background releases of hedges' losing calls."""
        while self._background:
            await asyncio.gather(*self._background, return_exceptions=True)

    async def close(self) -> None:
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        for batcher in list(self._batchers.values()):
            await batcher.close()
        for stream in list(self._streams.values()):
            await stream.close()
        await self.pool.close()

    def _batcher(self, replica: Replica) -> StepBatcher:
        batcher = self._batchers.get(replica.address)
        if batcher is None:
            address = replica.address

            async def send(requests: list, timeout_s: float):
                self.pool.review_ejections()
                current = self.pool.replicas.get(address)
                if current is None or current.ejected:  # rounds queued before it went: elsewhere
                    raise rpc_error(grpc.StatusCode.UNAVAILABLE,
                                    f"replica {address} " + ("is ejected" if current else "left the pool"))
                try:
                    return await self._send_step(current, requests, timeout_s)
                except grpc.aio.AioRpcError as exc:
                    if exc.code() in STEP_FAULT:
                        # Counted before the batcher sends its next step here, not when this
                        # step's rounds wake: a failure that ejects the replica keeps the
                        # steps queued behind it from being sent. Its rounds' own counting
                        # of it is then a no-op (WorkerPool.mark_failed).
                        self.pool.mark_failed(address)
                    raise

            batcher = self._batchers[address] = StepBatcher(
                self.kind, send, self.step_token_budget, self.max_batch_rounds,
                on_step=lambda response, requests: self._on_step(address, response, requests), gather=self.gathers)
        return batcher

    async def _send_step(self, replica: Replica, requests: list, timeout_s: float):
        """One batched step: a message on the replica's step stream, or a unary call where
        streams are off or the replica has none. Fails as the unary call would."""
        if self.streams:
            stream = self._streams.get(replica.address)
            if stream is None or stream.channel is not replica.channel:
                stub = self.stub(replica)
                address = replica.address
                stream = self._streams[address] = StepStream(
                    lambda: self._open_stream(stub), f"{self.kind} replica {address}", replica.channel,
                    unsolicited=lambda response: self._unsolicited(address, response),
                    ended=lambda: self._stream_ended(address))
            if not stream.unsupported:
                loop = asyncio.get_running_loop()
                began = loop.time()
                try:
                    return await stream.step(self._batch(requests), timeout_s)
                except StreamUnsupported:
                    log.warning("%s replica %s serves no step stream (an older worker): unary calls to it from "
                                "now on", self.kind, replica.address)
                    timeout_s = max(0.001, timeout_s - (loop.time() - began))
        return await self._unary_batch(self.stub(replica))(self._batch(requests), timeout=timeout_s)

    def _batch(self, requests: list):
        """The batched request (VerifyBatchRequest / ProposeBatchRequest) of `requests`."""
        raise NotImplementedError

    def _open_stream(self, stub):
        """Starts the replica's step stream call (VerifyStream / ProposeStream)."""
        raise NotImplementedError

    def _unary_batch(self, stub):
        """The unary batched call (VerifyBatch / ProposeBatch)."""
        raise NotImplementedError

    def _on_step(self, address: str, response, requests: list) -> None:
        """Sees each batched step's response (the target learns its step costs)."""

    def _unsolicited(self, address: str, response) -> None:
        """Sees a message of the replica's step stream that answers no step."""

    def _stream_ended(self, address: str) -> None:
        """The replica's step stream ended (it broke, or was closed)."""

    @staticmethod
    def _round_tokens(request) -> int:
        """What a round adds to a step's token budget."""
        return len(request.delta.tokens)

    async def _call(self, replica: Replica, request, timeout: float, session: WorkerSession, method: str):
        """One round's worker call: queued into the replica's next batched step, or (with
        batching off) a call of its own. Per-round errors raise RoundFailed."""
        if not self.batching:
            return await getattr(self.stub(replica), method)(
                request, timeout=timeout, metadata=((REQUEST_ID_KEY, session.request_id),))
        try:
            response = await self._batcher(replica).submit(request, self._round_tokens(request), timeout,
                                                           key=session.key)
        except TimeoutError as exc:
            raise RoundFailed(grpc.StatusCode.DEADLINE_EXCEEDED, f"no answer within {timeout:.3g} s") from exc
        if response.WhichOneof("result") == "error":
            raise RoundFailed(response.error.code, response.error.message, refused=True)
        return response

    async def _admit(self, replica: Replica) -> bool:
        """A replica joins only if it serves the tokenizer the coordinator checked at start
        and the weights pinned for its kind (`pin_weights`); each refusal is counted
        (specdec_replicas_refused_total) by its reason."""
        if self.accepted_vocab_hashes is None:
            return True
        info = await self.stub(replica).GetInfo(common_pb2.WorkerInfoRequest(), timeout=INFO_TIMEOUT_S)
        if self.expected_shape is not None and model_shape(info) != self.expected_shape:
            return refused(self.kind, "shape")
        if self.kind == "draft" and info.feature_size and info.feature_size != self.target_feature_size:
            return refused(self.kind, "features")
        if info.vocab_hash not in self.accepted_vocab_hashes:
            return refused(self.kind, "vocabulary")
        if not self._same_weights(replica.address, info):
            return False
        if self.kind == "target":
            self.heads[replica.address] = info.head
        if self.kind == "draft" and info.feature_size:
            self.feature_size = info.feature_size  # a head that joined after start: send it features
        return True

    def pin_weights(self, info: common_pb2.WorkerInfo) -> None:
        """Pins the weights this kind's replicas must serve, where none are pinned yet: the
        replica's fingerprint, and for a target running a head, the head's."""
        self.fingerprints.setdefault("weights", info.fingerprint)
        if info.head:
            self.fingerprints.setdefault("head_weights", info.head_fingerprint)

    def _same_weights(self, address: str, info: common_pb2.WorkerInfo) -> bool:
        """Whether a replica serves the pinned weights (pinning them if it is the first).
        A target with other weights would change the output, silently, and a session moved
        to it mid-request would mix two models; a draft (or a target's head) with other
        weights would change what the fleet drafts. Either is refused, never used."""
        served = {"weights": info.fingerprint}
        if info.head:  # a target replica without a head runs no head weights to compare
            served["head_weights"] = info.head_fingerprint
        for reason, fingerprint in served.items():
            pinned = self.fingerprints.get(reason)
            if pinned is not None and fingerprint != pinned:
                log.warning("%s replica %s refused: it serves %s fingerprint %s, but this coordinator pinned %s "
                            "(a coordinator serves one model: roll new weights out with a new coordinator set)",
                            self.kind, address, "head" if reason == "head_weights" else "weights",
                            fingerprint or "(none reported)", pinned or "(none reported)")
                return refused(self.kind, reason)
        self.pin_weights(info)
        return True

    async def info(self, timeout_s: float) -> common_pb2.WorkerInfo:
        """Waits up to timeout_s for any replica to answer (models take a while to load)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        reported = ""
        while True:
            if not self.pool.replicas:
                await self.pool.resolve()
            for replica in list(self.pool.replicas.values()):
                try:
                    info = await self.stub(replica).GetInfo(common_pb2.WorkerInfoRequest(), wait_for_ready=True,
                                                            timeout=max(0.1, min(INFO_TIMEOUT_S, deadline - loop.time())))
                except grpc.aio.AioRpcError:
                    continue
                return info
            reason = await self._unreachable()
            if reason and reason != reported:
                log.warning("no %s worker answers yet: %s", self.kind, reason)
                reported = reason
            if loop.time() >= deadline:
                raise Unavailable(f"no {self.kind} worker at {self.pool.endpoints} answered within {timeout_s:g} s"
                                  + (f" ({reported})" if reported else ""))
            await asyncio.sleep(0.5)

    async def _unreachable(self) -> str:
        """Why a replica does not answer: a call that does not wait for the connection fails
        with the cause (refused, a failed TLS handshake or certificate check), where a waiting
        one reports only its deadline. "" when none is known."""
        for replica in list(self.pool.replicas.values()):
            try:
                await self.stub(replica).GetInfo(common_pb2.WorkerInfoRequest(), timeout=INFO_TIMEOUT_S)
            except grpc.aio.AioRpcError as exc:
                reason = f"{replica.address}: {(exc.details() or '').rstrip('.')}"
                if "Hostname Verification" in reason or "not in peer certificate" in reason:
                    name = self.pool.tls.server_name if self.pool.tls is not None else None
                    reason += (f"; its certificate does not name {name} (--{self.kind}-tls-server-name)" if name else
                               f"; its certificate does not name {replica.address.rpartition(':')[0]}: give "
                               f"--{self.kind}-tls-server-name with a name it does cover")
                return reason
        return ""

    async def release(self, session: WorkerSession) -> None:
        for address in session.used:
            batcher = self._batchers.get(address)
            if batcher is not None:
                # A round sent before the request ended still runs there: release after it.
                try:
                    await asyncio.wait_for(batcher.settled(session.key), RELEASE_TIMEOUT_S)
                except TimeoutError:
                    log.info("%s step carrying %s still in flight after %g s; releasing anyway", self.kind,
                             session.session_id, RELEASE_TIMEOUT_S)
            replica = self.pool.replicas.get(address)
            if replica is not None:
                await self._release_on(replica, session.session_id)
        self.pool.forget(session.session_id)

    async def _release_on(self, replica: Replica, session_id: str, timeout_s: float = RELEASE_TIMEOUT_S) -> None:
        try:
            await self.stub(replica).Release(common_pb2.ReleaseRequest(session_id=session_id), timeout=timeout_s)
        except (grpc.aio.AioRpcError, grpc.aio.BaseError) as exc:  # the worker evicts it anyway, in time
            log.info("release of %s on %s failed: %s", session_id, replica.address, exc)

    async def _replica(self, session: WorkerSession, attempt: int) -> Replica | None:
        replica = self.pool.replica_for(session.session_id, session.replica)
        if replica is None and self.patient:
            await self.pool.check_health()  # a restarted replica may be back already
            replica = self.pool.replica_for(session.session_id, session.replica)
        if replica is not None and replica.address != session.replica:
            if session.replica is not None:
                session.moves += 1
                log.info("%s session %s moves %s -> %s", self.kind, session.session_id, session.replica,
                         replica.address)
            session.replica = replica.address
            session.used.add(replica.address)
        return replica

    async def _round(self, session: WorkerSession, committed: list[int], make_request, method: str,
                     chunk: int | None = None):
        """One round's call: a delta from what the worker holds, resending on request,
        moving to another replica and retrying on transient failures (bounded). With
        `chunk`, a resend of more than chunk + 1 tokens raises Rechunk instead of going as
        one round (its start recorded in session.sent)."""
        loop = asyncio.get_running_loop()
        began = loop.time()
        attempt = resyncs = 0
        moved_at_once = False  # a busy replica's session went to another without back-off
        start = min(session.sent, len(committed) - 1)
        last_error = "no replica is healthy"
        hedges = session.hedges  # a round is hedged at most once, whatever its attempts
        while True:
            if chunk is not None and len(committed) - start > chunk + 1:
                session.sent = start
                raise Rechunk()
            replica = await self._replica(session, attempt)
            busy_here = False  # this attempt's replica was too full for the round
            if replica is not None:
                delta = common_pb2.SessionDelta(session_id=session.session_id, start=start, tokens=committed[start:],
                                                request_id=session.request_id)
                request = make_request(delta)
                try:
                    timeout = self.call_timeout_s
                    if session.deadline is not None:
                        timeout = min(timeout, max(0.001, session.deadline - loop.time()))
                    # The replica that answered, and what it answered, when a hedge won.
                    response, replica, request = await self._call_hedged(
                        replica, request, timeout, session, method, committed, make_request, session.hedges == hedges)
                except (grpc.aio.AioRpcError, RoundFailed) as exc:
                    last_error = f"{replica.address}: {exc.code().name}: {exc.details()}"
                    if session.deadline is not None and loop.time() >= session.deadline:
                        # The client's deadline ran out, not the replica: leave it in the pool.
                        raise DeadlineExceeded(f"deadline exceeded during a {self.kind} round") from exc
                    busy_here = busy(exc)
                    if busy_here:
                        last_try = attempt >= (self.retries if self.patient else 1)
                        if not last_try and self._move_off_busy(session, replica, last_error):
                            start = 0
                            if not moved_at_once:  # the first move needs no back-off; the next ones do
                                moved_at_once = True
                                attempt += 1
                                continue
                        elif not self.patient:  # no waiting for a suggestion: the target decodes alone
                            raise ResourceExhausted(f"{self.kind} workers too busy ({last_error})") from exc
                    elif exc.code() in REPLICA_FAULT:
                        log.warning("%s replica fault (%s): session %s restarts from scratch", self.kind, last_error,
                                    session.session_id)
                        await self._release_on(replica, session.session_id)
                        start = 0
                    elif exc.code() not in TRANSIENT:
                        # The coordinator validated the request: a worker refusing it means the
                        # two disagree (versions, limits), not that the client erred.
                        raise FailedPrecondition(f"{self.kind} worker {replica.address} refused a round: "
                                                 f"{exc.code().name}: {exc.details()}") from exc
                    if not busy_here:
                        self.pool.mark_failed(replica.address)
                else:
                    self.pool.succeeded(replica.address)
                    session.wire_bytes += request.ByteSize() + response.ByteSize()
                    kind = response.WhichOneof("result")
                    if kind == "resync":
                        resyncs += 1
                        session.resyncs += 1
                        if resyncs > MAX_RESYNCS_PER_CALL:
                            raise Unavailable(f"{self.kind} worker {replica.address} keeps losing session state")
                        start = min(response.resync.cached_len, len(committed) - 1)
                        continue
                    session.sent = len(committed)
                    session.seconds += loop.time() - began
                    self.round_times.observe(loop.time() - began)
                    return getattr(response, kind)
            if attempt >= (self.retries if self.patient else 1) or (replica is None and not self.patient):
                if busy_here:
                    raise ResourceExhausted(f"{self.kind} workers too busy after {attempt + 1} attempts "
                                            f"({last_error})")
                raise Unavailable(f"{self.kind} workers unavailable after {attempt + 1} attempts ({last_error})")
            await asyncio.sleep(self.backoff_s * (2 ** attempt))
            attempt += 1

    def _move_off_busy(self, session: WorkerSession, replica: Replica, reason: str) -> bool:
        """A round `replica` was too full for: the session moves to the least loaded other
        serving replica (True), its copy on `replica` released in the background, or stays
        where there is none (False). Neither counts against `replica`."""
        other = self.pool.alternative(session.session_id, replica.address)
        outcome = "moved" if other is not None else "retried" if self.patient else "skipped"
        metrics.BUSY_ROUNDS.labels(self.kind, outcome).inc()
        if other is None:
            log.info("%s replica busy (%s): session %s %s", self.kind, reason, session.session_id,
                     "retries its round there" if self.patient else "goes without a draft this round")
            return False
        log.info("%s replica busy (%s): session %s moves to %s", self.kind, reason, session.session_id,
                 other.address)
        replica.sessions.discard(session.session_id)
        other.sessions.add(session.session_id)
        session.replica = other.address
        session.used.add(other.address)
        session.moves += 1
        batcher = self._batchers.get(replica.address)
        if batcher is not None:
            batcher.forget(session.key)  # its next step need not wait for this session
        self._release_loser(None, replica.address, session)
        return True

    # --- hedged rounds (coordinator.hedging) ---------------------------------------------

    async def _call_hedged(self, replica: Replica, request, timeout: float, session: WorkerSession, method: str,
                           committed: list[int], make_request, may_hedge: bool):
        """`_call`, hedged where this pool hedges and the round has not been yet: when no
        answer comes within the delay, the round also goes to a second replica and the
        first answer is used. Returns (the answer, the replica that gave it, the request it
        answers); raises the first call's error when neither call answered."""
        hedger = self.hedger
        if hedger is None:
            return await self._call(replica, request, timeout, session, method), replica, request
        loop = asyncio.get_running_loop()
        began = loop.time()
        tokens = self._round_tokens(request)
        hedger.count_call()
        delay = hedger.delay(tokens) if may_hedge else None
        if delay is None or delay >= timeout:
            response = await self._call(replica, request, timeout, session, method)
            hedger.observe(tokens, loop.time() - began)
            return response, replica, request
        first = asyncio.ensure_future(self._call(replica, request, timeout, session, method))
        hedge: asyncio.Future | None = None
        second: Replica | None = None
        try:
            done, _ = await asyncio.wait((first,), timeout=delay)
            second = None if done else self._hedge_replica(session, replica, delay)
            if second is None:
                response = await first
                hedger.observe(tokens, loop.time() - began)
                return response, replica, request
            session.hedges += 1
            log.debug("%s round of %s unanswered by %s after %.3g s: hedged to %s", self.kind, session.session_id,
                      replica.address, loop.time() - began, second.address)
            hedge = asyncio.ensure_future(self._hedge(second, session, committed, make_request, method))
            done, _ = await asyncio.wait((first, hedge), return_when=asyncio.FIRST_COMPLETED)
            if hedge in done and hedge.exception() is not None:
                self._failed_in_race(second, hedge.exception(), session)
            elif first in done and first.exception() is not None:
                try:
                    answer = await hedge
                except Exception as exc:  # noqa: BLE001 - the first call's error then decides the round
                    self._failed_in_race(second, exc, session)
                else:
                    self._failed_in_race(replica, first.exception(), session)
                    hedge = None  # it answers for the round
                    return self._hedge_won(answer, replica, first, second, session, tokens, began)
            elif first not in done:
                answer, hedge = hedge.result(), None
                return self._hedge_won(answer, replica, first, second, session, tokens, began)
            # The first call answers (or fails) for the round; the hedge's copy goes (finally).
            metrics.HEDGED_ROUNDS.labels("lost").inc()
            log.debug("hedge of %s to %s lost: %s answered first", session.session_id, second.address,
                      replica.address)
            response = await first
            hedger.observe(tokens, loop.time() - began)
            return response, replica, request
        finally:
            if not first.done():
                first.cancel()
            if hedge is not None:  # it lost or failed, or the round was cancelled: free its copy
                self._release_loser(hedge, second.address, session)

    def _hedge_won(self, answer, loser: Replica, call: asyncio.Future, winner: Replica, session: WorkerSession,
                   tokens: int, began: float):
        """The hedge answered first: the session lives on `winner` from now on, and the
        first call's copy on `loser` goes."""
        response, request = answer
        metrics.HEDGED_ROUNDS.labels("won").inc()
        log.debug("hedge of %s to %s won: the session moves there from %s", session.session_id, winner.address,
                  loser.address)
        self.hedger.observe(tokens, asyncio.get_running_loop().time() - began)
        session.moves += 1
        session.replica = winner.address
        session.used.add(winner.address)
        winner.sessions.add(session.session_id)
        loser.sessions.discard(session.session_id)
        self._release_loser(call, loser.address, session)
        return response, winner, request

    def _hedge_replica(self, session: WorkerSession, replica: Replica, delay: float) -> Replica | None:
        """The replica a round that `replica` has not answered within `delay` also goes to;
        None, with the reason counted, where HedgePolicy's bounds allow no hedge."""
        second = self.pool.alternative(session.session_id, replica.address)
        if second is None:
            reason = "no_replica"
        elif session.deadline is not None and session.deadline - asyncio.get_running_loop().time() < delay:
            reason = "deadline"
        elif not self.hedger.grant():
            reason = "budget"
        else:
            return second
        metrics.HEDGES_SKIPPED.labels(reason).inc()
        log.debug("%s round of %s unanswered by %s after %.3g s, not hedged: %s", self.kind, session.session_id,
                  replica.address, delay, reason)
        return None

    async def _hedge(self, replica: Replica, session: WorkerSession, committed: list[int], make_request,
                     method: str):
        """A hedge: the round on `replica`, from what it may hold of the session (nothing,
        unless the session used it before), resending from where it asks (the resync
        protocol). Returns (its answer, the request it answers)."""
        loop = asyncio.get_running_loop()
        start = min(session.sent, len(committed) - 1) if replica.address in session.used else 0
        for _ in range(MAX_RESYNCS_PER_CALL + 1):
            delta = common_pb2.SessionDelta(session_id=session.session_id, start=start, tokens=committed[start:],
                                            request_id=session.request_id)
            request = make_request(delta)
            timeout = self.call_timeout_s
            if session.deadline is not None:
                timeout = min(timeout, max(0.001, session.deadline - loop.time()))
            response = await self._call(replica, request, timeout, session, method)
            if response.WhichOneof("result") != "resync":
                return response, request
            session.resyncs += 1
            session.wire_bytes += request.ByteSize() + response.ByteSize()
            start = min(response.resync.cached_len, len(committed) - 1)
        raise Unavailable(f"{self.kind} worker {replica.address} keeps losing session state")

    def _failed_in_race(self, replica: Replica, exc: BaseException, session: WorkerSession) -> None:
        """A call of a hedged round failed while the other went on: it counts against its
        replica as a round's failed call does (coordinator.pool.EjectionPolicy), unless the
        client's deadline ran out."""
        log.debug("%s call of hedged round of %s failed on %s: %s", self.kind, session.session_id, replica.address,
                  exc)
        if session.deadline is not None and asyncio.get_running_loop().time() >= session.deadline:
            return
        code = exc.code() if isinstance(exc, (grpc.aio.AioRpcError, RoundFailed)) else None
        if (code in TRANSIENT or code in REPLICA_FAULT) and not busy(exc):  # a full replica is healthy
            self.pool.mark_failed(replica.address)

    def _release_loser(self, call: asyncio.Future | None, address: str, session: WorkerSession) -> None:
        """Cancels a hedged round's losing call and, in the background, frees what it may
        have left of the session on `address`: once the call is over and no step in flight
        there carries the round (StepBatcher.settled), so the Release cannot overtake it;
        never while the session lives there (its own release frees it then). call: None for
        a session that moved off a busy replica."""
        if call is not None and not call.done():
            call.cancel()
        if address != session.replica:
            session.used.discard(address)

        async def release() -> None:
            if call is not None:
                await asyncio.gather(call, return_exceptions=True)
            batcher = self._batchers.get(address)
            if batcher is not None:
                try:
                    await asyncio.wait_for(batcher.settled(session.key), RELEASE_TIMEOUT_S)
                except TimeoutError:
                    log.info("%s step carrying %s still in flight on %s after %g s; releasing anyway", self.kind,
                             session.session_id, address, RELEASE_TIMEOUT_S)
            replica = self.pool.replicas.get(address)
            if replica is not None and address != session.replica:
                await self._release_on(replica, session.session_id)

        task = asyncio.get_running_loop().create_task(release())
        self._background.add(task)
        task.add_done_callback(self._background.discard)


class DraftClient(WorkerClient):
    kind = "draft"
    service_name = draft_pb2.DESCRIPTOR.services_by_name["DraftWorker"].full_name
    patient = False  # the target alone is always a correct fallback

    # Width of the target features the drafter reads (WorkerInfo.feature_size; 0: none).
    feature_size = 0

    def _make_stub(self, channel):
        return draft_pb2_grpc.DraftWorkerStub(channel)

    def _batch(self, requests: list):
        return draft_pb2.ProposeBatchRequest(rounds=requests)

    def _open_stream(self, stub):
        return stub.ProposeStream()

    def _unary_batch(self, stub):
        return stub.ProposeBatch

    async def propose(self, session: WorkerSession, committed: list[int], k: int,
                      features: FeatureLog | None = None, min_draft_prob: float = 0.0) -> draft_pb2.DraftBlock:
        """Up to k draft tokens; a drafter with probabilities (a head) drafts a token only
        where it puts its chance of being accepted at min_draft_prob or more (the price of a
        draft row, ProposeRequest.min_draft_prob)."""
        def request(delta: common_pb2.SessionDelta) -> draft_pb2.ProposeRequest:
            if features is None:
                return draft_pb2.ProposeRequest(delta=delta, k=k, min_draft_prob=min_draft_prob)
            # The feature of the position before each committed token the delta carries.
            first = max(delta.start - 1, 0)
            return draft_pb2.ProposeRequest(delta=delta, k=k, feature_start=first, min_draft_prob=min_draft_prob,
                                            features=features.rows(first, len(committed) - 1))

        return await self._round(session, committed, request, "Propose")


class TargetClient(WorkerClient):
    kind = "target"
    service_name = target_pb2.DESCRIPTOR.services_by_name["TargetWorker"].full_name

    gathers = True

    def _make_stub(self, channel):
        return target_pb2_grpc.TargetWorkerStub(channel)

    def finished(self, session: WorkerSession) -> None:
        """The generation ended: no round run ahead for it is waited for, and no step waits
        for its next round."""
        self._runs.pop(session.session_id, None)
        self._sends_no_round(session)

    def _sends_no_round(self, session: WorkerSession) -> None:
        """No step waits for the session's next round."""
        batcher = self._batchers.get(session.replica) if session.replica else None
        if batcher is not None:
            batcher.forget(session.key)

    async def step_left(self, session: WorkerSession) -> None:
        """Returns once the step gathering on the session's replica has left (at once when
        none is gathering; StepBatcher.gathered)."""
        batcher = self._batchers.get(session.replica) if session.replica else None
        if batcher is not None:
            await batcher.gathered()

    def __init__(self, *args, prefill_chunk: int = 256, hedging: HedgePolicy | None = None, run_ahead: int = 0,
                 **kwargs):
        super().__init__(*args, **kwargs)
        # Rounds a replica may run by itself after a round that goes straight to it (see
        # verify and next_ahead), and the sessions whose rounds run ahead.
        self.run_ahead = run_ahead
        self._runs: dict[str, _AheadRun] = {}
        self._changes: dict[StepStream, list] = {}  # run changes to send, per stream (change_run)
        self._stream_ends = 0  # step streams that ended, to any replica
        # Longest run of committed tokens one round sends while batching (see verify).
        self.prefill_chunk = prefill_chunk
        if hedging is not None and hedging.enabled:
            self.hedger = Hedger(hedging)
        self.costs: dict[str, StepCostModel] = {}
        # The draft head the target workers run next to the target (WorkerInfo.head; "": none):
        # as the first replica reported it, and per replica address as each joined.
        self.head = ""
        self.heads: dict[str, str] = {}

    def runs_head(self, session: WorkerSession) -> bool:
        """Whether the replica serving the session drafts with a head of its own."""
        if session.replica is not None and session.replica in self.heads:
            return bool(self.heads[session.replica])
        return bool(self.head)

    def _batch(self, requests: list):
        return target_pb2.VerifyBatchRequest(rounds=requests)

    def _open_stream(self, stub):
        return stub.VerifyStream()

    def _unary_batch(self, stub):
        return stub.VerifyBatch

    def _on_step(self, address: str, response, requests: list) -> None:
        # The rounds the replica ran ahead in the same step share its rows and time.
        self._observe_step(address, response, len(requests) + response.ahead_rounds,
                           sum(len(r.draft_tokens) for r in requests) + response.ahead_drafts,
                           sum(1 for r in requests if r.draft_tokens) + response.ahead_drafting,
                           sum(1 for r in requests if r.draft_next) + response.ahead_head_rounds)

    def _observe_step(self, address: str, response, rounds: int, drafts: int, drafting: int, asking: int) -> None:
        model = self.costs.get(address)
        if model is None:
            model = self.costs[address] = StepCostModel()
        verdicts, scale = model.verdict_count, model.price_scale
        model.observe(response.rows, response.step_s, rounds, drafts, drafting, response.draft_s)
        model.observe_head(response.draft_s, rounds, asking)
        if model.verdict_count != verdicts:
            verdict = "raised" if model.price_scale > scale else "lowered" if model.price_scale < scale else "kept"
            metrics.DRAFT_PRICE_VERDICTS.labels(verdict=verdict).inc()

    @staticmethod
    def _round_tokens(request) -> int:
        return len(request.delta.tokens) + len(request.draft_tokens)

    def draft_token_cost(self, session: WorkerSession) -> float:
        """What one draft token costs now on the replica serving the session, in its steps
        (coordinator.adaptive.StepCostModel); the one-request figure before any step."""
        model = self.costs.get(session.replica) if session.replica else None
        return model.draft_token_cost() if model is not None else DRAFT_TOKEN_COST

    def observe_round(self, session: WorkerSession, tokens: int) -> None:
        """A round of the session committed `tokens`: what every round in a step of its
        replica stands to lose while a draft row delays the step (StepCostModel)."""
        model = self.costs.get(session.replica) if session.replica else None
        if model is not None:
            model.observe_round(tokens)

    def drafting_paused(self, session: WorkerSession) -> bool:
        """Whether rounds on the replica serving the session should go without drafts now,
        so that its cost model sees steps without them (coordinator.adaptive.StepCostModel)."""
        model = self.costs.get(session.replica) if session.replica else None
        if model is None:
            return False
        pauses = model.pauses
        paused = model.paused
        if model.pauses != pauses:
            metrics.DRAFT_PAUSES.inc()
        return paused

    def propose_cost(self, session: WorkerSession, propose: RoundTimes) -> float:
        """What asking the drafter (its rounds taking `propose`) costs now on the replica
        serving the session, in its steps; the one-request figure before any step."""
        model = self.costs.get(session.replica) if session.replica else None
        return model.propose_cost(propose) if model is not None else PROPOSE_COST

    def head_cost(self, session: WorkerSession) -> float:
        """What asking the head on the replica serving the session for a block costs now, in
        its steps (the head's measured drafting time per step); the one-request figure
        before any step."""
        model = self.costs.get(session.replica) if session.replica else None
        return model.head_cost() if model is not None else PROPOSE_COST

    async def verify(self, session: WorkerSession, committed: list[int], drafts: list[int],
                     sampling: common_pb2.SamplingParams | None = None,
                     features: FeatureLog | None = None, draft_next: int = 0, token_room: int = 0,
                     stop_ids: frozenset[int] = frozenset(), min_draft_prob: float = 0.0) -> target_pb2.Verdict:
        """One round; with `features`, the verdicts' target features go into it; with
        draft_next, a target worker that runs a head (`head`) drafts the next round's block
        (Verdict.next_drafts), each token only where the head puts its chance of being
        accepted at min_draft_prob or more (the price of a draft row). With token_room (the
        tokens the request may still commit, this round's included; 0: its next round needs
        more than this verdict, e.g. a draft worker), the replica may run the session's next rounds by itself (`run_ahead`,
        target_worker.run_ahead): `running_ahead` then says so, and `next_ahead` gives each."""
        wanted = features is not None
        ahead = self.run_ahead if (self.batching and self.streams and not wanted and token_room > 1) else 0
        # Chunked prefill: a long run of committed tokens (a new prompt, or the whole context
        # again after a fault, a move or an eviction) goes prefill_chunk tokens per step, so
        # it never makes one step long for every other request in it. The target's answers
        # to the partial prefixes are not used. A resend found mid-round starts the chunks
        # over (Rechunk), a bounded number of times; then it goes whole.
        rechunks = 0
        while True:
            chunk = self.prefill_chunk if self.batching and rechunks <= self.retries else None
            try:
                while chunk is not None and len(committed) - min(session.sent, len(committed) - 1) > chunk + 1:
                    end = min(session.sent, len(committed) - 1) + chunk
                    partial = await self._round(
                        session, committed[:end],
                        lambda delta: target_pb2.VerifyRequest(delta=delta, return_features=wanted), "Verify",
                        chunk)
                    if wanted:
                        features.put(partial.feature_start, partial.features)
                # Registered before the round goes: what the replica runs ahead may come at once.
                run = _AheadRun(stream_ends=self._stream_ends, left=ahead) if ahead else None
                if run is not None:
                    self._runs[session.session_id] = run
                verdict = await self._round(
                    session, committed,
                    lambda delta: target_pb2.VerifyRequest(delta=delta, draft_tokens=drafts, sampling=sampling,
                                                           return_features=wanted, draft_next=draft_next,
                                                           min_draft_prob=min_draft_prob,
                                                           run_ahead=ahead, token_room=token_room,
                                                           stop_token_ids=stop_ids),
                    "Verify", chunk)
            except Rechunk:
                rechunks += 1
                continue
            except BaseException:
                self._runs.pop(session.session_id, None)
                raise
            break
        if run is not None:
            # A stream that ended since the round went may have carried the verdict, and its
            # run with it (a stream to another replica ending costs a run, nothing more).
            if (verdict.run_id and self._runs.get(session.session_id) is run
                    and self._stream_ends == run.stream_ends):
                run.run_id, run.address = verdict.run_id, session.replica
                self._sends_no_round(session)
            else:
                self._runs.pop(session.session_id, None)
        if wanted:
            features.put(verdict.feature_start, verdict.features)
        return verdict

    # --- rounds a replica runs ahead (target_worker.run_ahead) ---------------------------

    def running_ahead(self, session: WorkerSession) -> bool:
        """Whether the session's replica runs its next round by itself (next_ahead gives it)."""
        run = self._runs.get(session.session_id)
        return run is not None and run.run_id != 0

    def run_grant(self, session: WorkerSession) -> int:
        """Rounds to add to the session's run now (change_run's more_rounds): once half of
        what it may run ahead of the rounds received here is used, enough to make it whole
        again, so a run this coordinator keeps up with does not end for want of rounds (its
        session would then miss the replica's next steps while its own round travels); 0
        otherwise."""
        run = self._runs.get(session.session_id)
        if run is None or not run.run_id or run.left > self.run_ahead // 2:
            return 0
        return self.run_ahead - run.left

    def change_run(self, session: WorkerSession, draft_next: int, min_draft_prob: float = 0.0,
                   more_rounds: int = 0) -> bool:
        """Asks the session's replica to draft `draft_next` tokens per block, at
        `min_draft_prob` (verify), from the run's next round on, and lets the run go
        `more_rounds` rounds further (RunChange, sent in the background); False where it
        cannot be sent. The changes asked for one replica while the event loop runs what is
        ready go together, one message (a step's verdicts wake their requests together,
        and each may top its run up)."""
        run = self._runs.get(session.session_id)
        stream = self._streams.get(run.address) if run is not None and run.run_id else None
        if stream is None or stream.unsupported:
            return False
        run.left += more_rounds
        change = target_pb2.RunChange(session_id=session.session_id, run_id=run.run_id, draft_next=draft_next,
                                      min_draft_prob=min_draft_prob, more_rounds=more_rounds)
        waiting = self._changes.get(stream)
        if waiting is None:
            waiting = self._changes[stream] = []
            asyncio.get_running_loop().call_soon(self._send_changes, stream, run.address)
        waiting.append(change)
        return True

    def _send_changes(self, stream: StepStream, address: str) -> None:
        """Sends the run changes waiting for `stream`, as one message."""
        changes = self._changes.pop(stream, [])

        async def send() -> None:
            try:
                await stream.step(target_pb2.VerifyBatchRequest(run_changes=changes), self.call_timeout_s)
            except (grpc.aio.AioRpcError, StreamUnsupported) as exc:  # the runs end with their stream
                log.debug("%d run changes on %s failed: %s", len(changes), address, exc)

        task = asyncio.get_running_loop().create_task(send())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def end_run(self, session: WorkerSession) -> None:
        """Waits for no more rounds run ahead for the session (its next round is sent)."""
        self._runs.pop(session.session_id, None)

    async def next_ahead(self, session: WorkerSession, committed: int,
                         wait: bool = True) -> target_pb2.Continued | None:
        """The next round the session's replica ran by itself, continuing the `committed`
        tokens held here, its verdict counted in the session's state as a round's would be;
        None where the run ended without one (the stream broke, the round failed or lost the
        session, it continued another sequence, nothing came in time): the session's next
        round is then sent as usual. wait=False: only a round already here, else None with
        the run going on (`running_ahead`). A round is waited for at most the call's
        deadline — or, where this pool hedges, the hedge delay: a round sent then can be
        hedged, and ends the run."""
        run = self._runs.get(session.session_id)
        if run is None or not run.run_id:
            return None
        loop = asyncio.get_running_loop()
        began = loop.time()
        timeout = self.call_timeout_s
        hedge = self.hedger.delay(1) if self.hedger is not None else None
        if hedge is not None:
            timeout = min(timeout, hedge)
        if session.deadline is not None:
            timeout = min(timeout, max(0.001, session.deadline - began))
        while True:
            if not run.arrived:
                if not wait:
                    return None
                left = began + timeout - loop.time()
                if left <= 0 or not await run.arrival(left):
                    log.info("no round run ahead for session %s on %s within %.3g s: sending its next round",
                             session.session_id, run.address, timeout)
                    break
            got = run.arrived.popleft()
            if got is None:
                break  # the stream it ran on ended
            address, item = got
            if item.run_id != run.run_id or address != run.address:
                continue  # an earlier run's, or another replica's
            kind = item.result.WhichOneof("result")
            if kind != "verdict":
                if kind == "resync":  # the replica lost the session: resent from what it holds
                    session.resyncs += 1
                    session.sent = min(session.sent, item.result.resync.cached_len)
                break
            if item.context_len != committed:  # never expected: resend it all
                log.warning("session %s: a round run ahead on %s continued %d tokens, not the %d committed",
                            session.session_id, address, item.context_len, committed)
                session.sent = 0
                break
            if item.result.verdict.run_id != run.run_id:
                self._runs.pop(session.session_id, None)  # the run's last round
            run.left -= 1
            session.sent = committed
            session.seconds += loop.time() - began
            session.wire_bytes += item.ByteSize()
            return item
        if self._runs.get(session.session_id) is run:
            del self._runs[session.session_id]
        return None

    def _unsolicited(self, address: str, response) -> None:
        if response.step_s > 0:  # a step that carried only rounds run ahead
            self._observe_step(address, response, response.ahead_rounds, response.ahead_drafts,
                               response.ahead_drafting, response.ahead_head_rounds)
        for item in response.continued:
            run = self._runs.get(item.session_id)
            if run is not None:
                run.put((address, item))

    def _stream_ended(self, address: str) -> None:
        self._stream_ends += 1
        for run in self._runs.values():
            if run.address == address:
                run.put(None)


@dataclass
class _AheadRun:
    """A session whose replica may run its rounds ahead: what it sent, as it arrives."""

    # (address, Continued) as they arrived, None where a stream ended; `waiter`: the request
    # awaiting the next one. Not an asyncio.Queue: a wait with a deadline on one costs a task.
    arrived: deque = field(default_factory=deque)
    waiter: asyncio.Future | None = None
    run_id: int = 0  # 0: its first round is not answered yet
    address: str | None = None
    stream_ends: int = 0  # TargetClient._stream_ends when it began
    left: int = 0  # rounds the replica may still run beyond those received here

    def put(self, item) -> None:
        self.arrived.append(item)
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(True)

    async def arrival(self, timeout_s: float) -> bool:
        """Waits up to timeout_s for something to arrive; whether it did."""
        loop = asyncio.get_running_loop()
        waiter = self.waiter = loop.create_future()
        timer = loop.call_later(timeout_s, lambda: waiter.done() or waiter.set_result(False))
        try:
            return await waiter
        finally:
            timer.cancel()
            self.waiter = None
