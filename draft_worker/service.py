"""The draft worker's gRPC servicer: parse, hand to the Proposer, map the result."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import grpc

from draft_worker.drafters.model import ModelDrafter
from draft_worker.drafters.ngram import NgramDrafter
from draft_worker.propose import Proposer, Request
from specdec import eagle, logs, metrics
from specdec.config import WorkerConfig
from specdec.eagle.checkpoint import is_eagle_dir
from specdec.eagle.batched import BatchedEagleDrafter
from specdec.eagle.policy import EagleDrafter
from specdec.errors import FailedPrecondition, InvalidArgument
from specdec.models import NGRAM, load_model, load_tokenizer, vocab_hash, weights_dtype
from specdec.ngram import ngram_bytes_per_token
from specdec.runtime.load import paged_pool_bytes, serving_lm
from specdec.runtime.precision import serving_dtype
from specdec.serving import (
    ModelThread,
    RunningServer,
    start_server,
    start_worker_upkeep,
    step_and_observe,
)
from specdec.sessions import Resync, SessionStore
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc
from specdec.worker_info import (
    DEFAULT_MAX_BATCH_ROUNDS,
    SessionWorkerRpcs,
    model_info,
    round_error,
)

log = logging.getLogger(__name__)
SERVICE_NAME = draft_pb2.DESCRIPTOR.services_by_name["DraftWorker"].full_name


class DraftWorkerServicer(SessionWorkerRpcs, draft_pb2_grpc.DraftWorkerServicer):
    kind = "draft"

    def __init__(self, proposer: Proposer, info: common_pb2.WorkerInfo, thread: ModelThread | None = None):
        self.proposer = proposer
        self.store = proposer.store
        self._info = info
        self.thread = thread or ModelThread("draft")
        self.max_batch_rounds = info.max_batch_rounds or DEFAULT_MAX_BATCH_ROUNDS

    async def Propose(self, request: draft_pb2.ProposeRequest,
                      context: grpc.aio.ServicerContext) -> draft_pb2.ProposeResponse:
        delta = request.delta
        logs.request_id.set(logs.metadata_request_id(context.invocation_metadata()))
        evictions = self.store.evictions
        with metrics.worker_call("draft", "Propose"):
            result = await self.thread.run(
                self.proposer.propose, delta.session_id, delta.start, list(delta.tokens), request.k,
                (request.feature_start, request.features), request.min_draft_prob,
            )
        log.debug("propose %s: start %d, %d new tokens, k %d -> %s", delta.session_id, delta.start,
                  len(delta.tokens), request.k, result)
        # The store belongs to the model thread: read it there, never from the event loop.
        await self.thread.run(metrics.observe_store, "draft", self.store, evictions)
        if isinstance(result, Resync):
            metrics.WORKER_RESYNCS.labels("draft").inc()
            return draft_pb2.ProposeResponse(resync=common_pb2.ResyncRequired(cached_len=result.cached_len))
        return draft_pb2.ProposeResponse(block=draft_pb2.DraftBlock(tokens=result.tokens, compute_s=result.compute_s))


    async def ProposeBatch(self, request: draft_pb2.ProposeBatchRequest,
                           context: grpc.aio.ServicerContext) -> draft_pb2.ProposeBatchResponse:
        if len(request.rounds) > self.max_batch_rounds:
            raise InvalidArgument(f"rounds: {len(request.rounds)} exceeds the limit of {self.max_batch_rounds}")
        requests = [Request(r.delta.session_id, r.delta.start, list(r.delta.tokens), r.k, (r.feature_start, r.features),
                            r.min_draft_prob)
                    for r in request.rounds]
        with metrics.worker_call("draft", "ProposeBatch", len(requests)):
            outcome = await self.thread.run(step_and_observe, self.proposer.propose_batch, requests, "draft", self.store)
        metrics.observe_batch("draft", len(requests))
        response = draft_pb2.ProposeBatchResponse(step_s=outcome.step_s)
        for r, result in zip(request.rounds, outcome.results):
            # Each round is logged under its own request's id (the call carries many).
            logs.request_id.set(r.delta.request_id)
            log.debug("propose %s: start %d, %d new tokens, k %d -> %s", r.delta.session_id, r.delta.start,
                      len(r.delta.tokens), r.k, result)
            item = response.results.add()
            if isinstance(result, Resync):
                metrics.WORKER_RESYNCS.labels("draft").inc()
                item.resync.cached_len = result.cached_len
            elif isinstance(result, BaseException):
                item.error.CopyFrom(round_error(result, r.delta.request_id))
            else:
                item.block.CopyFrom(draft_pb2.DraftBlock(tokens=result.tokens, compute_s=result.compute_s))
        logs.request_id.set("")
        log.debug("propose batch: %d rounds, %.1f ms", len(requests), outcome.step_s * 1e3)
        return response

    async def ProposeStream(self, request_iterator: AsyncIterator[draft_pb2.ProposeBatchRequest],
                            context: grpc.aio.ServicerContext) -> None:
        # Each step is a ProposeBatch call's work, answered on the stream (specdec.step_streams).
        await self.streams.serve(context, self.ProposeBatch, draft_pb2.ProposeBatchResponse)


def build_servicer(config: WorkerConfig, model=None, tokenizer=None) -> DraftWorkerServicer:
    """Builds the drafter named by config.model (loading a model unless given one, on the
    model thread that runs it afterwards: see ModelThread.call)."""
    thread = ModelThread("draft")
    lm = None  # a model drafter's CausalLM
    if config.model == NGRAM and model is None:
        drafter = NgramDrafter()
        info = common_pb2.WorkerInfo(model=NGRAM, fingerprint=drafter.fingerprint)
        bytes_per_token = ngram_bytes_per_token(drafter.max_ngram, drafter.min_ngram)
    elif isinstance(model, eagle.EagleHead) or (model is None and is_eagle_dir(config.model)):
        def load_head():
            # A head reads the target's embeddings: loading it loads them (by its config's
            # target spec, on this worker's device, in its dtype), and the target's tokenizer
            # is the one it shares.
            head = model if model is not None else eagle.load(
                config.model, dtype=serving_dtype(config.dtype, config.device), device=config.device)
            if head.config.aux_layers:
                raise FailedPrecondition(
                    f"{config.model!r} reads the target's layers {head.config.aux_layers} besides its final hidden "
                    "states, which only the target worker has: run it there (specdec serve target --head, "
                    "specdec up --draft HEAD)")
            loaded_tokenizer = tokenizer if tokenizer is not None else load_tokenizer(head.config.target)
            info = common_pb2.WorkerInfo(model=config.model, feature_size=head.config.hidden_size,
                                         model_vocab_size=int(head.embed.shape[0]),
                                         max_context=head.config.max_position_embeddings,
                                         tokenizer_vocab_size=len(loaded_tokenizer),
                                         vocab_hash=vocab_hash(loaded_tokenizer),
                                         fingerprint=eagle.fingerprint(head), dtype=weights_dtype(head))
            log.info("serving head %s: %s weights, fingerprint %s", config.model, info.dtype, info.fingerprint)
            return head, info

        head, info = thread.call(load_head)
        if config.cpu_fast_path:
            head = thread.call(lambda: eagle.fast_cpu_head(head))
        # Every session of a step drafted together (specdec.eagle.batched).
        drafter = BatchedEagleDrafter(EagleDrafter(config.model, head, min_chain_prob=config.min_chain_prob))
        bytes_per_token = drafter.bytes_per_token
    else:
        def load():
            loaded, loaded_tokenizer = (model, tokenizer) if model is not None else load_model(
                config.model, dtype=serving_dtype(config.dtype, config.device), device=config.device)
            info = model_info(config.model, loaded, loaded_tokenizer)
            lm = serving_lm(loaded, config.cpu_fast_path, config.kv_cache, max_cache_bytes=paged_pool_bytes(config),
                            kv_memory_fraction=config.kv_memory_fraction, block_size=config.kv_block_size,
                            max_batch=config.max_batch_rounds, cuda_graphs=config.cuda_graphs,
                            namespace=info.fingerprint)
            return lm, info

        lm, info = thread.call(load)
        drafter = ModelDrafter(config.model, lm)
        bytes_per_token = lm.bytes_per_token
    info.max_batch_rounds = config.max_batch_rounds
    store = SessionStore(config.max_sessions, config.max_cache_bytes, bytes_per_token, config.session_ttl_s)
    if lm is not None:
        thread.call(lm.bind, store)
    return DraftWorkerServicer(Proposer(drafter, store, config.max_k), info, thread)


async def serve(config: WorkerConfig, servicer: DraftWorkerServicer | None = None) -> RunningServer:
    servicer = servicer or build_servicer(config)
    running = await start_server(
        config.server,
        lambda server: draft_pb2_grpc.add_DraftWorkerServicer_to_server(servicer, server),
        [SERVICE_NAME],
        on_stop=servicer.thread.shutdown,
    )
    running.companions.append(servicer.streams)  # step streams drain with the server
    start_worker_upkeep(running, servicer.thread, servicer.store, "draft", config.stall_timeout_s)
    return running
