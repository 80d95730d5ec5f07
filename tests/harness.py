"""Real services on loopback for tests: the three grpc.aio servers on ephemeral ports, in
this process, driven by the real client."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
from dataclasses import dataclass

import torch

from coordinator import service as coordinator_service
from draft_worker import service as draft_service
from specdec.config import CoordinatorConfig, ServerConfig, WorkerConfig
from specdec.models import NGRAM
from target_worker import service as target_service

LOOPBACK = "127.0.0.1"


# On a GPU a worker's paged pool takes this share of the memory its weights leave: the tests'
# tiny models need little, and a test's workers must leave room for the next test's.
TEST_KV_MEMORY_FRACTION = 0.02


def worker_config(name: str, port: int = 0, host: str = LOOPBACK) -> WorkerConfig:
    """SPECDEC_KV_CACHE=paged runs every service test over the paged KV pool (as the flag's
    variable does for `specdec serve`)."""
    return WorkerConfig(model=name, server=ServerConfig(host=host, port=port, grace_period_s=1.0),
                        kv_cache=os.environ.get("SPECDEC_KV_CACHE", "auto"),
                        kv_memory_fraction=TEST_KV_MEMORY_FRACTION)


async def start_target(model, tokenizer, port: int = 0, host: str = LOOPBACK, head=None, **options):
    """head: an EagleHead to run next to the target (target_worker.head); options:
    WorkerConfig fields."""
    config = dataclasses.replace(worker_config("tiny-target", port, host), **options)
    servicer = target_service.build_servicer(config, model, tokenizer, head=head)
    return await target_service.serve(config, servicer), servicer


async def start_draft(draft, tokenizer=None, port: int = 0, host: str = LOOPBACK, **options):
    """draft: a model, or "ngram"; options: WorkerConfig fields."""
    if draft == NGRAM:
        config = dataclasses.replace(worker_config(NGRAM, port, host), **options)
        servicer = draft_service.build_servicer(config)
    else:
        config = dataclasses.replace(worker_config("tiny-draft", port, host), **options)
        servicer = draft_service.build_servicer(config, draft, tokenizer)
    return await draft_service.serve(config, servicer), servicer


@dataclass
class Stack:
    coordinator: object
    target: object
    draft: object | None
    target_servicer: object
    draft_servicer: object | None
    coordinator_servicer: object

    @property
    def address(self) -> str:
        return self.coordinator.address

    async def restart_target(self, model, tokenizer):
        """Kills the target worker (its caches die with it) and starts a fresh one on the
        same port, as a pod restart would."""
        port = self.target.port
        await self.target.stop(grace=0)
        self.target, self.target_servicer = await start_target(model, tokenizer, port)

    async def restart_draft(self, draft, tokenizer=None, **options):
        port = self.draft.port
        await self.draft.stop(grace=0)
        self.draft, self.draft_servicer = await start_draft(draft, tokenizer, port, **options)


@contextlib.asynccontextmanager
async def running_stack(target_model, tokenizer, draft=None, draft_tokenizer=None, draft_options=None,
                        target_head=None, target_options=None, **coordinator_options):
    """Target (with an EagleHead target_head next to it, and WorkerConfig fields
    target_options) + draft (a model or "ngram", with WorkerConfig fields draft_options) +
    coordinator, torn down at exit."""
    target, target_servicer = await start_target(target_model, tokenizer, head=target_head, **(target_options or {}))
    draft_server = draft_servicer = None
    try:
        if draft is not None:
            draft_server, draft_servicer = await start_draft(draft, draft_tokenizer or tokenizer,
                                                             **(draft_options or {}))
        config = CoordinatorConfig(
            target_addr=target.address, draft_addr=draft_server.address if draft_server else None,
            tokenizer="unused: given in memory", server=ServerConfig(host=LOOPBACK, port=0, grace_period_s=1.0),
            worker_timeout_s=30.0, retry_backoff_s=0.05, **coordinator_options,
        )
        servicer = await coordinator_service.connect(config, tokenizer=tokenizer, startup_timeout_s=10.0)
        coordinator = await coordinator_service.serve(config, servicer)
    except BaseException:
        for server in (draft_server, target):
            if server is not None:
                await server.stop(grace=0)
        raise
    stack = Stack(coordinator, target, draft_server, target_servicer, draft_servicer, servicer)
    try:
        yield stack
    finally:
        await stack.coordinator.stop(grace=0)
        await servicer.runner.drain()
        await servicer.runner.target.close()
        if servicer.runner.draft is not None:
            await servicer.runner.draft.close()
        for server in (stack.draft, stack.target):
            if server is not None:
                await server.stop(grace=0)


@dataclass
class Cluster:
    """Several replicas of each worker kind behind one coordinator."""

    coordinator: object
    servicer: object
    targets: list  # [(RunningServer, servicer)]
    drafts: list

    @property
    def address(self) -> str:
        return self.coordinator.address


@contextlib.asynccontextmanager
async def running_cluster(target_model, tokenizer, draft, hosts: list[str], resolver=None,
                          target_spec: str | None = None, target_options=None, **coordinator_options):
    """One target and one draft replica on each loopback host (127.0.0.2, 127.0.0.3, ...),
    and a coordinator given every replica (or `target_spec`, e.g. a name for `resolver`);
    target_options: WorkerConfig fields of every target replica, or a list of them, one per
    host."""
    targets, drafts = [], []
    per_host = target_options if isinstance(target_options, list) else [target_options or {}] * len(hosts)
    try:
        for host, options in zip(hosts, per_host, strict=True):
            targets.append(await start_target(target_model, tokenizer, host=host, **options))
            drafts.append(await start_draft(draft, tokenizer, host=host))
        config = CoordinatorConfig(
            target_addr=target_spec or ",".join(t[0].address for t in targets),
            draft_addr=",".join(d[0].address for d in drafts),
            tokenizer="unused: given in memory", server=ServerConfig(host=LOOPBACK, port=0, grace_period_s=1.0),
            worker_timeout_s=30.0, retry_backoff_s=0.05, health_interval_s=0.2, resolve_interval_s=0.2,
            **coordinator_options,
        )
        extra = {} if resolver is None else {"resolver": resolver}
        servicer = await coordinator_service.connect(config, tokenizer=tokenizer, startup_timeout_s=10.0,
                                                     draft_startup_timeout_s=5.0, **extra)
        coordinator = await coordinator_service.serve(config, servicer)
    except BaseException:
        for server, _ in targets + drafts:
            await server.stop(grace=0)
        raise
    cluster = Cluster(coordinator, servicer, targets, drafts)
    try:
        yield cluster
    finally:
        await coordinator.stop(grace=0)
        await servicer.runner.drain()
        await servicer.runner.target.close()
        await servicer.runner.draft.close()
        for server, _ in cluster.targets + cluster.drafts:
            await server.stop(grace=0)


def reference_greedy(model, prompt_ids: list[int], max_new_tokens: int, eos_ids=None) -> list[int]:
    """The target alone: HF generate, greedy; generated ids only, EOS included when hit."""
    # Passing eos_token_id=None would switch EOS off; leave it to the generation config.
    extra = {} if eos_ids is None else {"eos_token_id": eos_ids}
    device = model.device
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt_ids], device=device),
                             attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long, device=device),
                             do_sample=False, max_new_tokens=max_new_tokens, **extra)
    return out[0, len(prompt_ids):].tolist()


# One event loop for the whole test session: grpc.aio binds its poller to the loop it first
# runs on, and tearing loops down between tests leaves its servers to die in the GC.
_LOOP = asyncio.new_event_loop()


def run(coro):
    return _LOOP.run_until_complete(coro)


def reference_sample(model, prompt_ids: list[int], max_new_tokens: int, temperature: float, top_k: int = 0,
                     top_p: float = 1.0, seed: int = 0, eos_ids=()) -> list[int]:
    """The target alone, sampling: one full forward per token, warped, drawn by inverse CDF
    with the Philox uniform of (seed, absolute position) — the sampler a seeded request
    must reproduce token for token."""
    from specdec.philox import STREAM_SAMPLE, philox_uniforms
    from target_worker.kernels.rejection_sample_ref import probability_weights, sample_weights
    from target_worker.kernels.warp_ref import warp_probs_ref

    ids = list(prompt_ids)
    out: list[int] = []
    device = model.device
    with torch.inference_mode():
        for _ in range(max_new_tokens):
            logits = model(torch.tensor([ids], device=device)).logits[0, -1:].float()  # [1, V]
            probs = warp_probs_ref(logits, torch.tensor([temperature], device=device),
                                   torch.tensor([top_k], device=device), torch.tensor([top_p], device=device))  # [1, V]
            u = philox_uniforms(torch.tensor([seed], device=device), torch.tensor([[len(ids)]], device=device),
                                STREAM_SAMPLE)[:, 0]  # [1]
            token = int(sample_weights(probability_weights(probs), u)[0])
            ids.append(token)
            out.append(token)
            if token in eos_ids:
                break
    return out
