"""Many clients at once: aggregate throughput, inter-token latency and time to first token at
1, 4 and 16 concurrent clients, with speculation off and with adaptive speculation on,
measured side by side in one run (this machine is shared and noisy).

    python benchmarks/load.py                       # SmolLM2-135M + its default drafter (the head), ~15 min
    python benchmarks/load.py --quick               # 1 and 4 clients, one repeat
    python benchmarks/load.py --draft ngram         # another drafter
    python benchmarks/load.py --unbatched           # also `specdec up --no-batching` (before/after)
    python benchmarks/load.py --paged --clients 1,16 --name load-paged   # also `--kv-cache paged`
    python benchmarks/load.py --clients 16 --up-args="--min-alt-prob 1"  # more `specdec up` flags
    python benchmarks/load.py --http                # the APIs side by side: gRPC, HTTP (openai SDK), HTTP (aiperf)
    python benchmarks/load.py --worker-loop         # also the target worker's own loop at each concurrency
    python benchmarks/load.py --baseline /tmp/base  # also another checkout's `specdec up` (before/after)

One `specdec up` process (coordinator, target and draft workers, mTLS links, exactly as users
run it, with the drafter `specdec up` picks for the target unless --draft names one) serves
every measurement; speculation is switched per request (`disable_speculation`
off/on through the real client), so "off" and "on" share the same processes and caches. For
each concurrency the two modes alternate, off/on/on/off/…, `--repeats` times each. A client
sends `--requests-per-client` requests one after another (prompts from `specdec bench`'s
built-in set, every kind mixed, a different start per client), each streamed to its end.

Per run: aggregate tokens/s = tokens streamed by all clients / wall time from the first
request to the last token; steady tokens/s = tokens streamed while every client still had
requests to send / that time (from the first request to the moment the first client sent
its last token). A run is a fixed batch of requests, so its end drains: the last requests
run at a lower concurrency than the run is named for, and the more request speeds differ
(speculation speeds some prompts more than others) the longer the drain. The steady figure
is the throughput at the named concurrency, as a server under a constant load of that many
clients sees it; both are reported and both ratios are checked. Time to first token per request; inter-token latency per token
(a streamed chunk of m tokens arriving g seconds after the previous chunk counts as m gaps
of g/m — speculation delivers tokens in bursts). Every run's tokens are checked equal to
the speculation-off tokens of the same request (greedy: the target alone).

Per run also the target worker's steps, read from the server's /metrics before and after
it: how many batched steps the run took, and their mean rounds and rows (tokens through the
model: prompts, rounds and draft rows). With a fixed batch of requests the run's wall time is
about its steps times their mean duration, so these say whether speculation saved steps or
only added rows to them.

--unbatched and --paged start a second `specdec up` (`--no-batching`, `--kv-cache paged`)
whose runs join the same alternation (modes "unbatched-off", "paged-off" and "paged-on"), so
their ratios to the first process's runs come from one run.

--baseline DIR starts a second `specdec up` from another checkout of this repository (a
worktree of the commit before a change) whose runs join the same alternation as modes
"base-off" and "base-on": a change's effect on both modes, and on the ratio, from one run
of this noisy machine instead of two (`on_over_base_on` and `base_on_over_off` in the
summary).

--worker-loop also runs, after the services' runs, the target worker's own code in this
process (benchmarks/round_cost.py's worker loop: its Verifier, B sessions one token each per
step, no gRPC, no coordinator, no clients) at each concurrency: how far the worker itself
scales with the batch, beside what the services make of it.

Prints the JSON report (also written to --out/NAME.json, with NAME.md; --name, default load).

--http compares the two front doors of one `specdec up` instead, speculation on, greedy, the
same prompts in the same order at each concurrency (`--requests-per-client` × clients
requests, `clients` in flight): specdec's gRPC client, the OpenAI-compatible HTTP API driven
by the official `openai` SDK from this process, and the HTTP API driven by NVIDIA's aiperf
(specdec.bench.aiperf; --aiperf names its executable); and a mixed run, half the clients
on gRPC and half on HTTP at the same time, so both see the same load and their TTFTs compare
within one run. The runs alternate within each repeat; TTFT p50 pools every request of every
repeat. In these closed-loop runs the requests arrive in waves, so a request's TTFT is mostly
its place in the wave's prefill queue; the API's time-to-first-token cost is measured by
probes instead: while clients − 1 others stream (half on each API), `--probes` requests per
API go out one at a time, alternating, each after a random pause, and their TTFTs compare
(with the part outside decoding: client TTFT − the server's own). gRPC and SDK outputs are
checked equal token for token; the report states the HTTP API's cost as tokens/s ratios and
the probes' TTFT differences against gRPC (written to --out/load-http.json and load-http.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdec.bench.machine import describe  # noqa: E402
from specdec.bench.prompts import PROMPTS  # noqa: E402
from specdec.bench.services import SpecdecUp  # noqa: E402
from specdec.client import make_request  # noqa: E402

# Speculation on must give at least this share of speculation off's tokens/s (medians of
# alternating repeats), and the paged KV cache this share of the buffered caches'.
ON_OVER_OFF = 0.97
PAGED_OVER_BUFFERED = 0.95
# Aggregate tokens/s at 16 clients over 1 client that batching must reach (speculation on).
SCALING_16 = 6.0
# Steps per concurrency of the worker's own loop (--worker-loop), after its prefill.
WORKER_LOOP_STEPS = 32


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


# The target worker's counters a run's step figures come from (specdec.metrics).
STEP_SERIES = {"specdec_worker_batch_rounds_count": "steps", "specdec_worker_batch_rounds_sum": "rounds",
               "specdec_worker_batch_rows_sum": "rows"}


def worker_steps(metrics_url: str) -> dict[str, float]:
    """The target worker's steps, rounds and rows so far, from a server's /metrics."""
    from urllib.request import urlopen

    from prometheus_client.parser import text_string_to_metric_families

    with urlopen(metrics_url, timeout=10) as response:
        text = response.read().decode()
    totals = dict.fromkeys(STEP_SERIES.values(), 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in STEP_SERIES and sample.labels.get("kind") == "target":
                totals[STEP_SERIES[sample.name]] += sample.value
    return totals


def step_figures(before: dict[str, float], after: dict[str, float]) -> dict:
    steps = after["steps"] - before["steps"]
    return {"steps": int(steps),
            "rounds_per_step": (after["rounds"] - before["rounds"]) / steps if steps else 0.0,
            "rows_per_step": (after["rows"] - before["rows"]) / steps if steps else 0.0}


async def one_request(client, prompt: str, max_new_tokens: int, k: int, speculate: bool) -> dict:
    request = make_request(prompt, max_new_tokens=max_new_tokens, k=k, speculate=speculate)
    began = time.perf_counter()
    last = None
    ttft = None
    gaps: list[float] = []
    tokens: list[int] = []
    arrivals: list[tuple[float, int]] = []  # (when, tokens) per streamed chunk
    stats = {}
    async for response in client.stream(request, wait_for_ready=True):
        now = time.perf_counter()
        if response.token_ids:
            arrivals.append((now, len(response.token_ids)))
            if ttft is None:
                ttft = now - began
            elif last is not None:
                gaps.extend([(now - last) / len(response.token_ids)] * len(response.token_ids))
            last = now
            tokens.extend(response.token_ids)
        if response.finish_reason:
            stats = {"rounds": response.stats.rounds, "proposed": response.stats.proposed,
                     "accepted": response.stats.accepted}
    return {"tokens": tokens, "ttft_s": ttft or 0.0, "gaps": gaps, "arrivals": arrivals, "end": time.perf_counter(),
            "stats": stats}


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
    per_user = await asyncio.gather(*(user(i) for i in range(clients)))
    results = [r for user_results in per_user for r in user_results]
    wall = max(r["end"] for r in results) - began
    generated = sum(len(r["tokens"]) for r in results)
    # Steady: until the first client is done, every client has a request in flight.
    steady_end = min(max(r["end"] for r in user_results) for user_results in per_user)
    steady_tokens = sum(n for r in results for when, n in r.pop("arrivals") if when <= steady_end)
    gaps = [g for r in results for g in r["gaps"]]
    ttfts = [r["ttft_s"] for r in results]
    proposed = sum(r["stats"].get("proposed", 0) for r in results)
    accepted = sum(r["stats"].get("accepted", 0) for r in results)
    rounds = sum(r["stats"].get("rounds", 0) for r in results)
    return {
        "clients": clients, "speculate": speculate, "requests": len(results), "tokens": generated, "wall_s": wall,
        "tokens_per_s": generated / wall, "steady_s": steady_end - began,
        "steady_tokens_per_s": steady_tokens / (steady_end - began), "itl_p50_ms": 1e3 * percentile(gaps, 50),
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
                "steady_tokens_per_s": statistics.median(r["steady_tokens_per_s"] for r in mine),
                "steady_tokens_per_s_runs": [round(r["steady_tokens_per_s"], 2) for r in mine],
                "itl_p50_ms": statistics.median(r["itl_p50_ms"] for r in mine),
                "itl_p99_ms": statistics.median(r["itl_p99_ms"] for r in mine),
                "ttft_p50_ms": statistics.median(r["ttft_p50_ms"] for r in mine),
                "ttft_p99_ms": statistics.median(r["ttft_p99_ms"] for r in mine),
                "acceptance_rate": statistics.median(r["acceptance_rate"] for r in mine),
                "draft_tokens_per_round": statistics.median(r["draft_tokens_per_round"] for r in mine),
                "tokens_per_round": statistics.median(r["tokens_per_round"] for r in mine),
            }
            if all("steps" in r for r in mine):
                for key in ("steps", "rounds_per_step", "rows_per_step"):
                    row[mode][key] = statistics.median(r[key] for r in mine)
        if "off" in row and "on" in row:
            row["on_over_off"] = row["on"]["tokens_per_s"] / row["off"]["tokens_per_s"]
            row["on_over_off_steady"] = row["on"]["steady_tokens_per_s"] / row["off"]["steady_tokens_per_s"]
        if "base-off" in row and "base-on" in row:
            row["base_on_over_off"] = row["base-on"]["tokens_per_s"] / row["base-off"]["tokens_per_s"]
            row["base_on_over_off_steady"] = \
                row["base-on"]["steady_tokens_per_s"] / row["base-off"]["steady_tokens_per_s"]
        for mode in ("off", "on"):
            if mode in row and f"base-{mode}" in row:
                row[f"{mode}_over_base_{mode}"] = row[mode]["tokens_per_s"] / row[f"base-{mode}"]["tokens_per_s"]
        for mode in ("off", "on"):
            if mode in row and f"paged-{mode}" in row:
                row[f"paged_over_buffered_{mode}"] = row[f"paged-{mode}"]["tokens_per_s"] / row[mode]["tokens_per_s"]
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
    if "1" in summary and "16" in summary and "on" in summary["1"] and "on" in summary["16"]:
        ratio = summary["16"]["on"]["tokens_per_s"] / summary["1"]["on"]["tokens_per_s"]
        out.append({"target": f"aggregate tokens/s at 16 clients >= {SCALING_16:g}x 1 client (speculation on)",
                    "value": round(ratio, 2), "met": ratio >= SCALING_16})
    for clients in concurrencies:
        ratio = summary[str(clients)].get("on_over_off")
        if ratio is not None:
            out.append({"target": f"speculation on >= {ON_OVER_OFF:g}x speculation off at {clients} clients",
                        "value": round(ratio, 3), "met": ratio >= ON_OVER_OFF})
            steady = summary[str(clients)]["on_over_off_steady"]
            out.append({"target": f"speculation on >= {ON_OVER_OFF:g}x speculation off at {clients} clients, "
                                  f"while every client is busy (steady)", "value": round(steady, 3),
                        "met": steady >= ON_OVER_OFF})
        for mode in ("off", "on"):
            ratio = summary[str(clients)].get(f"paged_over_buffered_{mode}")
            if ratio is not None:
                out.append({"target": f"paged KV cache >= {PAGED_OVER_BUFFERED:g}x the buffered caches at {clients} "
                                      f"clients (speculation {mode})", "value": round(ratio, 3),
                            "met": ratio >= PAGED_OVER_BUFFERED})
    return out


def worker_targets(loop: dict) -> list[dict]:
    """The scaling target for the target worker's own loop (--worker-loop)."""
    if "1" not in loop or "16" not in loop:
        return []
    ratio = loop["16"]["tokens_per_s"] / loop["1"]["tokens_per_s"]
    return [{"target": f"the target worker's own loop: tokens/s at 16 sessions >= {SCALING_16:g}x 1 session "
                       "(no gRPC, speculation off)", "value": round(ratio, 2), "met": ratio >= SCALING_16}]


def markdown(report: dict) -> str:
    lines = [f"# Load benchmark — {report['machine'].get('cpu_model', '')}, {report['machine'].get('cpu_cores', '')} cores, torch {report['machine'].get('torch', '')}", "",
             f"`{report['command']}`; target {report['config']['target']}, drafter {report['config']['draft']}, "
             f"k ≤ {report['config']['k']}, {report['config']['max_new_tokens']} new tokens per request, "
             f"{report['config']['requests_per_client']} requests per client, medians of "
             f"{report['config']['repeats']} alternating runs.", "",
             "| clients | mode | tokens/s | steady tokens/s | ITL p50 ms | ITL p99 ms | TTFT p50 ms | TTFT p99 ms | α "
             "| drafts/round | target steps | rounds/step | rows/step |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for clients, row in report["summary"].items():
        for mode in ("off", "on", "base-off", "base-on", "unbatched-off", "paged-off", "paged-on"):
            if mode in row:
                m = row[mode]
                lines.append(f"| {clients} | {mode} | {m['tokens_per_s']:.1f} | {m['steady_tokens_per_s']:.1f} | "
                             f"{m['itl_p50_ms']:.0f} | "
                             f"{m['itl_p99_ms']:.0f} | {m['ttft_p50_ms']:.0f} | {m['ttft_p99_ms']:.0f} | "
                             f"{m['acceptance_rate']:.2f} | {m['draft_tokens_per_round']:.2f} | "
                             + (f"{m['steps']:.0f} | {m['rounds_per_step']:.1f} | {m['rows_per_step']:.1f} |"
                                if "steps" in m else "| | |"))
    if report.get("worker_loop"):
        lines += ["", "The target worker's own loop (`--worker-loop`: its Verifier in one process, B sessions "
                  "one token each per step):", "", "| sessions | ms per step | tokens/s | over 1 session |",
                  "| --- | --- | --- | --- |"]
        one = report["worker_loop"].get("1", {}).get("tokens_per_s")
        for sessions, row in report["worker_loop"].items():
            scale = f"{row['tokens_per_s'] / one:.2f}" if one else ""
            lines.append(f"| {sessions} | {row['ms_per_round']:.1f} | {row['tokens_per_s']:.1f} | {scale} |")
    baseline = [(clients, row) for clients, row in report["summary"].items() if "base_on_over_off" in row]
    if baseline:
        lines += ["", f"Against the baseline (`--baseline {report['config'].get('baseline')}`, run in the same "
                  "alternation):", "", "| clients | on / off | baseline on / off | on / baseline on | "
                  "off / baseline off | steady on / off | steady, baseline |", "| --- | --- | --- | --- | --- | --- | --- |"]
        lines += [f"| {clients} | {row['on_over_off']:.3f} | {row['base_on_over_off']:.3f} | "
                  f"{row['on_over_base_on']:.3f} | {row['off_over_base_off']:.3f} | {row['on_over_off_steady']:.3f} | "
                  f"{row['base_on_over_off_steady']:.3f} |" for clients, row in baseline]
    lines += ["", "| target | value | met |", "| --- | --- | --- |"]
    lines += [f"| {t['target']} | {t['value']} | {'yes' if t['met'] else 'NO'} |" for t in report["targets"]]
    lines += ["", f"Outputs identical to speculation off in every run: {report['identical']}."]
    return "\n".join(lines) + "\n"


# --- the APIs side by side (--http) ---------------------------------------------------

async def queue_run(send, prompts: list[str], concurrency: int) -> dict:
    """Every prompt once, `concurrency` in flight: `send(prompt)` streams one request and
    yields lists of new token ids as they arrive. `send` may be a list: client i then uses
    send[i % len(send)], and the TTFTs are also reported per sender ("ttfts_by_sender")."""
    senders = send if isinstance(send, list) else [send]
    results: list[dict | None] = [None] * len(prompts)
    next_index = 0

    async def worker(client: int) -> None:
        nonlocal next_index
        send = senders[client % len(senders)]
        while next_index < len(prompts):
            index, next_index = next_index, next_index + 1
            began = time.perf_counter()
            ttft, last, gaps, tokens = None, None, [], []
            async for ids in send(prompts[index]):
                now = time.perf_counter()
                if not ids:
                    continue
                if ttft is None:
                    ttft = now - began
                elif last is not None:
                    gaps.extend([(now - last) / len(ids)] * len(ids))
                last = now
                tokens.extend(ids)
            results[index] = {"tokens": tokens, "ttft_s": ttft or 0.0, "gaps": gaps, "end": time.perf_counter(),
                              "sender": client % len(senders)}

    began = time.perf_counter()
    await asyncio.gather(*(worker(client) for client in range(concurrency)))
    wall = max(r["end"] for r in results) - began
    tokens = sum(len(r["tokens"]) for r in results)
    gaps = [g for r in results for g in r["gaps"]]
    ttfts = [r["ttft_s"] for r in results]
    return {"requests": len(results), "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
            "ttft_p50_ms": 1e3 * percentile(ttfts, 50), "ttft_avg_ms": 1e3 * statistics.fmean(ttfts),
            "itl_p50_ms": 1e3 * percentile(gaps, 50), "outputs": [r["tokens"] for r in results],
            "ttfts_ms": [1e3 * t for t in ttfts],
            "ttfts_by_sender": [[1e3 * r["ttft_s"] for r in results if r["sender"] == i] for i in range(len(senders))]}


def grpc_sender(client, max_new_tokens: int, k: int):
    async def send(prompt: str):
        async for response in client.stream(make_request(prompt, max_new_tokens=max_new_tokens, k=k),
                                            wait_for_ready=True):
            yield list(response.token_ids)

    return send


def sdk_sender(sdk, model: str, max_new_tokens: int):
    async def send(prompt: str):
        stream = await sdk.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_new_tokens, temperature=0,
            stream=True, extra_body={"return_token_ids": True})
        async for chunk in stream:
            for choice in chunk.choices:
                yield list(choice.model_extra.get("token_ids") or [])

    return send


async def probe_grpc(client, prompt: str, max_new_tokens: int) -> dict:
    """One streamed request over gRPC: client-observed TTFT, the server's own TTFT
    (stats.ttft_s: plan start to first committed token) and the tokens."""
    began, first, tokens = time.perf_counter(), None, []
    async for response in client.stream(make_request(prompt, max_new_tokens=max_new_tokens), wait_for_ready=True):
        if response.token_ids and first is None:
            first = time.perf_counter() - began
        tokens.extend(response.token_ids)
        if response.finish_reason:
            return {"ttft_s": first, "server_ttft_s": response.stats.ttft_s, "tokens": tokens}
    raise RuntimeError("the stream ended without a finish reason")


async def probe_http(sdk, model: str, prompt: str, max_new_tokens: int) -> dict:
    """The same over HTTP with the openai SDK (the server's TTFT from the `specdec` extension)."""
    began, first, server, tokens = time.perf_counter(), None, None, []
    stream = await sdk.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                               max_tokens=max_new_tokens, temperature=0, stream=True,
                                               extra_body={"return_token_ids": True})
    async for chunk in stream:
        for choice in chunk.choices:
            ids = choice.model_extra.get("token_ids") or []
            if ids and first is None:
                first = time.perf_counter() - began
            tokens.extend(ids)
            if choice.finish_reason:
                server = chunk.model_extra["specdec"]["ttft_s"]
    return {"ttft_s": first, "server_ttft_s": server, "tokens": tokens}


async def probe_under_load(probes: dict, background: list, prompts: list[str], others: int, count: int,
                           max_new_tokens: int, seed: int) -> dict:
    """Time to first token of a request that arrives while `others` clients stream.

    `others` closed-loop clients (alternating over the `background` senders, so both APIs
    carry the load) stream until the probes are done; once each has its first token (the
    prefill wave is over), `count` probe requests per API go out one at a time, the APIs
    alternating in pairs on the same prompt, each after a random pause (seeded, the same
    distribution for both) so that probes land at every phase of the batch's step. Closed-loop
    runs cannot show this: their requests arrive in waves, and a request's TTFT there is its
    place in the wave's prefill queue."""
    import random

    rng = random.Random(seed)
    started = 0
    all_started = asyncio.Event()

    async def streamer(index: int) -> None:
        nonlocal started
        send, j, counted = background[index % len(background)], index, False
        while True:
            async for ids in send(prompts[j % len(prompts)]):
                if ids and not counted:
                    counted, started = True, started + 1
                    if started == others:
                        all_started.set()
            j += others

    tasks = [asyncio.ensure_future(streamer(i)) for i in range(others)]
    samples: dict[str, list[dict]] = {api: [] for api in probes}
    try:
        if others:
            await asyncio.wait_for(all_started.wait(), timeout=600)
        for n in range(count):
            prompt = prompts[n % len(prompts)]
            order = list(probes) if n % 2 == 0 else list(reversed(probes))
            for api in order:
                await asyncio.sleep(rng.uniform(0.0, 0.15))
                samples[api].append(await probes[api](prompt))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    result: dict = {"others": others, "probes_per_api": count}
    for api, rows in samples.items():
        result[api] = {"ttft_ms": [1e3 * r["ttft_s"] for r in rows],
                       "outside_ms": [1e3 * (r["ttft_s"] - r["server_ttft_s"]) for r in rows]}
    first, second = list(samples)
    result["identical"] = all(a["tokens"] == b["tokens"] for a, b in zip(samples[first], samples[second]))
    return result


def http_markdown(report: dict) -> str:
    machine = report["machine"]
    lines = [f"# The APIs under load — {machine.get('cpu_model', '')}, {machine.get('cpu_cores', '')} cores", "",
             f"`{report['command']}`; target {report['config']['target']}, drafter {report['config']['draft']}, "
             f"{report['config']['max_new_tokens']} new tokens per request, greedy, "
             f"{report['config']['requests_per_client']} requests per client, medians of "
             f"{report['config']['repeats']} alternating runs.", "",
             "| clients | API (driver) | tokens/s | vs gRPC | TTFT p50 ms | Δ TTFT p50 ms | ITL p50 ms |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for clients, row in report["summary"].items():
        for mode in HTTP_MODES:
            if mode in row:
                m = row[mode]
                lines.append(f"| {clients} | {mode} | {m['tokens_per_s']:.1f} | {m.get('vs_grpc', 1.0):.3f} | "
                             f"{m['ttft_p50_ms']:.1f} | {m.get('ttft_p50_delta_ms', 0.0):+.1f} | "
                             f"{m['itl_p50_ms']:.1f} |")
        if "mixed" in row:
            m = row["mixed"]
            lines.append(f"| {clients} | mixed (half gRPC, half SDK) | {m['tokens_per_s']:.1f} | | gRPC "
                         f"{m['grpc_ttft_p50_ms']:.1f} / HTTP {m['http_ttft_p50_ms']:.1f} | "
                         f"{m['ttft_p50_delta_ms']:+.1f} | |")
    if any("ttft_under_load" in row for row in report["summary"].values()):
        lines += ["", "Time to first token of a request arriving while the others stream (probes, the APIs "
                  "alternating; \"outside\" = client TTFT − the server's own TTFT, what the API adds; "
                  "[95% bootstrap interval]):", "",
                  "| clients | probes per API | TTFT p50 gRPC ms | TTFT p50 HTTP ms | Δ ms | outside gRPC ms | "
                  "outside HTTP ms | Δ outside ms |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for clients, row in report["summary"].items():
            p = row.get("ttft_under_load")
            if p:
                lines.append(f"| {clients} | {p['probes_per_api']} | {p['grpc']['ttft_p50_ms']:.1f} | "
                             f"{p['http-sdk']['ttft_p50_ms']:.1f} | {p['ttft_p50_delta_ms']:+.1f} "
                             f"{p['ttft_p50_delta_ci95_ms']} | {p['grpc']['outside_decoding_p50_ms']:.1f} | "
                             f"{p['http-sdk']['outside_decoding_p50_ms']:.1f} | "
                             f"{p['outside_decoding_delta_ms']:+.1f} {p['outside_decoding_delta_ci95_ms']} |")
    if report.get("worker_loop"):
        lines += ["", "The target worker's own loop (`--worker-loop`: its Verifier in one process, B sessions "
                  "one token each per step):", "", "| sessions | ms per step | tokens/s | over 1 session |",
                  "| --- | --- | --- | --- |"]
        one = report["worker_loop"].get("1", {}).get("tokens_per_s")
        for sessions, row in report["worker_loop"].items():
            scale = f"{row['tokens_per_s'] / one:.2f}" if one else ""
            lines.append(f"| {sessions} | {row['ms_per_round']:.1f} | {row['tokens_per_s']:.1f} | {scale} |")
    lines += ["", "| target | value | met |", "| --- | --- | --- |"]
    lines += [f"| {t['target']} | {t['value']} | {'yes' if t['met'] else 'NO'} |" for t in report["targets"]]
    lines += ["", f"gRPC and HTTP (openai SDK) outputs identical in every run: {report['identical']}."]
    return "\n".join(lines) + "\n"


HTTP_MODES = ("grpc", "http-sdk", "http-aiperf")
TOKENS_PER_S_COST = 0.05  # the HTTP API may cost at most this share of gRPC's tokens/s
TTFT_COST_MS = 10.0  # and at most this much time to first token


def median_delta_ci(a: list[float], b: list[float], resamples: int = 2000, seed: int = 0) -> list[float]:
    """95% bootstrap interval of median(b) − median(a) (each sample resampled on its own)."""
    import random

    rng = random.Random(seed)
    deltas = sorted(statistics.median(rng.choices(b, k=len(b))) - statistics.median(rng.choices(a, k=len(a)))
                    for _ in range(resamples))
    return [round(deltas[int(0.025 * resamples)], 1), round(deltas[int(0.975 * resamples) - 1], 1)]


def http_summary(runs: list[dict], probe_runs: list[dict], concurrencies: list[int]) -> tuple[dict, list[dict]]:
    """Per concurrency: each API's medians and its cost against gRPC; the targets."""
    summary: dict = {}
    for clients in concurrencies:
        row: dict = {}
        for mode in HTTP_MODES:
            mine = [r for r in runs if r["clients"] == clients and r["mode"] == mode]
            if mine:
                row[mode] = {name: statistics.median(r[name] for r in mine)
                             for name in ("tokens_per_s", "ttft_avg_ms", "itl_p50_ms")}
                row[mode]["tokens_per_s_runs"] = [round(r["tokens_per_s"], 2) for r in mine]
                # TTFT p50 over every request of every repeat (one run's p50 varies too much);
                # aiperf reports its percentiles only: the median of its runs' p50s.
                pooled = [t for r in mine for t in r.get("ttfts_ms", [])]
                row[mode]["ttft_p50_ms"] = percentile(pooled, 50) if pooled else \
                    statistics.median(r["ttft_p50_ms"] for r in mine)
        mixed = [r for r in runs if r["clients"] == clients and r["mode"] == "mixed"]
        if mixed:
            grpc_ttfts = [t for r in mixed for t in r["ttfts_by_sender"][0]]
            http_ttfts = [t for r in mixed for t in r["ttfts_by_sender"][1]]
            row["mixed"] = {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in mixed),
                            "grpc_ttft_p50_ms": percentile(grpc_ttfts, 50),
                            "http_ttft_p50_ms": percentile(http_ttfts, 50),
                            "ttft_p50_delta_ms": percentile(http_ttfts, 50) - percentile(grpc_ttfts, 50)}
        for mode in HTTP_MODES[1:]:
            if mode in row:
                row[mode]["vs_grpc"] = row[mode]["tokens_per_s"] / row["grpc"]["tokens_per_s"]
                row[mode]["ttft_p50_delta_ms"] = row[mode]["ttft_p50_ms"] - row["grpc"]["ttft_p50_ms"]
        mine = [p for p in probe_runs if p["clients"] == clients]
        if mine:
            pooled = {api: {key: [v for p in mine for v in p[api][key]] for key in ("ttft_ms", "outside_ms")}
                      for api in ("grpc", "http-sdk")}
            probe = {api: {"ttft_p50_ms": percentile(pooled[api]["ttft_ms"], 50),
                           "outside_decoding_p50_ms": percentile(pooled[api]["outside_ms"], 50)}
                     for api in pooled}
            probe["probes_per_api"] = len(pooled["grpc"]["ttft_ms"])
            probe["ttft_p50_delta_ms"] = probe["http-sdk"]["ttft_p50_ms"] - probe["grpc"]["ttft_p50_ms"]
            probe["ttft_p50_delta_ci95_ms"] = median_delta_ci(pooled["grpc"]["ttft_ms"], pooled["http-sdk"]["ttft_ms"])
            probe["outside_decoding_delta_ci95_ms"] = median_delta_ci(pooled["grpc"]["outside_ms"],
                                                                      pooled["http-sdk"]["outside_ms"])
            probe["outside_decoding_delta_ms"] = probe["http-sdk"]["outside_decoding_p50_ms"] - \
                probe["grpc"]["outside_decoding_p50_ms"]
            row["ttft_under_load"] = probe
        summary[str(clients)] = row
    targets_met = []
    for clients, row in summary.items():
        for mode in HTTP_MODES[1:]:
            if mode in row:
                targets_met.append({"target": f"{mode} tokens/s ≥ {1 - TOKENS_PER_S_COST:.0%} of gRPC at {clients} "
                                              "clients", "value": round(row[mode]["vs_grpc"], 3),
                                    "met": row[mode]["vs_grpc"] >= 1 - TOKENS_PER_S_COST})
        probe = row.get("ttft_under_load")
        if probe:
            targets_met.append({"target": f"the API's part of TTFT (client TTFT − server TTFT, p50) while "
                                          f"{int(clients) - 1} others stream: HTTP (SDK) ≤ gRPC + "
                                          f"{TTFT_COST_MS:g} ms",
                                "value": round(probe["outside_decoding_delta_ms"], 1),
                                "met": probe["outside_decoding_delta_ms"] <= TTFT_COST_MS})
    return summary, targets_met


def main_http(args, argv) -> int:
    import openai

    from specdec.bench import aiperf as aiperf_driver
    from specdec.models import model_directory

    aiperf = aiperf_driver.find(args.aiperf)
    if aiperf is None and not args.no_aiperf:
        raise SystemExit("aiperf not found: install it (python -m venv .aiperf && .aiperf/bin/pip install aiperf), "
                         "name it with --aiperf, or pass --no-aiperf")
    concurrencies = [1, 4] if args.quick else [int(c) for c in args.clients.split(",")]
    repeats = 1 if args.quick else args.repeats
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    up = SpecdecUp(args.target, args.draft, args.k, args.threads, loop, http_port=free_port())
    model = args.target
    sdk = openai.AsyncOpenAI(base_url=up.http_url, api_key="none", max_retries=0, timeout=600)
    senders = {"grpc": grpc_sender(up.client, args.max_new_tokens, args.k),
               "http-sdk": sdk_sender(sdk, model, args.max_new_tokens)}
    probes = {"grpc": lambda prompt: probe_grpc(up.client, prompt, args.probe_tokens),
              "http-sdk": lambda prompt: probe_http(sdk, model, prompt, args.probe_tokens)}
    runs: list[dict] = []
    probe_runs: list[dict] = []
    try:
        loop.run_until_complete(queue_run(senders["grpc"], [p.text for p in PROMPTS[:2]], 2))  # warm-up
        loop.run_until_complete(queue_run(senders["http-sdk"], [p.text for p in PROMPTS[:2]], 2))
        for clients in concurrencies:
            prompts = [PROMPTS[i % len(PROMPTS)].text for i in range(clients * args.requests_per_client)]
            for repeat in range(repeats):
                order = [m for m in HTTP_MODES if m != "http-aiperf" or aiperf is not None]
                if clients > 1:
                    order.append("mixed")
                if repeat % 2:
                    order.reverse()
                for mode in order:
                    if mode == "http-aiperf":
                        run = aiperf_driver.profile(aiperf, up.http_url, model, model_directory(args.target), prompts,
                                                    args.max_new_tokens, clients, extra={"temperature": 0},
                                                    niceness=args.aiperf_nice)
                        run.pop("raw")
                    elif mode == "mixed":  # half the clients on each API, at the same time
                        run = loop.run_until_complete(queue_run([senders["grpc"], senders["http-sdk"]], prompts,
                                                                clients))
                    else:
                        run = loop.run_until_complete(queue_run(senders[mode], prompts, clients))
                    run.update(clients=clients, mode=mode)
                    runs.append(run)
                    print(f"{clients:>3} clients {mode:>11}: {run['tokens_per_s']:6.1f} tok/s, "
                          f"TTFT p50 {run['ttft_p50_ms']:.1f} ms, ITL p50 {run['itl_p50_ms']:.1f} ms",
                          file=sys.stderr, flush=True)
            if args.probes:
                probe = loop.run_until_complete(probe_under_load(
                    probes, [senders["grpc"], senders["http-sdk"]], prompts, clients - 1, args.probes,
                    args.probe_tokens, seed=clients))
                probe["clients"] = clients
                probe_runs.append(probe)
                print(f"{clients:>3} clients      probes: TTFT p50 gRPC {percentile(probe['grpc']['ttft_ms'], 50):.1f}"
                      f" / HTTP {percentile(probe['http-sdk']['ttft_ms'], 50):.1f} ms", file=sys.stderr, flush=True)
    finally:
        loop.run_until_complete(sdk.close())
        up.close()
    identical = all(a["outputs"] == b["outputs"] for a in runs for b in runs
                    if a["clients"] == b["clients"] and "outputs" in a and "outputs" in b) and \
        all(p["identical"] for p in probe_runs)
    summary, targets_met = http_summary(runs, probe_runs, concurrencies)
    report = {
        "command": "python benchmarks/load.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": describe(args.threads),
        "config": {"target": args.target, "draft": args.draft, "k": args.k, "clients": concurrencies,
                   "requests_per_client": args.requests_per_client, "max_new_tokens": args.max_new_tokens,
                   "repeats": repeats, "aiperf": aiperf, "aiperf_nice": args.aiperf_nice,
                   "probes": args.probes, "probe_tokens": args.probe_tokens},
        "summary": summary, "targets": targets_met, "identical": identical,
        "runs": [{key: value for key, value in r.items() if key != "outputs"} for r in runs],
        "probes": probe_runs,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "load-http.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "load-http.md").write_text(http_markdown(report))
    print(json.dumps(report, indent=2))
    return 0 if identical else 1


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--draft", default=None, help="drafter (default: what `specdec up` runs for the target)")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--clients", default="1,4,16", help="comma-separated concurrencies")
    parser.add_argument("--requests-per-client", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="runs per mode and concurrency (alternating)")
    parser.add_argument("--threads", type=int, default=2, help="OMP threads of the specdec processes")
    parser.add_argument("--unbatched", action="store_true",
                        help="also measure speculation off on `specdec up --no-batching` (no continuous batching)")
    parser.add_argument("--paged", action="store_true",
                        help="also measure on `specdec up --kv-cache paged` (against the buffered caches)")
    parser.add_argument("--baseline", default=None, metavar="DIR",
                        help="also measure `specdec up` run from this other checkout (before/after a change)")
    parser.add_argument("--name", default="load", help="report file name under --out (NAME.json, NAME.md)")
    parser.add_argument("--up-args", default="", help="more `specdec up` arguments for every server, one string")
    parser.add_argument("--quick", action="store_true", help="1 and 4 clients, one repeat")
    parser.add_argument("--http", action="store_true",
                        help="compare the APIs instead: gRPC, HTTP via the openai SDK, HTTP via aiperf")
    parser.add_argument("--aiperf", default=None, help="aiperf executable (default: .aiperf/bin/aiperf, else PATH)")
    parser.add_argument("--no-aiperf", action="store_true", help="--http without aiperf (gRPC and the SDK only)")
    parser.add_argument("--aiperf-nice", type=int, default=19,
                        help="run aiperf at this niceness, so its processes take only the CPU the services leave "
                             "(on a small machine they compete with the model for cores; default %(default)s)")
    parser.add_argument("--probes", type=int, default=24,
                        help="--http: probe requests per API and concurrency for TTFT under load (0: none)")
    parser.add_argument("--probe-tokens", type=int, default=8, help="--http: new tokens per probe request")
    parser.add_argument("--worker-loop", action="store_true",
                        help="also the target worker's own loop at each concurrency (no gRPC), after the services")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    if args.draft is None:
        from specdec.models import default_draft

        args.draft = default_draft(args.target)
    if args.http:
        return main_http(args, argv)
    concurrencies = [1, 4] if args.quick else [int(c) for c in args.clients.split(",")]
    repeats = 1 if args.quick else args.repeats

    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    # Every simulated user streams through this process's one client: let it hold them all,
    # and start their requests at once.
    streams = ["--max-streams-per-client", str(max(16, max(concurrencies))), "--rate-limit", "0",
               *shlex.split(args.up_args)]
    metrics_urls: dict[int, str] = {}

    def start(extra: list[str], cwd: str | None = None) -> SpecdecUp:
        port = free_port()
        server = SpecdecUp(args.target, args.draft, args.k, args.threads, loop,
                           extra_args=streams + extra + ["--metrics-port", str(port)], cwd=cwd)
        metrics_urls[id(server)] = f"http://127.0.0.1:{port}/metrics"
        return server

    up = start([])
    unbatched = start(["--no-batching"]) if args.unbatched else None
    paged = start(["--kv-cache", "paged"]) if args.paged else None
    base = start([], cwd=args.baseline) if args.baseline else None
    runs: list[dict] = []
    try:
        # Warm-up: model pages, oneDNN kernels, the coordinator's cost model.
        for server in (up, paged, base):
            if server is not None:
                loop.run_until_complete(one_run(server.client, 2, 1, 16, args.k, True))
        for clients in concurrencies:
            for repeat in range(repeats):
                order = [("off", up, False), ("on", up, True)]
                if paged is not None:
                    order += [("paged-off", paged, False), ("paged-on", paged, True)]
                if base is not None:
                    order += [("base-off", base, False), ("base-on", base, True)]
                if repeat % 2:
                    order.reverse()
                if unbatched is not None:
                    order.append(("unbatched-off", unbatched, False))
                for mode, server, speculate in order:
                    before = worker_steps(metrics_urls[id(server)])
                    run = loop.run_until_complete(one_run(server.client, clients, args.requests_per_client,
                                                          args.max_new_tokens, args.k, speculate))
                    run.update(step_figures(before, worker_steps(metrics_urls[id(server)])))
                    run["mode"] = mode
                    runs.append(run)
                    print(f"{clients:>3} clients {mode:>13}: {run['tokens_per_s']:6.1f} tok/s "
                          f"(steady {run['steady_tokens_per_s']:.1f}), ITL p50 {run['itl_p50_ms']:.0f} ms, TTFT p50 {run['ttft_p50_ms']:.0f} ms, "
                          f"α {run['acceptance_rate']:.2f}, {run['steps']} steps of {run['rows_per_step']:.0f} rows",
                          file=sys.stderr, flush=True)
    finally:
        up.close()
        for other in (unbatched, paged, base):
            if other is not None:
                other.close()
    # A key is (client, request) and always names the same prompt: every run, at every
    # concurrency, must give the tokens of the first speculation-off run of that prompt
    # (for the smallest concurrency: a request served alone).
    reference: dict = {}
    for r in runs:
        if r["mode"] == "off":
            for key, out in r["outputs"].items():
                reference.setdefault(key, out)
    identical = all(reference.get(key) == out for r in runs for key, out in r["outputs"].items())
    worker_loop: dict = {}
    if args.worker_loop:
        from benchmarks.round_cost import worker_loop as run_worker_loop

        for clients in concurrencies:
            worker_loop[str(clients)] = run_worker_loop(args.target, clients, WORKER_LOOP_STEPS, args.threads)
            print(f"{clients:>3} sessions   worker loop: {worker_loop[str(clients)]['tokens_per_s']:6.1f} tok/s "
                  f"({worker_loop[str(clients)]['ms_per_round']:.1f} ms per step)", file=sys.stderr, flush=True)
    modes = ["off", "on"] + (["unbatched-off"] if unbatched is not None else []) + \
        (["paged-off", "paged-on"] if paged is not None else []) + (["base-off", "base-on"] if base is not None else [])
    summary = summarise(runs, concurrencies, modes)
    report = {
        "command": "python benchmarks/load.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": describe(args.threads),
        "config": {"target": args.target, "draft": args.draft, "k": args.k, "clients": concurrencies,
                   "requests_per_client": args.requests_per_client, "max_new_tokens": args.max_new_tokens,
                   "repeats": repeats, "up_args": args.up_args, "baseline": args.baseline},
        "summary": summary,
        "targets": targets(summary, concurrencies) + worker_targets(worker_loop),
        "worker_loop": worker_loop,
        "identical": identical,
        "runs": [{key: value for key, value in r.items() if key != "outputs"} for r in runs],
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / f"{args.name}.md").write_text(markdown(report))
    print(json.dumps(report, indent=2))
    return 0 if identical else 1


if __name__ == "__main__":
    raise SystemExit(main())
