"""Speculation on vs `--no-speculation`, through the real services, measured side by side.

Starts `specdec up` (default: SmolLM2-135M target, n-gram drafter), then for each prompt
alternates the two configurations `--repeats` times via `specdec generate --json` (the CLI
users run), so machine drift hits both alike. Prints one JSON object: per prompt, the median
wall time and tokens/s of each configuration, their ratio, the acceptance stats, and whether
the outputs were token-identical.

    python benchmarks/spec_vs_baseline.py [--target smollm2-135m] [--draft ngram] [--k 4] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

PROMPTS = {
    "grounded": "Summarise this paragraph in two sentences: The Great Barrier Reef, off the coast of "
                "Queensland in Australia, is the world's largest coral reef system. It is made of over 2,900 "
                "individual reefs and 900 islands stretching over 2,300 kilometres. The reef is home to a huge "
                "variety of life, including many endangered species, and it can be seen from outer space. "
                "Warming seas have caused mass coral bleaching, which threatens the reef's future.",
    "open": "Write a short story about a robot who learns to paint.",
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def generate(port: int, prompt: str, max_new: int, speculate: bool) -> dict:
    args = [sys.executable, "-m", "specdec", "generate", "--addr", f"127.0.0.1:{port}", "--json",
            "--max-new-tokens", str(max_new), prompt]
    if not speculate:
        args.insert(-1, "--no-speculation")
    began = time.perf_counter()
    out = subprocess.run(args, capture_output=True, text=True, check=True)
    result = json.loads(out.stdout)
    result["process_wall_s"] = time.perf_counter() - began
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--draft", default="ngram")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of the services")
    args = parser.parse_args()

    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    server = subprocess.Popen([sys.executable, "-m", "specdec", "up", "--port", str(port), "--http-port", "0", "--target", args.target,
                               "--draft", args.draft, "--k", str(args.k)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True)
    try:
        while not server.stdout.readline().startswith("coordinator"):
            if server.poll() is not None:
                raise SystemExit("specdec up failed to start")
        generate(port, "warm up", 4, True)
        report = {"target": args.target, "draft": args.draft, "k": args.k, "max_new_tokens": args.max_new_tokens,
                  "repeats": args.repeats, "cpu_threads": args.threads, "prompts": {}}
        for name, prompt in PROMPTS.items():
            runs = {"speculative": [], "baseline": []}
            for _ in range(args.repeats):
                runs["speculative"].append(generate(port, prompt, args.max_new_tokens, True))
                runs["baseline"].append(generate(port, prompt, args.max_new_tokens, False))
            spec, base = runs["speculative"], runs["baseline"]
            median = lambda rs, key: statistics.median(r["wall_s"] if key == "wall_s" else r["stats"][key] for r in rs)  # noqa: E731
            report["prompts"][name] = {
                "identical_output": all(r["token_ids"] == base[0]["token_ids"] for r in spec + base),
                "generated_tokens": len(base[0]["token_ids"]),
                "speculative": {"wall_s": median(spec, "wall_s"), "tokens_per_s": median(spec, "tokens_per_s"),
                                "acceptance_rate": median(spec, "acceptance_rate"),
                                "tokens_per_round": median(spec, "tokens_per_round"),
                                "rounds": median(spec, "rounds"), "ttft_s": median(spec, "ttft_s"),
                                "wire_bytes_per_round": median(spec, "wire_bytes") / max(1, median(spec, "rounds"))},
                "baseline": {"wall_s": median(base, "wall_s"), "tokens_per_s": median(base, "tokens_per_s"),
                             "rounds": median(base, "rounds"), "ttft_s": median(base, "ttft_s")},
                "speedup": median(base, "wall_s") / median(spec, "wall_s"),
                "first_stats": spec[0]["stats"],
            }
        print(json.dumps(report, indent=2))
    finally:
        server.terminate()
        server.wait(timeout=60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
