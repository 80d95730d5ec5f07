"""What recording the target's features costs the target worker per step while sessions draft
nothing (a paused request, speculation switched off, a price too high under load): every
step hands the inline head one more row per session (target_worker.head.InlineHead.record).
Against the way it was done before, one tensor per session grown by copying it whole at
every step (kept here as the baseline), so a session paused for n steps copied O(n²) rows.

    python benchmarks/head_record.py [--sessions 64] [--prompt 100] [--steps 164] [--threads 2]

Feature sizes: SmolLM2-135M's with three layers (the default head's, 3 × 576) and a
Llama-3.1-8B-shaped one (3 × 4096). Prints ms per step for both ways, interleaved.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdec.sessions import Session  # noqa: E402
from target_worker.head import InlineHead  # noqa: E402


class CopyWhole:
    """The baseline: one tensor per session, the new rows appended by torch.cat."""

    def record(self, session: Session, start: int, rows: torch.Tensor) -> None:
        if session.head is None:
            session.head = [0, rows]
            return
        first, held = session.head
        session.head = [first, torch.cat([held[:start - first], rows])]


def per_step_ms(recorder, feature: int, sessions: int, prompt: int, steps: int) -> float:
    torch.manual_seed(0)
    prompts = torch.randn(sessions, prompt, feature).half()
    new = torch.randn(steps, sessions, 1, feature).half()
    held = [Session(f"s{i}") for i in range(sessions)]
    for session, rows in zip(held, prompts):
        recorder.record(session, 0, rows)
    began = time.perf_counter()
    for step in range(steps):
        for session, rows in zip(held, new[step]):
            recorder.record(session, prompt + step, rows)
    return (time.perf_counter() - began) / steps * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sessions", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=100)
    parser.add_argument("--steps", type=int, default=164)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    head = InlineHead.__new__(InlineHead)  # record() needs no model
    head.batched = None
    for name, feature in (("SmolLM2-135M, 3 layers", 3 * 576), ("Llama-3.1-8B shape, 3 layers", 3 * 4096)):
        times = {"copy whole (before)": [], "pieces (InlineHead.record)": []}
        for _ in range(args.repeats):
            for label, recorder in (("copy whole (before)", CopyWhole()), ("pieces (InlineHead.record)", head)):
                times[label].append(per_step_ms(recorder, feature, args.sessions, args.prompt, args.steps))
        before, after = (statistics.median(t) for t in times.values())
        print(f"{name}: F = {feature}, {args.sessions} sessions, {args.prompt}-token prompts, {args.steps} steps: "
              f"{before:.2f} ms/step copying whole, {after:.2f} ms/step in pieces ({after / before:.3f}×)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
