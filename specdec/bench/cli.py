"""Flags of `specdec bench` (also `python -m specdec.bench`), read into a BenchConfig."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from specdec.bench.config import BenchConfig

QUICK_MAX_NEW_TOKENS = 32


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = BenchConfig()
    parser.add_argument("--target", default=defaults.target, help="target model spec (default %(default)s)")
    parser.add_argument("--draft", default=None,
                        help="the drafter to bench beside n-gram: a draft model or head sharing the target's "
                             "tokenizer (default: what `specdec up` runs for the target, e.g. smollm2-135m-eagle90 "
                             "for smollm2-135m); 'ngram': n-gram only")
    parser.add_argument("--k", type=int, default=defaults.k, help="draft tokens per round (default %(default)s)")
    parser.add_argument("--max-new-tokens", type=int, default=None,
                        help=f"tokens per prompt (default {defaults.max_new_tokens}; {QUICK_MAX_NEW_TOKENS} "
                             "with --quick)")
    parser.add_argument("--repeats", type=int, default=None,
                        help=f"runs per configuration and prompt (default {defaults.repeats}; 1 with --quick)")
    parser.add_argument("--threads", type=int, default=defaults.threads,
                        help="torch threads of the bench and of the services (default %(default)s)")
    parser.add_argument("--quick", action="store_true", help="smoke run: one prompt per kind, short outputs")
    parser.add_argument("--no-fast-peers", action="store_true",
                        help="skip the HF peers on the fast-path model (1f, 2f)")
    parser.add_argument("--out", type=Path, default=defaults.out_dir,
                        help="output directory (default %(default)s)")
    parser.add_argument("--name", default=defaults.name, help="stem of the output files (default %(default)s)")
    parser.add_argument("--max-foreign-load", type=float, default=defaults.max_foreign_load,
                        help="repeat a run when other processes used more than this share of the CPU "
                             "(default %(default)s)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    # Imported here: models loads torch, and `specdec --help` builds this parser without it.
    from specdec.models import NGRAM, default_draft

    defaults = BenchConfig()
    quick = bool(args.quick)
    draft = args.draft if args.draft is not None else default_draft(args.target)
    return BenchConfig(
        target=args.target, draft=None if draft == NGRAM else draft, k=args.k,
        max_new_tokens=args.max_new_tokens or (QUICK_MAX_NEW_TOKENS if quick else defaults.max_new_tokens),
        repeats=args.repeats or (1 if quick else defaults.repeats), threads=args.threads, quick=quick,
        fast_peers=not args.no_fast_peers, out_dir=args.out, name=args.name,
        max_foreign_load=args.max_foreign_load, progress=not args.no_progress,
    )


def run(args: argparse.Namespace) -> int:
    from specdec.bench import report
    from specdec.bench.runner import Bench

    config = config_from_args(args)
    if config.k < 1 or config.repeats < 1 or config.max_new_tokens < 2 or config.threads < 1:
        print("INVALID_ARGUMENT: --k, --repeats, --threads must be >= 1 and --max-new-tokens >= 2", file=sys.stderr)
        return 2
    data = Bench(config).run()
    analysed = report.analyse(data)
    paths = report.write(analysed, config.out_dir, config.name)
    print(report.markdown(analysed))
    print("wrote " + ", ".join(str(p) for p in paths.values()), file=sys.stderr)
    return 0 if analysed["outputs_match"]["all"] else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specdec.bench", description=__doc__)
    add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    return run(args)
