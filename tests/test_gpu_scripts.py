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


def test_paged_step_cut_by_its_time_cap_still_reports() -> None:
    """gpu_check.sh runs each part under `timeout`: on SIGTERM paged_step_gpu.py stops, prints
    its report with a note saying where it was cut, and exits 124."""
    import signal
    import time

    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="2")
    process = subprocess.Popen([sys.executable, "benchmarks/paged_step_gpu.py", "--dry-run"], cwd=REPO_ROOT,
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:  # cut it once the timed part has begun
        line = process.stderr.readline()
        if "bandwidth" in line or not line:
            break
    process.send_signal(signal.SIGTERM)
    out, _ = process.communicate(timeout=120)
    assert process.returncode == 124
    report = json.loads(out)
    assert any("cut short by the time cap" in note for note in report["notes"])
    assert report["correctness"] and all(r["pass"] for r in report["correctness"])


def test_the_warp_check_forgives_only_tokens_on_the_top_p_cut() -> None:
    """kernels_gpu.py: a kept set that differs from the reference's by the token on which the
    running mass reaches top-p passes; one that differs by the most likely token does not."""
    import torch

    sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
    from kernels_gpu import top_p_cut_only

    from target_worker.kernels.warp_ref import warp_probs_ref

    torch.manual_seed(0)
    logits = torch.randn(2, 1000) * 3
    temperature, top_k = torch.full((2,), 0.8), torch.full((2,), 50, dtype=torch.int64)
    expected = warp_probs_ref(logits, temperature, top_k, torch.full((2,), 0.9))
    kept = (expected[0] > 0).nonzero()[:, 0]
    cut = int(kept[logits[0, kept].argmin()])  # the last token the reference keeps
    # top_p placed exactly where the mass reaches that token: it may fall either side.
    x = logits[0]
    e = torch.exp((x - x.max()) / 0.8)
    order = x.argsort(descending=True)[:50]
    mass = e[order].cumsum(0) / e[order].sum()
    top_p = torch.tensor([float(mass[len(kept) - 2]), 0.9])
    dropped = expected.clone()
    dropped[0, cut] = 0
    assert top_p_cut_only(logits, temperature, top_k, top_p, dropped, expected, [0])
    assert not top_p_cut_only(logits, temperature, top_k, torch.full((2,), 0.9), dropped, expected, [0],
                              margin=1e-9)
    best = expected.clone()
    best[0, int(logits[0].argmax())] = 0
    assert not top_p_cut_only(logits, temperature, top_k, top_p, best, expected, [0])


def test_the_triton_preflight_says_whether_a_kernel_runs() -> None:
    """benchmarks/triton_preflight.py, which gpu_check.sh runs first: under the interpreter on
    CPU its kernel computes and it exits 0; compiled for a device this machine lacks, it exits
    non-zero with the reason on one line."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="2")
    script = [sys.executable, "benchmarks/triton_preflight.py"]
    ran = subprocess.run([*script, "--device", "cpu"], cwd=REPO_ROOT, env={**env, "TRITON_INTERPRET": "1"},
                         capture_output=True, text=True, timeout=300, check=False)
    assert ran.returncode == 0 and "computed on cpu" in ran.stdout, ran.stderr[-2000:]
    if torch_has_cuda():
        return
    failed = subprocess.run(script, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert failed.returncode != 0
    assert failed.stderr.strip().splitlines()[-1].startswith("triton_preflight.py: a Triton kernel does not launch")


def torch_has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()
