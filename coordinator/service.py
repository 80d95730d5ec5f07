"""The coordinator's gRPC servicer and its start-up: connect to the workers, check they
share a tokenizer, then serve Generate."""

from __future__ import annotations

import asyncio
import logging

import grpc

from coordinator.rounds import RoundRunner
from coordinator.validation import plan_request, render_prompt
from coordinator.pool import resolve_dns
from coordinator.workers import DraftClient, TargetClient
from specdec import metrics
from specdec.config import CoordinatorConfig
from specdec.errors import SpecdecError, Unavailable
from specdec.models import load_tokenizer, vocab_hash
from specdec.serving import RunningServer, start_server
from specdec.v1 import coordinator_pb2, coordinator_pb2_grpc
from specdec.worker_info import check_compatible

log = logging.getLogger(__name__)

SERVICE_NAME = coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"].full_name
WORKER_STARTUP_TIMEOUT_S = 600.0
DRAFT_STARTUP_TIMEOUT_S = 30.0


class CoordinatorServicer(coordinator_pb2_grpc.CoordinatorServicer):
    def __init__(self, config: CoordinatorConfig, runner: RoundRunner, tokenizer,
                 eos_ids: frozenset[int], max_context: int, vocab_size: int):
        self.config = config
        self.runner = runner
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.max_context = max_context
        self.vocab_size = vocab_size

    async def Generate(self, request: coordinator_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext):
        metrics.COORDINATOR_ACTIVE.inc()
        status = "OK"
        try:
            prompt_ids = await asyncio.to_thread(render_prompt, request, self.tokenizer, self.vocab_size)
            plan = plan_request(request, prompt_ids, self.config, self.eos_ids, self.max_context)
            async for response in self.runner.run(plan):
                yield response
        except SpecdecError as exc:
            status = exc.code.name
            raise
        except grpc.aio.AioRpcError as exc:
            status = exc.code().name
            raise
        except asyncio.CancelledError:
            status = "CANCELLED"
            raise
        except Exception:
            status = "INTERNAL"
            raise
        finally:
            metrics.COORDINATOR_ACTIVE.dec()
            metrics.REQUESTS.labels(status).inc()


async def connect(config: CoordinatorConfig, tokenizer=None, startup_timeout_s: float = WORKER_STARTUP_TIMEOUT_S,
                  draft_startup_timeout_s: float = DRAFT_STARTUP_TIMEOUT_S, resolver=resolve_dns) -> CoordinatorServicer:
    """Waits for a target replica, refuses to start (FailedPrecondition) when the draft's,
    the target's and the coordinator's tokenizers disagree, and builds the servicer. A
    draft that does not answer within draft_startup_timeout_s is not waited for: requests
    decode with the target alone until a draft replica appears (and passes the same check)."""
    tokenizer = tokenizer or await asyncio.to_thread(load_tokenizer, config.tokenizer)
    client_args = dict(timeout_s=config.worker_timeout_s, retries=config.worker_retries,
                       backoff_s=config.retry_backoff_s, max_message_bytes=config.server.max_message_bytes,
                       resolve_interval_s=config.resolve_interval_s, health_interval_s=config.health_interval_s,
                       resolver=resolver)
    target = TargetClient(config.target_addr, **client_args)
    draft = DraftClient(config.draft_addr, **client_args) if config.draft_addr else None
    try:
        target_info = await target.info(startup_timeout_s)
        draft_info = None
        if draft is not None:
            try:
                draft_info = await draft.info(draft_startup_timeout_s)
            except Unavailable as exc:
                log.warning("%s; starting without speculation until a draft replica appears", exc)
        check_compatible(target_info, draft_info, len(tokenizer), vocab_hash(tokenizer))
        target.accepted_vocab_hashes = {target_info.vocab_hash}
        if draft is not None:
            # A model draft must share the target's vocabulary; the n-gram drafter has none.
            draft.accepted_vocab_hashes = {target_info.vocab_hash, ""}
        for client in (target, draft):
            if client is not None:
                await client.start()
    except BaseException:
        for client in (target, draft):
            if client is not None:
                await client.close()
        raise
    log.info("target %s at %s; draft %s at %s", target_info.model, config.target_addr,
             draft_info.model if draft_info else None, config.draft_addr)
    runner = RoundRunner(target, draft, tokenizer, target_info.model_vocab_size)
    return CoordinatorServicer(config, runner, tokenizer, frozenset(target_info.eos_token_ids),
                               target_info.max_context, target_info.model_vocab_size)


async def serve(config: CoordinatorConfig, servicer: CoordinatorServicer | None = None) -> RunningServer:
    servicer = servicer or await connect(config)
    return await start_server(
        config.server,
        lambda server: coordinator_pb2_grpc.add_CoordinatorServicer_to_server(servicer, server),
        [SERVICE_NAME],
    )
