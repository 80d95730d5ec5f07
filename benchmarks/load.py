"""Many clients at once: aggregate throughput, inter-token latency and time to first token at
1, 4 and 16 concurrent clients, with speculation off and with adaptive speculation on,
measured side by side in one run (this machine is shared and noisy).

    python benchmarks/load.py                       # SmolLM2-135M + n-gram, ~10 min on 2 cores
    python benchmarks/load.py --quick               # 1 and 4 clients, one repeat
    python benchmarks/load.py --unbatched           # also `specdec up --no-batching` (before/after)

One `specdec up` process (coordinator, target and draft workers, mTLS links, exactly as users
run it) serves every measurement; speculation is switched per request (`disable_speculation`
off/on through the real client), so "off" and "on" share the same processes and caches. For
each concurrency the two modes alternate, off/on/on/off/…, `--repeats` times each. A client
sends `--requests-per-client` requests one after another (prompts from `specdec bench`'s
built-in set, every kind mixed, a different start per client), each streamed to its end.

Per run: aggregate tokens/s = tokens streamed by all clients / wall time from the first
request to the last token; time to first token per request; inter-token latency per token
(a streamed chunk of m tokens arriving g seconds after the previous chunk counts as m gaps
of g/m — speculation delivers tokens in bursts). Every run's tokens are checked equal to
the speculation-off tokens of the same request (greedy: the target alone).

Prints the JSON report (also written to --out/load.json, with load.md).
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

from specdec.bench.machine import describe  # noqa: E402
from specdec.bench.prompts import PROMPTS  # noqa: E402
from specdec.bench.services import SpecdecUp  # noqa: E402
from specdec.client import make_request  # noqa: E402

# Within this ratio of speculation off, adaptive speculation counts as "not below" it:
# repeats of one configuration on this shared 2-core machine vary by about this much.
NOISE = 0.05


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


async def one_request(client, prompt: str, max_new_tokens: int, k: int, speculate: bool) -> dict:
    request = make_request(prompt, max_new_tokens=max_new_tokens, k=k, speculate=speculate)
    began = time.perf_counter()
    last = None
    ttft = None
    gaps: list[float] = []
    tokens: list[int] = []
    stats = {}
    async for response in client.stream(request, wait_for_ready=True):
        now = time.perf_counter()
        if response.token_ids:
            if ttft is None:
                ttft = now - began
            elif last is not None:
                gaps.extend([(now - last) / len(response.token_ids)] * len(response.token_ids))
            last = now
            tokens.extend(response.token_ids)
        if response.finish_reason:
            stats = {"rounds": response.stats.rounds, "proposed": response.stats.proposed,
                     "accepted": response.stats.accepted}
    return {"tokens": tokens, "ttft_s": ttft or 0.0, "gaps": gaps, "end": time.perf_counter(), "stats": stats}


async def one_run(client, clients: int, per_client: int, max_new_tokens: int, k: int, speculate: bool) -> dict:
    async def user(index: int) -> list[dict]:
        out = []
        for j in range(per_client):
            prompt = PROMPTS[(index * per_client + j) % len(PROMPTS)]
            result = await one_request(client, prompt.text, max_new_tokens, k, speculate)
            result["key"] = (index, j)
            out.append(result)
        return out

    began = time.perf_counter()
    results = [r for user_results in await asyncio.gather(*(user(i) for i in range(clients))) for r in user_results]
    wall = max(r["end"] for r in results) - began
    generated = sum(len(r["tokens"]) for r in results)
    gaps = [g for r in results for g in r["gaps"]]
    ttfts = [r["ttft_s"] for r in results]
    proposed = sum(r["stats"].get("proposed", 0) for r in results)
    accepted = sum(r["stats"].get("accepted", 0) for r in results)
    rounds = sum(r["stats"].get("rounds", 0) for r in results)
    return {
        "clients": clients, "speculate": speculate, "requests": len(results), "tokens": generated, "wall_s": wall,
        "tokens_per_s": generated / wall, "itl_p50_ms": 1e3 * percentile(gaps, 50),
        "itl_p99_ms": 1e3 * percentile(gaps, 99), "ttft_p50_ms": 1e3 * percentile(ttfts, 50),
        "ttft_p99_ms": 1e3 * percentile(ttfts, 99), "acceptance_rate": accepted / proposed if proposed else 0.0,
        "tokens_per_round": generated / rounds if rounds else 0.0, "draft_tokens_per_round": proposed / rounds if rounds else 0.0,
        "outputs": {f"{i}/{j}": r["tokens"] for r in results for i, j in [r["key"]]},
    }


def summarise(runs: list[dict], concurrencies: list[int], modes: list[str]) -> dict:
    summary: dict = {}
    for clients in concurrencies:
        row: dict = {}
        for mode in modes:
            mine = [r for r in runs if r["clients"] == clients and r["mode"] == mode]
            if not mine:
                continue
            row[mode] = {
                "tokens_per_s": statistics.median(r["tokens_per_s"] for r in mine),
                "tokens_per_s_runs": [round(r["tokens_per_s"], 2) for r in mine],
                "itl_p50_ms": statistics.median(r["itl_p50_ms"] for r in mine),
                "itl_p99_ms": statistics.median(r["itl_p99_ms"] for r in mine),
                "ttft_p50_ms": statistics.median(r["ttft_p50_ms"] for r in mine),
                "ttft_p99_ms": statistics.median(r["ttft_p99_ms"] for r in mine),
                "acceptance_rate": statistics.median(r["acceptance_rate"] for r in mine),
                "draft_tokens_per_round": statistics.median(r["draft_tokens_per_round"] for r in mine),
                "tokens_per_round": statistics.median(r["tokens_per_round"] for r in mine),
            }
        if "off" in row and "on" in row:
            row["on_over_off"] = row["on"]["tokens_per_s"] / row["off"]["tokens_per_s"]
        summary[str(clients)] = row
    return summary


def targets(summary: dict, concurrencies: list[int]) -> list[dict]:
    out = []
    low, high = str(min(concurrencies)), str(max(concurrencies))
    for mode in ("off", "on"):
        if mode in summary.get(low, {}) and mode in summary.get(high, {}) and low != high:
            ratio = summary[high][mode]["tokens_per_s"] / summary[low][mode]["tokens_per_s"]
            out.append({"target": f"aggregate tokens/s at {high} clients >= 3x {low} client (speculation {mode})",
                        "value": round(ratio, 2), "met": ratio >= 3.0})
    for clients in concurrencies:
        ratio = summary[str(clients)].get("on_over_off")
        if ratio is not None:
            out.append({"target": f"adaptive speculation not below speculation off at {clients} clients "
                                  f"(within {NOISE:.0%} noise)", "value": round(ratio, 3), "met": ratio >= 1 - NOISE})
    return out


def markdown(report: dict) -> str:
    lines = [f"# Load benchmark — {report['machine'].get('cpu_model', '')}, {report['machine'].get('cpu_cores', '')} cores, torch {report['machine'].get('torch', '')}", "",
             f"`{report['command']}`; target {report['config']['target']}, drafter {report['config']['draft']}, "
             f"k ≤ {report['config']['k']}, {report['config']['max_new_tokens']} new tokens per request, "
             f"{report['config']['requests_per_client']} requests per client, medians of "
             f"{report['config']['repeats']} alternating runs.", "",
             "| clients | mode | tokens/s | ITL p50 ms | ITL p99 ms | TTFT p50 ms | TTFT p99 ms | α | drafts/round |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for clients, row in report["summary"].items():
        for mode in ("off", "on", "unbatched-off"):
            if mode in row:
                m = row[mode]
                lines.append(f"| {clients} | {mode} | {m['tokens_per_s']:.1f} | {m['itl_p50_ms']:.0f} | "
                             f"{m['itl_p99_ms']:.0f} | {m['ttft_p50_ms']:.0f} | {m['ttft_p99_ms']:.0f} | "
                             f"{m['acceptance_rate']:.2f} | {m['draft_tokens_per_round']:.2f} |")
    lines += ["", "| target | value | met |", "| --- | --- | --- |"]
    lines += [f"| {t['target']} | {t['value']} | {'yes' if t['met'] else 'NO'} |" for t in report["targets"]]
    lines += ["", f"Outputs identical to speculation off in every run: {report['identical']}."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--draft", default="ngram")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--clients", default="1,4,16", help="comma-separated concurrencies")
    parser.add_argument("--requests-per-client", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="runs per mode and concurrency (alternating)")
    parser.add_argument("--threads", type=int, default=2, help="OMP threads of the specdec processes")
    parser.add_argument("--unbatched", action="store_true",
                        help="also measure speculation off on `specdec up --no-batching` (no continuous batching)")
    parser.add_argument("--quick", action="store_true", help="1 and 4 clients, one repeat")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    concurrencies = [1, 4] if args.quick else [int(c) for c in args.clients.split(",")]
    repeats = 1 if args.quick else args.repeats

    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    up = SpecdecUp(args.target, args.draft, args.k, args.threads, loop)
    unbatched = SpecdecUp(args.target, args.draft, args.k, args.threads, loop, extra_args=["--no-batching"]) \
        if args.unbatched else None
    runs: list[dict] = []
    try:
        # Warm-up: model pages, oneDNN kernels, the coordinator's cost model.
        loop.run_until_complete(one_run(up.client, 2, 1, 16, args.k, True))
        for clients in concurrencies:
            for repeat in range(repeats):
                order = [("off", up, False), ("on", up, True)]
                if repeat % 2:
                    order.reverse()
                if unbatched is not None:
                    order.append(("unbatched-off", unbatched, False))
                for mode, server, speculate in order:
                    run = loop.run_until_complete(one_run(server.client, clients, args.requests_per_client,
                                                          args.max_new_tokens, args.k, speculate))
                    run["mode"] = mode
                    runs.append(run)
                    print(f"{clients:>3} clients {mode:>13}: {run['tokens_per_s']:6.1f} tok/s, "
                          f"ITL p50 {run['itl_p50_ms']:.0f} ms, TTFT p50 {run['ttft_p50_ms']:.0f} ms, "
                          f"α {run['acceptance_rate']:.2f}", file=sys.stderr, flush=True)
    finally:
        up.close()
        if unbatched is not None:
            unbatched.close()
    # A key is (client, request) and always names the same prompt: every run, at every
    # concurrency, must give the tokens of the first speculation-off run of that prompt
    # (for the smallest concurrency: a request served alone).
    reference: dict = {}
    for r in runs:
        if r["mode"] == "off":
            for key, out in r["outputs"].items():
                reference.setdefault(key, out)
    identical = all(reference.get(key) == out for r in runs for key, out in r["outputs"].items())
    modes = ["off", "on"] + (["unbatched-off"] if unbatched is not None else [])
    summary = summarise(runs, concurrencies, modes)
    report = {
        "command": "python benchmarks/load.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": describe(args.threads),
        "config": {"target": args.target, "draft": args.draft, "k": args.k, "clients": concurrencies,
                   "requests_per_client": args.requests_per_client, "max_new_tokens": args.max_new_tokens,
                   "repeats": repeats, "noise": NOISE},
        "summary": summary,
        "targets": targets(summary, concurrencies),
        "identical": identical,
        "runs": [{key: value for key, value in r.items() if key != "outputs"} for r in runs],
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "load.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "load.md").write_text(markdown(report))
    print(json.dumps(report, indent=2))
    return 0 if identical else 1


if __name__ == "__main__":
    raise SystemExit(main())
