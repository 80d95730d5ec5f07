"""How identical is speculative output to no-speculation output when the weights are bfloat16?

In float32 speculative decoding is token-identical to the target alone (the tests check it
on every drafter). In bfloat16 the target's hidden states carry ~3 significant digits, and a
verification pass over k + 1 tokens does its arithmetic in another order than a one-token
step: where the target's top two logits are nearly tied, the two orders can pick different
tokens, and from there the texts part. This script measures how often that happens, through
the real services, and checks that every divergence sits at such a near-tie.

1. For each dtype (bfloat16, then float32) and each drafter (the default drafter of
   `specdec up` for the target, and n-gram): one `specdec up --dtype DTYPE --draft DRAFTER`;
   every prompt (PROMPTS below: chat prompts the bench does not use) generated greedily with
   speculation off, then on (k = 4), through the same service; the two outputs compared
   token for token.
2. For bfloat16: the target loaded in bfloat16 here and run the worker's way
   (specdec.runtime.load.serving_lm, float32 logits), one token per forward pass along each
   no-speculation output: the top-1 − top-2 logit gap at every position. At each divergence's
   first differing position: that gap and its percentile among all positions' gaps, the
   speculative token's rank and how far it trails the top token, and whether a
   verification-shaped pass (k + 1 tokens on top of a cache, at each offset that covers the
   position) picks the speculative token. For scale, the same positions scored in ONE forward
   pass over the whole sequence (another arithmetic order): how far the gap moves.

Writes OUT.json and OUT.md (default benchmarks/results/bf16-identity); --reanalyse redoes
step 2 on the service runs stored in OUT.json.

    python benchmarks/bf16_identity.py [--prompts 20] [--max-new-tokens 96] [--threads 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import sys
import time
from datetime import date
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdec.bench.services import SpecdecUp  # noqa: E402
from specdec.models import NGRAM, default_draft, eos_token_ids, load_model  # noqa: E402
from specdec.runtime.load import serving_lm  # noqa: E402
from specdec.sessions import Session  # noqa: E402

# Chat prompts of many kinds, none of them in specdec bench's set (specdec/bench/prompts.py).
PROMPTS = (
    "What causes the seasons on Earth?",
    "How do I make a good cup of pour-over coffee?",
    "Explain the difference between a virus and a bacterium.",
    "Write a Python function that checks whether a string is a palindrome.",
    "Write a JavaScript function that debounces another function, with a short explanation.",
    "What are three good habits for learning a new language?",
    "Write a limerick about a cat who loves cheese.",
    "Describe a busy market in a small town on a Saturday morning.",
    "Why is the sky blue?",
    "Give me a packing list for a weekend camping trip.",
    "Explain what a hash table is and when to use one.",
    "Write a short encouraging message for a friend starting a new job.",
    "What is the difference between weather and climate?",
    "How does a bicycle stay upright when it is moving?",
    "Write a shell command that counts the lines of every .txt file in a folder.",
    "Suggest five names for a bakery that sells only bread.",
    "Explain compound interest with a simple example.",
    "Write a haiku about autumn leaves.",
    "What should I think about before adopting a dog?",
    "How would you say 'Good morning, how are you?' in French and in Spanish?",
)
DTYPES = ("bfloat16", "float32")


def chat_ids(tokenizer, text: str) -> list[int]:
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where two outputs differ (a shorter one ends there), None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def through_services(target: str, drafter: str, dtype: str, prompts: list[list[int]], args) -> dict:
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    began = time.perf_counter()
    up = SpecdecUp(target, drafter, args.k, args.threads, loop, extra_args=["--dtype", dtype])
    runs = []
    try:
        for ids in prompts:
            plain = up.generate(ids, args.max_new_tokens, speculate=False)
            spec = up.generate(ids, args.max_new_tokens, speculate=True)
            runs.append({"plain": plain.token_ids, "speculative": spec.token_ids,
                         "plain_s": plain.wall_s, "speculative_s": spec.wall_s,
                         "proposed": spec.stats.get("proposed", 0), "accepted": spec.stats.get("accepted", 0),
                         "first_difference": first_difference(plain.token_ids, spec.token_ids)})
    finally:
        up.close()
        loop.close()
    # Tokens both outputs share before they part (all of them when they never do): the
    # divergence rate per token is len(divergences) / this.
    shared = sum(len(r["plain"]) if r["first_difference"] is None else r["first_difference"] for r in runs)
    return {"dtype": dtype, "drafter": drafter, "wall_s": time.perf_counter() - began, "runs": runs,
            "identical": sum(r["first_difference"] is None for r in runs), "prompts": len(runs),
            "shared_tokens": shared}


@torch.inference_mode()
def scored(lm, prompt: list[int], output: list[int], probes=(), k: int = 4):
    """Logits [len(output), V] float32 of every output position (the prediction of output[i]),
    computed twice: one token per forward pass (the prompt in one), and the whole sequence in
    one forward pass. And for each output position d in `probes`, its prediction in
    verification-shaped passes: a block of k + 1 tokens (the last committed token, then k
    more) on top of a cache built one token at a time, for every committed length that puts d
    in the block; returns {d: {output positions committed before the block: argmax}}."""
    n = len(prompt)
    seq = prompt + output
    at: dict[int, list[int]] = {}  # cache length before the earliest block -> probed positions
    for d in sorted(set(probes)):
        if d >= 1:
            at.setdefault(max(n + 1, n + d - k) - 1, []).append(d)
    picks: dict[int, dict[int, int]] = {}
    session = Session("stepwise")
    session.cache, session.ids = lm._new_cache(), []

    def probe(length: int) -> None:
        for d in at.get(length, []):
            picks[d] = {}
            for committed in range(length + 1, n + d + 1):  # the block's first output position
                for token in seq[length:committed - 1]:  # the cache up to the block, a token at a time
                    lm.feed(session, [token], 1)
                block = (seq[committed - 1:committed + k] + [seq[-1]] * (k + 1))[:k + 1]
                logits = lm.feed(session, block, k + 1)  # [k + 1, V]
                picks[d][committed - n] = int(logits[n + d - committed].argmax())
                lm.crop(session, length)

    stepwise = [lm.feed(session, prompt, 1)[0]]
    probe(n)
    for token in output[:-1]:
        stepwise.append(lm.feed(session, [token], 1)[0])
        probe(len(session.ids))
    block = Session("block")
    block.cache, block.ids = lm._new_cache(), []
    whole = lm.feed(block, prompt + output[:-1], len(output))
    return torch.stack(stepwise), whole, picks


def gaps(logits: torch.Tensor) -> torch.Tensor:
    top = logits.topk(2, -1).values  # [n, 2]
    return top[:, 0] - top[:, 1]


def percentile(value: float, population: list[float]) -> float:
    """Percent of the population at or below value."""
    return 100.0 * sum(p <= value for p in population) / len(population)


def analyse_bf16(target: str, results: list[dict], prompts: list[list[int]], tokenizer, k: int) -> dict:
    model, _ = load_model(target, dtype=torch.bfloat16)
    lm = serving_lm(model)  # the worker's own path: CPU fast path where it applies, float32 logits
    eos = set(eos_token_ids(model, tokenizer))
    all_gaps: list[float] = []
    order_moves: list[float] = []
    agree = positions = 0
    scores: dict[tuple, tuple] = {}  # (prompt, no-speculation output) -> its logits and gaps
    probes: dict[tuple, set[int]] = {}  # the first differing positions along each output
    for result in results:
        for i, run in enumerate(result["runs"]):
            if run["first_difference"] is not None:
                probes.setdefault((i, tuple(run["plain"])), set()).add(run["first_difference"])
    for result in results:
        for i, run in enumerate(result["runs"]):
            key = (i, tuple(run["plain"]))
            if key in scores:
                continue
            stepwise, whole, picks = scored(lm, prompts[i], run["plain"], probes.get(key, ()), k)
            step_gaps, whole_gaps = gaps(stepwise), gaps(whole)
            scores[key] = stepwise, step_gaps, whole, picks
            agree += sum(c == t for c, t in zip(stepwise.argmax(-1).tolist(), run["plain"]))
            positions += len(run["plain"])
            all_gaps += step_gaps.tolist()
            order_moves += (step_gaps - whole_gaps).abs().tolist()
    divergences = []
    for result in results:
        for i, run in enumerate(result["runs"]):
            d = run["first_difference"]
            if d is None:
                continue
            stepwise, step_gaps, wholes, picks = scores[(i, tuple(run["plain"]))]
            plain, spec = run["plain"], run["speculative"]
            entry = {"drafter": result["drafter"], "prompt": i, "position": d, "of": len(plain)}
            if d >= len(plain) or d >= len(spec):
                ended = set(plain[d:d + 1] + spec[d:d + 1]) & eos
                entry["note"] = "one output ended there" + (" (EOS)" if ended else "")
            if d < len(plain):
                top = stepwise[d].topk(2)
                gap = float(step_gaps[d])
                entry.update({
                    "plain_token": plain[d], "speculative_token": spec[d] if d < len(spec) else None,
                    "top2": [int(t) for t in top.indices], "top2_logits": [float(v) for v in top.values],
                    "top2_text": [tokenizer.decode([int(t)]) for t in top.indices],
                    "gap": gap, "gap_percentile": percentile(gap, all_gaps),
                    # The no-speculation token's lead over the speculative one when the same
                    # position is scored in one pass over the whole sequence (negative: flipped).
                    "lead_whole_sequence": (float(wholes[d][plain[d]] - wholes[d][spec[d]])
                                            if d < len(spec) else None),
                    "outputs_are_top2": d < len(spec) and {plain[d], spec[d]} == {int(t) for t in top.indices},
                    # Per verification-shaped block (keyed by the output tokens committed before
                    # it), the token it picks at d; `flipped`: some block picks the speculative one.
                    "block_picks": {str(c): t for c, t in picks.get(d, {}).items()},
                    "flipped_by_a_block": (spec[d] in picks[d].values()) if d in picks and d < len(spec) else None,
                })
                if d < len(spec):
                    # The speculative token's place in the one-token-per-pass logits: its rank and
                    # how far behind the top token (a three-way near-tie puts it third).
                    deficit = float(stepwise[d].max() - stepwise[d][spec[d]])
                    entry.update({"speculative_rank": int((stepwise[d] > stepwise[d][spec[d]]).sum()) + 1,
                                  "speculative_deficit": deficit,
                                  "deficit_percentile": percentile(deficit, all_gaps)})
            divergences.append(entry)
    quantiles = statistics.quantiles(all_gaps, n=100)
    return {
        "positions": positions,
        "stepwise_argmax_equals_service_plain": agree,
        "gap_quantiles": {"p1": quantiles[0], "p5": quantiles[4], "p10": quantiles[9], "p25": quantiles[24],
                          "median": quantiles[49]},
        "gap_min": min(all_gaps),
        "order_move_quantiles": {"median": statistics.median(order_moves),
                                 "p99": statistics.quantiles(order_moves, n=100)[98], "max": max(order_moves)},
        "divergences": divergences,
    }


def markdown(report: dict) -> str:
    cfg = report["config"]
    lines = [f"# Speculative vs no-speculation output in bfloat16 ({report['date']})", "",
             f"`{report['command']}`", "",
             f"Target {cfg['target']}, greedy, k = {cfg['k']}, {cfg['prompts']} chat prompts (not the bench's), "
             f"at most {cfg['max_new_tokens']} new tokens, torch threads {cfg['threads']}; {report['machine']}.", "",
             "| dtype | drafter | identical outputs | tokens shared before parting | divergences per 1,000 tokens "
             "| proposed | accepted | wall |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in report["services"]:
        proposed = sum(x["proposed"] for x in r["runs"])
        accepted = sum(x["accepted"] for x in r["runs"])
        rate = 1000 * (r["prompts"] - r["identical"]) / max(r["shared_tokens"], 1)
        lines.append(f"| {r['dtype']} | {r['drafter']} | {r['identical']} / {r['prompts']} | {r['shared_tokens']} | "
                     f"{rate:.1f} | {proposed} | {accepted} | {r['wall_s']:.0f} s |")
    same = report.get("plain_same_across_drafters", {})
    lines += ["", "No-speculation outputs the same in both services of a dtype: "
              + ", ".join(f"{dtype} {'yes' if ok else 'no'}" for dtype, ok in same.items())
              + (f"; bfloat16's equal to float32's for {report['plain_bf16_equals_fp32']} of "
                 f"{report['config']['prompts']} prompts." if "plain_bf16_equals_fp32" in report else ".")]
    a = report["bf16_analysis"]
    q = a["gap_quantiles"]
    divergences = [d for d in a["divergences"] if "speculative_deficit" in d]
    within = sum(d["deficit_percentile"] <= 5.0 for d in divergences)
    lines += ["", "## bfloat16: where the outputs part", "",
              f"The target in bfloat16 run the worker's way, one token per forward pass along each no-speculation "
              f"output: its argmax equals the service's token at {a['stepwise_argmax_equals_service_plain']} of "
              f"{a['positions']} positions. Top-1 − top-2 logit gap over those positions: p1 {q['p1']:.3f}, "
              f"p5 {q['p5']:.3f}, p10 {q['p10']:.3f}, median {q['median']:.3f} (min {a['gap_min']:.4f}). "
              f"Scoring the same positions in one forward pass over the whole sequence moves the gap by "
              f"{a['order_move_quantiles']['median']:.3f} (median), {a['order_move_quantiles']['p99']:.3f} (p99), "
              f"{a['order_move_quantiles']['max']:.3f} (max). At {within} of {len(divergences)} divergences the "
              f"speculative token trails the top token by no more than the 5th percentile of top-1 − top-2 gaps; "
              f"the largest deficit is {max((d['speculative_deficit'] for d in divergences), default=0):.4f}.", "",
              "Per divergence, at its first differing position, one token per pass: the top-2 gap and its "
              "percentile among all positions' gaps; the speculative token's rank and how far it trails the top "
              "token (percentile likewise); the no-speculation token's lead over the speculative one when the "
              "whole sequence is scored in one pass (negative: that pass picks the speculative one too); whether a "
              "verification-shaped block (k + 1 tokens on a cache built a token at a time, at any offset that "
              "covers the position) picks the speculative token.", "",
              "| drafter | prompt | position | top 2 | top-2 gap (percentile) | speculative token: rank, behind by "
              "(percentile) | lead, whole-sequence pass | a block picks it |",
              "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for d in a["divergences"]:
        if "gap" not in d:
            lines.append(f"| {d['drafter']} | {d['prompt']} | {d['position']} / {d['of']} | — | — | — | — | "
                         f"{d.get('note', '')} |")
            continue
        top2 = " / ".join(repr(t) for t in d["top2_text"])
        lead = d["lead_whole_sequence"]
        block = {True: "yes", False: "no", None: "— (first token)"}[d["flipped_by_a_block"]]
        speculative = ("—" if "speculative_rank" not in d else
                       f"{d['speculative_rank']}, {d['speculative_deficit']:.4f} ({d['deficit_percentile']:.1f} %)")
        lines.append(f"| {d['drafter']} | {d['prompt']} | {d['position']} / {d['of']} | {top2} | "
                     f"{d['gap']:.4f} ({d['gap_percentile']:.1f} %) | {speculative} | "
                     f"{'—' if lead is None else format(lead, '+.4f')} | {block} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--drafters", nargs="+", default=None,
                        help="default: the default drafter of `specdec up` for the target, and ngram")
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=DTYPES)
    parser.add_argument("--prompts", type=int, default=len(PROMPTS))
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the services and of this script")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "bf16-identity")
    parser.add_argument("--reanalyse", action="store_true",
                        help="keep the service runs stored in OUT.json (and their config); redo the analysis")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    drafters = args.drafters or list(dict.fromkeys([default_draft(args.target), NGRAM]))

    from specdec.models import load_tokenizer

    stored = json.loads(args.out.with_suffix(".json").read_text()) if args.reanalyse else None
    if stored is not None:
        config = stored["config"]
        args.target, args.k, args.max_new_tokens, args.threads = (config["target"], config["k"],
                                                                    config["max_new_tokens"], config["threads"])
        drafters, args.prompts = config["drafters"], config["prompts"]
        args.dtypes = list(dict.fromkeys(r["dtype"] for r in stored["services"]))
        torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer(args.target)
    prompts = [chat_ids(tokenizer, text) for text in PROMPTS[:args.prompts]]
    services = stored["services"] if stored is not None else []
    for dtype in args.dtypes if stored is None else ():
        for drafter in drafters:
            result = through_services(args.target, drafter, dtype, prompts, args)
            print(f"{dtype} {drafter}: {result['identical']} / {result['prompts']} identical "
                  f"({result['wall_s']:.0f} s)", flush=True)
            services.append(result)
    report = {
        "date": stored["date"] if stored is not None else date.today().isoformat(),
        "command": stored["command"] if stored is not None else "python benchmarks/bf16_identity.py " + " ".join(
            sys.argv[1:]),
        "machine": stored["machine"] if stored is not None else
        f"{platform.processor() or platform.machine()}, torch {torch.__version__}",
        "config": {"target": args.target, "drafters": drafters, "k": args.k, "prompts": len(prompts),
                   "max_new_tokens": args.max_new_tokens, "threads": args.threads},
        "prompts": list(PROMPTS[:args.prompts]),
        "services": services,
    }
    bf16 = [r for r in services if r["dtype"] == "bfloat16"]
    if bf16:
        began = time.perf_counter()
        report["bf16_analysis"] = analyse_bf16(args.target, bf16, prompts, tokenizer, args.k)
        report["bf16_analysis"]["wall_s"] = time.perf_counter() - began
    for r in services:
        r["identical_fraction"] = r["identical"] / r["prompts"]
        r["divergences_per_1000_tokens"] = 1000 * (r["prompts"] - r["identical"]) / max(r["shared_tokens"], 1)
    # The no-speculation outputs: the same in every service of a dtype? bfloat16's against float32's?
    plain = {dtype: [[tuple(x["plain"]) for x in r["runs"]] for r in services if r["dtype"] == dtype]
             for dtype in args.dtypes}
    report["plain_same_across_drafters"] = {dtype: all(runs == lists[0] for runs in lists)
                                            for dtype, lists in plain.items() if lists}
    if plain.get("bfloat16") and plain.get("float32"):
        report["plain_bf16_equals_fp32"] = sum(a == b for a, b in zip(plain["bfloat16"][0], plain["float32"][0]))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    if bf16:
        args.out.with_suffix(".md").write_text(markdown(report))
    print(json.dumps({f"{r['dtype']} {r['drafter']}": f"{r['identical']}/{r['prompts']}" for r in services}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
