"""A feature-level draft head in the style of EAGLE (Li et al., 2024, arXiv:2401.15077, and
EAGLE-3's training-time test, arXiv:2503.01840): instead of a small model that reads only
tokens, one decoder layer that reads the *target's own hidden states*.

The target's last hidden state at position t (after its final norm: what its LM head reads)
is its whole opinion of what comes next; call it f_t. The head at position t takes
(f_{t-1}, token x_t) — the target's state before x_t and the token that followed — runs one
Llama-style decoder layer over them with its own KV cache, and predicts f_t (hence x_{t+1}
through the target's LM head). Committed positions are fed with the target's true features,
which the target worker computes anyway while verifying and returns with each verdict
(protos: Verdict.features); speculative positions are fed the head's own predictions:

    step 1 at the last committed position c:   (f_{c-1}, x_c)   -> h_c     -> d_1
    step 2 at c + 1:                           (h_c, d_1)       -> h_{c+1} -> d_2  ...

Training unrolls those steps ("training-time test"): step s at position t reads the
prediction of step s-1 at t-1 and attends to the true-feature entries at positions ≤ t-s+1
plus its own chain's entries at t-s+2 … t, exactly the cache it will see when serving.

With `aux_layers` (EAGLE-3's feature fusion), committed positions also bring the residual
stream after some of the target's middle layers, concatenated after f: what the context is
about, which the final state (tuned to the very next token) has partly let go of. Those
states exist only inside the target's forward pass, so such a head runs on the target worker.

Costs on the target's side: nothing extra to compute. Where it runs: next to the target, in
the target worker (target_worker.head: `specdec up --draft HEAD`, `specdec serve target
--head`), it reads the states the verification has just computed and drafts in the same
step; served by a draft worker instead, every committed token's features cross the wire
twice, 2·H bytes each (float16; SmolLM2-135M: 1,152 bytes), and every round waits for a
Propose round trip. The head proposes from a reduced vocabulary
(`draft_vocab`: the target's most frequent output tokens) through those rows of the target's
LM head, so a draft step reads one decoder layer and Vd×H head weights instead of the
target's 30 layers and 49,152×576 head; the input embeddings are the target's own. Neither
is shipped with the draft: the worker takes them from the target model named in the draft's
config, so a head for SmolLM2-135M is ~10 MB.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from specdec.runtime import attention_threads
from specdec.runtime.memory import storage_bytes
from specdec.runtime.precision import fp32_logits

KIND = "eagle"  # config.json "specdec_draft" of a head directory
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
FEATURE_DTYPE = torch.float16  # features on the wire and in training data
FEATURE_BYTES = 2


@dataclass
class EagleConfig:
    target: str  # spec of the target model whose features, embeddings and LM head it uses
    hidden_size: int  # the target's
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    draft_vocab_size: int
    specdec_draft: str = KIND
    # Target decoder layers (0-based) whose outputs (the residual stream after the layer) the
    # head reads beside the final features, at committed positions (EAGLE-3's low/mid-level
    # features); empty: the final features only.
    aux_layers: list[int] = field(default_factory=list)

    @property
    def feature_size(self) -> int:
        """Width of the target features the head is fed at committed positions: the final
        hidden state, then each aux layer's."""
        return self.hidden_size * (1 + len(self.aux_layers))

    def save(self, directory: Path) -> None:
        (directory / CONFIG_NAME).write_text(json.dumps(asdict(self), indent=1) + "\n")

    @classmethod
    def load(cls, directory: Path) -> EagleConfig:
        data = json.loads((Path(directory) / CONFIG_NAME).read_text())
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})


class RMSNorm(torch.nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * x).to(dtype)


def inverse_frequencies(head_dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))  # [d/2]


def rotate(x: torch.Tensor, positions: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    """Rotary embedding (Llama's half-split layout). x: [..., n, d], positions: [n] or
    broadcastable to x's [..., n]; inv: inverse_frequencies(d, theta)."""
    d = x.shape[-1]
    angles = positions.to(torch.float32)[..., None] * inv  # [..., n, d/2]
    cos = torch.cat([angles.cos(), angles.cos()], -1).to(x.dtype)
    sin = torch.cat([angles.sin(), angles.sin()], -1).to(x.dtype)
    half = d // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


class AuxNorm(torch.nn.Module):
    """RMS norm of each of `count` concatenated [H] states (layers' residual streams differ
    in scale by orders of magnitude), with a learned gain per layer."""

    def __init__(self, count: int, size: int, eps: float):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(count, size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., count·H] -> same
        dtype = x.dtype
        y = x.float().unflatten(-1, self.weight.shape)
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * y).flatten(-2).to(dtype)


class EagleHead(torch.nn.Module):
    """fc(concat(feature, embedding)) [+ aux_fc(aux_norm(aux features))] -> one pre-norm
    decoder layer -> norm -> predicted feature; logits over the draft vocabulary through the
    target's LM-head rows.

    With `aux_layers`, committed positions also bring the residual stream after those target
    layers (EAGLE-3, arXiv:2503.01840, fuses low, mid and high-level states): the final state
    is tuned to the next token, and the middle of the network still holds what the context is
    about, which the token after next depends on. The head's own predictions (later chain
    steps) have no such states and are fed without the term. aux_fc starts at zero, so a head
    with aux layers starts as the same head without them (a warm start from one).

    `embed` [V, H] and `head` [Vd, H] are the target's (frozen buffers, never saved with the
    head); `draft_vocab` [Vd] maps head rows to target token ids."""

    def __init__(self, config: EagleConfig, embed: torch.Tensor, head: torch.Tensor, draft_vocab: torch.Tensor):
        super().__init__()
        self.config = config
        h, d = config.hidden_size, config.head_dim
        self.fc = torch.nn.Linear(2 * h, h, bias=False)
        if config.aux_layers:
            self.aux_norm = AuxNorm(len(config.aux_layers), h, config.rms_norm_eps)
            self.aux_fc = torch.nn.Linear(len(config.aux_layers) * h, h, bias=False)
            torch.nn.init.zeros_(self.aux_fc.weight)
        self.input_norm = RMSNorm(h, config.rms_norm_eps)
        self.q = torch.nn.Linear(h, config.num_heads * d, bias=False)
        self.k = torch.nn.Linear(h, config.num_kv_heads * d, bias=False)
        self.v = torch.nn.Linear(h, config.num_kv_heads * d, bias=False)
        self.o = torch.nn.Linear(config.num_heads * d, h, bias=False)
        self.post_norm = RMSNorm(h, config.rms_norm_eps)
        self.gate = torch.nn.Linear(h, config.intermediate_size, bias=False)
        self.up = torch.nn.Linear(h, config.intermediate_size, bias=False)
        self.down = torch.nn.Linear(config.intermediate_size, h, bias=False)
        self.out_norm = RMSNorm(h, config.rms_norm_eps)
        self.register_buffer("embed", embed, persistent=False)
        self.register_buffer("head", head, persistent=False)
        self.register_buffer("draft_vocab", draft_vocab.long(), persistent=False)
        self.register_buffer("inv_freq", inverse_frequencies(d, config.rope_theta), persistent=False)
        self.lm_head: torch.nn.Module | None = None  # the CPU serving copy's `head` (fast_cpu_head)

    # -- pieces shared by training and serving -------------------------------------------

    def inputs(self, features: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """[..., H] features (the head's own predictions) or [..., config.feature_size] (the
        target's, with the aux layers' states) and [...] token ids -> the layer's residual
        input [..., H]."""
        h, dtype = self.config.hidden_size, self.fc.weight.dtype
        x = self.fc(torch.cat([features[..., :h].to(dtype), self.embed[tokens].to(dtype)], -1))
        if features.shape[-1] > h:
            x = x + self.aux_fc(self.aux_norm(features[..., h:].to(dtype)))
        return x

    def qkv(self, x: torch.Tensor, positions: torch.Tensor):
        """x [B, n, H] -> q [B, heads, n, d], k, v [B, kv_heads, n, d], rotated."""
        c = self.config
        b, n, _ = x.shape
        y = self.input_norm(x)
        q = self.q(y).view(b, n, c.num_heads, c.head_dim).transpose(1, 2)
        k = self.k(y).view(b, n, c.num_kv_heads, c.head_dim).transpose(1, 2)
        v = self.v(y).view(b, n, c.num_kv_heads, c.head_dim).transpose(1, 2)
        return rotate(q, positions, self.inv_freq), rotate(k, positions, self.inv_freq), v

    def finish(self, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """Residual input x [B, n, H] and attention output [B, heads, n, d] -> predicted
        features [B, n, H]."""
        b, n, _ = x.shape
        x = x + self.o(attended.transpose(1, 2).reshape(b, n, -1))
        y = self.post_norm(x)
        x = x + self.down(F.silu(self.gate(y)) * self.up(y))
        return self.out_norm(x)

    def logits(self, predicted: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., Vd] float32 over the draft vocabulary (specdec.runtime.precision;
        the CPU serving copy's `lm_head` projects with the kernel chosen for it at load,
        float32 out: specdec.eagle.cpu)."""
        if self.lm_head is not None:
            return self.lm_head(predicted)
        return fp32_logits(predicted, self.head)

    def cast(self, dtype: torch.dtype) -> EagleHead:
        """The head in `dtype`, in place: its weights and the target's embeddings it reads;
        the target's LM-head rows (`head`) and the rotary frequencies stay float32, so logits
        are float32 and positions are not rounded."""
        kept = {name: getattr(self, name).float() for name in ("head", "inv_freq")}
        self.to(dtype)
        for name, tensor in kept.items():
            setattr(self, name, tensor)
        return self

    # -- training: the unrolled chain ------------------------------------------------------

    def unrolled(self, tokens: torch.Tensor, features: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """Training-time test over whole sequences. tokens [B, T]; features [B, T, feature_size]
        where features[:, t] is the target's f_{t-1} (zeros at t = 0). Returns per step s = 1..steps
        the predicted features [B, T, H]: at position t, step s's prediction of f_t when the
        features of positions t-s+1 … t-1 are the head's own (steps 1 … s-1)."""
        t = features.shape[1]
        positions = torch.arange(t, device=tokens.device)
        keys, values, outputs = [], [], []
        feed = features
        rows = positions[:, None]  # query position
        cols = positions[None, :]  # key position
        for s in range(1, steps + 1):
            x = self.inputs(feed, tokens)
            q, k, v = self.qkv(x, positions)
            keys.append(k)
            values.append(v)
            # Step 1's entries are true-feature ones: visible up to t-s+1; step r ≥ 2's entry
            # at exactly t-(s-r) (the chain that led to this query).
            masks = [cols <= rows - (s - 1)] + [cols == rows - (s - r) for r in range(2, s + 1)]
            mask = torch.cat(masks, -1)  # [T, s·T]
            attended = F.scaled_dot_product_attention(q, torch.cat(keys, 2), torch.cat(values, 2), attn_mask=mask,
                                                      enable_gqa=True)
            # A query with nothing visible (t < s-1) yields NaN rows; they are never used.
            attended = torch.nan_to_num(attended)
            out = self.finish(x, attended)
            outputs.append(out)
            # The next step at t reads this step's prediction at t-1.
            feed = torch.cat([torch.zeros_like(out[:, :1]), out[:, :-1]], 1)
        return outputs

    # -- serving: one session's cache ------------------------------------------------------

    @torch.inference_mode()
    def new_cache(self) -> HeadCache:
        """An empty KV cache for one session of this head, in the dtype of its weights."""
        return HeadCache(self.config.num_kv_heads, self.config.head_dim, self.fc.weight.dtype, self.embed.device)

    def extend(self, cache: HeadCache, features: torch.Tensor, tokens: list[int]) -> torch.Tensor:
        """Feeds n positions (features [n, H] or [n, feature_size] of the positions before
        them, tokens) on top of the cache; returns the predicted features [n, H]."""
        return self.extend_many([cache], features, [tokens])

    def extend_many(self, caches: list[HeadCache], features: torch.Tensor, tokens: list[list[int]]) -> torch.Tensor:
        """`extend` for many sessions in one pass of the layer's linears: session i feeds
        tokens[i] on top of caches[i], features packed in the same order [T, H or
        feature_size]; returns the predicted features [T, H]. Attention runs per session,
        each over its own contiguous cache."""
        device = self.embed.device  # the target's (a head on a GPU target runs on that GPU)
        positions = [p for cache, fed in zip(caches, tokens) for p in range(cache.length, cache.length + len(fed))]
        ids = [t for fed in tokens for t in fed]
        x = self.inputs(features[None].to(device=device, dtype=self.fc.weight.dtype),
                        torch.tensor([ids], device=device))  # [1, T, H]
        q, k, v = self.qkv(x, torch.tensor(positions, device=device))  # [1, Hq, T, d]; [1, Hkv, T, d]
        parts, offset = [], 0
        lengths = [len(fed) for fed in tokens]
        with attention_threads.batched_step(self.config.num_kv_heads, self.config.head_dim, lengths,
                                            [cache.length + n for cache, n in zip(caches, lengths)]):
            for cache, n in zip(caches, lengths):
                start = cache.length
                keys, values = cache.append(k[0, :, offset:offset + n], v[0, :, offset:offset + n])  # [kv_heads, L, d]
                mask = None
                if n > 1:
                    mask = torch.arange(start + n, device=device)[None, :] <= \
                        torch.arange(start, start + n, device=device)[:, None]  # [n, L]
                parts.append(attention_threads.sdpa(q[:, :, offset:offset + n], keys[None], values[None],
                                                    attn_mask=mask, enable_gqa=True))
                offset += n
        attended = parts[0] if len(parts) == 1 else torch.cat(parts, 2)  # [1, Hq, T, d]
        return self.finish(x, attended)[0]


class HeadCache:
    """The head's keys and values for one session: [kv_heads, capacity, d] buffers grown in
    blocks, cropped by moving the length back."""

    BLOCK = 256

    def __init__(self, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device | str = "cpu"):
        self.keys = torch.empty((kv_heads, 0, head_dim), dtype=dtype, device=device)
        self.values = torch.empty((kv_heads, 0, head_dim), dtype=dtype, device=device)
        self.length = 0

    def append(self, k: torch.Tensor, v: torch.Tensor):
        n = k.shape[1]
        if self.length + n > self.keys.shape[1]:
            capacity = math.ceil((self.length + n) * 1.5 / self.BLOCK) * self.BLOCK
            grown_k = self.keys.new_empty((self.keys.shape[0], capacity, self.keys.shape[2]))
            grown_v = self.values.new_empty(grown_k.shape)
            grown_k[:, :self.length] = self.keys[:, :self.length]
            grown_v[:, :self.length] = self.values[:, :self.length]
            self.keys, self.values = grown_k, grown_v
        self.keys[:, self.length:self.length + n] = k
        self.values[:, self.length:self.length + n] = v
        self.length += n
        return self.keys[:, :self.length], self.values[:, :self.length]

    def crop(self, length: int) -> None:
        self.length = min(self.length, length)

    def get_seq_length(self) -> int:
        return self.length

    def held_bytes(self) -> int:
        """The bytes this cache keeps allocated: its buffers' capacity (specdec.runtime.memory)."""
        return storage_bytes((self.keys, self.values))


def target_parts(target) -> tuple[torch.Tensor, torch.Tensor]:
    """(input embeddings [V, H], LM head [V, H]) of a target model, float32, detached."""
    embed = target.get_input_embeddings().weight.detach().float()
    head = target.get_output_embeddings().weight.detach().float()
    return embed, head


def new_config(target, target_spec: str, draft_vocab_size: int, intermediate: int | None = None,
               aux_layers: tuple[int, ...] = ()) -> EagleConfig:
    """A head shaped like one of the target's own decoder layers."""
    text = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
    heads = int(text.num_attention_heads)
    rope = getattr(text, "rope_parameters", None) or {}
    theta = float(rope.get("rope_theta", getattr(text, "rope_theta", 10000.0)))
    layers = int(getattr(text, "num_hidden_layers", 0) or 0)
    bad = [i for i in aux_layers if not 0 <= i < layers]
    if bad:
        raise ValueError(f"aux layers {bad} are not layers of the target (0 … {layers - 1})")
    return EagleConfig(
        target=target_spec, hidden_size=int(text.hidden_size), num_heads=heads,
        num_kv_heads=int(getattr(text, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(text, "head_dim", None) or text.hidden_size // heads),
        intermediate_size=int(intermediate or text.intermediate_size), rope_theta=theta,
        rms_norm_eps=float(getattr(text, "rms_norm_eps", 1e-5)),
        max_position_embeddings=int(getattr(text, "max_position_embeddings", 0) or 2048),
        draft_vocab_size=draft_vocab_size, aux_layers=sorted(set(aux_layers)))


def build(config: EagleConfig, target, draft_vocab: torch.Tensor) -> EagleHead:
    embed, head = target_parts(target)
    draft_vocab = draft_vocab.long().to(embed.device)
    return EagleHead(config, embed, head[draft_vocab].clone(), draft_vocab).to(embed.device)
