"""`specdec generate`: stream one completion from a coordinator."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from specdec.cli import flags
from specdec.config import DEFAULT_COORDINATOR_PORT


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help="the prompt (one user chat message unless --raw)")
    parser.add_argument("--addr", default=flags.env("SPECDEC_ADDR", f"127.0.0.1:{DEFAULT_COORDINATOR_PORT}"),
                          help="coordinator host:port [SPECDEC_ADDR]")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=None, help="speculative tokens per round (server default)")
    parser.add_argument("--no-speculation", action="store_true", help="decode with the target alone")
    parser.add_argument("--raw", action="store_true", help="send the prompt as-is, without the chat template")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--temperature", type=float, default=None, help="sampling temperature; 0 (default): greedy")
    parser.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens; 0: off")
    parser.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass in (0, 1]; 1: off")
    parser.add_argument("--seed", type=int, default=None, help="random seed: same seed, same tokens")
    parser.add_argument("--timeout", type=float, default=None, help="deadline of the call, seconds")
    parser.add_argument("--wait-ready", type=float, default=0.0,
                          help="wait up to this many seconds for the coordinator to come up")
    parser.add_argument("--token", default=flags.env("SPECDEC_TOKEN", None),
                          help="bearer token for a coordinator that requires one [SPECDEC_TOKEN]")
    parser.add_argument("--ca", default=flags.env("SPECDEC_CA", None),
                          help="CA of the coordinator's TLS certificate: connect over TLS [SPECDEC_CA]")
    parser.add_argument("--cert", default=None, help="client certificate, if the coordinator demands one")
    parser.add_argument("--key", default=None, help="private key of --cert")
    parser.add_argument("--request-id", default="", help="id for the logs of every service (x-request-id)")
    parser.add_argument("--no-resume", action="store_true",
                        help="fail when the stream breaks instead of resuming the request where it broke")



async def run(args) -> int:
    from specdec.client import NO_RESUME, Client, Resume, make_request

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
    from specdec.security.tls import ClientTLS

    tls = None
    if args.ca:
        tls = ClientTLS(Path(args.ca), args.cert and Path(args.cert), args.key and Path(args.key))
    async with Client(args.addr, tls=tls, token=args.token) as client:
        result = await client.complete(request, timeout=timeout, wait_for_ready=args.wait_ready > 0,
                                       on_text=None if args.json else stream_text, request_id=args.request_id,
                                       resume=NO_RESUME if args.no_resume else Resume())
    if args.json:
        print(json.dumps(result.to_json(), ensure_ascii=False))
    else:
        sys.stdout.write("\n")
        if result.stats.get("resumes"):
            print(f"(the stream broke and was resumed {result.stats['resumes']} times)", file=sys.stderr)
    return 0
