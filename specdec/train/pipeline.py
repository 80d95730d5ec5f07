"""`specdec distill`, start to end: train a draft for a target by self-distillation.

A draft is only worth its cost if the target accepts what it proposes, and a draft accepts
well when it predicts the *target's* next token, not a corpus's. So the training text is
the target's own: it answers a built-in, diverse prompt set (specdec.train.prompts),
greedily and then sampled for variety, and for every generated position the target's top-K
log-probabilities are stored. The draft then learns those distributions (losses). The
teacher never runs during training.

Three phases, each resumable from the work directory (default `<out>.work`, workdir):

1. data: the target answers the prompts in shards until the plan is done or the data time
   budget is spent, held-out prompts first (data, teacher).
2. training: the loop drives the draft (a Student of students.model or students.eagle)
   until --steps or the wall-clock budget, evaluating on the held-out answers (loop,
   evaluate).
3. export: the draft directory (export), evaluated and timed as it will be served, with
   the run record distill.json and a README (record).
"""

from __future__ import annotations

import json
import math
import time

import torch

from specdec.models import load_model
from specdec.train import loop, record, workdir
from specdec.train.config import EAGLE, DistillConfig, check
from specdec.train.data import generate_data
from specdec.train.evaluate import COST_CONTEXT_TOKENS
from specdec.train.students import eagle as eagle_student
from specdec.train.students import model as model_student

FINAL_RESERVE_S = 90.0  # of --max-minutes, kept for export, final evaluation and cost timing


def run(config: DistillConfig) -> dict:
    """The whole command; returns the training record (also written to out_dir)."""
    check(config)
    torch.set_num_threads(config.threads)
    began = time.monotonic()
    end = began + config.max_minutes * 60 if config.max_minutes else math.inf
    data_minutes = config.data_minutes if config.data_minutes is not None else (
        config.max_minutes / 2 if config.max_minutes else math.inf)
    workdir.prepare(config)
    target, tokenizer = load_model(config.target)
    if config.kind == EAGLE:
        eagle_student.check_target(config, target)
    if (config.work / workdir.CHECKPOINT_NAME).exists():  # training has begun: the data set is frozen
        data = json.loads((config.work / workdir.DATA_SUMMARY_NAME).read_text())
    else:
        data = generate_data(config, target, tokenizer, min(end, began + data_minutes * 60))

    prepare = eagle_student.prepare if config.kind == EAGLE else model_student.prepare
    student, train_set, heldout = prepare(config, target, tokenizer, data, end)
    state = loop.train(config, student, train_set, heldout, end - FINAL_RESERVE_S)

    served = student.export(config.out_dir)
    final = served.evaluate(heldout) if heldout else {}
    context = (heldout[0].tokens.tolist() if heldout else train_set[0].tokens.tolist())[:COST_CONTEXT_TOKENS]
    cost = served.cost_ratio(context)
    run_record = record.build(config, student=served.describe(config.out_dir), data=data, state=state,
                              train_sequences=len(train_set), final=final, cost=cost, began=began)
    record.write(config.out_dir, run_record)
    return run_record
