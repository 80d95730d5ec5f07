"""What the bench ran on, and whether anything else was using the CPU while it ran.

A run on a shared machine is only honest if it says how shared the machine was: each timed
run records the fraction of the CPU that processes outside the bench (and its services)
used meanwhile, from /proc; runs above a threshold are repeated.
"""

from __future__ import annotations

import os
import platform
import subprocess
import time
from dataclasses import dataclass

import torch

# /proc/stat counts CPU time in clock ticks.
CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def describe(threads: int) -> dict:
    """lscpu model name and core count, torch and transformers versions, threads."""
    import transformers

    model_name = platform.processor() or "unknown"
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout.splitlines():
            if line.startswith("Model name:"):
                model_name = line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return {
        "cpu_model": model_name,
        "cpu_cores": os.cpu_count(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "torch_threads": threads,
        "onednn_available": torch.backends.mkldnn.is_available(),
        "python": platform.python_version(),
    }


def _busy_ticks() -> int | None:
    """Non-idle CPU ticks of the whole machine so far; None where /proc is absent."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields[:8]) - idle


def _process_ticks(pid: int) -> int:
    """utime + stime of a process (its threads included), in ticks; 0 if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0
    return int(fields[11]) + int(fields[12])  # fields 14 and 15 of proc(5), after pid and comm


@dataclass
class ForeignLoad:
    """Measures, over an interval, the CPU share used by processes other than `pids`."""

    pids: list[int]

    def __enter__(self) -> ForeignLoad:
        self._began = time.perf_counter()
        self._busy = _busy_ticks()
        self._ours = sum(_process_ticks(pid) for pid in self.pids)
        self.fraction = 0.0
        return self

    def __exit__(self, *exc) -> None:
        busy = _busy_ticks()
        if busy is None or self._busy is None:
            return
        elapsed_ticks = (time.perf_counter() - self._began) * CLOCK_TICKS * (os.cpu_count() or 1)
        ours = sum(_process_ticks(pid) for pid in self.pids) - self._ours
        foreign = max(0, (busy - self._busy) - ours)
        # Tick accounting is coarse (10 ms): short intervals read noisy, never negative.
        self.fraction = min(1.0, foreign / elapsed_ticks) if elapsed_ticks > 0 else 0.0


def wait_for_quiet(pids: list[int], threshold: float, timeout_s: float) -> float:
    """Waits (up to timeout_s) for a 1-second window with foreign load under threshold;
    returns the last window's foreign fraction."""
    deadline = time.monotonic() + timeout_s
    while True:
        with ForeignLoad(pids) as load:
            time.sleep(1.0)
        if load.fraction < threshold or time.monotonic() > deadline:
            return load.fraction
