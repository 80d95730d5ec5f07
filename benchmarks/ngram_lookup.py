"""The host cost of a session's n-gram lookup per drafting round, by context length: a scan
of the whole context (specdec.ngram.lookup) against the session's index taking in the
round's new tokens and looking up (specdec.ngram.NgramIndex), and the per-step comparison of
a head session's fed ids with its context (specdec.sessions.common_prefix_len) element by
element in Python against the C comparison it now makes. Both run once per drafting session
per step on the target worker's model thread, so on a GPU serving hundreds of long sessions
they add up to host time per step.

    python benchmarks/ngram_lookup.py                  # contexts 300, 1000, 8000
    python benchmarks/ngram_lookup.py --lengths 500,4000 --rounds 500

Random token ids from a 49,152-token vocabulary (SmolLM2's), so the lookup mostly finds no
match and scans everything (its worst case); each round appends 2 tokens. Both ways'
answers are checked equal; the garbage collector is off while timing, as in timeit. Prints the JSON report (also written to --out/NAME.json).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdec.bench.machine import describe  # noqa: E402
from specdec.ngram import NgramIndex, lookup  # noqa: E402
from specdec.sessions import common_prefix_len  # noqa: E402

MAX_NGRAM, MIN_NGRAM, K = 3, 2, 4  # the head's copies (specdec.eagle.policy)


def python_prefix_len(a: list[int], b: list[int]) -> int:
    """The element-by-element comparison common_prefix_len made before."""
    n, i = min(len(a), len(b)), 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def one_length(length: int, rounds: int, seed: int) -> dict:
    gc.collect()
    gc.disable()  # as timeit does: a collection in a timed loop would be charged to whichever way ran
    try:
        return _one_length(length, rounds, seed)
    finally:
        gc.enable()


def _one_length(length: int, rounds: int, seed: int) -> dict:
    rng = random.Random(seed)
    sequence = [rng.randrange(49152) for _ in range(length + 2 * rounds)]
    context = sequence[:length]
    grown = [sequence[:length + 2 * (r + 1)] for r in range(rounds)]  # each round's context
    index = NgramIndex(MAX_NGRAM, MIN_NGRAM)
    index.sync(context)
    began = time.perf_counter()
    scanned = [lookup(c, K, MAX_NGRAM, MIN_NGRAM) for c in grown]
    scan_s = (time.perf_counter() - began) / rounds
    began = time.perf_counter()
    indexed = []
    for c in grown:
        index.sync(c)
        indexed.append(index.lookup(K))
    index_s = (time.perf_counter() - began) / rounds
    assert indexed == scanned
    fed = grown[-1][:-2]  # a head session's ids: everything but the round's new tokens
    began = time.perf_counter()
    for _ in range(rounds):
        loop = python_prefix_len(fed, grown[-1])
    loop_s = (time.perf_counter() - began) / rounds
    began = time.perf_counter()
    for _ in range(rounds):
        compared = common_prefix_len(fed, grown[-1])
    compare_s = (time.perf_counter() - began) / rounds
    assert loop == compared == len(fed)
    return {"context": length, "lookup_scan_us": scan_s * 1e6, "lookup_index_us": index_s * 1e6,
            "index_over_scan": index_s / scan_s, "prefix_python_us": loop_s * 1e6, "prefix_c_us": compare_s * 1e6,
            "c_over_python": compare_s / loop_s, "index_bytes_per_token": index.held_bytes() / len(index.ids)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="300,1000,8000")
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--name", default="ngram-lookup")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    rows = []
    for length in (int(n) for n in args.lengths.split(",")):
        row = one_length(length, args.rounds, seed=length)
        rows.append(row)
        print(f"context {length}: lookup {row['lookup_scan_us']:.1f} µs scanned, {row['lookup_index_us']:.1f} µs "
              f"indexed ({row['index_over_scan']:.3f}×); prefix {row['prefix_python_us']:.1f} µs in Python, "
              f"{row['prefix_c_us']:.1f} µs in C ({row['c_over_python']:.3f}×)", file=sys.stderr, flush=True)
    report = {"command": "python benchmarks/ngram_lookup.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "machine": describe(1), "config": vars(args), "lengths": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
