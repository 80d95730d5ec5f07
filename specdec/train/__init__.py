"""`specdec distill`: training drafts for a target by self-distillation (a small draft
model, or a feature-level head). What lives where, each module importing only ones listed
before it:

    config.py        DistillConfig, one field per flag, and the refusals of bad settings; no torch
    cli.py           the command's flags (add_arguments, config_from_args); no torch
    prompts.py       the built-in prompt set (train / held-out split, bench subjects excluded)
    workdir.py       the work directory: its files, whole writes, the data identity a resume keeps
    progress.py      progress bars
    teacher.py       the target answering prompts (top-K log-probs, features, aux layer states)
    self_prompts.py  --self-prompts: requests written by the target itself
    data.py          the data phase: the shard plan, run until done or out of time
    examples.py      stored data as training examples and batches, per kind of draft
    losses.py        the top-K distillation loss, and each kind's loss on a batch
    evaluate.py      held-out agreement, simulated acceptance, the draft/target cost ratio c
    students/base.py the Student protocol: what the loop drives
    loop.py          the training loop, kind-blind: schedule, optimizer, checkpoints, log
    export.py        writing the draft directory
    record.py        the run record (distill.json) and the README rendered from it
    students/        model.py, eagle.py: the kinds of draft as Students
    pipeline.py      run(config): the command start to end (data, training, export, record)
"""
