"""Writing a trained draft's directory: whole or not at all, readable by all.

A draft model is a plain Hugging Face LlamaForCausalLM directory in bfloat16 with the
target's tokenizer files and generation config, loadable by `--draft DIR` and by HF
assisted generation; a feature-level head is specdec.eagle's own format (config.json and
model.safetensors, reading the target's embeddings and LM head, not storing them).
"""

from __future__ import annotations

import copy
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from specdec import eagle


def replace_dir(out_dir: Path, write: Callable[[Path], None]) -> None:
    """Runs write(tmp) on a new sibling directory, then puts it in place of `out_dir`, so
    that out_dir is either the complete new draft or what it was before."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".", dir=out_dir.parent))
    try:
        write(tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private; the draft is meant to be shared
        for path in tmp.iterdir():
            path.chmod(0o644)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def export_model(student, tokenizer, target, out_dir: Path) -> None:
    """Writes a draft model as a plain HF directory (bfloat16 safetensors, the target's
    tokenizer files and generation config)."""

    def write(tmp: Path) -> None:
        exported = copy.deepcopy(student).to(torch.bfloat16).eval()
        exported.config.dtype = torch.bfloat16
        if getattr(target, "generation_config", None) is not None:
            exported.generation_config = copy.deepcopy(target.generation_config)
        exported.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)

    replace_dir(out_dir, write)


def export_eagle(head: eagle.EagleHead, out_dir: Path) -> None:
    """Writes a feature-level head's directory (specdec.eagle.save: bfloat16 weights)."""
    replace_dir(out_dir, lambda tmp: eagle.save(head, tmp))


def dir_mb(path: Path) -> float:
    """Size of the files under `path`, in MB."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 1e6
