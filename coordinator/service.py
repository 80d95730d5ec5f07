"""The coordinator's gRPC servicer and its start-up: connect to the workers, check they
share a tokenizer, then serve Generate."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections import OrderedDict

import grpc
from asyncio_throttle import Throttler

from coordinator.rounds import RoundRunner
from coordinator.validation import plan_request, render_prompt, request_id_of
from coordinator.pool import resolve_dns
from coordinator.workers import DraftClient, TargetClient, model_shape
from specdec import logs, metrics
from specdec.security.auth import AuthInterceptor, TokenSet, client_identity
from specdec.config import CoordinatorConfig
from specdec.errors import FailedPrecondition, ResourceExhausted, SpecdecError, Unavailable
from specdec.models import load_tokenizer, vocab_hash
from specdec.serving import RunningServer, start_server
from specdec.v1 import coordinator_pb2, coordinator_pb2_grpc
from specdec.worker_info import check_compatible

log = logging.getLogger(__name__)

SERVICE_NAME = coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"].full_name
RETRY_AFTER_S = 1
MAX_TRACKED_CLIENTS = 10_000
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
        self.active = 0
        self.per_client: dict[str, int] = {}
        self.throttlers: OrderedDict[str, Throttler] = OrderedDict()

    async def _throttle(self, client: str, context: grpc.aio.ServicerContext) -> None:
        """Per-client request rate (asyncio-throttle): a short wait, then RESOURCE_EXHAUSTED."""
        rate = self.config.rate_limit_per_client
        if rate <= 0:
            return
        throttler = self.throttlers.get(client)
        if throttler is None:
            throttler = self.throttlers[client] = Throttler(rate_limit=max(1, int(rate)), period=max(1, int(rate)) / rate)
            while len(self.throttlers) > MAX_TRACKED_CLIENTS:
                self.throttlers.popitem(last=False)
        self.throttlers.move_to_end(client)
        try:
            await asyncio.wait_for(throttler.acquire(), timeout=self.config.rate_limit_wait_s)
        except asyncio.TimeoutError:
            retry = max(1, round(1 / rate))
            context.set_trailing_metadata((("retry-after-s", str(retry)),))
            metrics.REQUESTS.labels("RESOURCE_EXHAUSTED").inc()
            raise ResourceExhausted(f"this client exceeds {rate:g} requests/s; retry in {retry} s") from None

    def _admit(self, client: str, context: grpc.aio.ServicerContext) -> None:
        """Backpressure: refuse (RESOURCE_EXHAUSTED, with a retry hint) beyond the limits."""
        if self.active >= self.config.max_concurrent_requests:
            limit = f"the coordinator serves {self.config.max_concurrent_requests} requests at once"
        elif self.per_client.get(client, 0) >= self.config.max_streams_per_client:
            limit = f"this client already holds {self.config.max_streams_per_client} streams"
        else:
            self.active += 1
            self.per_client[client] = self.per_client.get(client, 0) + 1
            return
        context.set_trailing_metadata((("retry-after-s", str(RETRY_AFTER_S)),))
        metrics.REQUESTS.labels("RESOURCE_EXHAUSTED").inc()
        raise ResourceExhausted(f"{limit}; retry in {RETRY_AFTER_S} s")

    def _leave(self, client: str) -> None:
        self.active -= 1
        self.per_client[client] -= 1
        if not self.per_client[client]:
            del self.per_client[client]

    async def Generate(self, request: coordinator_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext):
        client = client_identity(context)
        await self._throttle(client, context)
        self._admit(client, context)
        metrics.COORDINATOR_ACTIVE.inc()
        status = "OK"
        try:
            request_id = request_id_of(request, logs.metadata_request_id(context.invocation_metadata()))
            logs.request_id.set(request_id)
            prompt_ids = await asyncio.to_thread(render_prompt, request, self.tokenizer, self.vocab_size,
                                                 self.config.max_prompt_tokens)
            plan = plan_request(request, prompt_ids, self.config, self.eos_ids, self.max_context, request_id)
            remaining = context.time_remaining()
            if remaining is not None:  # the client's deadline bounds every worker call too
                plan = dataclasses.replace(plan, deadline=asyncio.get_running_loop().time() + remaining)
            log.info("request admitted: %d prompt tokens, max_new_tokens %d, k %d, %s", len(prompt_ids),
                     plan.max_new_tokens, plan.k, "greedy" if plan.sampling.greedy else "sampling")
            async for response in self.runner.run(plan):
                if response.finish_reason:
                    log.info("request finished: %s, %d tokens, %d rounds, acceptance %.2f",
                             coordinator_pb2.FinishReason.Name(response.finish_reason),
                             response.stats.generated_tokens, response.stats.rounds, response.stats.acceptance_rate)
                yield response
        except SpecdecError as exc:
            status = exc.code.name
            raise
        except grpc.aio.AioRpcError as exc:
            status = exc.code().name
            raise
        except (asyncio.CancelledError, GeneratorExit):
            status = "CANCELLED"
            raise
        except Exception:
            status = "INTERNAL"
            raise
        finally:
            self._leave(client)
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
                       resolver=resolver, tls=config.worker_tls, batching=config.batching,
                       step_token_budget=config.step_token_budget, max_batch_rounds=config.max_batch_rounds)
    target = TargetClient(config.target_addr, prefill_chunk=config.prefill_chunk_tokens, **client_args)
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
        if draft is not None:
            draft.target_feature_size = target_info.feature_size
            if draft_info is not None and draft_info.feature_size:
                if draft_info.feature_size != target_info.feature_size:
                    raise FailedPrecondition(
                        f"draft {draft_info.model!r} reads target features of width {draft_info.feature_size}, but "
                        f"target {target_info.model!r} returns width {target_info.feature_size or 'none'}: the "
                        "draft head was trained for another target")
                draft.feature_size = draft_info.feature_size
        target.head = target_info.head
        if target.head and draft is not None:
            log.info("the target worker runs draft head %s: the draft worker drafts only for target replicas "
                     "that run none", target.head)
        target.accepted_vocab_hashes = {target_info.vocab_hash}
        target.expected_shape = model_shape(target_info)
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
             f"head {target_info.head} (on the target worker)" if target_info.head else
             draft_info.model if draft_info else None, config.draft_addr)
    runner = RoundRunner(target, draft, tokenizer, target_info.model_vocab_size)
    return CoordinatorServicer(config, runner, tokenizer, frozenset(target_info.eos_token_ids),
                               target_info.max_context, target_info.model_vocab_size)


async def serve(config: CoordinatorConfig, servicer: CoordinatorServicer | None = None) -> RunningServer:
    servicer = servicer or await connect(config)
    tokens = TokenSet(config.auth_token_file, config.auth_tokens_env)
    if not tokens.enabled:
        log.warning("no --auth-token-file / SPECDEC_AUTH_TOKENS: the client API accepts every caller")
    return await start_server(
        config.server,
        lambda server: coordinator_pb2_grpc.add_CoordinatorServicer_to_server(servicer, server),
        [SERVICE_NAME],
        interceptors=[AuthInterceptor(tokens)] if tokens.enabled else None,
    )
