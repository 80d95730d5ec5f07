"""`specdec serve coordinator|draft|target`: one service per process, as in a deployment."""

from __future__ import annotations

import argparse
from pathlib import Path

from specdec.cli import flags
from specdec.config import DEFAULT_COORDINATOR_PORT, DEFAULT_DRAFT_PORT, DEFAULT_K, DEFAULT_TARGET_PORT


def add_arguments(parser: argparse.ArgumentParser) -> None:
    kinds = parser.add_subparsers(dest="service", required=True)
    coordinator = kinds.add_parser("coordinator", help="client-facing coordinator")
    flags.add_server_flags(coordinator, DEFAULT_COORDINATOR_PORT)
    coordinator.add_argument("--target-addr", default=flags.env("SPECDEC_TARGET_ADDR", f"127.0.0.1:{DEFAULT_TARGET_PORT}"),
                             help="target worker endpoints: host:port[,host:port...]; a host may be a DNS name "
                                  "resolving to many replicas (re-resolved) [SPECDEC_TARGET_ADDR]")
    coordinator.add_argument("--draft-addr", default=flags.env("SPECDEC_DRAFT_ADDR", f"127.0.0.1:{DEFAULT_DRAFT_PORT}"),
                             help="draft worker endpoints, the same way, or 'none' [SPECDEC_DRAFT_ADDR]")
    coordinator.add_argument("--tokenizer", default=flags.env("SPECDEC_TOKENIZER", flags.DEFAULT_TARGET),
                             help="model spec whose tokenizer to use: the target's [SPECDEC_TOKENIZER]")
    coordinator.add_argument("--k", type=int, default=DEFAULT_K, help="default speculative tokens per round")
    flags.add_coordinator_flags(coordinator)
    coordinator.add_argument("--worker-ca", default=flags.env("SPECDEC_WORKER_CA", None),
                             help="CA of the workers' TLS certificates: call workers over TLS [SPECDEC_WORKER_CA]")
    coordinator.add_argument("--worker-cert", default=flags.env("SPECDEC_WORKER_CERT", None),
                             help="client certificate for workers that demand one (mTLS) [SPECDEC_WORKER_CERT]")
    coordinator.add_argument("--worker-key", default=flags.env("SPECDEC_WORKER_KEY", None),
                             help="private key of --worker-cert [SPECDEC_WORKER_KEY]")
    coordinator.add_argument("--worker-tls-server-name", default=flags.env("SPECDEC_WORKER_TLS_SERVER_NAME", None),
                             help="check every worker's certificate against this name, not the address dialed "
                                  "(replicas behind a headless Service are dialed by pod IP) "
                                  "[SPECDEC_WORKER_TLS_SERVER_NAME]")
    for kind in ("target", "draft"):
        variable = f"SPECDEC_{kind.upper()}_TLS_SERVER_NAME"
        coordinator.add_argument(f"--{kind}-tls-server-name", default=flags.env(variable, None),
                                 help=f"the same for the {kind} workers only (e.g. the DNS name of their Service, "
                                      f"when each Service has its own certificate) [{variable}]")
    for name, port, default_model in (("draft", DEFAULT_DRAFT_PORT, flags.DEFAULT_DRAFT),
                                      ("target", DEFAULT_TARGET_PORT, flags.DEFAULT_TARGET)):
        worker = kinds.add_parser(name, help=f"{name} worker")
        flags.add_server_flags(worker, port)
        flags.add_worker_flags(worker)
        worker.add_argument("--model", default=flags.env("SPECDEC_MODEL", default_model),
                            help="model spec" + (" or 'ngram'" if name == "draft" else "") + " [SPECDEC_MODEL]")
        if name == "target":
            worker.add_argument("--head", default=flags.env("SPECDEC_HEAD", None) or None,
                                help="a feature-level draft head (directory or built-in name) to run next to the "
                                     "target: it drafts in each verification step, no draft worker needed "
                                     "[SPECDEC_HEAD]")


def coordinator_config(args):
    """The coordinator's config from `specdec serve coordinator` flags."""
    from specdec.security.tls import ClientTLS

    draft_addr = None if args.draft_addr == flags.NO_DRAFT else args.draft_addr
    worker_tls = None
    if args.worker_ca:
        worker_tls = ClientTLS(Path(args.worker_ca), args.worker_cert and Path(args.worker_cert),
                               args.worker_key and Path(args.worker_key))
    config = flags.coordinator_config(args, args.target_addr, draft_addr, args.tokenizer, worker_tls)
    config.target_tls_server_name = args.target_tls_server_name or args.worker_tls_server_name
    config.draft_tls_server_name = args.draft_tls_server_name or args.worker_tls_server_name
    return config


async def run(args) -> int:
    from specdec.metrics import serve_metrics
    from specdec.serving import serve_until, stop_on_signals

    stop = stop_on_signals()
    serve_metrics(flags.server_config(args).metrics_port, args.host)

    if args.service == "coordinator":
        from coordinator import service

        running = await service.serve(coordinator_config(args))
    else:
        if args.service == "draft":
            from draft_worker import service
        else:
            from target_worker import service
        running = await service.serve(flags.worker_config(args, args.model))
    print(f"{args.service} listening on {running.address}", flush=True)
    for url in [getattr(c, "url", None) for c in running.companions]:
        if url:  # the coordinator's HTTP API
            print(f"{args.service} HTTP API (OpenAI-compatible) on {url}/v1", flush=True)
    await serve_until(stop, [running])
    return 0
