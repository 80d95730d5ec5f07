"""The soak of benchmarks/soak.py, one minute of it: three service processes on loopback,
mixed clients (greedy, seeded sampling, cancels, tight deadlines, bad requests) and a
target worker killed and restarted mid-run; no admitted request is lost or answered wrong."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SOAK = REPO / "benchmarks" / "soak.py"
DURATION_S = 45
# Set-up (tiny models, three interpreters, the references) and shutdown come on top.
TIMEOUT_S = DURATION_S + 240


def run_soak(tmp_path_factory, *args: str, duration_s: int = DURATION_S) -> tuple[int, dict, str]:
    out = tmp_path_factory.mktemp("soak") / "report.json"
    # Its own session, so that a soak overrunning the timeout goes down with its services.
    soak = subprocess.Popen(
        [sys.executable, str(SOAK), "--duration", str(duration_s), "--clients", "4", *args, "--json-out", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, start_new_session=True,
    )
    try:
        _, stderr = soak.communicate(timeout=duration_s + TIMEOUT_S - DURATION_S)
    except subprocess.TimeoutExpired:
        os.killpg(soak.pid, signal.SIGKILL)
        _, stderr = soak.communicate()
    report = json.loads(out.read_text()) if out.exists() else {}
    return soak.returncode, report, stderr[-4000:]


@pytest.fixture(scope="module")
def soak_report(tmp_path_factory) -> tuple[int, dict, str]:
    return run_soak(tmp_path_factory, "--restart", "target", "--restart-signal", "KILL")


@pytest.fixture(scope="module")
def coordinator_soak(tmp_path_factory) -> tuple[int, dict, str]:
    """Two coordinator replicas, one SIGKILLed mid-run: its streams resume on the other."""
    return run_soak(tmp_path_factory, "--restart", "coordinator", "--restart-signal", "KILL", duration_s=30)


def soak_summary(report: dict) -> dict:
    """What a failure message shows of the report."""
    return {key: report.get(key) for key in ("error", "lost", "wrong", "lost_examples", "wrong_examples",
                                             "crashed", "restart")}


def test_soak_loses_no_admitted_request(soak_report):
    _, report, stderr = soak_report
    assert report, f"no report; stderr:\n{stderr}"
    assert report["lost"] == 0, soak_summary(report)


def test_soak_returns_no_wrong_output(soak_report):
    _, report, stderr = soak_report
    assert report, f"no report; stderr:\n{stderr}"
    assert report["wrong"] == 0, soak_summary(report)


def test_soak_crashes_no_service(soak_report):
    _, report, stderr = soak_report
    assert report, f"no report; stderr:\n{stderr}"
    assert report["crashed"] == [], soak_summary(report)


def test_soak_exits_cleanly(soak_report):
    returncode, report, stderr = soak_report
    assert report, f"no report; stderr:\n{stderr}"
    assert returncode == 0, soak_summary(report)


def test_soak_restarts_the_target_while_serving(soak_report):
    _, report, stderr = soak_report
    assert report, f"no report; stderr:\n{stderr}"
    restart = report["restart"]
    assert restart["happened"], restart
    assert restart["old_pid"] != restart["new_pid"]
    assert report["served_after_restart"] > 0


def test_soak_exercises_every_kind_of_client(soak_report):
    _, report, stderr = soak_report
    assert report, f"no report; stderr:\n{stderr}"
    by_kind = report["by_kind"]
    assert by_kind["greedy"].get("OK", 0) > 0
    assert by_kind["sampled"].get("OK", 0) > 0
    assert by_kind["cancel"].get("CANCELLED", 0) > 0
    assert by_kind["bad"].get("INVALID_ARGUMENT", 0) > 0
    assert set(report["peak_rss_mib"]) >= {"coordinator", "target", "draft"}
    assert all(mib > 0 for mib in report["peak_rss_mib"].values())


def test_a_killed_coordinator_loses_no_stream(coordinator_soak):
    returncode, report, stderr = coordinator_soak
    assert report, f"no report; stderr:\n{stderr}"
    assert report["restart"]["happened"] and report["restart"]["worker"] == "coordinator", report["restart"]
    assert report["lost"] == 0 and report["wrong"] == 0, soak_summary(report)
    assert report["crashed"] == [] and returncode == 0, soak_summary(report)
    # Streams were in flight on the killed replica, and they were resumed, not restarted.
    assert report["in_flight_at_restart"] > 0 and report["resumes"] > 0
