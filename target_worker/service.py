"""The target worker's gRPC servicer: parse, hand to the Verifier, map the result."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import grpc

from specdec import logs, metrics
from specdec.config import WorkerConfig
from specdec.errors import FailedPrecondition, InvalidArgument
from specdec.models import load_model
from specdec.runtime.load import paged_pool_bytes, serving_lm
from specdec.runtime.precision import serving_dtype
from specdec.sampling import Sampling
from specdec.serving import (
    ModelThread,
    RunningServer,
    start_server,
    start_worker_upkeep,
    step_and_observe,
)
from specdec.sessions import Resync, SessionStore
from specdec.v1 import common_pb2, target_pb2, target_pb2_grpc
from specdec.worker_info import (
    DEFAULT_MAX_BATCH_ROUNDS,
    SessionWorkerRpcs,
    model_info,
    round_error,
)
from target_worker.head import load_inline_head
from target_worker.kernels.ops import paged_attention
from target_worker.run_ahead import RunsAhead
from target_worker.verify import Round, Verifier

log = logging.getLogger(__name__)
SERVICE_NAME = target_pb2.DESCRIPTOR.services_by_name["TargetWorker"].full_name


class TargetWorkerServicer(SessionWorkerRpcs, target_pb2_grpc.TargetWorkerServicer):
    kind = "target"

    def __init__(self, verifier: Verifier, info: common_pb2.WorkerInfo, thread: ModelThread | None = None):
        self.verifier = verifier
        self.store = verifier.store
        self._info = info
        self.thread = thread or ModelThread("target")
        self.max_batch_rounds = info.max_batch_rounds or DEFAULT_MAX_BATCH_ROUNDS
        self.runs = RunsAhead(self._parse, self._run, self._answer, self._result, self.max_batch_rounds)

    async def Verify(self, request: target_pb2.VerifyRequest,
                     context: grpc.aio.ServicerContext) -> target_pb2.VerifyResponse:
        delta = request.delta
        logs.request_id.set(logs.metadata_request_id(context.invocation_metadata()))
        evictions = self.store.evictions
        with metrics.worker_call("target", "Verify"):
            result = await self.thread.run(
                self.verifier.verify, delta.session_id, delta.start, list(delta.tokens), list(request.draft_tokens),
                Sampling.from_proto(request.sampling if request.HasField("sampling") else None),
                request.return_features, request.draft_next,
            )
        log.debug("verify %s: start %d, %d new tokens, %d drafts -> %s", delta.session_id, delta.start,
                  len(delta.tokens), len(request.draft_tokens), result)
        # The store belongs to the model thread: read it there, never from the event loop.
        await self.thread.run(metrics.observe_store, "target", self.store, evictions)
        if isinstance(result, Resync):
            metrics.WORKER_RESYNCS.labels("target").inc()
            return target_pb2.VerifyResponse(resync=common_pb2.ResyncRequired(cached_len=result.cached_len))
        return target_pb2.VerifyResponse(verdict=_verdict(result))


    async def VerifyBatch(self, request: target_pb2.VerifyBatchRequest,
                          context: grpc.aio.ServicerContext) -> target_pb2.VerifyBatchResponse:
        # run_changes concern runs, which only VerifyStream has.
        rounds = self._parse(request)
        outcome = await self._run(rounds)
        return self._answer(request.rounds, outcome.results, outcome)

    def _parse(self, request: target_pb2.VerifyBatchRequest) -> list[Round]:
        if len(request.rounds) > self.max_batch_rounds:
            raise InvalidArgument(f"rounds: {len(request.rounds)} exceeds the limit of {self.max_batch_rounds}")
        return [Round(r.delta.session_id, r.delta.start, list(r.delta.tokens), list(r.draft_tokens),
                      Sampling.from_proto(r.sampling if r.HasField("sampling") else None), r.return_features,
                      r.draft_next, r.min_draft_prob)
                for r in request.rounds]

    async def _run(self, rounds: list[Round]):
        """One step over `rounds` on the model thread (BatchOutcome)."""
        with metrics.worker_call("target", "VerifyBatch", len(rounds)):
            outcome = await self.thread.run(step_and_observe, self.verifier.verify_batch, rounds, "target", self.store)
        metrics.observe_batch("target", len(rounds), outcome.rows)
        log.debug("verify batch: %d rounds, %d rows, %.1f ms", len(rounds), outcome.rows, outcome.step_s * 1e3)
        return outcome

    def _answer(self, requests, results: list, outcome) -> target_pb2.VerifyBatchResponse:
        """The step's answer to `requests` (VerifyRequest), whose results are `results`."""
        response = target_pb2.VerifyBatchResponse(step_s=outcome.step_s, rows=outcome.rows, draft_s=outcome.draft_s)
        for r, result in zip(requests, results):
            # Each round is logged under its own request's id (the call carries many).
            logs.request_id.set(r.delta.request_id)
            log.debug("verify %s: start %d, %d new tokens, %d drafts -> %s", r.delta.session_id, r.delta.start,
                      len(r.delta.tokens), len(r.draft_tokens), result)
            response.results.append(self._result(result, r.delta.request_id))
        logs.request_id.set("")
        return response

    @staticmethod
    def _result(result, request_id: str) -> target_pb2.VerifyResponse:
        """One round's result (Verdict, Resync or the exception it raised) as sent."""
        if isinstance(result, Resync):
            metrics.WORKER_RESYNCS.labels("target").inc()
            return target_pb2.VerifyResponse(resync=common_pb2.ResyncRequired(cached_len=result.cached_len))
        if isinstance(result, BaseException):
            return target_pb2.VerifyResponse(error=round_error(result, request_id))
        return target_pb2.VerifyResponse(verdict=_verdict(result))

    async def VerifyStream(self, request_iterator: AsyncIterator[target_pb2.VerifyBatchRequest],
                           context: grpc.aio.ServicerContext) -> None:
        # Each step is a VerifyBatch call's work, answered on the stream (specdec.step_streams),
        # with the rounds this worker runs ahead of the coordinator (target_worker.run_ahead).
        await self.streams.serve(context, self.VerifyBatch, target_pb2.VerifyBatchResponse, ahead=self.runs)

    async def Release(self, request: common_pb2.ReleaseRequest,
                      context: grpc.aio.ServicerContext) -> common_pb2.ReleaseResponse:
        self.runs.end(request.session_id)
        return await super().Release(request, context)


def _verdict(result) -> target_pb2.Verdict:
    return target_pb2.Verdict(accepted=result.accepted, next_token=result.next_token, cached_len=result.cached_len,
                              compute_s=result.compute_s, feature_start=result.feature_start,
                              features=result.features, next_drafts=result.next_drafts,
                              extra_tokens=result.extra)


def build_servicer(config: WorkerConfig, model=None, tokenizer=None, head=None) -> TargetWorkerServicer:
    """Loads the model (unless given one), and the draft head named by config.head (or the
    given EagleHead) to run next to it (target_worker.head), and wires the verifier. Loading
    runs on the model thread, like every forward pass after it (see ModelThread.call)."""
    thread = ModelThread("target")

    def load():
        loaded, loaded_tokenizer = (model, tokenizer) if model is not None else load_model(
            config.model, dtype=serving_dtype(config.dtype, config.device), device=config.device)
        inline = load_inline_head(config.head, loaded, head, fast=config.cpu_fast_path,
                                  min_chain_prob=config.min_chain_prob, min_alt_prob=config.min_alt_prob)
        info = model_info(config.model, loaded, loaded_tokenizer)
        lm = serving_lm(loaded, config.cpu_fast_path, config.kv_cache, max_cache_bytes=paged_pool_bytes(config),
                        kv_memory_fraction=config.kv_memory_fraction, block_size=config.kv_block_size,
                        max_batch=config.max_batch_rounds, cuda_graphs=config.cuda_graphs,
                        attention=paged_attention, namespace=info.fingerprint)
        return lm, info, inline

    lm, info, inline = thread.call(load)
    info.max_batch_rounds = config.max_batch_rounds
    info.feature_size = lm.feature_size
    bytes_per_token = lm.bytes_per_token
    if inline is not None:
        if inline.hidden_size != lm.feature_size:
            raise FailedPrecondition(f"head {inline.name!r} reads features of width {inline.hidden_size}, but "
                                     f"target {config.model!r} has width {lm.feature_size}: it was trained for "
                                     "another target")
        missing = [i for i in inline.aux_layers if i >= lm.num_layers]
        if missing:
            raise FailedPrecondition(f"head {inline.name!r} reads the outputs of layers {missing}, but target "
                                     f"{config.model!r} has {lm.num_layers} layers: it was trained for another target")
        info.head = inline.name
        info.head_fingerprint = inline.fingerprint
        bytes_per_token += inline.bytes_per_token
    store = SessionStore(config.max_sessions, config.max_cache_bytes, bytes_per_token, config.session_ttl_s)
    thread.call(lm.bind, store)
    return TargetWorkerServicer(Verifier(lm, store, config.max_k, inline), info, thread)


async def serve(config: WorkerConfig, servicer: TargetWorkerServicer | None = None) -> RunningServer:
    servicer = servicer or build_servicer(config)
    running = await start_server(
        config.server,
        lambda server: target_pb2_grpc.add_TargetWorkerServicer_to_server(servicer, server),
        [SERVICE_NAME],
        on_stop=servicer.thread.shutdown,
    )
    running.companions.append(servicer.streams)  # step streams drain with the server
    start_worker_upkeep(running, servicer.thread, servicer.store, "target", config.stall_timeout_s)
    return running
