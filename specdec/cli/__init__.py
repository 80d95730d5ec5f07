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
import logging
import os
import sys

from specdec.cli import certs, generate, serve, top, up
from specdec.config import MAX_K

log = logging.getLogger("specdec")

RUNNERS = {"up": up.run, "serve": serve.run, "generate": generate.run, "certs": certs.run, "top": top.run}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdec", description="Lossless speculative decoding over gRPC")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    commands = parser.add_subparsers(dest="command", required=True)
    up.add_arguments(commands.add_parser("up", help="run coordinator, draft and target workers on this machine"))
    serve.add_arguments(commands.add_parser("serve", help="run one service"))
    generate.add_arguments(commands.add_parser("generate", help="stream a completion from a coordinator"))
    top.add_arguments(commands.add_parser("top", help="a live view of running services, from their /metrics "
                                                      "endpoints"))
    from specdec.bench.cli import add_arguments as add_bench_arguments

    add_bench_arguments(commands.add_parser("bench", help="measure specdec against HF generate() and assisted "
                                                          "generation"))
    from specdec.train.cli import add_arguments as add_distill_arguments

    add_distill_arguments(commands.add_parser("distill", help="train a draft for a target by self-distillation"))
    certs.add_arguments(commands.add_parser("certs", help="make a development CA, server and client certificates"))
    return parser


def _run_distill(args, argv: list[str] | None) -> int:
    from specdec.train.cli import config_from_args
    from specdec.train.pipeline import run

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

    try:
        if args.command == "bench":  # synchronous: it drives its own event loop and processes
            from specdec.bench.cli import run as run_bench

            return run_bench(args)
        if args.command == "distill":  # synchronous: a long training run in this process
            return _run_distill(args, argv)
        return asyncio.run(RUNNERS[args.command](args))
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
