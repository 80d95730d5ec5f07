"""How copies and the head's chains fare at a price of a draft row: the target worker's own
Verifier with its head (no gRPC), the bench's prompts one session at a time, greedy, each
round asking the head for up to k tokens at `min_draft_prob` = the price, as the coordinator
asks under load (coordinator.rounds._draft_price).

    python benchmarks/copy_price.py                         # prices 0, 0.25, 0.5; 12 prompts
    python benchmarks/copy_price.py --prices 0,0.5 --prompts 4

For each price, a fresh worker (fresh copy records): the draft tokens proposed and accepted,
split by whether the round's draft was a copy (an n-gram lookup) or the head's chain, and
the draft's value at that price, accepted − price × proposed (tokens the round gains over
what its rows cost, in the price's units). A copy carries no probability of its own; on the
target worker it is cut by its measured chance of being right (target_worker.head), so at a
price near 0 it is drafted whole and under a price only as deep as it pays.

A draft counts as a copy when it is the lookup's continuation of the context or a prefix of
it, whatever the code that drafted it: run from a checkout of the commit before a change
(copy the script there), it measures the same way.

Prints the JSON report (also written to --out/NAME.json).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdec.bench.machine import describe  # noqa: E402
from specdec.bench.prompts import PROMPTS  # noqa: E402
from specdec.config import WorkerConfig  # noqa: E402
from specdec.models import default_draft, load_model  # noqa: E402
from specdec.ngram import DEFAULT_MAX_NGRAM, lookup  # noqa: E402
from target_worker.service import build_servicer  # noqa: E402
from target_worker.verify import Round  # noqa: E402


def one_price(target: str, price: float, k: int, prompts: int, new_tokens: int) -> dict:
    model, tokenizer = load_model(target)
    servicer = build_servicer(WorkerConfig(model=target, head=default_draft(target)), model, tokenizer)
    verifier = servicer.verifier
    lookup_ngram = verifier.head.drafter.lookup_ngram
    counts = {kind: {"rounds": 0, "proposed": 0, "accepted": 0} for kind in ("copy", "chain")}
    try:
        for n, prompt in enumerate(PROMPTS[:prompts]):
            ids = list(tokenizer.apply_chat_template([{"role": "user", "content": prompt.text}],
                                                     add_generation_prompt=True)["input_ids"])
            session, start, pending, drafts, kind = f"s{n}", 0, ids, [], "chain"
            context = list(ids)
            while len(context) - len(ids) < new_tokens:
                verdict = verifier.verify_batch([Round(session, start, pending, drafts, draft_next=k,
                                                       min_draft_prob=price)]).results[0]
                if drafts:
                    counts[kind]["rounds"] += 1
                    counts[kind]["proposed"] += len(drafts)
                    counts[kind]["accepted"] += verdict.accepted
                # The worker holds the context it was sent; the next round sends what this one committed.
                start = len(context)
                pending = list(drafts[:verdict.accepted]) + [verdict.next_token] + list(verdict.extra)
                context += pending
                drafts = list(verdict.next_drafts)
                # A copy is the lookup's continuation, or a prefix of it (cut by its price).
                copy = lookup(context, k, max(DEFAULT_MAX_NGRAM, lookup_ngram), lookup_ngram) if lookup_ngram else []
                kind = "copy" if drafts and drafts == copy[:len(drafts)] else "chain"
    finally:
        servicer.thread.shutdown()
    for row in counts.values():
        row["acceptance"] = row["accepted"] / row["proposed"] if row["proposed"] else 0.0
        row["per_round"] = row["proposed"] / row["rounds"] if row["rounds"] else 0.0
    proposed = sum(row["proposed"] for row in counts.values())
    accepted = sum(row["accepted"] for row in counts.values())
    return {"price": price, **counts, "proposed": proposed, "accepted": accepted,
            "value": accepted - price * proposed}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--prices", default="0,0.25,0.5")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--name", default="copy-price")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = []
    for price in (float(p) for p in args.prices.split(",")):
        row = one_price(args.target, price, args.k, args.prompts, args.new_tokens)
        rows.append(row)
        print(f"price {price:.2f}: copies {row['copy']['proposed']} proposed, α {row['copy']['acceptance']:.2f}; "
              f"chains {row['chain']['proposed']}, α {row['chain']['acceptance']:.2f}; value {row['value']:.1f}",
              file=sys.stderr, flush=True)
    report = {"command": "python benchmarks/copy_price.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "machine": describe(args.threads), "config": vars(args), "prices": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
