"""`specdec`: run the services and talk to them.

    specdec up [--port P] [--target MODEL] [--draft MODEL|ngram|none] [--k K]
    specdec serve coordinator|draft|target ...
    specdec generate [--addr HOST:PORT] [--max-new-tokens N] [--k K] [--no-speculation] [--raw] [--json] PROMPT

This is the one place that reads flags and the environment into the typed configs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys

from specdec.config import (
    DEFAULT_COORDINATOR_PORT, DEFAULT_DRAFT_PORT, DEFAULT_K, DEFAULT_TARGET_PORT, MAX_K,
    CoordinatorConfig, ServerConfig, WorkerConfig,
)

DEFAULT_TARGET = "smollm2-135m"
DEFAULT_DRAFT = "ngram"
NO_DRAFT = "none"

log = logging.getLogger("specdec")


def _env(name: str, default):
    return os.environ.get(name, default)


def _add_server_flags(parser: argparse.ArgumentParser, default_port: int) -> None:
    parser.add_argument("--host", default=_env("SPECDEC_HOST", "127.0.0.1"),
                        help="interface to bind (0.0.0.0 in a pod) [SPECDEC_HOST]")
    parser.add_argument("--port", type=int, default=int(_env("SPECDEC_PORT", default_port)),
                        help="gRPC port; 0 picks a free one [SPECDEC_PORT]")
    parser.add_argument("--metrics-port", type=int, default=_env("SPECDEC_METRICS_PORT", None),
                        help="serve Prometheus /metrics on this port [SPECDEC_METRICS_PORT]")
    parser.add_argument("--grace-period", type=float, default=float(_env("SPECDEC_GRACE_PERIOD", 20.0)),
                        help="seconds in-flight calls get to finish after SIGTERM [SPECDEC_GRACE_PERIOD]")


def _add_worker_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-sessions", type=int, default=256, help="sessions cached at once (LRU beyond)")
    parser.add_argument("--max-cache-mb", type=int, default=2048, help="KV-cache budget in MiB (LRU beyond)")
    parser.add_argument("--device", default=_env("SPECDEC_DEVICE", "cpu"), help="torch device [SPECDEC_DEVICE]")


def _server_config(args) -> ServerConfig:
    metrics_port = None if args.metrics_port in (None, "") else int(args.metrics_port)
    return ServerConfig(host=args.host, port=args.port, grace_period_s=args.grace_period, metrics_port=metrics_port)


def _worker_config(args, model: str, port: int | None = None) -> WorkerConfig:
    server = _server_config(args)
    if port is not None:
        server.port = port
    return WorkerConfig(model=model, server=server, max_sessions=args.max_sessions,
                        max_cache_bytes=args.max_cache_mb << 20, device=args.device)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdec", description="Lossless speculative decoding over gRPC")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    commands = parser.add_subparsers(dest="command", required=True)

    up = commands.add_parser("up", help="run coordinator, draft and target workers on this machine")
    _add_server_flags(up, DEFAULT_COORDINATOR_PORT)
    _add_worker_flags(up)
    up.add_argument("--target", default=DEFAULT_TARGET, help="target model spec (default %(default)s)")
    up.add_argument("--draft", default=DEFAULT_DRAFT,
                    help="draft model spec, 'ngram' or 'none' (default %(default)s)")
    up.add_argument("--k", type=int, default=DEFAULT_K, help="default speculative tokens per round")

    serve = commands.add_parser("serve", help="run one service")
    kinds = serve.add_subparsers(dest="service", required=True)
    coordinator = kinds.add_parser("coordinator", help="client-facing coordinator")
    _add_server_flags(coordinator, DEFAULT_COORDINATOR_PORT)
    coordinator.add_argument("--target-addr", default=_env("SPECDEC_TARGET_ADDR", f"127.0.0.1:{DEFAULT_TARGET_PORT}"),
                             help="target worker endpoints: host:port[,host:port...]; a host may be a DNS name "
                                  "resolving to many replicas (re-resolved) [SPECDEC_TARGET_ADDR]")
    coordinator.add_argument("--draft-addr", default=_env("SPECDEC_DRAFT_ADDR", f"127.0.0.1:{DEFAULT_DRAFT_PORT}"),
                             help="draft worker endpoints, the same way, or 'none' [SPECDEC_DRAFT_ADDR]")
    coordinator.add_argument("--tokenizer", default=_env("SPECDEC_TOKENIZER", DEFAULT_TARGET),
                             help="model spec whose tokenizer to use: the target's [SPECDEC_TOKENIZER]")
    coordinator.add_argument("--k", type=int, default=DEFAULT_K, help="default speculative tokens per round")
    for name, port, default_model in (("draft", DEFAULT_DRAFT_PORT, DEFAULT_DRAFT),
                                      ("target", DEFAULT_TARGET_PORT, DEFAULT_TARGET)):
        worker = kinds.add_parser(name, help=f"{name} worker")
        _add_server_flags(worker, port)
        _add_worker_flags(worker)
        worker.add_argument("--model", default=_env("SPECDEC_MODEL", default_model),
                            help="model spec" + (" or 'ngram'" if name == "draft" else "") + " [SPECDEC_MODEL]")

    generate = commands.add_parser("generate", help="stream a completion from a coordinator")
    generate.add_argument("prompt", help="the prompt (one user chat message unless --raw)")
    generate.add_argument("--addr", default=_env("SPECDEC_ADDR", f"127.0.0.1:{DEFAULT_COORDINATOR_PORT}"),
                          help="coordinator host:port [SPECDEC_ADDR]")
    generate.add_argument("--max-new-tokens", type=int, default=128)
    generate.add_argument("--k", type=int, default=None, help="speculative tokens per round (server default)")
    generate.add_argument("--no-speculation", action="store_true", help="decode with the target alone")
    generate.add_argument("--raw", action="store_true", help="send the prompt as-is, without the chat template")
    generate.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    generate.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    generate.add_argument("--temperature", type=float, default=None, help="sampling temperature; 0 (default): greedy")
    generate.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens; 0: off")
    generate.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass in (0, 1]; 1: off")
    generate.add_argument("--seed", type=int, default=None, help="random seed: same seed, same tokens")
    generate.add_argument("--timeout", type=float, default=None, help="deadline of the call, seconds")
    generate.add_argument("--wait-ready", type=float, default=0.0,
                          help="wait up to this many seconds for the coordinator to come up")
    return parser


async def _run_up(args) -> int:
    from coordinator import service as coordinator_service
    from draft_worker import service as draft_service
    from specdec.metrics import serve_metrics
    from specdec.serving import serve_until, stop_on_signals
    from target_worker import service as target_service

    stop = stop_on_signals()

    # One process serves all three here, so one /metrics endpoint covers them.
    serve_metrics(_server_config(args).metrics_port, args.host)

    target = await target_service.serve(_worker_config(args, args.target, port=0))
    print(f"target worker  ({args.target}) listening on {target.address}", flush=True)
    servers = [target]
    draft_addr = None
    if args.draft != NO_DRAFT:
        draft = await draft_service.serve(_worker_config(args, args.draft, port=0))
        print(f"draft worker   ({args.draft}) listening on {draft.address}", flush=True)
        servers.insert(0, draft)
        draft_addr = draft.address
    config = CoordinatorConfig(target_addr=target.address, draft_addr=draft_addr, tokenizer=args.target,
                               server=_server_config(args), default_k=args.k)
    coordinator = await coordinator_service.serve(config)
    print(f"coordinator    listening on {coordinator.address} (k={args.k}); Ctrl-C stops", flush=True)
    await serve_until(stop, [coordinator, *servers])
    return 0


async def _run_serve(args) -> int:
    from specdec.metrics import serve_metrics
    from specdec.serving import serve_until, stop_on_signals

    stop = stop_on_signals()
    serve_metrics(_server_config(args).metrics_port, args.host)

    if args.service == "coordinator":
        from coordinator import service

        draft_addr = None if args.draft_addr == NO_DRAFT else args.draft_addr
        config = CoordinatorConfig(target_addr=args.target_addr, draft_addr=draft_addr, tokenizer=args.tokenizer,
                                   server=_server_config(args), default_k=args.k)
        running = await service.serve(config)
    else:
        if args.service == "draft":
            from draft_worker import service
        else:
            from target_worker import service
        running = await service.serve(_worker_config(args, args.model))
    print(f"{args.service} listening on {running.address}", flush=True)
    await serve_until(stop, [running])
    return 0


async def _run_generate(args) -> int:
    from specdec.client import Client, make_request

    try:
        request = make_request(args.prompt, raw=args.raw, max_new_tokens=args.max_new_tokens, k=args.k,
                               speculate=not args.no_speculation, stop=args.stop, temperature=args.temperature,
                               top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    except (ValueError, TypeError) as exc:  # e.g. a negative seed or k does not fit the field
        print(f"INVALID_ARGUMENT: {exc}", file=sys.stderr)
        return 2

    def stream_text(delta: str) -> None:
        sys.stdout.write(delta)
        sys.stdout.flush()

    timeout = args.timeout
    if args.wait_ready and timeout is None:
        timeout = args.wait_ready + 3600.0
    async with Client(args.addr) as client:
        result = await client.complete(request, timeout=timeout, wait_for_ready=args.wait_ready > 0,
                                       on_text=None if args.json else stream_text)
    if args.json:
        print(json.dumps(result.to_json(), ensure_ascii=False))
    else:
        sys.stdout.write("\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import grpc

    from specdec.errors import SpecdecError
    from specdec.models import ModelNotFound

    if getattr(args, "k", None) is not None and not 1 <= args.k <= MAX_K:
        print(f"--k must be in 1..{MAX_K}", file=sys.stderr)
        return 2

    runners = {"up": _run_up, "serve": _run_serve, "generate": _run_generate}
    try:
        return asyncio.run(runners[args.command](args))
    except grpc.aio.AioRpcError as exc:
        print(f"{exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    except SpecdecError as exc:
        print(f"{exc.code.name}: {exc}", file=sys.stderr)
        return 1
    except ModelNotFound as exc:
        print(f"model not found: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
