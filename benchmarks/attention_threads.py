"""Per-session attention calls on one thread or the intra-op pool, in the target worker's own
batched steps (specdec.runtime.attention_threads):

    python benchmarks/attention_threads.py            # SmolLM2-135M, ~4 min on 2 cores
    python benchmarks/attention_threads.py --configs 16x256 --repeats 5

Per configuration B×L (B sessions, each with an L-token context, one new token a step), the
worker's Verifier steps in three modes taking turns, `--steps` steps each, `--repeats` times:
"chosen" (each step's calls in the mode its work class measured faster, as served), "pool"
(every call on the intra-op pool: SDPA's own choice, as before) and "one thread" (every call
on one; these steps are not in the chooser's record). Before them `--warm` steps are served
with the chooser deciding, as a serving worker's would have. Prints ms per step (the
median) and the ratios; writes --out/NAME.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from specdec.bench.machine import describe  # noqa: E402
from specdec.runtime import attention_threads  # noqa: E402

MODES = ("chosen", "pool", "one thread")


class Forced(attention_threads.AttentionThreads):
    """Every step in one mode, and nothing recorded."""

    def __init__(self, mode: int) -> None:
        super().__init__()
        self.forced = mode

    def step(self, work_per_call: float) -> None:
        super().step(work_per_call)
        self.current = (self.current[0], self.forced)

    def record(self, index: int, mode: int, seconds: float) -> None:
        pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--configs", default="16x64,16x256,64x256,4x1024,4x2048",
                        help="comma-separated BxL: sessions x context tokens")
    parser.add_argument("--steps", type=int, default=4, help="steps per mode per repeat")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warm", type=int, default=24,
                        help="steps served (the chooser deciding) before the timed ones, per configuration")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--name", default="attention-threads")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    from specdec.config import WorkerConfig
    from specdec.models import load_model
    from target_worker.service import build_servicer
    from target_worker.verify import Round

    model, tokenizer = load_model(args.model)
    servicer = build_servicer(WorkerConfig(model=args.model), model, tokenizer)
    verifier = servicer.verifier
    chooser = attention_threads.ATTENTION  # the served choice, kept over the configurations
    forced = {"pool": Forced(attention_threads.POOL), "one thread": Forced(attention_threads.SERIAL)}
    results = []
    try:
        for index, config in enumerate(args.configs.split(",")):
            batch, context = (int(x) for x in config.split("x"))
            held = [0] * batch
            pending = [[1000 + (7 * i + j) % 20000 for j in range(context)] for i in range(batch)]

            def step() -> float:
                began = time.perf_counter()
                outcome = verifier.verify_batch([Round(f"c{index}s{i}", held[i], pending[i], [])
                                                 for i in range(batch)])
                elapsed = time.perf_counter() - began
                for i, verdict in enumerate(outcome.results):
                    held[i], pending[i] = verdict.cached_len, [verdict.next_token]
                return elapsed

            step()  # the prefill
            for _ in range(args.warm):  # the chooser meets this load before it is timed, as when serving
                step()
            times: dict[str, list[float]] = {mode: [] for mode in MODES}
            for repeat in range(args.repeats):
                for mode in (MODES if repeat % 2 == 0 else MODES[::-1]):
                    attention_threads.ATTENTION = forced.get(mode, chooser)
                    try:
                        times[mode] += [step() for _ in range(args.steps)]
                    finally:
                        attention_threads.ATTENTION = chooser
            row = {"B": batch, "context": context, "ms_per_step": {m: 1e3 * statistics.median(t)
                                                                   for m, t in times.items()}}
            ms = row["ms_per_step"]
            row["chosen_over_pool"] = ms["chosen"] / ms["pool"]
            row["chosen_over_one_thread"] = ms["chosen"] / ms["one thread"]
            row["one_thread_over_pool"] = ms["one thread"] / ms["pool"]
            results.append(row)
            print(f"B={batch:3d} L={context:5d}: chosen {ms['chosen']:7.1f} ms, pool {ms['pool']:7.1f} ms, "
                  f"one thread {ms['one thread']:7.1f} ms | chosen/pool {row['chosen_over_pool']:.3f}, "
                  f"chosen/one thread {row['chosen_over_one_thread']:.3f}", flush=True)
            for i in range(batch):
                verifier.store.release(f"c{index}s{i}")
    finally:
        servicer.thread.shutdown()
    report = {"command": "python benchmarks/attention_threads.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "machine": describe(args.threads), "config": vars(args),
              "chosen_classes": chooser.chosen(), "results": results}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(report, indent=2) + "\n")
    for work, choice in report["chosen_classes"].items():
        print(f"work class 2^{work}: {choice}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
