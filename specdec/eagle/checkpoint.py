"""A head on disk: a directory with config.json (`"specdec_draft": "eagle"`) and
model.safetensors (the head's weights and its draft vocabulary). The target's embeddings and
LM head are not stored: they are taken from the target named in the config."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from specdec.eagle.head import CONFIG_NAME, KIND, WEIGHTS_NAME, EagleConfig, EagleHead, build
from specdec.models import load_model, local_path, weights_fingerprint


def is_eagle_dir(spec: str) -> bool:
    """Whether a draft spec names a feature-level head directory."""
    path = local_path(spec) / CONFIG_NAME
    if not path.is_file():
        return False
    try:
        return json.loads(path.read_text()).get("specdec_draft") == KIND
    except (OSError, ValueError):
        return False


def fingerprint(head: EagleHead) -> str:
    """The head's weights fingerprint (specdec.models.weights_fingerprint) over its config,
    but for the target's spec (a name or path, which may differ between machines serving the
    same files), and over its tensors: its weights, its draft vocabulary and the target's
    embeddings and LM-head rows it reads, so the target it runs on is in it too. Take it
    from the head as loaded, before fast_cpu_head packs a serving copy."""
    config = {k: v for k, v in asdict(head.config).items() if k != "target"}
    return weights_fingerprint(head, config)


def save(head: EagleHead, directory: Path, dtype: torch.dtype = torch.bfloat16) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    head.config.save(directory)
    tensors = {name: p.detach().to(dtype).contiguous() for name, p in head.named_parameters()}
    tensors["draft_vocab"] = head.draft_vocab.to(torch.int32).contiguous()
    save_file(tensors, str(directory / WEIGHTS_NAME), metadata={"format": "pt", "specdec_draft": KIND})


def warm_start(head: EagleHead, directory: str | Path) -> list[str]:
    """Copies into `head` the weights of the head saved in `directory` that it has with the
    same shape (same target and draft vocabulary required); returns the names it lacked."""
    directory = local_path(str(directory))
    config = EagleConfig.load(directory)
    tensors = load_file(str(directory / WEIGHTS_NAME))
    mine = head.config
    if (config.hidden_size, config.draft_vocab_size) != (mine.hidden_size, mine.draft_vocab_size) or \
            not torch.equal(tensors.pop("draft_vocab").long(), head.draft_vocab):
        raise ValueError(f"{directory} is a head of another shape or draft vocabulary: cannot start from it")
    own = dict(head.named_parameters())
    wrong = [k for k, v in tensors.items() if k not in own or own[k].shape != v.shape]
    if wrong:
        raise ValueError(f"{directory}: {wrong} do not fit this head")
    with torch.no_grad():
        for name, value in tensors.items():
            own[name].copy_(value.to(own[name].dtype))
    return sorted(set(own) - set(tensors))


def load(directory: str | Path, target=None, dtype: torch.dtype = torch.float32, device: str = "cpu") -> EagleHead:
    """A head directory and the target it reads (loaded by its spec unless given: on `device`,
    in `dtype`; a given target's device is the head's). The head's weights and embeddings
    take `dtype`; its LM-head rows stay float32 (EagleHead.cast)."""
    directory = local_path(str(directory))
    config = EagleConfig.load(directory)
    tensors = load_file(str(directory / WEIGHTS_NAME))
    if target is None:
        target, _ = load_model(config.target, dtype=dtype, device=device)
    draft_vocab = tensors.pop("draft_vocab").long()
    head = build(config, target, draft_vocab)
    head.load_state_dict({k: v.to(torch.float32) for k, v in tensors.items()})
    return head.cast(dtype).eval()
