"""Where the HTTP API's time to first token goes, one request at a time: the same prompts,
alternating gRPC (specdec's client) and HTTP (the official `openai` SDK, streaming) against
one `specdec up`, each request alone on the machine.

    python benchmarks/http_ttft.py                  # SmolLM2-135M + n-gram, 6 prompts x 3, ~1 min

Per API: the client-observed TTFT (request sent to first token received), and the server's
own TTFT (`stats.ttft_s` / the `specdec` extension: the request's plan start to its first
committed token), whose difference is what the API adds outside the decoding: request
parsing and validation, admission, the response's framing and the client library. Medians.
Writes --out/http-ttft.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.load import free_port, probe_grpc, probe_http  # noqa: E402
from specdec.bench.machine import describe  # noqa: E402
from specdec.bench.prompts import PROMPTS  # noqa: E402
from specdec.bench.services import SpecdecUp  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    import openai

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--draft", default="ngram")
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)

    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    up = SpecdecUp(args.target, args.draft, 4, args.threads, loop, http_port=free_port())
    sdk = openai.AsyncOpenAI(base_url=up.http_url, api_key="none", max_retries=0, timeout=600)
    prompts = [p.text for p in PROMPTS[:args.prompts]]
    samples: dict[str, list[tuple[float, float]]] = {"grpc": [], "http": []}
    try:
        loop.run_until_complete(probe_grpc(up.client, prompts[0], 8))  # warm-up
        loop.run_until_complete(probe_http(sdk, args.target, prompts[0], 8))
        for repeat in range(args.repeats):
            for prompt in prompts:
                order = ["grpc", "http"] if repeat % 2 == 0 else ["http", "grpc"]
                for api in order:
                    call = probe_grpc(up.client, prompt, args.max_new_tokens) if api == "grpc" else \
                        probe_http(sdk, args.target, prompt, args.max_new_tokens)
                    result = loop.run_until_complete(call)
                    samples[api].append((result["ttft_s"], result["server_ttft_s"]))
    finally:
        loop.run_until_complete(sdk.close())
        up.close()
    summary = {}
    for api, rows in samples.items():
        client = statistics.median(1e3 * c for c, _ in rows)
        server = statistics.median(1e3 * s for _, s in rows)
        summary[api] = {"client_ttft_p50_ms": client, "server_ttft_p50_ms": server,
                        "outside_decoding_p50_ms": statistics.median(1e3 * (c - s) for c, s in rows)}
    summary["http_minus_grpc_client_ttft_ms"] = summary["http"]["client_ttft_p50_ms"] - \
        summary["grpc"]["client_ttft_p50_ms"]
    report = {"command": "python benchmarks/http_ttft.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "machine": describe(args.threads), "requests_per_api": len(samples["grpc"]), "summary": summary}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "http-ttft.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
