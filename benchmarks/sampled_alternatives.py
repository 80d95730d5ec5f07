"""A head's alternatives with seeded sampling, through the services: speed and sameness.

Two `specdec up` processes serve the target with the same head, one with alternatives (the
default) and one without (`--min-alt-prob 1`); every bench prompt is sampled with a few seeds
three ways — alternatives, chain only, no speculation — interleaved so the machine's drift hits
all three alike. Seeded sampling is exact (the target's own Philox draw at every position), so
the three outputs of a (prompt, seed) must be equal token for token; the script fails if not.
It prints per configuration the median tokens/s, the paired speed ratios (same prompt, same
seed), tokens per round and the tokens committed from alternatives.

    python benchmarks/sampled_alternatives.py [--draft smollm2-135m-eagle3] [--temperature 0.7]
        [--top-p 0.95] [--seeds 2] [--max-new-tokens 96] [--threads 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from pathlib import Path

CONFIGS = ("alternatives", "chain only", "no speculation")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--draft", default="smollm2-135m-eagle3")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    from specdec.bench.prompts import OPEN_KINDS, PROMPTS
    from specdec.bench.services import SpecdecUp
    from specdec.client import make_request
    from specdec.models import load_tokenizer

    tokenizer = load_tokenizer(args.target)
    loop = asyncio.new_event_loop()
    stacks = {"alternatives": SpecdecUp(args.target, args.draft, args.k, args.threads, loop),
              "chain only": SpecdecUp(args.target, args.draft, args.k, args.threads, loop, ["--min-alt-prob", "1"])}
    runs: list[dict] = []
    try:
        for index, prompt in enumerate(PROMPTS):
            rendered = tokenizer.apply_chat_template([{"role": "user", "content": prompt.text}],
                                                     add_generation_prompt=True)
            ids = list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)
            for seed in range(1, args.seeds + 1):
                shift = (index + seed) % len(CONFIGS)
                for config in CONFIGS[shift:] + CONFIGS[:shift]:
                    stack = stacks["chain only" if config == "chain only" else "alternatives"]
                    request = make_request(ids, max_new_tokens=args.max_new_tokens, k=args.k,
                                           speculate=config != "no speculation", temperature=args.temperature,
                                           top_p=args.top_p, seed=seed)
                    result = loop.run_until_complete(stack.client.complete(request, wait_for_ready=True))
                    runs.append({"prompt": prompt.name, "kind": prompt.kind, "seed": seed, "config": config,
                                 "tokens": list(result.token_ids), "tokens_per_s": len(result.token_ids) / result.wall_s,
                                 "stats": dict(result.stats)})
                print(f"{prompt.name} seed {seed}: done", file=sys.stderr)
    finally:
        for stack in stacks.values():
            stack.close()
        loop.close()

    by = {(r["prompt"], r["seed"], r["config"]): r for r in runs}
    keys = sorted({(r["prompt"], r["seed"]) for r in runs})
    mismatches = [key for key in keys if len({tuple(by[(*key, c)]["tokens"]) for c in CONFIGS}) != 1]
    kinds = {r["prompt"]: r["kind"] for r in runs}

    def paired(a: str, b: str, only_open: bool) -> float:
        return statistics.median(by[(*key, a)]["tokens_per_s"] / by[(*key, b)]["tokens_per_s"] for key in keys
                                 if not only_open or kinds[key[0]] in OPEN_KINDS)

    summary = {
        config: {"median_tokens_per_s": statistics.median(by[(*key, config)]["tokens_per_s"] for key in keys),
                 "tokens_per_round": statistics.mean(by[(*key, config)]["stats"].get("tokens_per_round", 1.0)
                                                     for key in keys) if config != "no speculation" else 1.0,
                 "alternative_tokens": sum(by[(*key, config)]["stats"].get("alternative_tokens", 0) for key in keys),
                 "generated_tokens": sum(len(by[(*key, config)]["tokens"]) for key in keys)}
        for config in CONFIGS
    }
    ratios = {f"{a} / {b}": {"all": paired(a, b, False), "open": paired(a, b, True)}
              for a, b in (("alternatives", "chain only"), ("alternatives", "no speculation"),
                           ("chain only", "no speculation"))}
    result = {"target": args.target, "draft": args.draft, "temperature": args.temperature, "top_p": args.top_p,
              "seeds": args.seeds, "max_new_tokens": args.max_new_tokens, "k": args.k, "threads": args.threads,
              "outputs_equal": not mismatches, "mismatches": [list(m) for m in mismatches],
              "summary": summary, "paired_speedups": ratios, "runs": runs}
    print(f"{len(keys)} (prompt, seed) pairs, temperature {args.temperature}, top-p {args.top_p}, "
          f"{args.max_new_tokens} tokens, k ≤ {args.k}")
    for config, s in summary.items():
        print(f"  {config:15s} median {s['median_tokens_per_s']:.1f} tok/s, {s['tokens_per_round']:.2f} tok/round, "
              f"{s['alternative_tokens']} of {s['generated_tokens']} tokens from alternatives")
    for name, r in ratios.items():
        print(f"  paired {name}: {r['all']:.3f}× all, {r['open']:.3f}× open")
    print("outputs equal across the three configurations: " + ("yes" if not mismatches else f"NO {mismatches}"))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0 if not mismatches else 1


if __name__ == "__main__":
    sys.exit(main())
