"""What `specdec distill` runs: one typed config, built from flags by specdec.train.cli, and
the refusals of settings that cannot run.

Light on purpose (no torch): the CLI reads the defaults here on every `specdec` call.
The config stays flat, one field per flag, because it is recorded whole (`asdict`) in the
run record's "config" and its field order is that record's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

MODEL, EAGLE = "model", "eagle"  # the kinds of draft `specdec distill` trains
WORK_SUFFIX = ".work"


@dataclass
class DistillConfig:
    """What `specdec distill` runs; built from flags by `specdec.train.cli.config_from_args`."""

    target: str
    """Target model spec (a HF directory, a .gguf file or a built-in name)."""
    out_dir: Path
    """Where the final Hugging Face draft directory is written."""
    work_dir: Path | None = None
    """Shards, checkpoints and metrics; default `<out_dir>.work` (keep it out of git)."""
    resume: bool = False
    """Continue from the work directory; without it a non-empty work directory is refused."""
    kind: str = "model"
    """"model": a standalone small causal LM; "eagle": a feature-level head that reads the
    target's hidden states (specdec.eagle)."""
    layers: int = 2
    """Decoder layers of the draft."""
    hidden: int = 256
    """Hidden width of the draft."""
    intermediate: int = 768
    """MLP width of the draft."""
    heads: int | None = None
    """Attention heads (default hidden // 64, at least 1)."""
    kv_heads: int | None = None
    """Key/value heads (default heads // 2, at least 1)."""
    train_prompts: int | None = None
    """Use only the first N training prompts of the built-in set (all by default)."""
    prompts_file: Path | None = None
    """More training prompts, the user's own (prompts.read_prompt_file), after the built-in ones."""
    self_prompts: int = 0
    """More training prompts written by the target itself (self_prompts.write_self_prompts), after those."""
    heldout_prompts: int = 96
    """Held-out prompts answered (greedily) for evaluation, spread over the held-out set."""
    samples_per_prompt: int = 4
    """Answers per training prompt: the greedy one, then sampled ones."""
    temperature: float = 0.8
    """Sampling temperature of the sampled answers."""
    top_p: float = 0.95
    """Nucleus mass of the sampled answers."""
    max_new_tokens: int = 192
    """Longest answer generated per prompt."""
    gen_batch: int = 64
    """Prompts per teacher generation batch (larger amortises the weight reads on CPU)."""
    top_k: int = 32
    """Teacher log-probs stored per position."""
    data_minutes: float | None = None
    """Wall-clock budget of the data phase (default: half of --max-minutes)."""
    steps: int | None = None
    """Training steps (with --max-minutes, whichever ends first)."""
    batch_size: int = 16
    """Sequences per training step."""
    lr: float = 2e-3
    """Peak learning rate (AdamW)."""
    warmup_steps: int = 50
    """Linear warmup steps."""
    weight_decay: float = 0.01
    """AdamW weight decay of the matrices (not of embeddings or norms)."""
    hard_weight: float = 0.5
    """Weight of the cross-entropy on the target's greedy token, beside the top-K soft loss."""
    bf16: bool = True
    """bf16 autocast for the training forward/backward on CPU (weights stay fp32)."""
    teacher_dtype: str = "float32"
    """Dtype the target answers the training prompts in: "bfloat16" answers faster on a CPU
    with AVX512-BF16 (benchmarks/teacher_bf16.py) but differs from the fp32 target at
    near-ties; held-out answers always come from the target as loaded (what is served)."""
    bf16_logits: bool = False
    """--kind eagle: the head's draft-vocabulary LM head under bf16 autocast too (with bf16):
    faster steps at the fp32 loss and gradient up to bf16 rounding (benchmarks/head_train_step.py)."""
    log_every: int = 25
    """Steps between loss lines."""
    eval_every: int = 200
    """Steps between held-out evaluations."""
    checkpoint_every: int = 100
    """Steps between checkpoints."""
    max_minutes: float | None = None
    """Wall-clock bound of this invocation: data + training + export."""
    threads: int = 2
    """torch intra-op threads."""
    seed: int = 0
    """Seed of the prompt order, sampling, initialisation and data order."""
    progress: bool = True
    """Show progress bars on stderr."""
    command: str = ""
    """The command line, for the training record."""
    draft_vocab: int = 8192
    """--kind eagle: target tokens the head can propose (the most frequent in the data)."""
    unroll: int = 3
    """--kind eagle: drafting steps unrolled per training step (training-time test)."""
    single_step_fraction: float = 0.0
    """--kind eagle: the first this fraction of training (by the schedule's progress: steps or
    wall clock) unrolls one step only (cheaper steps than --unroll), then --unroll steps: the
    head learns to read the target's features on many cheap steps and then to read its own;
    0: --unroll from the start."""
    feature_weight: float = 1.0
    """--kind eagle: weight of the feature regression (smooth L1) beside the token losses."""
    feature_noise: float = 0.0
    """--kind eagle: uniform noise on the target features fed while training, U(-a, a) times
    each state's RMS (EAGLE-1's regulariser; losses.noisy_features); 0: none."""
    aux_layers: tuple[int, ...] = ()
    """--kind eagle: target decoder layers (0-based) whose states the head also reads."""
    init_from: Path | None = None
    """--kind eagle: a head directory whose weights start training (those it has)."""

    @property
    def work(self) -> Path:
        return self.work_dir or self.out_dir.with_name(self.out_dir.name + WORK_SUFFIX)


def check(config: DistillConfig) -> None:
    """Refuses (ValueError) settings that cannot run, before anything is loaded or written."""
    if config.steps is None and config.max_minutes is None:
        raise ValueError("bound the training: give --steps, --max-minutes, or both")
    if config.self_prompts < 0:
        raise ValueError(f"--self-prompts {config.self_prompts}: expected 0 or more")
    if config.kind != EAGLE and (config.aux_layers or config.init_from is not None or config.feature_noise
                                 or config.single_step_fraction):
        raise ValueError("--aux-layers, --init-from, --feature-noise and --single-step-fraction "
                         "apply to --kind eagle only")
    if not 0.0 <= config.single_step_fraction < 1.0:
        raise ValueError(f"--single-step-fraction {config.single_step_fraction}: expected 0 up to (not including) 1")
    if not 0.0 <= config.feature_noise < 10.0:
        raise ValueError(f"--feature-noise {config.feature_noise}: expected 0 (none) up to 10 (times each state's RMS)")
