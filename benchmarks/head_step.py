"""What a feature-level head's draft step costs, and where its chain should stop.

1. Step cost: one head step (1 position on a cache of 200, then draft-vocabulary logits and
   argmax, as the draft worker runs it) for the head as loaded (fp32, stock linears) and as
   packed on CPU (specdec.eagle.fast_cpu_head: oneDNN weights, fp32 and bfloat16) and as
   served (each linear's kernel per row count timed at load), interleaved, against a target step on the target worker's serving path: c = head / target.
2. Agreement of the served head's greedy chains with the fp32 head's, on held-out teacher
   data (bfloat16 rounds activations: a draft can flip at a near-tie).
3. Calibration and block policies, on the held-out teacher data of a `specdec distill --kind
   eagle` work directory: top-1 right vs the head's top-1 probability, and for fixed k and
   for stopping the chain when the head's probability of the whole chain falls below θ
   (draft_worker.drafters.eagle.MIN_CHAIN_PROB): tokens per round, accepted/proposed and the
   modelled speedup (tokens per round over 1 + per-round overhead + rows × (c + row cost)),
   exact greedy chains as in `specdec distill`'s evaluation. With alternatives
   (draft_worker.drafters.eagle.MIN_ALT_PROB, scored by the target as tree leaves): the
   head's second choice at a chain depth where the chain's probability so far times its own
   is at least the threshold costs a row, and where the chain is cut at that depth and it is
   the reference's token it adds that token and the target's next one.

    python benchmarks/head_step.py [--head smollm2-135m-eagle3] [--work DIR] [--threads 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

CONTEXT = 200
REPEATS = 41
CHAIN_K = 6
# Per-round costs in target steps for the modelled speedup (coordinator.adaptive's measured
# constants: a Propose round trip, a verification row).
ROUND_OVERHEAD = 0.05
ROW_COST = 0.045
THRESHOLDS = (0.0, 0.05, 0.1, 0.15, 0.2, 0.3)
ALT_THRESHOLDS = (0.02, 0.05, 0.1)


def time_steps(heads: dict, target_lm, context: list[int]) -> dict[str, float]:
    from specdec.runtime.costs import measure_head, measure_target

    samples: dict[str, list[float]] = {name: [] for name in heads}
    samples["target step"] = []
    for _ in range(5):  # interleaved rounds: drift hits every variant alike
        for name, head in heads.items():
            samples[name].append(measure_head(head, context, repeats=REPEATS // 5))
        samples["target step"].append(measure_target(target_lm, context, 1, repeats=3).target_step_s)
    return {name: statistics.median(v) for name, v in samples.items()}


@torch.inference_mode()
def chains(head, examples, index_of, k: int) -> list[tuple[int, int, list, list, list, list]]:
    """Per example: (prompt_len, length, conf[s][c], ok[s][c], conf2[s][c], ok2[s][c]) for
    chains drafted after each committed position c: step s+1's top-1 probability and whether
    its token is the reference's (teacher-forced features, as served), and the same for its
    second choice."""
    from specdec.train.examples import collate_eagle

    out = []
    for start in range(0, len(examples), 16):
        chunk = examples[start:start + 16]
        batch = collate_eagle(chunk, 0, index_of, head.config.hidden_size)
        steps = [torch.softmax(head.logits(o.float()), -1).topk(2, -1) for o in head.unrolled(batch.tokens,
                                                                                               batch.features_in, k)]
        for b, e in enumerate(chunk):
            n = len(e.tokens)

            def conf(j):
                return [[float(steps[s].values[b, c + s, j]) if c + s < n else 0.0 for c in range(n)] for s in range(k)]

            def ok(j):
                return [[c + s + 1 < n and int(head.draft_vocab[steps[s].indices[b, c + s, j]]) == int(e.tokens[c + s + 1])
                         for c in range(n)] for s in range(k)]

            out.append((e.prompt_len, n, conf(0), ok(0), conf(1), ok(1)))
    return out


def simulate(records, k: int, threshold: float, c: float, alt_threshold: float | None = None) -> dict:
    rounds = proposed = accepted = generated = leaves = 0
    cost = 0.0
    for prompt_len, n, conf, ok, conf2, ok2 in records:
        last = prompt_len - 1
        while last < n - 1:
            block, chain, alternatives = 0, 1.0, []
            while block < min(k, n - 1 - last):
                if alt_threshold is not None and chain * conf2[block][last] >= alt_threshold:
                    alternatives.append(block)
                chain *= conf[block][last]
                if chain < threshold:
                    break
                block += 1
            alternatives = [depth for depth in alternatives if depth < block]  # as the drafter keeps them
            run = 0
            while run < block and ok[run][last]:
                run += 1
            extra = 2 if run < block and run in alternatives and ok2[run][last] else 0
            rounds, proposed, accepted = rounds + 1, proposed + block, accepted + run
            generated, leaves = generated + run + 1 + (extra - 1 if extra else 0), leaves + len(alternatives)
            cost += 1 + ROUND_OVERHEAD + block * (c + ROW_COST) + len(alternatives) * ROW_COST
            last += run + 1 + (extra - 1 if extra else 0)
    return {"k": k, "min_chain_prob": threshold, "min_alt_prob": alt_threshold,
            "tokens_per_round": generated / rounds, "rows_per_round": (proposed + leaves) / rounds,
            "accepted_per_proposed": accepted / proposed if proposed else 0.0, "modelled_speedup": generated / cost}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--head", default="smollm2-135m-eagle3")
    parser.add_argument("--work", default=None, help="distill work directory with held-out data "
                                                     "(default: HEAD.work when it exists)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    from specdec import eagle
    from specdec.runtime.load import serving_lm
    from specdec.models import load_model, local_path

    plain = eagle.load(args.head)
    target, _ = load_model(plain.config.target)
    target_lm = serving_lm(target)
    heads = {"head fp32 (stock)": plain, "head packed fp32": eagle.fast_cpu_head(plain, torch.float32)}
    if eagle.fast_cpu_dtype() == torch.bfloat16:
        heads["head packed bf16"] = eagle.fast_cpu_head(plain, torch.bfloat16)
    heads["head as served (kernels timed at load)"] = eagle.fast_cpu_head(plain)
    served = list(heads.values())[-1]
    context = list(range(100, 100 + CONTEXT))
    seconds = time_steps(heads, target_lm, context)
    result: dict = {"threads": args.threads, "context": CONTEXT, "seconds": seconds,
                    "c": {name: s / seconds["target step"] for name, s in seconds.items() if name != "target step"}}
    print(f"step at a {CONTEXT}-token context ({args.threads} threads), median of {REPEATS}:")
    for name, s in seconds.items():
        ratio = "" if name == "target step" else f"  c = {s / seconds['target step']:.3f}"
        print(f"  {name:28s} {s * 1e3:7.3f} ms{ratio}")

    work = Path(args.work) if args.work else Path(str(local_path(args.head)) + ".work")
    if (work / "data").is_dir():
        from specdec.train.examples import load_eagle_examples

        examples = load_eagle_examples(work, "heldout", tuple(plain.config.aux_layers))
        index_of = torch.full((int(plain.embed.shape[0]),), -1, dtype=torch.long)
        index_of[plain.draft_vocab] = torch.arange(len(plain.draft_vocab))
        reference = chains(plain, examples, index_of, CHAIN_K)
        records = chains(served, examples, index_of, CHAIN_K) if served is not plain else reference
        same = total = 0
        for (_, n, _, ok_a, *_), (_, _, _, ok_b, *_) in zip(reference, records):
            same += sum(a == b for a, b in zip(ok_a[0], ok_b[0]))
            total += n
        c = result["c"][list(heads)[-1]]
        bins: dict[int, list[int]] = {}
        for prompt_len, n, conf, ok, *_ in records:
            for pos in range(prompt_len - 1, n - 1):
                entry = bins.setdefault(min(9, int(conf[0][pos] * 10)), [0, 0])
                entry[0] += 1
                entry[1] += ok[0][pos]
        policies = [simulate(records, k, 0.0, c) for k in (1, 2, 3, 4)]
        policies += [simulate(records, k, t, c) for k in (4, 6) for t in THRESHOLDS if t > 0]
        policies += [simulate(records, 4, t, c, a) for t in (0.05, 0.1, 0.15) for a in ALT_THRESHOLDS]
        result.update({"heldout_examples": len(examples), "served_vs_fp32_step1_same": same / total,
                       "calibration": {f"{b / 10:.1f}-{(b + 1) / 10:.1f}": {"positions": v[0], "top1_right": v[1] / v[0]}
                                       for b, v in sorted(bins.items())},
                       "policies": policies, "policy_c": c})
        print(f"\nheld-out ({len(examples)} answers): served head's step-1 right/wrong same as fp32's at "
              f"{same / total:.4f} of positions")
        print("top-1 probability -> top-1 right:")
        for name, v in result["calibration"].items():
            print(f"  {name}  {v['top1_right']:.2f}  ({v['positions']} positions)")
        print(f"policies (c = {c:.3f}, row {ROW_COST}, round {ROUND_OVERHEAD}):")
        for p in policies:
            alt = f", alternatives ≥ {p['min_alt_prob']:.2f}" if p["min_alt_prob"] is not None else ""
            print(f"  k ≤ {p['k']}  min chain prob {p['min_chain_prob']:.2f}{alt}: {p['tokens_per_round']:.2f} tok/round, "
                  f"{p['rows_per_round']:.2f} rows, accepted/proposed {p['accepted_per_proposed']:.2f}, "
                  f"modelled {p['modelled_speedup']:.3f}×")
    else:
        print(f"\n(no held-out data under {work}: calibration and policies skipped)")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
