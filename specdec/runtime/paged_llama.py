"""One forward per step over every session, for Llama-family models, on a paged KV cache.

The decoder runs on the HF module's own weights and submodules (embed_tokens; per layer
input_layernorm, q/k/v/o_proj, post_attention_layernorm, mlp; the final norm, lm_head), in
the order LlamaDecoderLayer calls them, but over the packed row of all sessions' new tokens
(specdec.runtime.paged_step) instead of a [batch, seq] tensor: every linear layer, norm and
MLP runs once over all T rows. At each layer the new tokens' keys and values (after RoPE) go
into the pool at their slots, then a paged-attention function reads them with each session's
context (the contract and its reference: specdec.runtime.paged_attention; PagedAttention,
Kwon et al., arXiv 2309.06180). RoPE's cos and sin come from the model's own rotary_emb at
the given positions, so rope scaling (llama3, linear, yarn, …) is the model's.

Every size comes from the host (StepInputs.lengths, logits_to_keep); no tensor value steers
Python, so a step can be captured in a CUDA graph at fixed padded sizes (dynamic RoPE
scaling, which reads the largest position, is the exception). Logits are float32: the LM head
projects in float32 (specdec.runtime.precision).

Covered: full-attention decoders whose layer is LlamaDecoderLayer's (Llama, SmolLM2; Mistral
and Qwen2 without a sliding window, whose q/k/v biases sit inside the projections). Not
covered: sliding-window layers, per-head q/k norms (Qwen3), Gemma's scaled embeddings and
offset norms, soft-capping.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch

from specdec.runtime.compat import full_attention_only
from specdec.runtime.paged import KVPool, KVShape
from specdec.runtime.paged_attention import paged_attention_reference
from specdec.runtime.paged_step import StepInputs
from specdec.runtime.precision import Fp32LMHead

# model_type of the HF families whose decoder layer this forward reproduces.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
_LAYER_PARTS = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
_ATTENTION_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj")
# Attention parts this forward does not apply: a model with any of them is refused.
_UNSUPPORTED_ATTENTION_PARTS = ("q_norm", "k_norm", "sinks")


@dataclass
class PagedOutput:
    logits: list[torch.Tensor]  # per session [logits_to_keep[i], V] float32
    features: list[torch.Tensor] | None  # per session [n_i, H·(1 + len(aux_layers))], or None


def supports_paged(model: torch.nn.Module) -> str | None:
    """None when `model` can run through PagedLlama; otherwise why not."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "model_type", None) not in SUPPORTED_MODEL_TYPES:
        return f"model type {getattr(config, 'model_type', None)!r} is not one of {SUPPORTED_MODEL_TYPES}"
    reason = full_attention_only(config)
    if reason is not None:
        return reason
    inner = getattr(model, "model", None)
    for part in ("embed_tokens", "layers", "norm", "rotary_emb"):
        if getattr(inner, part, None) is None:
            return f"the model has no model.{part}"
    for layer in inner.layers:
        attention = getattr(layer, "self_attn", None)
        if any(getattr(layer, p, None) is None for p in _LAYER_PARTS) or \
                any(getattr(attention, p, None) is None for p in _ATTENTION_PARTS):
            return f"a decoder layer lacks one of {_LAYER_PARTS + _ATTENTION_PARTS}"
        if any(getattr(attention, p, None) is not None for p in _UNSUPPORTED_ATTENTION_PARTS):
            return f"its attention has one of {_UNSUPPORTED_ATTENTION_PARTS}, which this forward does not apply"
    if model.get_output_embeddings() is None:
        return "the model has no LM head"
    return None


class PagedLlama:
    """A Llama-family model's forward over a paged KV pool. Holds references to the model's
    modules (no copies but, for a reduced-precision model, a float32 copy of the LM head)."""

    def __init__(self, model: torch.nn.Module, attention: Callable[..., torch.Tensor] = paged_attention_reference):
        """attention: a function with paged_attention_reference's signature (the reference,
        paged_attention_sdpa, a kernel)."""
        reason = supports_paged(model)
        if reason is not None:
            raise ValueError(f"{type(model).__name__} cannot run on the paged KV cache: {reason}")
        inner = model.model
        self.config = model.config
        self.embed, self.layers, self.norm, self.rotary = inner.embed_tokens, inner.layers, inner.norm, inner.rotary_emb
        head = model.get_output_embeddings()
        self.head = Fp32LMHead(head) if type(head) is torch.nn.Linear and head.weight.dtype != torch.float32 else head
        self.attention = attention
        self.kv_shape = KVShape.of(model.config)
        first = self.layers[0].self_attn
        self.heads = self.config.num_attention_heads
        self.scaling = first.scaling
        # The rotation its own attention applies (rotate-half RoPE in these families).
        self._rope = inspect.getmodule(type(first)).apply_rotary_pos_emb

    @property
    def feature_size(self) -> int:
        return int(self.config.hidden_size)

    @torch.inference_mode()
    def forward(self, pool: KVPool, step: StepInputs, features: bool = False,
                aux_layers: tuple[int, ...] = ()) -> PagedOutput:
        """Runs the step's T new tokens: writes their K/V into `pool` at step.slot_mapping
        and returns per session the float32 logits of its last logits_to_keep[i] tokens;
        with features, per session the final norm's output for each of its tokens followed
        by the residual stream after decoder layers aux_layers (what CausalLM.feed_batch
        gives an EAGLE head)."""
        logits, states = self.compute(pool, step, features, aux_layers)
        return split_output(logits, states, step, features)

    def check_aux_layers(self, aux_layers: tuple[int, ...]) -> None:
        if any(not 0 <= i < len(self.layers) for i in aux_layers):
            raise ValueError(f"aux_layers {aux_layers} name layers outside 0..{len(self.layers) - 1}")

    def compute(self, pool: KVPool, step: StepInputs, features: bool = False,
                aux_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The step's work as `forward` does it, unsplit: the float32 logits of step.logit_rows
        [R, V] and, with features, the states of every row [T, H·(1 + len(aux_layers))]; the
        caller holds inference mode."""
        hidden, states = self.body(pool, step, features, aux_layers)
        return self.logits(hidden, step.logit_rows), states

    def logits(self, hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The float32 logits [R, V] of the final-norm states hidden[rows]."""
        return self.head(hidden[rows]).float()

    def body(self, pool: KVPool, step: StepInputs, features: bool = False,
             aux_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Everything in the step but the LM head: writes the K/V and returns the final norm's
        output for every row [T, H] and, with features, the states [T, H·(1 + len(aux_layers))].
        Sizes come from the tensors' shapes alone, never from a tensor's value, so this is what
        a CUDA graph captures (specdec.runtime.graphs); the caller holds inference mode."""
        self.check_aux_layers(aux_layers)
        shape = self.kv_shape
        assert pool.shape == shape, f"pool {pool.shape} for a model of {shape}"
        assert step.input_ids.dim() == 1 and step.input_ids.device == pool.device, (step.input_ids.shape, pool.device)
        total, (d, kv_heads) = step.input_ids.shape[0], (shape.head_dim, shape.kv_heads)
        hidden = self.embed(step.input_ids)  # [T, H]
        assert hidden.dtype == pool.dtype, f"the model computes in {hidden.dtype}, the pool holds {pool.dtype}"
        cos, sin = self.rotary(hidden, position_ids=step.positions[None])  # each [1, T, d]
        cos, sin = cos[0], sin[0]  # [T, d]
        kept_layers: dict[int, torch.Tensor] = {}
        for index, layer in enumerate(self.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(hidden)  # [T, H]
            q = attn.q_proj(x).view(total, self.heads, d)  # [T, Hq, d]
            k = attn.k_proj(x).view(total, kv_heads, d)  # [T, Hkv, d]
            v = attn.v_proj(x).view(total, kv_heads, d)  # [T, Hkv, d]
            q, k = self._rope(q, k, cos, sin, unsqueeze_dim=1)
            k_pool, v_pool = pool.layer(index)  # each [num_blocks, block_size, Hkv, d]
            k_pool.view(-1, kv_heads, d).index_copy_(0, step.slot_mapping, k)
            v_pool.view(-1, kv_heads, d).index_copy_(0, step.slot_mapping, v)
            out = self.attention(q, k_pool, v_pool, step.block_tables, step.context_lens, step.query_starts,
                                 step.tree_mask, scale=self.scaling)  # [T, Hq, d]
            hidden = hidden + attn.o_proj(out.reshape(total, self.heads * d))
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
            if index in aux_layers:
                kept_layers[index] = hidden
        hidden = self.norm(hidden)  # [T, H]
        if not features:
            return hidden, None
        return hidden, torch.cat([hidden] + [kept_layers[i] for i in aux_layers], -1) if aux_layers else hidden


def split_output(logits: torch.Tensor, states: torch.Tensor | None, step: StepInputs, features: bool) -> PagedOutput:
    """`compute`'s tensors per session: the first Σ logits_to_keep rows of logits and Σ lengths
    rows of states (a padded step's rows past them are padding)."""
    per_session = list(torch.split(logits[:sum(step.logits_to_keep)], step.logits_to_keep))
    if not features:
        return PagedOutput(per_session, None)
    return PagedOutput(per_session, list(torch.split(states[:sum(step.lengths)], step.lengths)))
