"""The GPU benchmarks that benchmarks/gpu_check.sh runs, in their --dry-run mode on CPU: their
argument parsing, inputs, checks and JSON report, so a GPU run does not fail on the script."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
CASES = {"chain", "tree", "rollback", "prefix"}


def dry_run(script: str) -> dict:
    """The script's JSON report of `--dry-run`; it must exit 0."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="2")
    result = subprocess.run(
        [sys.executable, f"benchmarks/{script}", "--dry-run"],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600, check=False,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout)


def test_paged_step_dry_run_reports_every_part() -> None:
    """benchmarks/paged_step_gpu.py --dry-run: every correctness case passes for both dtypes and
    every attention (the padded steps of CUDA graphs, run eagerly, replayed in each chain case),
    every batch is timed on the three paths, and the roofline, memory and targets are
    reported."""
    report = dry_run("paged_step_gpu.py")
    assert report["all_correct"] and "error" not in report
    rows = report["correctness"]
    assert {(r["dtype"], r["attention"], r["case"]) for r in rows} == {
        (dtype, attention, case) for dtype in ("float32", "bfloat16")
        for attention in ("ops", "reference", "ops+graphs") for case in CASES
    }
    assert all(r["pass"] for r in rows)
    assert all(r["replayed"] for r in rows if r["attention"] == "ops+graphs" and r["case"] != "tree")
    assert all(r["max_abs_diff"] <= report["tolerance_fp32"] for r in rows if r["dtype"] == "float32")
    steps = report["steps"]
    assert [r["B"] for r in steps["paged"]] == [r["B"] for r in steps["graphs"]] == [r["B"] for r in steps["old"]] \
        == [1, 2]
    assert all(r["ms"] > 0 and r["tokens_per_s"] > 0 for r in steps["paged"] + steps["graphs"] + steps["old"])
    assert report["roofline"]["step_over_roofline"] > 0 and report["roofline"]["graphs_step_over_roofline"] > 0
    for memory in ("memory", "memory_graphs"):
        assert report[memory]["flat"] and report[memory]["steps"] == 100
    assert report["targets"]["argmax_identical_fp32"]["pass"] is True
    assert set(report["targets"]) >= {"step_B2_over_B1", "throughput_over_old_B2", "step_B1_over_roofline",
                                      "step_B1_graphs_over_roofline", "memory_flat"}
