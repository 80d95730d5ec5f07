"""`specdec top`: a live view of running services for an operator, read from their
Prometheus endpoints (no other access needed).

    specdec top --metrics http://127.0.0.1:9090/metrics [--metrics URL ...] [--interval 2] [--once]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import urllib.request
from collections import defaultdict

from prometheus_client.parser import text_string_to_metric_families

FETCH_TIMEOUT_S = 5.0


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of one endpoint."""
    body = urllib.request.urlopen(url, timeout=FETCH_TIMEOUT_S).read().decode()
    samples = {}
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def total(samples, name: str, **labels) -> float:
    wanted = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and wanted <= set(ls))


def render(now: dict, before: dict | None, seconds: float) -> str:
    def rate(name, **labels):
        if before is None or seconds <= 0:
            return float("nan")
        return (total(now, name, **labels) - total(before, name, **labels)) / seconds

    proposed, accepted = total(now, "specdec_proposed_tokens_total"), total(now, "specdec_accepted_tokens_total")
    rounds = total(now, "specdec_rounds_total")
    generated = total(now, "specdec_generated_tokens_total")
    statuses = defaultdict(float)
    for (name, labels), value in now.items():
        if name == "specdec_coordinator_requests_total":
            statuses[dict(labels)["status"]] += value
    lines = [
        time.strftime("specdec top  %H:%M:%S"),
        f"requests  active {total(now, 'specdec_coordinator_active_requests'):.0f}   "
        f"rate {rate('specdec_coordinator_requests_total'):.2f}/s   by status "
        + ", ".join(f"{k} {v:.0f}" for k, v in sorted(statuses.items())),
        f"tokens    {generated:.0f} generated   {rate('specdec_generated_tokens_total'):.1f} tok/s",
        f"speculate acceptance {accepted / proposed if proposed else 0:.2f}   "
        f"tokens/round {generated / rounds if rounds else 0:.2f}   rounds {rounds:.0f}",
        "position  " + "  ".join(
            f"{i}:{total(now, 'specdec_position_accepted_total', position=str(i)) / p:.2f}"
            for i in range(16) if (p := total(now, "specdec_position_proposed_total", position=str(i)))),
    ]
    for kind in ("draft", "target"):
        calls = total(now, "specdec_worker_request_seconds_count", kind=kind)
        spent = total(now, "specdec_worker_request_seconds_sum", kind=kind)
        lines.append(
            f"{kind:6s}    in flight {total(now, 'specdec_worker_inflight_requests', kind=kind):.0f}   "
            f"calls {calls:.0f}   mean {1000 * spent / calls if calls else 0:.1f} ms   "
            f"sessions {total(now, 'specdec_worker_sessions', kind=kind):.0f}   "
            f"cache {total(now, 'specdec_worker_cache_bytes', kind=kind) / 2**20:.1f} MiB   "
            f"evictions {total(now, 'specdec_worker_cache_evictions_total', kind=kind):.0f}")
    return "\n".join(lines)


def watch(urls: list[str], interval: float, once: bool) -> int:
    before, before_at = None, 0.0
    while True:
        merged: dict = defaultdict(float)
        for url in urls:
            try:
                for key, value in scrape(url).items():
                    merged[key] += value
            except OSError as exc:
                print(f"{url}: {exc}", file=sys.stderr)
        now_at = time.monotonic()
        view = render(merged, before, now_at - before_at)
        if once:
            print(view)
            return 0
        sys.stdout.write("\x1b[2J\x1b[H" + view + "\n")
        sys.stdout.flush()
        before, before_at = merged, now_at
        time.sleep(interval)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--metrics", action="append", default=[],
                     help="a /metrics URL (repeatable; default http://127.0.0.1:9090/metrics)")
    parser.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes")
    parser.add_argument("--once", action="store_true", help="print one view and exit")



async def run(args) -> int:
    return await asyncio.to_thread(watch, args.metrics or ["http://127.0.0.1:9090/metrics"], args.interval, args.once)
