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
