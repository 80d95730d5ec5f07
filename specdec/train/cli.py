"""The flags of `specdec distill`: the parser's arguments and the config they make.

Light on purpose: `specdec` builds every command's parser on each call, so nothing here
imports torch; the run itself is specdec.train.pipeline.run.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from specdec.train.config import EAGLE, MODEL, DistillConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = DistillConfig(target="", out_dir=Path("."))
    parser.add_argument("--target", required=True, help="target model spec (HF dir, .gguf, or built-in name)")
    parser.add_argument("--out", required=True, type=Path, help="output directory of the draft (a HF model dir)")
    parser.add_argument("--work", type=Path, default=None,
                        help="work directory: data shards, checkpoints, metrics (default OUT.work)")
    parser.add_argument("--resume", action="store_true", help="continue from the work directory")
    parser.add_argument("--layers", type=int, default=d.layers, help="draft decoder layers (default %(default)s)")
    parser.add_argument("--hidden", type=int, default=d.hidden, help="draft hidden width (default %(default)s)")
    parser.add_argument("--intermediate", type=int, default=d.intermediate,
                        help="draft MLP width (default %(default)s)")
    parser.add_argument("--heads", type=int, default=None, help="attention heads (default hidden/64)")
    parser.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default heads/2)")
    parser.add_argument("--train-prompts", type=int, default=None,
                        help="use only the first N built-in training prompts (default all)")
    parser.add_argument("--prompts", type=Path, default=None, metavar="FILE",
                        help="more training prompts, e.g. your own traffic: one per line, or .jsonl with a "
                             "\"prompt\" string per line; added after the built-in ones (held-out stays built-in)")
    parser.add_argument("--self-prompts", type=int, default=d.self_prompts, metavar="N",
                        help="more training prompts written by the target itself (Magpie-style: it continues its "
                             "chat template up to a user's message); kept ones are stored in the work dir "
                             "(default %(default)s)")
    parser.add_argument("--heldout-prompts", type=int, default=d.heldout_prompts,
                        help="held-out prompts for evaluation (default %(default)s)")
    parser.add_argument("--samples-per-prompt", type=int, default=d.samples_per_prompt,
                        help="answers per training prompt: greedy, then sampled (default %(default)s)")
    parser.add_argument("--temperature", type=float, default=d.temperature,
                        help="temperature of the sampled answers (default %(default)s)")
    parser.add_argument("--top-p", type=float, default=d.top_p,
                        help="top-p of the sampled answers (default %(default)s)")
    parser.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens,
                        help="longest teacher answer (default %(default)s)")
    parser.add_argument("--gen-batch", type=int, default=d.gen_batch,
                        help="prompts per teacher generation batch (default %(default)s)")
    parser.add_argument("--top-k", type=int, default=d.top_k,
                        help="teacher log-probs kept per position (default %(default)s)")
    parser.add_argument("--data-minutes", type=float, default=None,
                        help="time budget of the data phase (default half of --max-minutes)")
    parser.add_argument("--steps", type=int, default=None, help="training steps (default: until --max-minutes)")
    parser.add_argument("--batch-size", type=int, default=d.batch_size, help="sequences per step (default %(default)s)")
    parser.add_argument("--lr", type=float, default=d.lr, help="peak learning rate (default %(default)s)")
    parser.add_argument("--warmup-steps", type=int, default=d.warmup_steps, help="default %(default)s")
    parser.add_argument("--hard-weight", type=float, default=d.hard_weight,
                        help="weight of the cross-entropy on the target's greedy token (default %(default)s)")
    parser.add_argument("--no-bf16", action="store_true", help="train in fp32 (default: bf16 autocast)")
    parser.add_argument("--teacher-dtype", choices=("float32", "bfloat16"), default=d.teacher_dtype,
                        help="dtype the target answers the training prompts in (held-out: always as loaded; "
                             "default %(default)s)")
    parser.add_argument("--bf16-logits", action="store_true",
                        help="--kind eagle: the head's LM head in bf16 too (~1.2x faster steps; default: fp32)")
    parser.add_argument("--log-every", type=int, default=d.log_every, help="default %(default)s")
    parser.add_argument("--eval-every", type=int, default=d.eval_every, help="default %(default)s")
    parser.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every, help="default %(default)s")
    parser.add_argument("--max-minutes", type=float, default=None,
                        help="wall-clock bound of the whole run: data, training and export")
    parser.add_argument("--threads", type=int, default=d.threads, help="torch threads (default %(default)s)")
    parser.add_argument("--seed", type=int, default=d.seed, help="default %(default)s")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument("--kind", choices=(MODEL, EAGLE), default=d.kind,
                        help="model: a standalone small causal LM (default); eagle: a one-layer head over the "
                             "target's hidden states (--layers/--hidden/--intermediate do not apply)")
    parser.add_argument("--draft-vocab", type=int, default=d.draft_vocab,
                        help="eagle: tokens the head can propose (default %(default)s)")
    parser.add_argument("--unroll", type=int, default=d.unroll,
                        help="eagle: drafting steps unrolled in training (default %(default)s)")
    parser.add_argument("--single-step-fraction", type=float, default=d.single_step_fraction, metavar="F",
                        help="eagle: unroll one step only for the first F of training (steps or time), "
                             "then --unroll (default %(default)s)")
    parser.add_argument("--feature-weight", type=float, default=d.feature_weight,
                        help="eagle: weight of the feature regression loss (default %(default)s)")
    parser.add_argument("--feature-noise", type=float, default=d.feature_noise, metavar="A",
                        help="eagle: while training, add uniform noise U(-A, A) times each state's RMS to the target "
                             "features the head reads (EAGLE-1's regulariser; default %(default)s: none)")
    parser.add_argument("--aux-layers", type=_layer_list, default=(),
                        help="eagle: target decoder layers (0-based, comma-separated) whose outputs the head reads "
                             "beside the final hidden states, e.g. 1,14 (EAGLE-3's low/mid-level features; "
                             "the head then runs on the target worker only)")
    parser.add_argument("--init-from", type=Path, default=None,
                        help="eagle: start from this head directory's weights (a warm start; parameters it lacks, "
                             "such as new aux layers' projection, start as usual)")


def _layer_list(text: str) -> tuple[int, ...]:
    try:
        layers = tuple(sorted({int(part) for part in text.split(",") if part.strip()}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated layer indices, e.g. 1,14") from None
    if any(i < 0 for i in layers):
        raise argparse.ArgumentTypeError(f"{text!r}: layer indices count from 0")
    return layers


def config_from_args(args: argparse.Namespace, argv: list[str] | None = None) -> DistillConfig:
    # argv: the arguments after the program name, the subcommand included.
    command = "specdec " + shlex.join(argv if argv is not None else sys.argv[1:])
    return DistillConfig(
        target=args.target, out_dir=args.out, work_dir=args.work, resume=args.resume, layers=args.layers,
        hidden=args.hidden, intermediate=args.intermediate, heads=args.heads, kv_heads=args.kv_heads,
        train_prompts=args.train_prompts, prompts_file=args.prompts, self_prompts=args.self_prompts,
        heldout_prompts=args.heldout_prompts,
        samples_per_prompt=args.samples_per_prompt, temperature=args.temperature, top_p=args.top_p,
        max_new_tokens=args.max_new_tokens, gen_batch=args.gen_batch, top_k=args.top_k,
        data_minutes=args.data_minutes, steps=args.steps, batch_size=args.batch_size, lr=args.lr,
        warmup_steps=args.warmup_steps, hard_weight=args.hard_weight, bf16=not args.no_bf16,
        bf16_logits=args.bf16_logits, teacher_dtype=args.teacher_dtype,
        log_every=args.log_every, eval_every=args.eval_every, checkpoint_every=args.checkpoint_every,
        max_minutes=args.max_minutes, threads=args.threads, seed=args.seed, progress=not args.no_progress,
        command=command, kind=args.kind, draft_vocab=args.draft_vocab, unroll=args.unroll,
        single_step_fraction=args.single_step_fraction, feature_weight=args.feature_weight,
        feature_noise=args.feature_noise, aux_layers=args.aux_layers, init_from=args.init_from,
    )
