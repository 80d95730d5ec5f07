"""`specdec up`: the coordinator, a draft worker and a target worker on this machine, the
worker links on mutual TLS with a CA made for the run."""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import tempfile
from pathlib import Path

from specdec.cli import flags
from specdec.config import DEFAULT_COORDINATOR_PORT, DEFAULT_K, WorkerConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    flags.add_server_flags(parser, DEFAULT_COORDINATOR_PORT)
    flags.add_worker_flags(parser)
    parser.add_argument("--target", default=flags.DEFAULT_TARGET, help="target model spec (default %(default)s)")
    parser.add_argument("--draft", default=None,
                    help="draft model or head spec, 'ngram' or 'none' (default: the built-in head trained for the "
                         "target if there is one — smollm2-135m-eagle90 for smollm2-135m — else ngram)")
    parser.add_argument("--k", type=int, default=DEFAULT_K, help="default speculative tokens per round")
    flags.add_coordinator_flags(parser)



async def run(args) -> int:
    from coordinator import service as coordinator_service
    from draft_worker import service as draft_service
    from specdec.eagle.checkpoint import is_eagle_dir
    from specdec.metrics import serve_metrics
    from specdec.serving import serve_until, stop_on_signals
    from target_worker import service as target_service

    from specdec.models import NGRAM, default_draft

    stop = stop_on_signals()
    args.draft = args.draft or default_draft(args.target)
    if args.http_port:  # a busy --http-port fails now, not after the models load
        from coordinator.openai_api.server import bind

        bind(args.host, args.http_port).close()

    # One process serves all three here, so one /metrics endpoint covers them.
    serve_metrics(flags.server_config(args).metrics_port, args.host)

    # The worker links always use mutual TLS here, with a CA made for this run: nothing but
    # this coordinator can call these workers, even on a shared machine.
    from specdec.security.tls import ClientTLS, ServerTLS, make_dev_certs

    cert_dir = Path(tempfile.mkdtemp(prefix="specdec-up-certs-"))
    certs = make_dev_certs(cert_dir, [])
    worker_tls = ServerTLS(cert_dir / "server.pem", cert_dir / "server.key", certs["ca"])
    coordinator_tls = ClientTLS(certs["ca"], cert_dir / "client.pem", cert_dir / "client.key")

    def worker_config(model: str) -> WorkerConfig:
        config = flags.worker_config(args, model, port=0)
        config.server.host, config.server.tls, config.server.insecure = "127.0.0.1", worker_tls, False
        config.server.health_port = None  # --health-port is the coordinator's
        return config

    # A feature-level head runs next to the target (target_worker.head): it reads the
    # states the verification computes and drafts in the same step.
    head = args.draft if args.draft not in (NGRAM, flags.NO_DRAFT) and is_eagle_dir(args.draft) else None
    target_config = worker_config(args.target)
    target_config.head = head
    # n-gram: no model, nothing to contend. Beside a head on the target it is the draft
    # worker for rounds on a target replica that runs no head.
    draft_model = NGRAM if head is not None else args.draft
    draft_addr = child = None
    try:
        if draft_model not in (NGRAM, flags.NO_DRAFT):
            # A model draft runs in a process of its own, as in a deployment: its torch
            # threads in this process measured verification rounds ~1.8x slower here. It is
            # started before this process serves anything: forked while gRPC's threads run,
            # a child can abort before it runs the worker (gRPC then skips its fork handlers).
            child = await _start_draft(args, cert_dir, certs["ca"])
        target = await target_service.serve(target_config)
        print(f"target worker  ({args.target}{f', head {head}' if head else ''}) listening on {target.address}",
              flush=True)
        servers = [target]
        if draft_model == NGRAM:
            draft = await draft_service.serve(worker_config(NGRAM))
            servers.insert(0, draft)
            draft_addr = draft.address
        elif child is not None:
            draft_addr = await _draft_listening(child, args.draft)
        if draft_addr is not None:
            print(f"draft worker   ({draft_model}) listening on {draft_addr}", flush=True)
        config = flags.coordinator_config(args, target.address, draft_addr, args.target, coordinator_tls)
        coordinator = await coordinator_service.serve(config)
        print(f"coordinator    listening on {coordinator.address} (k={args.k}); Ctrl-C stops", flush=True)
        for url in [getattr(c, "url", None) for c in coordinator.companions]:
            if url:
                print(f"HTTP API       (OpenAI-compatible) on {url}/v1", flush=True)
        await serve_until(stop, [coordinator, *servers])
    finally:
        if child is not None:
            await _stop_child(child)
        shutil.rmtree(cert_dir, ignore_errors=True)
    return 0


async def _start_draft(args, cert_dir, ca) -> asyncio.subprocess.Process:
    """`specdec serve draft` for `specdec up` in a child process, on a free loopback port with
    this run's mutual TLS (`_draft_listening` waits for its address)."""
    command = [sys.executable, "-m", "specdec", "serve", "draft", "--host", "127.0.0.1", "--port", "0",
               "--model", args.draft, "--tls-cert", str(cert_dir / "server.pem"),
               "--tls-key", str(cert_dir / "server.key"), "--tls-client-ca", str(ca),
               "--max-sessions", str(args.max_sessions), "--max-cache-mb", str(args.max_cache_mb),
               "--min-chain-prob", str(args.min_chain_prob), "--session-ttl", str(args.session_ttl),
               "--stall-timeout", str(args.stall_timeout), "--device", args.device, "--dtype", args.dtype,
               "--kv-cache", args.kv_cache, "--kv-memory-fraction", str(args.kv_memory_fraction),
               "--kv-block-size", str(args.kv_block_size), *(["--cuda-graphs"] if args.cuda_graphs else []),
               "--grace-period", "2", "--log-format", args.log_format or "text"]
    return await asyncio.create_subprocess_exec(*command, stdout=asyncio.subprocess.PIPE,
                                                preexec_fn=parent_death_signal())


async def _draft_listening(child: asyncio.subprocess.Process, draft: str) -> str:
    """The address the draft worker `child` listens on, once it says so."""
    marker = "draft listening on "
    while True:
        line = (await child.stdout.readline()).decode()
        if not line:
            code = await child.wait()
            raise ValueError(f"the draft worker for --draft {draft} exited ({code}) before listening; "
                             "its log is above")
        if line.startswith(marker):
            return line[len(marker):].strip()


def parent_death_signal():
    """A function to run in a child between fork and exec, so that the kernel sends it
    SIGTERM when `specdec up` dies, however it dies (SIGKILL, the OOM killer): no worker
    outlives it holding its port, memory and certificates (Linux prctl PR_SET_PDEATHSIG).
    None elsewhere, where only `up`'s own clean exit stops the child. Everything it needs is
    looked up here, in the parent: after a fork only async-signal-safe calls are safe."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes
    import signal

    prctl, parent = ctypes.CDLL(None, use_errno=True).prctl, os.getpid()
    pr_set_pdeathsig, sigterm = 1, int(signal.SIGTERM)

    def arm() -> None:
        prctl(pr_set_pdeathsig, sigterm, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the prctl took effect
            os._exit(1)

    return arm


async def _stop_child(child: asyncio.subprocess.Process) -> None:
    if child.returncode is None:
        child.terminate()
        try:
            await asyncio.wait_for(child.wait(), timeout=10)
        except asyncio.TimeoutError:
            child.kill()
            await child.wait()
