"""Time to first token of a request that shares a long prefix with a finished one, against
the same request cold: the paged KV pool's prefix cache, side by side with the buffered
caches (which have none) in one run.

    python benchmarks/prefix_cache.py [--model smollm2-135m] [--prefix-tokens 1000] [--pairs 6]

Two `specdec up` processes serve the same target with speculation off, one with
`--kv-cache paged`, one with `--kv-cache buffered`. For each pair, a fresh prefix of
`--prefix-tokens` token ids: the cold request is prefix + suffix A, then the warm one is
prefix + suffix B (the first finished, so its full blocks are cached). The servers take turns
request by request. Prints one JSON object: per server the median cold and warm TTFT (the
client's time to the first streamed token) and their ratio; every warm request's ids must
equal the other server's for the same request (exit 1 otherwise). Target: paged warm/cold
≤ 0.25.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from specdec.bench.services import SpecdecUp
from specdec.client import make_request

SUFFIX_TOKENS = 24


async def first_token(client, prompt: list[int], max_new_tokens: int) -> tuple[float, list[int]]:
    """(seconds to the first streamed token, all the ids) of one greedy request."""
    request = make_request(prompt, max_new_tokens=max_new_tokens, speculate=False)
    began = time.perf_counter()
    ttft, ids = None, []
    async for response in client.generate(request, wait_for_ready=True):
        if response.token_ids and ttft is None:
            ttft = time.perf_counter() - began
        ids.extend(response.token_ids)
    return ttft, ids


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", help="target model spec (default %(default)s)")
    parser.add_argument("--prefix-tokens", type=int, default=1000, help="shared prefix length (default %(default)s)")
    parser.add_argument("--pairs", type=int, default=6, help="cold/warm pairs per server (default %(default)s)")
    parser.add_argument("--max-new-tokens", type=int, default=4, help="tokens each request generates")
    parser.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of each server")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json-out", type=Path, default=None)
    args = parser.parse_args(argv)

    loop = asyncio.new_event_loop()
    servers = {}
    try:
        for kind in ("paged", "buffered"):
            servers[kind] = SpecdecUp(args.model, "none", 1, args.threads, loop, ["--kv-cache", kind])
        vocab = servers["paged"].generate([1, 2, 3], 1, False)  # warm-up; the ids bound below
        del vocab
        rng = random.Random(args.seed)
        runs = {kind: {"cold": [], "warm": []} for kind in servers}
        warm_ids: dict[str, list[list[int]]] = {kind: [] for kind in servers}
        for _ in range(args.pairs):
            prefix = [rng.randrange(100, 40000) for _ in range(args.prefix_tokens)]
            cold = prefix + [rng.randrange(100, 40000) for _ in range(SUFFIX_TOKENS)]
            warm = prefix + [rng.randrange(100, 40000) for _ in range(SUFFIX_TOKENS)]
            for label, prompt in (("cold", cold), ("warm", warm)):
                for kind, server in servers.items():
                    ttft, ids = loop.run_until_complete(first_token(server.client, prompt, args.max_new_tokens))
                    runs[kind][label].append(ttft)
                    if label == "warm":
                        warm_ids[kind].append(ids)
        same = warm_ids["paged"] == warm_ids["buffered"]
        summary = {}
        for kind, times in runs.items():
            cold, warm = statistics.median(times["cold"]), statistics.median(times["warm"])
            summary[kind] = {"cold_ttft_s": round(cold, 4), "warm_ttft_s": round(warm, 4),
                             "warm_over_cold": round(warm / cold, 3),
                             "cold_all_s": [round(t, 4) for t in times["cold"]],
                             "warm_all_s": [round(t, 4) for t in times["warm"]]}
        report = {"config": vars(args) | {"json_out": None}, "servers": summary,
                  "warm_ids_equal_across_servers": same,
                  "target_met": summary["paged"]["warm_over_cold"] <= 0.25}
        text = json.dumps(report, indent=2)
        print(text)
        if args.json_out is not None:
            args.json_out.write_text(text + "\n")
        return 0 if same else 1
    finally:
        for server in servers.values():
            server.close()
        loop.close()


if __name__ == "__main__":
    sys.exit(main())
