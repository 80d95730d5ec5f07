"""The chaos run of benchmarks/chaos.py, one minute of it: two coordinators, two targets, two
drafts and a wrong-weights target as separate processes on loopback, under steady greedy and
seeded load, through every fault of the schedule (kills with one and two replicas, a frozen
and a slow replica, flapping DNS, the wrong weights, a coordinator kill, a flood of
whole-context prompts); the history has no lost, wrong or unknown request."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CHAOS = REPO / "benchmarks" / "chaos.py"
DURATION_S = 60
# Set-up (three tiny models, eleven interpreters, the references) and shutdown come on top.
TIMEOUT_S = DURATION_S + 300


@pytest.fixture(scope="module")
def chaos_report(tmp_path_factory) -> tuple[int, dict, list, str]:
    out = tmp_path_factory.mktemp("chaos")
    # Its own session, so that a run overrunning the timeout goes down with its services.
    run = subprocess.Popen(
        [sys.executable, str(CHAOS), "--duration", str(DURATION_S), "--json-out", str(out / "report.json"),
         "--history-out", str(out / "history.json")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, start_new_session=True,
    )
    try:
        _, stderr = run.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(run.pid, signal.SIGKILL)
        _, stderr = run.communicate()
    report = json.loads((out / "report.json").read_text()) if (out / "report.json").exists() else {}
    history = json.loads((out / "history.json").read_text()) if (out / "history.json").exists() else []
    return run.returncode, report, history, stderr[-4000:]


def summary(report: dict) -> dict:
    return {key: report.get(key) for key in ("error", "lost", "wrong", "unknown", "bad_examples",
                                             "unknown_examples", "faults_failed", "crashed")}


def test_chaos_loses_and_changes_nothing(chaos_report):
    returncode, report, _, stderr = chaos_report
    assert report, f"no report; stderr:\n{stderr}"
    assert (report["lost"], report["wrong"], report["unknown"]) == (0, 0, 0), summary(report)
    assert report["ok"] > 0 and report["passed"] and returncode == 0, summary(report)


def test_every_fault_happened_under_load(chaos_report):
    _, report, _, stderr = chaos_report
    assert report, f"no report; stderr:\n{stderr}"
    assert report["faults_failed"] == [] and report["crashed"] == [], summary(report)
    assert set(report["faults"]) == {"target-kill", "draft-kill", "target-stop", "target-kill-last", "slow-target",
                                     "dns-flap", "wrong-weights", "coordinator-kill", "draft-kill-last", "flood"}
    for name, fault in report["faults"].items():
        assert fault["happened"] and fault["requests"] > 0, (name, fault)
    # The last target was killed while the other was frozen; both drafts were down at once.
    assert report["faults"]["target-kill-last"]["other_target_stopped"]
    assert len(report["faults"]["draft-kill-last"]["killed"]) == 2
    # Whole-context prompts were served during the flood.
    assert report["by_kind"]["flood"] > 0 and report["by_kind"]["greedy"] > 0 and report["by_kind"]["sampled"] > 0


def test_the_wrong_weights_are_refused(chaos_report):
    _, report, _, stderr = chaos_report
    assert report, f"no report; stderr:\n{stderr}"
    # In the short run's few seconds a coordinator may not have polled the replica yet; one
    # that did refused it, and no request was answered by it (0 wrong, above).
    refused_by = report["faults"]["wrong-weights"]["refused_by"]
    assert refused_by and any(count >= 1 for count in refused_by.values()), refused_by


def test_the_killed_coordinators_streams_were_resumed(chaos_report):
    _, report, history, stderr = chaos_report
    assert report, f"no report; stderr:\n{stderr}"
    assert report["resumes"] > 0
    # The history holds every request, each with its verdict.
    assert len(history) == report["requests"] + report["unknown"]
    assert {entry["verdict"] for entry in history} <= {"ok", "refused"}
