"""Every Triton kernel compiles to GPU machine code (cubin) for sm_80 and sm_90, on CPU; and
the ops layer imports and runs where triton is not installed at all.

triton.compile lowers the kernel through TTIR -> TTGIR -> LLVM IR -> PTX and runs the ptxas
shipped in the triton wheel, so no GPU is needed. It must run without TRITON_INTERPRET (the
variable is read when a kernel is *defined*, and conftest sets it for the interpreter tests),
hence a subprocess with a fresh environment and an empty kernel cache (so it really compiles).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
ARCHITECTURES = (80, 90)

# Runs in the subprocess: compile each (kernel, signature, constexprs) and print cubin sizes.
COMPILE_SCRIPT = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from target_worker.kernels import greedy_verify, paged_attention, rejection_sample, warp
from target_worker.kernels.launch import is_interpreted

BLOCK_V = 4096
rejection_constants = dict(
    WEIGHT_SCALE=rejection_sample.WEIGHT_SCALE, UNIFORM_SCALE=rejection_sample.UNIFORM_SCALE,
    UNIFORM_BITS=rejection_sample.UNIFORM_BITS, UNIFORM_MASK=rejection_sample.UNIFORM_MASK,
    NO_TOKEN=rejection_sample.NO_TOKEN, BLOCK_V=BLOCK_V,
)
cases = {
    "argmax_bf16": (greedy_verify._argmax_kernel,
        dict(logits_ptr="*bf16", rows_ptr="*i64", num_draft_ptr="*i64", target_tokens_ptr="*i64", k="i32",
             V="i32"),
        dict(NO_TOKEN=greedy_verify.NO_TOKEN, BLOCK_V=BLOCK_V)),
    "argmax_fp32": (greedy_verify._argmax_kernel,
        dict(logits_ptr="*fp32", rows_ptr="*i64", num_draft_ptr="*i64", target_tokens_ptr="*i64", k="i32",
             V="i32"),
        dict(NO_TOKEN=greedy_verify.NO_TOKEN, BLOCK_V=BLOCK_V)),
    "accept": (greedy_verify._accept_kernel,
        dict(draft_tokens_ptr="*i64", target_tokens_ptr="*i64", num_draft_ptr="*i64",
             accepted_ptr="*i64", next_token_ptr="*i64", k="i32"),
        dict(BLOCK_K=8)),
    "rejection_q": (rejection_sample._rejection_sample_kernel,
        dict(p_ptr="*fp32", q_ptr="*fp32", draft_tokens_ptr="*i64", num_draft_ptr="*i64",
             u_accept_ptr="*fp64", u_sample_ptr="*fp64", accepted_ptr="*i64",
             next_token_ptr="*i64", k="i32", V="i32"),
        dict(BLOCK_K=8, **rejection_constants)),
    # The one-hot (coupled) path: these draws, then the "accept" kernel above.
    "one_hot_draw_fp32": (rejection_sample._draw_kernel,
        dict(p_ptr="*fp32", num_draft_ptr="*i64", u_sample_ptr="*fp64", drawn_ptr="*i64",
             k="i32", V="i32"),
        dict(rejection_constants)),
    "one_hot_draw_bf16": (rejection_sample._draw_kernel,
        dict(p_ptr="*bf16", num_draft_ptr="*i64", u_sample_ptr="*fp64", drawn_ptr="*i64",
             k="i32", V="i32"),
        dict(rejection_constants)),
    "warp_bf16": (warp._warp_kernel,
        dict(logits_ptr="*bf16", temperature_ptr="*fp32", top_k_ptr="*i64", top_p_ptr="*fp32",
             probs_ptr="*fp32", V="i32"),
        dict(KEY_MIN=warp.KEY_MIN, KEY_MAX=warp.KEY_MAX, SIGN_FLIP=warp.SIGN_FLIP,
             BLOCK_V=BLOCK_V)),
}
# Paged attention at a Llama-3-8B layer's shape (Hq / Hkv = 32 / 8, D = 128), block size 16.
for dtype in ("bf16", "fp32"):
    for tree in (False, True):
        cases[f"paged_attention_{dtype}" + ("_tree" if tree else "")] = (
            paged_attention._paged_attention_kernel,
            dict(q_ptr=f"*{dtype}", k_pool_ptr=f"*{dtype}", v_pool_ptr=f"*{dtype}",
                 block_tables_ptr="*i32", context_lens_ptr="*i32", query_starts_ptr="*i32",
                 token_sessions_ptr="*i32", tree_mask_ptr="*u8", out_ptr=f"*{dtype}",
                 max_blocks="i32", max_queries="i32", qk_scale="fp32"),
            dict(HQ=32, HKV=8, HEAD_DIM=128, BLOCK_SIZE=16, TILE=paged_attention.TILE_POSITIONS,
                 BLOCK_H=paged_attention.MIN_DOT_ROWS, BLOCK_D=128, HAS_TREE=tree,
                 DOT_FP32=dtype == "fp32"),
            paged_attention.NUM_WARPS,
        )
sizes = {}
for name, (kernel, signature, constexprs, *num_warps) in cases.items():
    assert not is_interpreted(kernel), "TRITON_INTERPRET leaked into the compile subprocess"
    # Pointers 16-byte aligned, as torch allocates them and as a launch specialises on.
    aligned = {(i,): [["tt.divisibility", 16]] for i, kind in enumerate(signature.values())
               if kind.startswith("*")}
    for key, value in constexprs.items():
        signature[key] = "constexpr"
    source = ASTSource(kernel, signature, constexprs, aligned)
    for arch in [int(a) for a in sys.argv[1:]]:
        compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32),
                                  options=dict(num_warps=num_warps[0] if num_warps else 8))
        sizes[f"{name}/sm_{arch}"] = len(compiled.asm["cubin"])
print(json.dumps(sizes))
"""


def test_every_kernel_compiles_to_cubin_for_sm80_and_sm90(tmp_path: Path) -> None:
    pytest.importorskip("triton")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    env["PYTHONPATH"] = str(REPO_ROOT)
    result = subprocess.run(
        [sys.executable, "-c", COMPILE_SCRIPT, *map(str, ARCHITECTURES)],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    sizes = json.loads(result.stdout.strip().splitlines()[-1])
    kernels = {
        "argmax_bf16", "argmax_fp32", "accept", "rejection_q", "one_hot_draw_fp32",
        "one_hot_draw_bf16", "warp_bf16", "paged_attention_bf16", "paged_attention_bf16_tree",
        "paged_attention_fp32", "paged_attention_fp32_tree",
    }
    assert set(sizes) == {f"{name}/sm_{arch}" for name in kernels for arch in ARCHITECTURES}
    empty = [name for name, size in sizes.items() if size <= 0]
    assert not empty, f"empty cubin: {empty}"


# Runs in a subprocess where `import triton` fails, as on a machine without it.
NO_TRITON_SCRIPT = r"""
import sys
sys.modules["triton"] = None  # makes any `import triton` raise ImportError
import torch
from target_worker.kernels import ops

assert not ops.TRITON_AVAILABLE
logits = torch.randn(2, 3, 50)
accepted, next_token = ops.greedy_verify(logits, logits.argmax(-1)[:, :2], torch.tensor([2, 1]))
assert accepted.tolist() == [2, 1]
probs = ops.warp_probs(
    logits, torch.tensor([1.0, 0.5]), torch.tensor([0, 5]), torch.tensor([0.9, 1.0])
)
ops.rejection_sample(probs, None, next_token[:, None].expand(2, 2), torch.tensor([2, 0]),
                     torch.rand(2, 2), torch.rand(2, 3))
ops.sampled_match(probs, next_token[:, None].expand(2, 2), torch.tensor([2, 0]), torch.rand(2, 3))
pool = torch.randn(3, 4, 1, 8)  # [num_blocks, block_size, Hkv, D]
attended = ops.paged_attention(torch.randn(3, 2, 8), pool, pool, torch.tensor([[2, 0], [1, 0]]),
                               torch.tensor([5, 0]), torch.tensor([0, 2, 3]))
assert attended.shape == (3, 2, 8)
kernel_modules = [m for m in sys.modules if m.startswith("target_worker.kernels.")
                  and not m.endswith(("_ref", ".ops"))]
assert kernel_modules == [], kernel_modules
"""


def test_ops_work_without_triton() -> None:
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO_ROOT)
    result = subprocess.run(
        [sys.executable, "-c", NO_TRITON_SCRIPT],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]
