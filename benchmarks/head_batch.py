"""What drafting costs a verification step when B sessions each want a block from the head on
the target worker: each session drafted alone (EagleDrafter.propose_tree on its own cache, a
Python loop over sessions, as the draft worker's head still runs) against all sessions
drafted together (specdec.eagle.batched: one head pass per depth) over buffered caches and
over a paged pool (specdec.eagle.paged), on the same features and contexts, interleaved, in
one run.

Each round feeds every session its newly committed tokens (the target's greedy
continuation, as a fully accepted block would) with the target's real hidden states, then
drafts k. Prints milliseconds per round for each way and the ratios to drafting alone at
each B; also counts how many drafts equal the alone drafts (they differ only where float
rounding flips a near-tie).

    python benchmarks/head_batch.py [--head smollm2-135m-eagle90] [--batches 1,4,16,64] [--json out.json]
    python benchmarks/head_batch.py --kernels       # the served head's kernels instead

--kernels compares, drafting together over buffered caches, the head as the workers serve
it (each linear's kernel per row count timed at load, specdec.eagle.cpu) with the same head
packed in bfloat16 and in fp32 at every row count, and with the plain fp32 head; ratios are
over packed bfloat16, what was served before the kernels were timed.
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
ROUNDS = 12
ADVANCE = 3  # committed tokens per round


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--head", default="smollm2-135m-eagle90")
    parser.add_argument("--batches", default="1,4,16,64")
    parser.add_argument("--k", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default=None)
    parser.add_argument("--kernels", action="store_true", help="compare the served head's kernels instead")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

    from specdec import eagle
    from specdec.eagle.batched import BatchedDrafter, BufferedHead
    from specdec.eagle.paged import PagedHead, head_pool_blocks
    from specdec.eagle.policy import EagleDrafter, Features
    from specdec.models import load_model
    from specdec.sessions import Session, SyncedContext, common_prefix_len

    plain = eagle.load(args.head)
    target, _ = load_model(plain.config.target)
    served = eagle.fast_cpu_head(plain)  # as the target worker serves it on this CPU
    batches = [int(b) for b in args.batches.split(",")]
    longest = CONTEXT + ROUNDS * ADVANCE + args.k
    torch.manual_seed(0)
    with torch.inference_mode():
        ids = torch.randint(100, 20000, (max(batches), longest))
        hidden = []
        for row in ids:
            out = target.model(input_ids=row[None]).last_hidden_state[0]
            hidden.append(out.to(torch.float16))

    def rounds(drafter_fn, batch: int, sessions: list[Session]) -> tuple[float, list]:
        drafts, times = [], []
        for r in range(ROUNDS):
            end = CONTEXT + r * ADVANCE
            contexts = [ids[s, :end].tolist() for s in range(batch)]
            features = [Features.from_rows(0, hidden[s][:end - 1]) for s in range(batch)]
            synced = [SyncedContext(sessions[s], contexts[s], common_prefix_len(sessions[s].ids, contexts[s]))
                      for s in range(batch)]
            began = time.perf_counter()
            drafts.append(drafter_fn(synced, [args.k] * batch, features))
            times.append(time.perf_counter() - began)
        return statistics.median(times[1:]), drafts  # the first round takes in the whole prompt

    policy = dict(min_chain_prob=0.0, lookup_ngram=0)  # every session drafts k: the cost of a full block
    if args.kernels:
        return compare_kernels(args, plain, served, batches, rounds, policy)
    result = {"head": args.head, "threads": args.threads, "k": args.k, "context": CONTEXT, "batches": {}}
    print(f"{args.head}, k = {args.k}, context {CONTEXT}, {args.threads} threads: ms per round "
          "(ratios: over drafting alone)")
    print(f"{'B':>4} {'alone':>8} {'buffered':>9} {'paged':>8} {'buf/alone':>10} {'paged/alone':>12} {'same drafts':>12}")
    for batch in batches:
        alone = EagleDrafter("alone", served, **policy)
        ways = {
            "buffered": BatchedDrafter(EagleDrafter("buffered", served, **policy), BufferedHead(served)),
            "paged": BatchedDrafter(EagleDrafter("paged", served, **policy),
                                    PagedHead(served, head_pool_blocks(batch * longest, batch, args.k))),
        }
        samples = {"alone": [], "buffered": [], "paged": []}
        same = total = 0
        for repeat in range(3):  # interleaved repeats, fresh sessions each
            sessions = [Session(f"a{s}") for s in range(batch)]
            t, d_alone = rounds(lambda sy, ks, fs: [alone.propose_tree(s, k, f) for s, k, f in zip(sy, ks, fs)],
                                batch, sessions)
            samples["alone"].append(t)
            for name, way in ways.items():
                sessions = [Session(f"{name}{s}") for s in range(batch)]
                t, drafts = rounds(way.propose_tree, batch, sessions)
                for session in sessions:
                    way.forget(session)
                samples[name].append(t)
                for x, y in zip(d_alone, drafts):
                    same += sum(a == b for a, b in zip(x, y))
                    total += len(x)
        ms = {name: statistics.median(v) * 1e3 for name, v in samples.items()}
        result["batches"][batch] = {**{f"{name}_ms": v for name, v in ms.items()},
                                    "buffered_over_alone": ms["buffered"] / ms["alone"],
                                    "paged_over_alone": ms["paged"] / ms["alone"],
                                    "same_drafts": same, "drafts": total}
        print(f"{batch:>4} {ms['alone']:>8.2f} {ms['buffered']:>9.2f} {ms['paged']:>8.2f} "
              f"{ms['buffered'] / ms['alone']:>10.3f} {ms['paged'] / ms['alone']:>12.3f} {same:>6}/{total}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


def compare_kernels(args, plain, served, batches, rounds, policy) -> int:
    from specdec import eagle
    from specdec.eagle.batched import BatchedDrafter, BufferedHead
    from specdec.eagle.policy import EagleDrafter
    from specdec.sessions import Session

    heads = {"served": served, "packed bf16": eagle.fast_cpu_head(plain, torch.bfloat16),
             "packed fp32": eagle.fast_cpu_head(plain, torch.float32), "plain fp32": plain}
    result = {"head": args.head, "threads": args.threads, "k": args.k, "context": CONTEXT, "kernels": {},
              "choice": {name: list(m.choice) for name, m in served.named_modules() if hasattr(m, "choice")}}
    print(f"{args.head}, k = {args.k}, context {CONTEXT}, {args.threads} threads: ms per round, all sessions "
          "drafted together (ratios: over packed bf16)")
    print(f"{'B':>4} " + " ".join(f"{name:>12}" for name in heads) + f" {'served/bf16':>12} {'fp32/bf16':>10}")
    for batch in batches:
        samples: dict[str, list[float]] = {name: [] for name in heads}
        for repeat in range(3):  # interleaved repeats, fresh sessions each
            for name, head in heads.items():
                way = BatchedDrafter(EagleDrafter(name, head, **policy), BufferedHead(head))
                sessions = [Session(f"{name}{s}") for s in range(batch)]
                t, _ = rounds(way.propose_tree, batch, sessions)
                samples[name].append(t)
        ms = {name: statistics.median(v) * 1e3 for name, v in samples.items()}
        result["kernels"][batch] = {**{f"{name}_ms": v for name, v in ms.items()},
                                    "served_over_bf16": ms["served"] / ms["packed bf16"],
                                    "fp32_over_bf16": ms["packed fp32"] / ms["packed bf16"]}
        print(f"{batch:>4} " + " ".join(f"{v:>12.2f}" for v in ms.values())
              + f" {ms['served'] / ms['packed bf16']:>12.3f} {ms['packed fp32'] / ms['packed bf16']:>10.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
