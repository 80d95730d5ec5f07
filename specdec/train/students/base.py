"""What specdec.train.loop trains, and specdec.train.pipeline evaluates and exports: a
Student, one per kind of draft (students.model, students.eagle).

The loop knows nothing of the kind: it optimises `module`, checkpoints it under its
`shape()`, asks for each batch's loss and, now and then, for the held-out metrics.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple, Protocol

import torch


class StepLoss(NamedTuple):
    loss: torch.Tensor  # scalar, to minimise
    tokens: int  # answer positions it covers
    parts: dict  # what the training log shows beside the loss: "kl", "ce_top1", ...


class Student(Protocol):
    module: torch.nn.Module
    """The parameters trained, and what a checkpoint's "model" holds."""
    shape_defaults: dict
    """Values of shape() keys that checkpoints written before the key existed lack."""

    def shape(self) -> dict:
        """What a checkpoint must have been written for to be resumed (a JSON-able dict)."""

    def step_loss(self, examples: list, step: int, progress: float) -> StepLoss:
        """The loss on a batch of training examples at training `step`, `progress` (0..1)
        through the schedule."""

    def evaluate(self, examples: list) -> dict:
        """Held-out metrics (specdec.train.evaluate): agreement and simulated acceptance."""

    def export(self, out_dir: Path) -> Student:
        """Writes the draft directory and returns the draft as served (loaded back from it)."""

    def cost_ratio(self, context: list[int]) -> dict:
        """c, one draft step over one target step on the serving path, at `context`."""

    def describe(self, out_dir: Path) -> dict:
        """The run record's "student": its shape, parameters and directory size."""
