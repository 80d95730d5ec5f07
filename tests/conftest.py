"""Shared test set-up.

TRITON_INTERPRET is read when a Triton kernel is *defined*, so it must be set before any
kernel module is imported: that is why it is set here, at the very top, before torch.
"""

import os

# SPECDEC_TEST_DEVICE=cuda runs the tiny models of the service tests on a GPU, with the
# Triton kernels compiled (the CPU's interpreter stays off); see tests/factories.py.
if not os.environ.get("SPECDEC_TEST_DEVICE", "cpu").startswith("cuda"):
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

# The CI machine has 2 cores; pin the intra-op pool so timings and thread oversubscription
# do not depend on what else is running.
torch.set_num_threads(2)

# Every process a test starts inherits this mark; at the end of the session none may still
# run (a `specdec up` child outliving its parent, a server a test forgot to stop).
import time  # noqa: E402
import uuid  # noqa: E402
from pathlib import Path  # noqa: E402

SESSION_MARK = "SPECDEC_TEST_SESSION"
os.environ[SESSION_MARK] = uuid.uuid4().hex
LEFT_BEHIND_WAIT_S = 20.0


def processes_left_behind(mark: str) -> list[str]:
    """'pid: command line' of every live process but this one whose environment carries `mark`."""
    needle = f"{SESSION_MARK}={mark}".encode()
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        if int(proc.name) == os.getpid():
            continue
        try:
            if needle not in (proc / "environ").read_bytes().split(b"\0"):
                continue
            if (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue  # exited, not yet reaped
            command = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        found.append(f"{proc.name}: {command.strip()}")
    return found


def pytest_sessionfinish(session, exitstatus):
    if not Path("/proc/self/environ").exists():
        return
    deadline = time.monotonic() + LEFT_BEHIND_WAIT_S
    left = processes_left_behind(os.environ[SESSION_MARK])
    while left and time.monotonic() < deadline:
        time.sleep(0.5)
        left = processes_left_behind(os.environ[SESSION_MARK])
    if left:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        message = "processes started by the tests are still running:\n  " + "\n  ".join(left)
        if reporter is not None:
            reporter.write_line(message, red=True)
        session.exitstatus = 1


if os.environ.get("SPECDEC_TEST_DEVICE", "cpu").startswith("cuda"):
    import gc  # noqa: E402
    import sys  # noqa: E402

    import pytest  # noqa: E402

    @pytest.fixture(autouse=True)
    def _give_the_gpu_memory_back():
        """On a GPU, a test's KV pools go with it: a pool is freed by the cyclic collector (the
        model and its session store refer to each other), and a failed test's frames, which
        hold its pools, stay reachable from sys.last_traceback. Otherwise the next test's
        pool may not fit."""
        yield
        sys.last_type = sys.last_value = sys.last_traceback = None
        gc.collect()
        torch.cuda.empty_cache()
