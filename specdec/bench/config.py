"""The typed configuration of a bench run (kept free of heavy imports: the CLI parser reads
its defaults)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from specdec.bench.prompts import PROMPTS, QUICK_PROMPTS, Prompt


@dataclass
class BenchConfig:
    """What `specdec bench` runs; built from flags in specdec.bench.cli."""

    target: str = "smollm2-135m"
    """Target model spec (as `specdec up --target`)."""
    draft: str | None = None
    """A draft model or head spec sharing the target's tokenizer (the CLI defaults it to the drafter
    `specdec up` runs); n-gram always runs."""
    k: int = 4
    """Draft tokens per round asked of every drafter (prompt_lookup_num_tokens, num_assistant_tokens, k)."""
    max_new_tokens: int = 128
    """Tokens generated per prompt (fewer when the model stops)."""
    repeats: int = 3
    """Runs of each (configuration, prompt) pair; medians are reported."""
    threads: int = 2
    """torch intra-op threads of the bench process and of the services."""
    quick: bool = False
    """One prompt per kind: a smoke run."""
    fast_peers: bool = True
    """Also run the HF peers on the CPU fast-path model (the same packed model specdec serves)."""
    out_dir: Path = Path("benchmarks/results")
    """Where bench.json, bench.md and bench.png go."""
    name: str = "bench"
    """Stem of the output files."""
    max_foreign_load: float = 0.15
    """A run during which other processes used more than this share of the CPU is repeated."""
    retries: int = 3
    """Most repetitions of one run for foreign load."""
    progress: bool = True
    """Show a progress bar on stderr."""

    @property
    def prompts(self) -> tuple[Prompt, ...]:
        return QUICK_PROMPTS if self.quick else PROMPTS
