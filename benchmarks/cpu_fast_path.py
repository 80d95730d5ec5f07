"""Before/after of the CPU fast path (specdec.runtime.cpu), on the target worker's own code path.

Stages, each on top of the previous: the stock model (MKL linears, transformers' SDPA with
repeated KV heads, DynamicCache), + oneDNN packed linears, + grouped-query attention inside
SDPA, + buffered KV caches, + each linear's kernel per row count chosen by timing both at load
(= `serving_lm`, what the workers serve). For each: a 1-token step
and a (k + 1)-token verification at two context lengths (median of interleaved repeats), and
end-to-end tokens/s of greedy decoding through the worker's Verifier, target alone and with
n-gram drafts (no gRPC: the services' own overhead is in `specdec bench`). Everything runs on
one worker thread that also loaded the model, as the workers do (specdec.serving.ModelThread).

    python benchmarks/cpu_fast_path.py [--target smollm2-135m] [--threads 2] [--k 4] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch

PROMPT = ("Summarise this paragraph in two sentences: The Great Barrier Reef, off the coast of Queensland in "
          "Australia, is the world's largest coral reef system. It is made of over 2,900 individual reefs and 900 "
          "islands stretching over 2,300 kilometres. The reef is home to a huge variety of life, including many "
          "endangered species, and it can be seen from outer space. Warming seas have caused mass coral bleaching, "
          "which threatens the reef's future.")
CONTEXTS = (200, 800)
REPEATS = 15
MAX_NEW = 96


def stages(model):
    from specdec.runtime.cpu import fast_cpu_model, new_cache
    from specdec.runtime.lm import CausalLM
    from specdec.runtime.load import serving_lm

    return {
        "stock (MKL, DynamicCache)": CausalLM(model),
        "+ packed linears": CausalLM(fast_cpu_model(model, gqa_attention=False)),
        "+ GQA inside SDPA": CausalLM(fast_cpu_model(model)),
        "+ buffered KV cache": CausalLM(fast_cpu_model(model), new_cache=new_cache),
        "+ linears chosen by timing (serving_lm)": serving_lm(model),
    }


def step_costs(lm, context: list[int], k: int) -> dict:
    from specdec.runtime.costs import measure_target

    costs = measure_target(lm, context, k, repeats=REPEATS)
    return {"step_ms": costs.target_step_s * 1e3, "verify_ms": costs.verify_s * 1e3, "v": costs.v}


def decode(lm, prompt_ids: list[int], k: int, eos: int) -> dict:
    """Greedy decoding through the target worker's Verifier: k = 0 target alone, else n-gram
    drafts of up to k tokens per round. Returns tokens/s and the tokens."""
    from specdec.ngram import lookup
    from specdec.sessions import SessionStore
    from target_worker.verify import Verifier

    verifier = Verifier(lm, SessionStore(4, 1 << 32, lm.bytes_per_token), max_draft_tokens=16)
    committed, sent, out = list(prompt_ids), 0, []
    began = time.perf_counter()
    while len(out) < MAX_NEW:
        drafts = lookup(committed, min(k, MAX_NEW - len(out) - 1)) if k else []
        verdict = verifier.verify("s", sent, committed[sent:], drafts)
        sent = len(committed)
        new = drafts[:verdict.accepted] + [verdict.next_token]
        if eos in new:  # what follows the end of the text is not output
            new = new[:new.index(eos) + 1]
        new = new[:MAX_NEW - len(out)]
        committed += new
        out += new
        if eos in new:
            break
    elapsed = time.perf_counter() - began
    return {"tokens_per_s": len(out) / elapsed, "tokens": out}


def run(args) -> dict:
    from specdec.models import load_model

    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.target)
    eos = tokenizer.eos_token_id
    prompt = list(tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}],
                                                add_generation_prompt=True)["input_ids"])
    filler = (prompt * (max(CONTEXTS) // len(prompt) + 1))
    lms = stages(model)
    report = {"target": args.target, "threads": args.threads, "k": args.k, "torch": torch.__version__,
              "stages": {name: {} for name in lms}}
    for context in CONTEXTS:
        for name, lm in lms.items():
            report["stages"][name][f"context_{context}"] = step_costs(lm, filler[:context], args.k)
    for name, lm in lms.items():
        alone, spec = decode(lm, prompt, 0, eos), decode(lm, prompt, args.k, eos)
        report["stages"][name]["target_alone_tokens_per_s"] = alone["tokens_per_s"]
        report["stages"][name]["ngram_tokens_per_s"] = spec["tokens_per_s"]
        report["stages"][name]["tokens"] = alone["tokens"]
        report["stages"][name]["speculative_equals_alone"] = spec["tokens"] == alone["tokens"]
    first = next(iter(report["stages"].values()))["tokens"]
    for row in report["stages"].values():
        row["equals_stock"] = row.pop("tokens") == first
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--json", default=None, help="also write the report here")
    args = parser.parse_args()
    # One thread loads and runs the model, as a worker's ModelThread does (see its docstring).
    with ThreadPoolExecutor(1) as worker:
        report = worker.submit(run, args).result()
    lines = [f"{args.target}, {args.threads} threads, k = {args.k}, torch {report['torch']}", "",
             "| stage | " + " | ".join(f"step ms @{c} | verify ms @{c} | v @{c}" for c in CONTEXTS)
             + " | target alone tok/s | n-gram tok/s | same tokens |",
             "|---|" + "---:|---:|---:|" * len(CONTEXTS) + "---:|---:|---|"]
    for name, row in report["stages"].items():
        cells = []
        for c in CONTEXTS:
            m = row[f"context_{c}"]
            cells += [f"{m['step_ms']:.1f}", f"{m['verify_ms']:.1f}", f"{m['v']:.2f}"]
        same = row["equals_stock"] and row["speculative_equals_alone"]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {row['target_alone_tokens_per_s']:.1f} "
                     f"| {row['ngram_tokens_per_s']:.1f} | {'yes' if same else 'NO'} |")
    print("\n".join(lines))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
