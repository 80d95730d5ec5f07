"""`specdec`: run the services and talk to them.

    specdec up [--port P] [--target MODEL] [--draft MODEL|ngram|none] [--k K]
    specdec serve coordinator|draft|target ...
    specdec generate [--addr HOST:PORT] [--max-new-tokens N] [--k K] [--no-speculation] [--raw] [--json] PROMPT
    specdec bench [--quick] [--target MODEL] [--draft MODEL] [--k K] [--threads N] [--out DIR]
    specdec distill --target MODEL --out DIR [--max-minutes M] [--steps N] [--resume] ...

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
    parser.add_argument("--tls-cert", default=_env("SPECDEC_TLS_CERT", None),
                        help="serve TLS with this certificate (PEM) [SPECDEC_TLS_CERT]")
    parser.add_argument("--tls-key", default=_env("SPECDEC_TLS_KEY", None),
                        help="private key of --tls-cert (PEM) [SPECDEC_TLS_KEY]")
    parser.add_argument("--tls-client-ca", default=_env("SPECDEC_TLS_CLIENT_CA", None),
                        help="demand client certificates signed by this CA: mutual TLS [SPECDEC_TLS_CLIENT_CA]")
    parser.add_argument("--insecure", action="store_true", default=_env("SPECDEC_INSECURE", "") == "1",
                        help="allow plaintext gRPC off loopback (logged as a warning) [SPECDEC_INSECURE=1]")
    parser.add_argument("--log-format", choices=["json", "text"], default=_env("SPECDEC_LOG_FORMAT", None),
                        help="log lines as JSON objects (default for serve) or text [SPECDEC_LOG_FORMAT]")


def _add_worker_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-sessions", type=int, default=256, help="sessions cached at once (LRU beyond)")
    parser.add_argument("--max-cache-mb", type=int, default=2048, help="KV-cache budget in MiB (LRU beyond)")
    parser.add_argument("--device", default=_env("SPECDEC_DEVICE", "cpu"), help="torch device [SPECDEC_DEVICE]")
    parser.add_argument("--min-chain-prob", type=float, default=float(_env("SPECDEC_MIN_CHAIN_PROB", 0.15)),
                        help="a feature-level head's chain stops where its own probability of the whole chain "
                             "falls below this; 0: always draft k (default %(default)s) [SPECDEC_MIN_CHAIN_PROB]")
    parser.add_argument("--min-alt-prob", type=float, default=float(_env("SPECDEC_MIN_ALT_PROB", 0.05)),
                        help="a head on the target worker also proposes its second choice at a chain depth where "
                             "its probability of being right is at least this, verified as a tree leaf in the same "
                             "pass; 1: never (default %(default)s) [SPECDEC_MIN_ALT_PROB]")


def _server_config(args) -> ServerConfig:
    from pathlib import Path

    from specdec.tls import ServerTLS

    metrics_port = None if args.metrics_port in (None, "") else int(args.metrics_port)
    paths = [None if p is None else Path(p) for p in (args.tls_cert, args.tls_key, args.tls_client_ca)]
    return ServerConfig(host=args.host, port=args.port, grace_period_s=args.grace_period, metrics_port=metrics_port,
                        tls=ServerTLS(*paths), insecure=args.insecure)


def _add_coordinator_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--auth-token-file", default=_env("SPECDEC_AUTH_TOKEN_FILE", None),
                        help="require a bearer token from this file (one per line; re-read when it changes) "
                             "[SPECDEC_AUTH_TOKEN_FILE; tokens may also come from SPECDEC_AUTH_TOKENS]")
    parser.add_argument("--max-concurrent-requests", type=int, default=256,
                        help="streams served at once; beyond: RESOURCE_EXHAUSTED")
    parser.add_argument("--max-streams-per-client", type=int, default=16,
                        help="streams one client (token, else address) may hold at once")
    parser.add_argument("--max-prompt-tokens", type=int, default=32768, help="longest prompt accepted")
    parser.add_argument("--rate-limit", type=float, default=0.0,
                        help="requests per second one client may start; 0: no limit")
    parser.add_argument("--max-new-tokens-limit", type=int, default=4096, help="largest max_new_tokens accepted")
    parser.add_argument("--no-batching", action="store_true",
                        help="one worker call per round instead of batched steps (continuous batching off)")
    parser.add_argument("--step-token-budget", type=int, default=512,
                        help="tokens (uncached committed + drafts) one batched step carries, about")
    parser.add_argument("--max-batch-rounds", type=int, default=32, help="most requests' rounds in one step")
    parser.add_argument("--prefill-chunk", type=int, default=256,
                        help="longest piece of a prompt one step prefills (bounds others' latency)")


def _coordinator_config(args, target_addr: str, draft_addr: str | None, tokenizer: str, worker_tls=None):
    from pathlib import Path

    return CoordinatorConfig(
        target_addr=target_addr, draft_addr=draft_addr, tokenizer=tokenizer, server=_server_config(args),
        default_k=args.k, worker_tls=worker_tls,
        auth_token_file=Path(args.auth_token_file) if args.auth_token_file else None,
        auth_tokens_env=os.environ.get("SPECDEC_AUTH_TOKENS", ""),
        max_concurrent_requests=args.max_concurrent_requests, max_streams_per_client=args.max_streams_per_client,
        max_prompt_tokens=args.max_prompt_tokens, max_new_tokens_limit=args.max_new_tokens_limit,
        rate_limit_per_client=args.rate_limit, batching=not args.no_batching,
        step_token_budget=args.step_token_budget, max_batch_rounds=args.max_batch_rounds,
        prefill_chunk_tokens=args.prefill_chunk,
    )


def _worker_config(args, model: str, port: int | None = None) -> WorkerConfig:
    server = _server_config(args)
    if port is not None:
        server.port = port
    return WorkerConfig(model=model, server=server, max_sessions=args.max_sessions,
                        max_cache_bytes=args.max_cache_mb << 20, device=args.device,
                        min_chain_prob=args.min_chain_prob, min_alt_prob=args.min_alt_prob,
                        head=getattr(args, "head", None))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdec", description="Lossless speculative decoding over gRPC")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    commands = parser.add_subparsers(dest="command", required=True)

    up = commands.add_parser("up", help="run coordinator, draft and target workers on this machine")
    _add_server_flags(up, DEFAULT_COORDINATOR_PORT)
    _add_worker_flags(up)
    up.add_argument("--target", default=DEFAULT_TARGET, help="target model spec (default %(default)s)")
    up.add_argument("--draft", default=None,
                    help="draft model or head spec, 'ngram' or 'none' (default: the built-in head trained for the "
                         "target if there is one — smollm2-135m-eagle90 for smollm2-135m — else ngram)")
    up.add_argument("--k", type=int, default=DEFAULT_K, help="default speculative tokens per round")
    _add_coordinator_flags(up)

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
    _add_coordinator_flags(coordinator)
    coordinator.add_argument("--worker-ca", default=_env("SPECDEC_WORKER_CA", None),
                             help="CA of the workers' TLS certificates: call workers over TLS [SPECDEC_WORKER_CA]")
    coordinator.add_argument("--worker-cert", default=_env("SPECDEC_WORKER_CERT", None),
                             help="client certificate for workers that demand one (mTLS) [SPECDEC_WORKER_CERT]")
    coordinator.add_argument("--worker-key", default=_env("SPECDEC_WORKER_KEY", None),
                             help="private key of --worker-cert [SPECDEC_WORKER_KEY]")
    for name, port, default_model in (("draft", DEFAULT_DRAFT_PORT, DEFAULT_DRAFT),
                                      ("target", DEFAULT_TARGET_PORT, DEFAULT_TARGET)):
        worker = kinds.add_parser(name, help=f"{name} worker")
        _add_server_flags(worker, port)
        _add_worker_flags(worker)
        worker.add_argument("--model", default=_env("SPECDEC_MODEL", default_model),
                            help="model spec" + (" or 'ngram'" if name == "draft" else "") + " [SPECDEC_MODEL]")
        if name == "target":
            worker.add_argument("--head", default=_env("SPECDEC_HEAD", None) or None,
                                help="a feature-level draft head (directory or built-in name) to run next to the "
                                     "target: it drafts in each verification step, no draft worker needed "
                                     "[SPECDEC_HEAD]")

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
    generate.add_argument("--token", default=_env("SPECDEC_TOKEN", None),
                          help="bearer token for a coordinator that requires one [SPECDEC_TOKEN]")
    generate.add_argument("--ca", default=_env("SPECDEC_CA", None),
                          help="CA of the coordinator's TLS certificate: connect over TLS [SPECDEC_CA]")
    generate.add_argument("--cert", default=None, help="client certificate, if the coordinator demands one")
    generate.add_argument("--key", default=None, help="private key of --cert")
    generate.add_argument("--request-id", default="", help="id for the logs of every service (x-request-id)")

    top = commands.add_parser("top", help="a live view of running services, from their /metrics endpoints")
    top.add_argument("--metrics", action="append", default=[],
                     help="a /metrics URL (repeatable; default http://127.0.0.1:9090/metrics)")
    top.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes")
    top.add_argument("--once", action="store_true", help="print one view and exit")

    bench = commands.add_parser("bench", help="measure specdec against HF generate() and assisted generation")
    from specdec.bench.cli import add_arguments as add_bench_arguments

    add_bench_arguments(bench)

    distill = commands.add_parser("distill", help="train a small draft model for a target by self-distillation")
    from specdec.distill import add_arguments as add_distill_arguments

    add_distill_arguments(distill)

    certs = commands.add_parser("certs", help="make a development CA, server and client certificates")
    certs.add_argument("--out", required=True, help="directory to write ca.pem, server.pem/.key, client.pem/.key")
    certs.add_argument("--host", action="append", default=[],
                       help="a DNS name or IP the server certificate must cover (repeatable); "
                            "localhost and 127.0.0.1 are always included")
    return parser


async def _run_up(args) -> int:
    from coordinator import service as coordinator_service
    from draft_worker import service as draft_service
    from specdec.eagle import is_eagle_dir
    from specdec.metrics import serve_metrics
    from specdec.serving import serve_until, stop_on_signals
    from target_worker import service as target_service

    from specdec.models import NGRAM, default_draft

    stop = stop_on_signals()
    args.draft = args.draft or default_draft(args.target)

    # One process serves all three here, so one /metrics endpoint covers them.
    serve_metrics(_server_config(args).metrics_port, args.host)

    # The worker links always use mutual TLS here, with a CA made for this run: nothing but
    # this coordinator can call these workers, even on a shared machine.
    import tempfile
    from pathlib import Path

    from specdec.tls import ClientTLS, ServerTLS, make_dev_certs

    cert_dir = Path(tempfile.mkdtemp(prefix="specdec-up-certs-"))
    certs = make_dev_certs(cert_dir, [])
    worker_tls = ServerTLS(cert_dir / "server.pem", cert_dir / "server.key", certs["ca"])
    coordinator_tls = ClientTLS(certs["ca"], cert_dir / "client.pem", cert_dir / "client.key")

    def worker_config(model: str) -> WorkerConfig:
        config = _worker_config(args, model, port=0)
        config.server.host, config.server.tls, config.server.insecure = "127.0.0.1", worker_tls, False
        return config

    # A feature-level head runs next to the target (target_worker.head): it reads the
    # states the verification computes and drafts in the same step.
    head = args.draft if args.draft not in (NGRAM, NO_DRAFT) and is_eagle_dir(args.draft) else None
    target_config = worker_config(args.target)
    target_config.head = head
    target = await target_service.serve(target_config)
    print(f"target worker  ({args.target}{f', head {head}' if head else ''}) listening on {target.address}",
          flush=True)
    servers = [target]
    draft_addr = child = None
    try:
        # n-gram: no model, nothing to contend. Beside a head on the target it is the draft
        # worker for rounds on a target replica that runs no head.
        draft_model = NGRAM if head is not None else args.draft
        if draft_model == NGRAM:
            draft = await draft_service.serve(worker_config(NGRAM))
            servers.insert(0, draft)
            draft_addr = draft.address
        elif draft_model != NO_DRAFT:
            # A model draft runs in a process of its own, as in a deployment: its torch
            # threads in this process measured verification rounds ~1.8x slower here.
            child, draft_addr = await _spawn_draft(args, cert_dir, certs["ca"])
        if draft_addr is not None:
            print(f"draft worker   ({draft_model}) listening on {draft_addr}", flush=True)
        config = _coordinator_config(args, target.address, draft_addr, args.target, coordinator_tls)
        coordinator = await coordinator_service.serve(config)
        print(f"coordinator    listening on {coordinator.address} (k={args.k}); Ctrl-C stops", flush=True)
        await serve_until(stop, [coordinator, *servers])
    finally:
        import shutil

        if child is not None:
            await _stop_child(child)
        shutil.rmtree(cert_dir, ignore_errors=True)
    return 0


async def _spawn_draft(args, cert_dir, ca) -> tuple[asyncio.subprocess.Process, str]:
    """`specdec serve draft` for `specdec up` in a child process, on a free loopback port with
    this run's mutual TLS; returns the process and its address once it listens."""
    command = [sys.executable, "-m", "specdec", "serve", "draft", "--host", "127.0.0.1", "--port", "0",
               "--model", args.draft, "--tls-cert", str(cert_dir / "server.pem"),
               "--tls-key", str(cert_dir / "server.key"), "--tls-client-ca", str(ca),
               "--max-sessions", str(args.max_sessions), "--max-cache-mb", str(args.max_cache_mb),
               "--min-chain-prob", str(args.min_chain_prob),
               "--device", args.device, "--grace-period", "2", "--log-format", args.log_format or "text"]
    child = await asyncio.create_subprocess_exec(*command, stdout=asyncio.subprocess.PIPE)
    marker = "draft listening on "
    while True:
        line = (await child.stdout.readline()).decode()
        if not line:
            code = await child.wait()
            raise ValueError(f"the draft worker for --draft {args.draft} exited ({code}) before listening; "
                             "its log is above")
        if line.startswith(marker):
            return child, line[len(marker):].strip()


async def _stop_child(child: asyncio.subprocess.Process) -> None:
    if child.returncode is None:
        child.terminate()
        try:
            await asyncio.wait_for(child.wait(), timeout=10)
        except asyncio.TimeoutError:
            child.kill()
            await child.wait()


async def _run_serve(args) -> int:
    from specdec.metrics import serve_metrics
    from specdec.serving import serve_until, stop_on_signals

    stop = stop_on_signals()
    serve_metrics(_server_config(args).metrics_port, args.host)

    if args.service == "coordinator":
        from coordinator import service

        from pathlib import Path

        from specdec.tls import ClientTLS

        draft_addr = None if args.draft_addr == NO_DRAFT else args.draft_addr
        worker_tls = None
        if args.worker_ca:
            worker_tls = ClientTLS(Path(args.worker_ca), args.worker_cert and Path(args.worker_cert),
                                   args.worker_key and Path(args.worker_key))
        config = _coordinator_config(args, args.target_addr, draft_addr, args.tokenizer, worker_tls)
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


async def _run_top(args) -> int:
    from specdec.top import run

    return await asyncio.to_thread(run, args.metrics or ["http://127.0.0.1:9090/metrics"], args.interval, args.once)


async def _run_certs(args) -> int:
    from pathlib import Path

    from specdec.tls import make_dev_certs

    written = make_dev_certs(Path(args.out), args.host)
    for stem, path in written.items():
        print(f"{stem:7s} {path}  (key: {path.with_suffix('.key')})" if stem != "ca" else f"ca      {path}")
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
    from pathlib import Path

    from specdec.tls import ClientTLS

    tls = None
    if args.ca:
        tls = ClientTLS(Path(args.ca), args.cert and Path(args.cert), args.key and Path(args.key))
    async with Client(args.addr, tls=tls, token=args.token) as client:
        result = await client.complete(request, timeout=timeout, wait_for_ready=args.wait_ready > 0,
                                       on_text=None if args.json else stream_text, request_id=args.request_id)
    if args.json:
        print(json.dumps(result.to_json(), ensure_ascii=False))
    else:
        sys.stdout.write("\n")
    return 0


def _run_distill(args, argv: list[str] | None) -> int:
    from specdec.distill import config_from_args, run

    run(config_from_args(args, argv if argv is not None else sys.argv[1:]))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from specdec import logs

    fmt = getattr(args, "log_format", None) or ("json" if args.command == "serve" else "text")
    logs.configure(fmt, logging.DEBUG if args.verbose else logging.INFO,
                   service=getattr(args, "service", None) or args.command)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import grpc

    from specdec.errors import SpecdecError
    from specdec.models import ModelNotFound

    if getattr(args, "k", None) is not None and not 1 <= args.k <= MAX_K:
        print(f"--k must be in 1..{MAX_K}", file=sys.stderr)
        return 2

    runners = {"up": _run_up, "serve": _run_serve, "generate": _run_generate, "certs": _run_certs, "top": _run_top}
    try:
        if args.command == "bench":  # synchronous: it drives its own event loop and processes
            from specdec.bench.cli import run as run_bench

            return run_bench(args)
        if args.command == "distill":  # synchronous: a long training run in this process
            return _run_distill(args, argv)
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
    except ValueError as exc:  # a bad flag value found while starting (endpoints, token file)
        print(f"INVALID_ARGUMENT: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
