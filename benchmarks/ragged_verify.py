"""Greedy verification of a step's ragged chains: in place (ops.greedy_verify_rows) against
a copy padded to the longest chain (ops.greedy_verify over [B, k + 1, V]), side by side.

    python benchmarks/ragged_verify.py [--vocab 49152] [--threads 2] [--json FILE]

A step of B rounds where one round verifies a chain of k drafts and the others none: the
forward scored B + k rows. Padded, every chain is verified as k + 1 rows (B·(k + 1) rows
gathered and reduced); in place, each of the B + k rows once. Both on this machine's default
device for the ops (the torch reference on CPU, the Triton kernels on CUDA); their results
are checked equal. Median ms of REPEATS calls per case, the two ways interleaved.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdec.bench.machine import describe  # noqa: E402
from target_worker.kernels import ops  # noqa: E402

REPEATS = 15


def case(batch: int, k: int, vocab: int, device: str) -> dict:
    generator = torch.Generator().manual_seed(batch * 10 + k)
    every = torch.randn(batch + k, vocab, generator=generator).to(device)  # [R, V]
    index = torch.zeros(batch, k + 1, dtype=torch.long)
    index[0] = torch.arange(k + 1)
    index[1:] = torch.arange(k + 1, batch + k)[:, None]  # pad rows repeat the chain's row
    index = index.to(device)
    draft = every[:k].argmax(-1)[None].repeat(batch, 1).reshape(batch, k)
    num_draft = torch.zeros(batch, dtype=torch.long, device=device)
    num_draft[0] = k

    def padded():
        return ops.greedy_verify(every[index], draft, num_draft)

    def in_place():
        return ops.greedy_verify_rows(every, index, draft, num_draft)

    assert all(torch.equal(a, b) for a, b in zip(padded(), in_place()))
    times: dict[str, list[float]] = {"padded": [], "in_place": []}
    for _ in range(REPEATS):
        for name, fn in (("padded", padded), ("in_place", in_place)):
            if device == "cuda":
                torch.cuda.synchronize()
            began = time.perf_counter()
            fn()[0].tolist()  # the step's host read
            times[name].append(time.perf_counter() - began)
    padded_ms, in_place_ms = (1e3 * statistics.median(times[n]) for n in ("padded", "in_place"))
    return {"B": batch, "k": k, "V": vocab, "padded_ms": round(padded_ms, 3), "in_place_ms": round(in_place_ms, 3),
            "in_place_vs_padded": round(in_place_ms / padded_ms, 3)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=49152, help="vocabulary (SmolLM2: 49152)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default=None, help="also write the report here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = [case(batch, k, args.vocab, device) for batch in (1, 16, 64) for k in (1, 5)]
    report = {"command": "python benchmarks/ragged_verify.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "machine": describe(args.threads), "device": device, "results": rows}
    for row in rows:
        print(f"B={row['B']:>3} k={row['k']}: padded {row['padded_ms']:8.3f} ms, in place {row['in_place_ms']:8.3f} ms, "
              f"in place / padded {row['in_place_vs_padded']:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
