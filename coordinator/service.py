"""The coordinator's gRPC servicer and its start-up: connect to the workers, check they
share a tokenizer, then serve Generate."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import AsyncIterator

import grpc

from coordinator.admission import Admission
from coordinator.hedging import HedgePolicy
from coordinator.pool import EjectionPolicy, resolve_dns
from coordinator.rounds import RoundRunner
from coordinator.validation import plan_request, render_prompt, request_id_of
from coordinator.workers import DraftClient, TargetClient, model_shape
from specdec import logs, metrics
from specdec.config import CoordinatorConfig
from specdec.errors import FailedPrecondition, ResourceExhausted, SpecdecError, Unavailable
from specdec.models import load_tokenizer, vocab_hash
from specdec.security.auth import AuthInterceptor, TokenSet, client_identity
from specdec.serving import RunningServer, start_server
from specdec.v1 import coordinator_pb2, coordinator_pb2_grpc
from specdec.worker_info import check_compatible

log = logging.getLogger(__name__)

SERVICE_NAME = coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"].full_name
WORKER_STARTUP_TIMEOUT_S = 600.0
DRAFT_STARTUP_TIMEOUT_S = 30.0
# At the end of a drain, streams still running are ended this long before the grace period
# ends (at most a quarter of it), so the status reaches their clients before the server stops.
STREAM_END_MARGIN_S = 1.0
STREAM_ENDED_MESSAGE = ("the coordinator is shutting down: resume the request on another replica "
                        "(GenerateRequest.resume_token_ids)")


class CoordinatorServicer(coordinator_pb2_grpc.CoordinatorServicer):
    """Serves Generate. `generate` is the one path of every request, whichever front door
    it came through (this gRPC servicer, or the HTTP API in coordinator.openai_api): the
    same admission, limits, validation, logs and metrics."""

    def __init__(self, config: CoordinatorConfig, runner: RoundRunner, tokenizer,
                 eos_ids: frozenset[int], max_context: int, vocab_size: int, model_name: str = ""):
        self.config = config
        self.runner = runner
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.max_context = max_context
        self.vocab_size = vocab_size
        self.model_name = model_name
        self.admission = Admission(config)
        # Per-client limits key on tokens only when tokens are checked (specdec.security.auth).
        self.authenticated = bool(config.auth_token_file or config.auth_tokens_env.strip(" ,"))
        # The tasks serving gRPC Generate streams now, for ending them at the end of a drain.
        self._streams: set[asyncio.Task] = set()
        self._no_streams = asyncio.Event()
        self._no_streams.set()
        self._ending = False

    @property
    def active(self) -> int:
        """Requests being served now."""
        return self.admission.active

    def serving_targets(self) -> int:
        """Target replicas that pass their health checks now."""
        return len(self.runner.target.pool.healthy())

    async def generate(self, request: coordinator_pb2.GenerateRequest, client: str, metadata_request_id: str = "",
                       timeout_s: float | None = None) -> AsyncIterator[coordinator_pb2.GenerateResponse]:
        """Admits, validates and runs one request; yields its responses. `client` keys the
        per-client limits; `timeout_s` (the caller's deadline) bounds every worker call."""
        await self.admission.enter(client)
        metrics.COORDINATOR_ACTIVE.inc()
        metrics.vllm.running.inc()
        began = time.perf_counter()
        status = "OK"
        try:
            request_id = request_id_of(request, metadata_request_id)
            logs.request_id.set(request_id)
            prompt_ids = await asyncio.to_thread(render_prompt, request, self.tokenizer, self.vocab_size,
                                                 self.config.max_prompt_tokens)
            plan = plan_request(request, prompt_ids, self.config, self.eos_ids, self.max_context, request_id)
            if timeout_s is not None:  # the client's deadline bounds every worker call too
                plan = dataclasses.replace(plan, deadline=asyncio.get_running_loop().time() + timeout_s)
            log.info("request admitted: %d prompt tokens, max_new_tokens %d, k %d, %s", len(prompt_ids),
                     plan.max_new_tokens, plan.k, "greedy" if plan.sampling.greedy else "sampling")
            metrics.vllm.prompt_tokens.inc(len(prompt_ids))
            # Closed here, not when collected: a request that ends at a yield (its client
            # gone) frees its worker sessions and cancels its round ahead at once.
            async with contextlib.aclosing(self.runner.run(plan)) as responses:
                async for response in responses:
                    if response.finish_reason:
                        log.info("request finished: %s, %d tokens, %d rounds, acceptance %.2f",
                                 coordinator_pb2.FinishReason.Name(response.finish_reason),
                                 response.stats.generated_tokens, response.stats.rounds,
                                 response.stats.acceptance_rate)
                        metrics.vllm.finished(response.finish_reason, time.perf_counter() - began)
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
            self.admission.leave(client)
            metrics.COORDINATOR_ACTIVE.dec()
            metrics.vllm.running.dec()
            metrics.REQUESTS.labels(status).inc()

    async def Generate(self, request: coordinator_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext):
        task = asyncio.current_task()
        self._streams.add(task)
        self._no_streams.clear()
        try:
            async for response in self.generate(request, client_identity(context, self.authenticated),
                                                logs.metadata_request_id(context.invocation_metadata()),
                                                context.time_remaining()):
                yield response
        except asyncio.CancelledError:
            if not self._ending:
                raise
            task.uncancel()
            await context.abort(grpc.StatusCode.UNAVAILABLE, STREAM_ENDED_MESSAGE)
        except ResourceExhausted as exc:
            if exc.retry_after_s is not None:
                # gRPC's own hint (A6 client retries: grpc-retry-pushback-ms) and a plain one.
                context.set_trailing_metadata((
                    ("grpc-retry-pushback-ms", str(math.ceil(exc.retry_after_s * 1000))),
                    ("retry-after-s", str(math.ceil(exc.retry_after_s))),
                ))
            raise
        except Unavailable:
            # This coordinator already retried the workers for its bound: another attempt
            # at once would not do better. gRPC's retry pushback (A6: a negative value means
            # "do not retry") tells resuming clients so; a drain's end sends none.
            context.set_trailing_metadata((("grpc-retry-pushback-ms", "-1"),))
            raise
        finally:
            self._streams.discard(task)
            if not self._streams:
                self._no_streams.set()

    async def end_streams(self, after_s: float) -> None:
        """Waits up to `after_s` for the gRPC streams to finish, then ends those still
        running with UNAVAILABLE: a status clients resume from (resume_token_ids) on another
        replica, where a server stopping past its grace period would cancel them."""
        if not self._streams:
            return
        try:
            await asyncio.wait_for(self._no_streams.wait(), after_s)
        except TimeoutError:
            self._ending = True
            log.warning("drain: ending %d streams still running; their clients resume them", len(self._streams))
            for task in list(self._streams):
                task.cancel()


class StreamEnder:
    """A companion of the coordinator's gRPC server (serving.RunningServer.companions): at
    stop it gives the streams the grace period less a margin, then ends the rest with a
    status clients resume from, before the server's own grace ends."""

    def __init__(self, servicer: CoordinatorServicer):
        self.servicer = servicer

    async def stop(self, grace: float) -> None:
        await self.servicer.end_streams(max(0.0, grace - min(STREAM_END_MARGIN_S, grace / 4)))


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
                       resolver=resolver, batching=config.batching, streams=config.worker_streams,
                       step_token_budget=config.step_token_budget, max_batch_rounds=config.max_batch_rounds,
                       keepalive_s=config.worker_keepalive_s, keepalive_timeout_s=config.worker_keepalive_timeout_s,
                       ejection=EjectionPolicy(config.eject_after_failures, config.eject_base_s, config.eject_max_s,
                                               config.max_ejected_percent))
    target = TargetClient(config.target_addr, prefill_chunk=config.prefill_chunk_tokens,
                          run_ahead=config.run_ahead_rounds,
                          tls=config.worker_channel_tls("target"),
                          hedging=HedgePolicy(config.hedge_percentile, config.hedge_factor, config.hedge_min_s,
                                              config.hedge_max_share), **client_args)
    draft = (DraftClient(config.draft_addr, tls=config.worker_channel_tls("draft"), **client_args)
             if config.draft_addr else None)
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
        # The fleet's weights: a later replica serving others is refused (coordinator.workers).
        target.pin_weights(target_info)
        if draft is not None:
            # A model draft must share the target's vocabulary; the n-gram drafter has none.
            draft.accepted_vocab_hashes = {target_info.vocab_hash, ""}
            if draft_info is not None:  # else the first draft replica admitted pins them
                draft.pin_weights(draft_info)
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
    log.info("weights pinned: target %s %s%s; draft %s", target_info.dtype, target_info.fingerprint,
             f", head {target_info.head_fingerprint}" if target_info.head else "",
             draft_info.fingerprint if draft_info else "by the first draft replica admitted")
    runner = RoundRunner(target, draft, tokenizer, target_info.model_vocab_size)
    metrics.vllm.bind(config.served_model_name or target_info.model)
    return CoordinatorServicer(config, runner, tokenizer, frozenset(target_info.eos_token_ids),
                               target_info.max_context, target_info.model_vocab_size, target_info.model)


async def serve(config: CoordinatorConfig, servicer: CoordinatorServicer | None = None) -> RunningServer:
    """The coordinator's gRPC server and, when config.http_port is set, its HTTP API beside
    it (coordinator.openai_api), both draining together on stop."""
    http_socket = None
    if config.http_port is not None:  # bound first: a busy port fails the start at once
        from coordinator.openai_api.server import bind

        http_socket = bind(config.server.host, config.http_port)
    try:
        servicer = servicer or await connect(config)
    except BaseException:
        if http_socket is not None:
            http_socket.close()
        raise
    tokens = TokenSet(config.auth_token_file, config.auth_tokens_env)
    if not tokens.enabled:
        log.warning("no --auth-token-file / SPECDEC_AUTH_TOKENS: the client API accepts every caller")
    running = await start_server(
        config.server,
        lambda server: coordinator_pb2_grpc.add_CoordinatorServicer_to_server(servicer, server),
        [SERVICE_NAME],
        interceptors=[AuthInterceptor(tokens)] if tokens.enabled else None,
    )
    if http_socket is not None:
        from coordinator.openai_api.app import build_app
        from coordinator.openai_api.server import HttpServer

        names = list(dict.fromkeys(n for n in (config.served_model_name, servicer.model_name) if n))
        http = HttpServer(build_app(servicer, tokens, names, config.server.max_message_bytes), config.server,
                          http_socket)
        try:
            await http.start()
        except BaseException:
            await running.stop(grace=0)
            http_socket.close()
            raise
        running.companions.append(http)
        log.info("OpenAI-compatible HTTP API on %s", http.url)
    running.companions.append(StreamEnder(servicer))
    return running
