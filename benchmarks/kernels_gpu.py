"""Time each Triton kernel against its torch reference on one CUDA GPU; print JSON.

    python benchmarks/kernels_gpu.py [--quick] > kernels_gpu.json

Grid: V in {49152, 262144} x B in {1, 8, 64} x k in {4, 8}; each kernel and its reference
run on the same inputs, are checked to agree (tokens exactly, probabilities within 1e-5), and
are timed with CUDA events (median of REPEATS after WARMUP calls). Bandwidth is a model of
the bytes a kernel must read, divided by its time:

* greedy_verify:    the logits of every scored position, B * (k + 1) * V * itemsize;
* greedy_verify_rows: ragged chains in place, one chain of k drafts among B - 1 without
                    (a step where one request drafts): its (B + k) scored rows, against the
                    reference's argmax of every row;
* rejection_sample: p and q of the one position each row emits from, B * V * 4 * 2
                    (the kernel reads them twice; acceptance gathers are negligible);
* sampled_match:    one-hot drafts (the coupled rule): p at every position up to num_draft,
                    B * (k + 1) * V * 4 (the total pass; the search pass stops at the token
                    and re-reads mostly from L2);
* warp_probs:       the logits once plus the probabilities written, N * V * (itemsize + 4)
                    (the bisection passes re-read rows, mostly from L2).

Runs in well under 5 minutes on one H100/H200-class GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

VOCAB_SIZES = (49152, 262144)
BATCH_SIZES = (1, 8, 64)
DRAFT_LENGTHS = (4, 8)
WARMUP = 3
REPEATS = 20
LOGITS_DTYPE = torch.bfloat16


def time_ms(fn: Callable[[], object]) -> float:
    """Median wall time of one call on the GPU, in milliseconds."""
    for _ in range(WARMUP):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(REPEATS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def entry(kernel: str, batch: int, k: int, vocab: int, bytes_read: int, triton_ms: float,
          torch_ms: float, match: bool) -> dict:
    return {
        "kernel": kernel, "B": batch, "k": k, "V": vocab, "match": match,
        "triton_ms": round(triton_ms, 4), "torch_ms": round(torch_ms, 4),
        "speedup": round(torch_ms / triton_ms, 2),
        "bytes_read": bytes_read,
        "triton_GBps": round(bytes_read / triton_ms / 1e6, 1),
        "torch_GBps": round(bytes_read / torch_ms / 1e6, 1),
        # Repeats of a case this small read the GPU's L2, not HBM: its GB/s is not HBM's.
        "fits_in_l2": bytes_read <= torch.cuda.get_device_properties(0).L2_cache_size,
    }


def bench_greedy(batch: int, k: int, vocab: int) -> dict:
    from target_worker.kernels.greedy_verify import greedy_verify_triton
    from target_worker.kernels.greedy_verify_ref import greedy_verify_ref

    logits = torch.randn(batch, k + 1, vocab, device="cuda").to(LOGITS_DTYPE)  # [B, k + 1, V]
    draft_tokens = logits.argmax(dim=-1)[:, :k].contiguous()  # all accepted: every position read
    num_draft = torch.full((batch,), k, device="cuda")
    got = greedy_verify_triton(logits, draft_tokens, num_draft)
    expected = greedy_verify_ref(logits, draft_tokens, num_draft)
    match = all(torch.equal(a, b) for a, b in zip(got, expected))
    return entry(
        "greedy_verify", batch, k, vocab, logits.numel() * logits.element_size(),
        time_ms(lambda: greedy_verify_triton(logits, draft_tokens, num_draft)),
        time_ms(lambda: greedy_verify_ref(logits, draft_tokens, num_draft)), match,
    )


def bench_greedy_rows(batch: int, k: int, vocab: int) -> dict:
    from target_worker.kernels.greedy_verify import greedy_verify_rows_triton
    from target_worker.kernels.greedy_verify_ref import greedy_verify_rows_ref

    logits = torch.randn(batch + k, vocab, device="cuda").to(LOGITS_DTYPE)  # [R, V]: the step's rows
    rows = torch.zeros(batch, k + 1, dtype=torch.int64, device="cuda")
    rows[0] = torch.arange(k + 1, device="cuda")  # the drafting chain first, then one row per chain
    rows[1:, 0] = torch.arange(k + 1, batch + k, device="cuda")
    num_draft = torch.zeros(batch, dtype=torch.int64, device="cuda")
    num_draft[0] = k
    draft_tokens = torch.zeros(batch, k, dtype=torch.int64, device="cuda")
    draft_tokens[0] = logits[:k].argmax(dim=-1)  # all accepted: every row of the chain read
    got = greedy_verify_rows_triton(logits, rows, draft_tokens, num_draft)
    expected = greedy_verify_rows_ref(logits, rows, draft_tokens, num_draft)
    match = all(torch.equal(a, b) for a, b in zip(got, expected))
    return entry(
        "greedy_verify_rows", batch, k, vocab, logits.numel() * logits.element_size(),
        time_ms(lambda: greedy_verify_rows_triton(logits, rows, draft_tokens, num_draft)),
        time_ms(lambda: greedy_verify_rows_ref(logits, rows, draft_tokens, num_draft)), match,
    )


def bench_rejection(batch: int, k: int, vocab: int) -> dict:
    from specdec.philox import STREAM_ACCEPT, STREAM_SAMPLE, philox_uniforms
    from target_worker.kernels.rejection_sample import rejection_sample_triton
    from target_worker.kernels.rejection_sample_ref import rejection_sample_ref

    logits = torch.randn(batch, k + 1, vocab, device="cuda") * 3
    p = torch.softmax(logits, dim=-1)  # [B, k + 1, V]
    noise = torch.randn(batch, k, vocab, device="cuda")
    q = torch.softmax(logits[:, :k] + noise, dim=-1)  # [B, k, V]
    draft_tokens = torch.multinomial(q.view(-1, vocab), 1).view(batch, k)
    num_draft = torch.full((batch,), k, device="cuda")
    seeds = torch.arange(batch, device="cuda")
    positions = torch.arange(k + 1, device="cuda")[None, :].expand(batch, -1).contiguous()
    u_accept = philox_uniforms(seeds, positions[:, :k].contiguous(), STREAM_ACCEPT)
    u_sample = philox_uniforms(seeds, positions, STREAM_SAMPLE)
    args = (p, q, draft_tokens, num_draft, u_accept, u_sample)
    got = rejection_sample_triton(*args)
    expected = rejection_sample_ref(*args)
    match = all(torch.equal(a, b) for a, b in zip(got, expected))
    return entry(
        "rejection_sample", batch, k, vocab, batch * vocab * 4 * 2,
        time_ms(lambda: rejection_sample_triton(*args)),
        time_ms(lambda: rejection_sample_ref(*args)), match,
    )


def bench_sampled_match(batch: int, k: int, vocab: int) -> dict:
    from specdec.philox import round_uniforms
    from target_worker.kernels.rejection_sample import rejection_sample_triton
    from target_worker.kernels.rejection_sample_ref import rejection_sample_ref

    logits = torch.randn(batch, k + 1, vocab, device="cuda") * 3
    p = torch.softmax(logits, dim=-1)  # [B, k + 1, V]
    draft_tokens = p[:, :k].argmax(dim=-1).contiguous()  # [B, k], the favourites
    num_draft = torch.full((batch,), k, device="cuda")  # every position drawn
    _, u_sample = round_uniforms(
        torch.arange(batch, device="cuda"), torch.zeros(batch, dtype=torch.int64, device="cuda"), k
    )
    u_accept = torch.zeros(batch, k, dtype=torch.float64, device="cuda")  # not read
    args = (p, None, draft_tokens, num_draft, u_accept, u_sample.contiguous())
    got = rejection_sample_triton(*args)
    expected = rejection_sample_ref(*args)
    match = all(torch.equal(a, b) for a, b in zip(got, expected))
    return entry(
        "sampled_match", batch, k, vocab, p.numel() * 4,
        time_ms(lambda: rejection_sample_triton(*args)),
        time_ms(lambda: rejection_sample_ref(*args)), match,
    )


def bench_warp(batch: int, k: int, vocab: int) -> dict:
    from target_worker.kernels.warp import warp_probs_triton
    from target_worker.kernels.warp_ref import warp_probs_ref

    rows = batch * (k + 1)
    logits = (torch.randn(rows, vocab, device="cuda") * 3).to(LOGITS_DTYPE)  # [N, V]
    temperature = torch.full((rows,), 0.8, device="cuda")
    top_k = torch.full((rows,), 50, device="cuda", dtype=torch.int64)
    top_p = torch.full((rows,), 0.9, device="cuda")
    args = (logits, temperature, top_k, top_p)
    got = warp_probs_triton(*args)
    expected = warp_probs_ref(*args)
    differ = ((got > 0) != (expected > 0)).any(-1)  # [N]: rows whose kept sets differ
    at_cut = top_p_cut_only(logits, temperature, top_k, top_p, got, expected, differ.nonzero()[:, 0].tolist())
    same = ~differ
    match = at_cut and torch.allclose(got[same], expected[same], rtol=1e-5, atol=1e-6)
    result = entry(
        "warp_probs", batch, k, vocab, rows * vocab * (logits.element_size() + 4),
        time_ms(lambda: warp_probs_triton(*args)),
        time_ms(lambda: warp_probs_ref(*args)), match,
    )
    result["top_p_cut_rows"] = int(differ.sum())
    return result


def top_p_cut_only(logits, temperature, top_k, top_p, got, expected, rows: list[int], margin: float = 1e-5) -> bool:
    """Whether, in each of `rows`, the kernel's and the reference's kept sets differ only by
    tokens at the top-p cut: where the running mass (sorted by logit, after top-k) just
    before or at the token is within `margin` of top_p. The kernel sums the mass in another
    order, with an approximate exp, so a token whose running mass sits on the cut may land
    on either side of it (target_worker/kernels/warp_ref.py)."""
    for row in rows:
        x = logits[row].float()
        e = torch.exp((x - x.max()) / temperature[row].float())
        order = x.argsort(descending=True)
        kept_k = int(top_k[row]) if int(top_k[row]) > 0 else x.numel()
        mass = torch.zeros_like(e)
        mass[order[:kept_k]] = e[order[:kept_k]].cumsum(0) / e[order[:kept_k]].sum()
        before = mass - torch.where(mass > 0, e / e[order[:kept_k]].sum(), 0.0)
        p = float(top_p[row])
        for token in ((got[row] > 0) != (expected[row] > 0)).nonzero()[:, 0].tolist():
            if min(abs(float(before[token]) - p), abs(float(mass[token]) - p)) > margin:
                return False
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="V = 49152, B = 8, k = 4 only")
    options = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("kernels_gpu.py: unset TRITON_INTERPRET; this benchmark times compiled kernels")
    if not torch.cuda.is_available():
        sys.exit(
            "kernels_gpu.py needs a CUDA GPU (torch.cuda.is_available() is False); on CPU the "
            "kernels are checked by tests/test_kernels_*.py under TRITON_INTERPRET=1"
        )
    try:
        import triton
    except ImportError:
        sys.exit("kernels_gpu.py needs triton (pip install 'specdec[triton]')")

    grid = [(v, b, k) for v in VOCAB_SIZES for b in BATCH_SIZES for k in DRAFT_LENGTHS]
    if options.quick:
        grid = [(49152, 8, 4)]
    results = []
    for vocab, batch, k in grid:
        for bench in (bench_greedy, bench_greedy_rows, bench_rejection, bench_sampled_match, bench_warp):
            results.append(bench(batch, k, vocab))
            print(json.dumps(results[-1]), file=sys.stderr, flush=True)
    report = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "logits_dtype": str(LOGITS_DTYPE),
        "results": results,
        "all_match": all(r["match"] for r in results),
    }
    print(json.dumps(report, indent=1))
    return 0 if report["all_match"] else 1


if __name__ == "__main__":
    sys.exit(main())
