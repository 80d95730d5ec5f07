"""Steps of the paged forward replayed from CUDA graphs captured at padded token counts.

A step of PagedLlama issues a few hundred kernels (per layer two norms, seven linears, RoPE, the
K/V write, paged attention, the residual adds; then the norm and the LM head), each launched
from Python. A small step on a GPU is bound by reading the weights once, and launching that
many kernels one by one from Python adds host time of the same order. A CUDA graph records the
step's kernels once and replays them in one launch. vLLM and SGLang capture their decode steps
the same way, at a list of batch sizes.

How a step fits a graph:

- Every input lives in StepBuffers' static arena (specdec.runtime.paged_step), so a graph replays
  on the addresses it was captured with; the step's body (PagedLlama.body) takes every size from
  the tensors' shapes, never from a tensor's value, so it issues the same kernels every time.
- A step of T tokens replays the graph of the smallest bucket ≥ T (TOKEN_BUCKETS). The plan pads
  it (StepBuffers.plan's pad_to): the padded tokens belong to the arena's padding session (zero
  context, only PAD_BLOCK in its block table) and write their K/V into PAD_BLOCK. Every
  operation but attention works row by row, and attention works per session, so the padding
  never reaches a real token's result; its logits and states are cut off.
- Captured: chain steps (decoding and chain verification) up to the largest bucket, with or
  without the features a head reads. A step with a tree mask, a prefill chunk past the largest
  bucket, or a model whose RoPE reads the largest position (dynamic scaling) runs eagerly.
- A bucket is captured by a step run at it (a warm-up run on a side stream first: Triton
  compiles, cuBLAS picks its kernels; then the capture, which records without running): at
  load, a throwaway step per bucket up to a size the caller names
  (PagedCausalLM.capture_graphs; the target worker's: what a batch of rounds can take), and
  past it the first step that needs one, whose warm-up writes the step's own K/V into its
  own slots, as its replay then does again. All graphs share one memory pool; each keeps
  its outputs (the final norm's states, and the features a head reads), which a replay
  overwrites, so what a step returns is computed or copied out of them.
- StepGraphs is the mechanism alone; GraphedForward runs the target's steps through it, and
  specdec.eagle.paged.PagedHead a head's.
- The graph is the step's body, PagedLlama.body. The LM head runs after the replay, eagerly,
  on the kept rows only (one matmul): a graph's outputs are then H (or the features' width)
  per padded token instead of a vocabulary's worth of logits.

On CPU nothing is captured: `capture=False` runs the same padded step eagerly, which is how the
CPU tests show that a padded step gives the unpadded step's logits, states and cache.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from specdec.runtime.paged import KVPool
from specdec.runtime.paged_llama import PagedLlama, PagedOutput, split_output
from specdec.runtime.paged_step import StepInputs, StepLimits

log = logging.getLogger(__name__)

# Token counts steps are padded to: every power of two up to 32, then steps of at most a
# quarter, up to 1,024 (at most 25% of a step's tokens are padding past 32).
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256,
                 320, 384, 448, 512, 640, 768, 896, 1024)


def graph_safe(runner: PagedLlama) -> str | None:
    """None when the model's forward can be captured; otherwise why not."""
    rope = str(getattr(runner.rotary, "rope_type", "default"))
    if "dynamic" in rope:
        return f"its RoPE ({rope}) reads the largest position on the host"
    return None


class StepGraphs:
    """Steps planned in one StepBuffers (specdec.runtime.paged_step), padded to the token counts
    of `buckets` and replayed from CUDA graphs, one per key (capture=None: capture on CUDA only;
    False: run the padded step eagerly). What a step computes is the caller's: `replay` takes
    it as a function of the static inputs."""

    def __init__(self, device: torch.device, limits: StepLimits, block_size: int,
                 buckets: tuple[int, ...] = TOKEN_BUCKETS, capture: bool | None = None):
        """limits: the StepBuffers' the steps are planned in; block_size: their pool's."""
        self.device = torch.device(device)
        self.buckets = tuple(b for b in sorted(buckets) if b <= limits.max_tokens)
        # The padding session's tokens sit at positions 0.. of its block table.
        self.max_padding = limits.max_blocks * block_size
        self.capture = self.device.type == "cuda" if capture is None else capture
        if self.capture and self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {self.device}")
        # key (its first item the padded token count) -> the graph and its output tensors
        self._graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, tuple]] = {}
        self._memory = torch.cuda.graph_pool_handle() if self.capture else None
        self.replays = 0
        """Steps run through a graph (or, capture off, through the padded eager path)."""
        self.capture_s = 0.0
        """Seconds spent warming up and capturing graphs, all buckets together."""
        self.off: str | None = None
        """Why no step is padded any more: a capture failed (the log says how)."""

    @property
    def captured(self) -> list[int]:
        """The token counts a graph has been captured at."""
        return sorted({key[0] for key in self._graphs})

    def bucket(self, tokens: int, trees: bool) -> int | None:
        """The padded size of a step of `tokens` tokens, or None: the step runs eagerly."""
        if trees or self.off is not None:
            return None
        for size in self.buckets:
            if size >= tokens:
                return size if size - tokens <= self.max_padding else None
        return None

    def warm_up_sizes(self, up_to: int) -> list[tuple[int, int]]:
        """For capturing at load every bucket a step of up to `up_to` tokens can take: per
        bucket, (its size, the fewest real tokens a step padded to it carries)."""
        last = self.bucket(min(up_to, self.buckets[-1]), trees=False)
        if last is None:
            return []
        return [(size, max(1, size - self.max_padding)) for size in self.buckets if size <= last]

    def replay(self, key: tuple, compute: Callable[[], tuple]) -> tuple:
        """compute()'s outputs for the step now in the static inputs: key[0] its padded token
        count, the rest whatever else changes the kernels compute issues (a width, a flag).
        Captured, they are the graph's output tensors, which the key's next replay
        overwrites: the caller copies what it keeps."""
        assert key[0] in self.buckets, (key, self.buckets)
        if self.capture and key not in self._graphs:
            try:
                self._graphs[key] = self._record(key, compute)
            except RuntimeError as exc:  # something in the step cannot be captured
                self.off = f"capturing a {key[0]}-token step failed: {exc}"
                log.warning("CUDA graphs off: %s", self.off)
        self.replays += 1
        if key not in self._graphs:
            return compute()
        graph, outputs = self._graphs[key]
        graph.replay()
        return outputs

    def _record(self, key: tuple, compute: Callable[[], tuple]):
        began = time.perf_counter()
        side = torch.cuda.Stream(device=self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                compute()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._memory):
            outputs = compute()
        torch.cuda.synchronize(self.device)
        self.capture_s += time.perf_counter() - began
        log.info("CUDA graph captured: %s in %.2f s", key, time.perf_counter() - began)
        return graph, outputs


class GraphedForward(StepGraphs):
    """PagedLlama.forward over one pool and one StepBuffers, its body replayed from CUDA
    graphs at padded token counts (StepGraphs)."""

    def __init__(self, runner: PagedLlama, pool: KVPool, limits: StepLimits,
                 buckets: tuple[int, ...] = TOKEN_BUCKETS, capture: bool | None = None):
        super().__init__(pool.device, limits, pool.block_size, buckets, capture)
        self.runner, self.pool = runner, pool

    def run(self, step: StepInputs, features: bool = False, aux_layers: tuple[int, ...] = ()) -> PagedOutput:
        """The output of PagedLlama.forward for a step planned with pad_to = a bucket."""
        self.runner.check_aux_layers(aux_layers)
        assert step.tree_mask is None
        hidden, states = self.replay((step.input_ids.shape[0], features, aux_layers),
                                     lambda: self.runner.body(self.pool, step, features, aux_layers))
        # A replay's outputs are the next replay's too: what the step returns is a copy (or,
        # the logits, computed from them). The LM head runs outside the graph on the kept rows
        # only: one launch, and no graph keeps a [bucket, vocabulary] logits buffer alive.
        if states is not None:
            states = states[:sum(step.lengths)].clone()
        logits = self.runner.logits(hidden, step.logit_rows)
        return split_output(logits, states, step, features)
