"""NVIDIA's aiperf (https://github.com/ai-dynamo/aiperf), the load generator the benchmarks
drive the HTTP API with, run as users run it: `aiperf profile` against the OpenAI-compatible
endpoint, streaming, a fixed concurrency and a given list of prompts, its results read from
the JSON it exports.

aiperf is not a dependency (it pulls a large stack of its own); install it in a venv of its
own, e.g. `python -m venv .aiperf && .aiperf/bin/pip install aiperf`, and point --aiperf at
it. It runs offline with the target's tokenizer directory. HF_HUB_OFFLINE must be unset for
it: aiperf 0.13 then treats a local directory as a hub repository id and fails.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

RESULTS = "profile_export_aiperf.json"


def find(explicit: str | None) -> str | None:
    """The aiperf executable: --aiperf, else ./.aiperf/bin/aiperf, else on PATH."""
    for candidate in (explicit, ".aiperf/bin/aiperf", shutil.which("aiperf")):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


def profile(aiperf: str, url: str, model: str, tokenizer_dir: Path, prompts: list[str], max_tokens: int,
            concurrency: int, token: str = "none", extra: dict | None = None, timeout_s: float = 1800,
            niceness: int = 0) -> dict:
    """One aiperf run: each prompt once, in order, as a streamed chat completion of at most
    max_tokens with `extra` fields in the body, `concurrency` in flight. Returns its
    headline numbers, and the whole export under "raw"."""
    with tempfile.TemporaryDirectory(prefix="specdec-aiperf-") as work:
        work = Path(work)
        dataset = work / "prompts.jsonl"
        dataset.write_text("".join(json.dumps({"text": p, "output_length": max_tokens}) + "\n" for p in prompts))
        command = [*(["nice", "-n", str(niceness)] if niceness else []), aiperf, "profile", "--model", model, "--url", url.removesuffix("/v1"), "--endpoint-type", "chat",
                   "--streaming", "--tokenizer", str(tokenizer_dir), "--input-file", str(dataset),
                   "--custom-dataset-type", "single_turn", "--dataset-sampling-strategy", "sequential",
                   "--request-count", str(len(prompts)), "--concurrency", str(concurrency), "--api-key", token,
                   "--use-server-token-count", "--workers-max", "1", "--record-processors", "1", "--ui", "none",
                   "--no-server-metrics", "--no-gpu-telemetry", "--zmq-ipc-path", str(work / "ipc"),
                   "--artifact-dir", str(work / "out"), "--export-level", "summary", "--random-seed", "0"]
        if extra:
            command += ["--extra-inputs", json.dumps(extra)]
        env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, env=env)
        results = work / "out" / RESULTS
        if not results.is_file():
            raise RuntimeError(f"aiperf wrote no results (exit {done.returncode}): {done.stderr[-2000:]}"
                               f"{done.stdout[-2000:]}")
        raw = json.loads(results.read_text())

    def metric(name: str, stat: str = "avg", default: float = 0.0) -> float:
        value = raw.get(name) or {}
        return float(value.get(stat, default)) if isinstance(value, dict) else default

    return {
        "tokens_per_s": metric("output_token_throughput"),
        "requests": int(metric("request_count")),
        "errors": int(metric("error_request_count")),
        "ttft_p50_ms": metric("time_to_first_token", "p50"),
        "ttft_avg_ms": metric("time_to_first_token"),
        "itl_p50_ms": metric("inter_token_latency", "p50"),
        "duration_s": metric("benchmark_duration"),
        "output_tokens": metric("output_sequence_length") * metric("request_count"),
        "raw": raw,
    }
