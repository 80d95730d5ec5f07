"""The training loop of `specdec distill`, the same for every kind of draft: it drives a
Student (students.base) over the training examples with AdamW, linear warmup then cosine
decay over whichever bound ends training first (--steps or the wall-clock budget), and
gradient clipping; it logs the loss, evaluates on the held-out examples, and checkpoints
the weights, the optimizer, the step and the data cursor so that --resume continues the
same run (one schedule, one history, the same data order).
"""

from __future__ import annotations

import json
import logging
import math
import signal
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch

from specdec.train.config import DistillConfig
from specdec.train.evaluate import EVAL_K
from specdec.train.progress import progress_bar
from specdec.train.students.base import Student
from specdec.train.workdir import CHECKPOINT_NAME, METRICS_NAME, atomic_save

log = logging.getLogger(__name__)

MIN_LR_RATIO = 0.1  # cosine decay ends at this fraction of --lr


@dataclass
class TrainState:
    step: int = 0
    epoch: int = 0
    cursor: int = 0  # position in the epoch's permutation
    trained_s: float = 0.0  # training seconds over all invocations
    tokens_seen: int = 0
    history: list[dict] = field(default_factory=list)


def learning_rate(schedule: DistillConfig, step: int, progress: float) -> float:
    """Linear warmup over schedule.warmup_steps, then cosine decay over `progress` (0..1)
    from schedule.lr to MIN_LR_RATIO of it."""
    if step < schedule.warmup_steps:
        return schedule.lr * (step + 1) / schedule.warmup_steps
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return schedule.lr * (MIN_LR_RATIO + (1 - MIN_LR_RATIO) * cosine)


def new_optimizer(module: torch.nn.Module, schedule: DistillConfig) -> torch.optim.Optimizer:
    """AdamW with schedule.weight_decay on the matrices only (not on the input embeddings,
    nor on norms and biases)."""
    embedding = module.get_input_embeddings().weight if hasattr(module, "get_input_embeddings") else None
    decay = [p for p in module.parameters() if p.ndim == 2 and p is not embedding]
    rest = [p for p in module.parameters() if not (p.ndim == 2 and p is not embedding)]
    return torch.optim.AdamW([{"params": decay, "weight_decay": schedule.weight_decay},
                              {"params": rest, "weight_decay": 0.0}], lr=schedule.lr, betas=(0.9, 0.98))


def _permutation(n: int, seed: int, epoch: int) -> list[int]:
    """The order of the training examples in an epoch (the same on a resume)."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 7919 + epoch)).tolist()


class _StopFlag:
    """SIGTERM/SIGINT end training at the next step boundary, then checkpoint and export."""

    def __init__(self):
        self.stopped = False
        self._previous = {}

    def __enter__(self):
        for signum in (signal.SIGTERM, signal.SIGINT):
            try:
                self._previous[signum] = signal.signal(signum, self._handle)
            except ValueError:  # not the main thread: no signal handling
                pass
        return self

    def _handle(self, signum, frame) -> None:
        log.warning("signal %d: stopping after this step (checkpoint and export follow)", signum)
        self.stopped = True

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


def train(config: DistillConfig, student: Student, train_set: list, heldout: list, deadline: float) -> TrainState:
    """Trains from the checkpoint in the work dir if there is one; stops at --steps, at
    `deadline` (monotonic) or on a signal; returns the final state (checkpointed)."""
    checkpoint_path = config.work / CHECKPOINT_NAME
    module = student.module
    optimizer = new_optimizer(module, config)
    state = TrainState()
    if checkpoint_path.exists():
        saved = torch.load(checkpoint_path, weights_only=False)
        wanted = student.shape()
        shape = {k: saved["student_config"].get(k, student.shape_defaults.get(k)) for k in wanted}
        if shape != wanted:
            raise ValueError(f"--resume: the checkpoint's draft is {shape}, the flags ask for {wanted}")
        module.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        state = TrainState(**saved["state"])
        log.info("resumed at step %d (epoch %d, %.0f s trained)", state.step, state.epoch, state.trained_s)
    # The schedule follows whichever bound ends training first: the step count, or the
    # wall-clock budget (training seconds so far + what this invocation has left).
    budget_s = state.trained_s + max(0.0, deadline - time.monotonic()) if math.isfinite(deadline) else math.inf

    def save() -> None:
        atomic_save({"model": module.state_dict(), "optimizer": optimizer.state_dict(),
                     "state": asdict(state), "student_config": student.shape()}, checkpoint_path)

    def record(entry: dict) -> None:
        state.history.append(entry)
        with open(config.work / METRICS_NAME, "a") as f:
            f.write(json.dumps(entry) + "\n")

    module.train()
    order = _permutation(len(train_set), config.seed, state.epoch)
    window: list[dict] = []
    bar = progress_bar(config.steps, config.progress, "training", unit="step", initial=state.step)
    with _StopFlag() as stop:
        while True:
            progress = max(state.step / config.steps if config.steps else 0.0,
                           state.trained_s / budget_s if math.isfinite(budget_s) else 0.0)
            if (config.steps and state.step >= config.steps) or time.monotonic() >= deadline or stop.stopped:
                break
            if state.cursor >= len(order):
                state.epoch, state.cursor = state.epoch + 1, 0
                order = _permutation(len(train_set), config.seed, state.epoch)
            picked = order[state.cursor:state.cursor + config.batch_size]
            lr = learning_rate(config, state.step, progress)
            for group in optimizer.param_groups:
                group["lr"] = lr
            began = time.monotonic()
            loss, tokens, parts = student.step_loss([train_set[i] for i in picked], state.step, progress)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
            optimizer.step()
            state.trained_s += time.monotonic() - began
            state.step += 1
            state.cursor += len(picked)
            state.tokens_seen += tokens
            window.append({"loss": loss.item(), **parts, "tokens": tokens, "seconds": time.monotonic() - began})
            bar.update(1)
            if state.step % config.log_every == 0:
                entry = _summarise(window, state, lr, len(train_set))
                record(entry)
                bar.set_postfix_str(f"loss {entry['loss']:.3f}")
                log.info("step %d epoch %.2f lr %.2e loss %.4f kl %.4f ce_top1 %.4f %.0f tok/s", state.step,
                         entry["epoch"], lr, entry["loss"], entry["kl"], entry["ce_top1"], entry["tokens_per_s"])
                window = []
            if state.step % config.eval_every == 0 and heldout:
                metrics = student.evaluate(heldout)
                record({"step": state.step, **metrics})
                log.info("step %d held-out: top-1 agreement %.3f, simulated k=%d acceptance %.3f (alpha %.3f), "
                         "%.2f tokens/round", state.step, metrics["heldout_top1_agreement"], EVAL_K,
                         metrics["sim_acceptance_rate"], metrics["sim_alpha"], metrics["sim_tokens_per_round"])
            if state.step % config.checkpoint_every == 0:
                save()
    bar.close()
    if window:
        record(_summarise(window, state, lr, len(train_set)))
    save()
    return state


def _summarise(window: list[dict], state: TrainState, lr: float, n_train: int) -> dict:
    tokens = sum(w["tokens"] for w in window)
    seconds = sum(w["seconds"] for w in window)
    return {"step": state.step, "epoch": state.epoch + state.cursor / max(1, n_train), "lr": lr,
            "loss": statistics.fmean(w["loss"] for w in window), "kl": statistics.fmean(w["kl"] for w in window),
            "ce_top1": statistics.fmean(w["ce_top1"] for w in window),
            **({"feature_l1": statistics.fmean(w["feature_l1"] for w in window)} if "feature_l1" in window[0] else {}),
            **({"unroll": window[-1]["unroll"]} if "unroll" in window[-1] else {}),
            "tokens_per_s": tokens / seconds if seconds else 0.0, "trained_s": state.trained_s}
