"""The peers, run in the bench's own process: Hugging Face `generate()` with the target
alone, and its assisted generation with the same drafter — prompt lookup
(`prompt_lookup_num_tokens=k`) for n-gram, `assistant_model=` for a draft model."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch


@dataclass
class PeerRun:
    token_ids: list[int]
    wall_s: float
    stats: dict = field(default_factory=dict)


@torch.inference_mode()
def hf_generate(model, prompt_ids: list[int], max_new_tokens: int, eos_ids: list[int], *,
                prompt_lookup_k: int | None = None, assistant=None, assistant_k: int | None = None) -> PeerRun:
    """Greedy `model.generate`; generated ids only (EOS included when hit), wall seconds
    from the call to its return (prefill included, as a client would see it)."""
    input_ids = torch.tensor([prompt_ids])  # [1, prompt]
    kwargs = dict(attention_mask=torch.ones_like(input_ids), do_sample=False, max_new_tokens=max_new_tokens,
                  eos_token_id=eos_ids, pad_token_id=eos_ids[0] if eos_ids else None)
    if prompt_lookup_k is not None:
        kwargs["prompt_lookup_num_tokens"] = prompt_lookup_k
    if assistant is not None:
        kwargs["assistant_model"] = assistant
        # HF's own adaptive block size, from the k every drafter gets; "_transient" resets it
        # per call, so one run does not tune the next (the default "heuristic" persists).
        assistant.generation_config.num_assistant_tokens_schedule = "heuristic_transient"
        if assistant_k is not None:
            assistant.generation_config.num_assistant_tokens = assistant_k
    began = time.perf_counter()
    out = model.generate(input_ids, **kwargs)  # [1, prompt + generated]
    wall = time.perf_counter() - began
    return PeerRun(out[0, len(prompt_ids):].tolist(), wall)
