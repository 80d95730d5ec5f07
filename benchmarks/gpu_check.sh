#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one run (CI has none; run this where one is):
#  1. every Triton kernel compiled for the GPU against its torch reference, on a grid of
#     vocabulary sizes, batch sizes and k, and timed (benchmarks/kernels_gpu.py), and the
#     paged-attention kernel against its reference on 256 sessions with contexts up to 8K
#     (benchmarks/paged_attention_gpu.py), and the paged serving step: correct against the old
#     per-session path, timed on an 8B-shaped model against it and the HBM roofline, eagerly and
#     replayed from CUDA graphs, its memory flat (benchmarks/paged_step_gpu.py);
#  2. the service tests with their tiny models on the GPU (SPECDEC_TEST_DEVICE=cuda):
#     greedy output equal to the target alone, seeded sampling equal to the target's own
#     sampler, the sampled-distribution test, continuous batching, the draft head next to
#     the target — with the compiled kernels instead of the CPU's interpreter.
#
#     benchmarks/gpu_check.sh OUT_DIR
#
# Writes OUT_DIR/device.txt, preflight.log, kernels_gpu.json (+ .log), paged_attention_gpu.json
# (+ .log), paged_step_gpu.json (+ .log), pytest_cuda_gpu.log and pytest_cuda_services.log;
# exits non-zero if any check failed or ran past its cap (the *_TIMEOUT_S variables).
set -uo pipefail
out=${1:-gpu-check}
mkdir -p "$out" && out=$(cd "$out" && pwd)  # absolute: the checks run from the repository root
cd "$(dirname "$0")/.."
unset TRITON_INTERPRET
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python=${PYTHON:-python3}

{ nvidia-smi -L; "$python" -c "import torch, triton, transformers, grpc, google.protobuf as pb
print('torch', torch.__version__, '| triton', triton.__version__, '| transformers', transformers.__version__,
      '| grpcio', grpc.__version__, '| protobuf', pb.__version__, '|', torch.cuda.get_device_name())"; } \
    2>&1 | tee "$out/device.txt"

# pyproject asks for transformers >= 5.18 (README, "On a GPU"): with an older one the service
# tests fail for reasons of its own, so say so instead of running them.
"$python" -c 'import sys, transformers
v = tuple(int(p) for p in transformers.__version__.split(".")[:2])
sys.exit(f"transformers {transformers.__version__} < 5.18: install a newer one first" if v < (5, 18) else 0)' || exit 2

# Triton builds a small C launcher for each compiled kernel on its first launch: without a C
# compiler or Python's headers every kernel fails, so say so once, before anything runs.
timeout 60 "$python" benchmarks/triton_preflight.py 2>&1 | tee "$out/preflight.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || { echo "preflight: a Triton kernel does not launch here (preflight.log)"; exit 2; }

# Time caps, in all under 8 minutes: a step cut short says so in its own report (or log) and the
# steps after it still run.
timeout "${KERNELS_TIMEOUT_S:-70}" "$python" benchmarks/kernels_gpu.py \
    >"$out/kernels_gpu.json" 2>"$out/kernels_gpu.log"
kernels=$?
echo "kernels_gpu.py: exit $kernels"
"$python" - "$out/kernels_gpu.json" <<'EOF' || true
import json, sys
report = json.load(open(sys.argv[1]))
print(f"all_match={report['all_match']} on {report['device']}")
for r in report["results"]:
    print(f"{r['kernel']:17s} V={r['V']:6d} B={r['B']:2d} k={r['k']}: match={r['match']} "
          f"triton {r['triton_ms']:.4f} ms ({r['triton_GBps']} GB/s{', in L2' if r.get('fits_in_l2') else ''}) "
          f"torch {r['torch_ms']:.4f} ms x{r['speedup']}")
EOF

timeout "${PAGED_TIMEOUT_S:-60}" "$python" benchmarks/paged_attention_gpu.py \
    >"$out/paged_attention_gpu.json" 2>"$out/paged_attention_gpu.log"
paged=$?
echo "paged_attention_gpu.py: exit $paged"
"$python" - "$out/paged_attention_gpu.json" <<'EOF' || true
import json, sys
report = json.load(open(sys.argv[1]))
print(f"all_match={report['all_match']} on {report['device']}")
for r in report["results"]:
    print(f"paged_attention new={r['new_tokens']!s:5s} tree={r['tree']!s:5s} T={r['tokens']:4d}: "
          f"match={r['match']} err={r['max_abs_err']:.2e} triton {r['triton_ms']:.4f} ms "
          f"({r['triton_GBps']} GB/s) reference {r['reference_ms']:.2f} ms sdpa {r.get('sdpa_ms', 'error')} ms")
EOF

timeout "${PAGED_STEP_TIMEOUT_S:-165}" "$python" benchmarks/paged_step_gpu.py \
    >"$out/paged_step_gpu.json" 2>"$out/paged_step_gpu.log"
step=$?
echo "paged_step_gpu.py: exit $step"
"$python" - "$out/paged_step_gpu.json" <<'EOF' || true
import json, sys
report = json.load(open(sys.argv[1]))
print(f"all_correct={report['all_correct']} on {report['device']}")
for r in report["correctness"]:
    print(f"paged step {r['dtype']:8s} {r['attention']:10s} {r['case']:8s}: pass={r['pass']} "
          f"argmax {r['argmax_agreement']:.4f} max|diff| {r['max_abs_diff']:.2e}")
for path in ("paged", "graphs", "old"):
    for r in report.get("steps", {}).get(path, []):
        print(f"{path:5s} step B={r['B']:3d}: {r['ms']:9.3f} ms {r['tokens_per_s']:10.1f} tokens/s")
for name, t in report["targets"].items():
    print(f"target {name:28s} {t['value']!s:>8} (limit {t['limit']}): pass={t['pass']}")
for note in report["notes"] + ([report["error"]] if "error" in report else []):
    print("note:", note)
EOF

# The tests in two runs, each under its own cap: first what only a GPU exercises (CUDA graphs,
# the paged pool and its kernel compiled, bfloat16), then the services on the GPU. -v: a run cut
# short still shows, test by test, how far it got.
SPECDEC_TEST_DEVICE=cuda timeout "${GPU_TESTS_TIMEOUT_S:-85}" "$python" -m pytest -v -p no:cacheprovider \
    -m "not slow" ${PYTEST_ARGS:-} tests/test_graphs.py tests/test_paged_cache.py tests/test_paged_serving.py \
    tests/test_paged_head.py tests/test_dtype.py >"$out/pytest_cuda_gpu.log" 2>&1
gpu_tests=$?
tail -5 "$out/pytest_cuda_gpu.log"
echo "pytest on cuda (graphs, paged pool, bfloat16): exit $gpu_tests"
SPECDEC_TEST_DEVICE=cuda timeout "${SERVICE_TESTS_TIMEOUT_S:-85}" "$python" -m pytest -v -p no:cacheprovider \
    -m "not slow" ${PYTEST_ARGS:-} tests/test_services.py tests/test_sampling_services.py \
    tests/test_seeded_determinism.py tests/test_batching.py tests/test_inline_head.py tests/test_eagle_services.py \
    tests/test_tree.py >"$out/pytest_cuda_services.log" 2>&1
service_tests=$?
tail -5 "$out/pytest_cuda_services.log"
echo "pytest on cuda (services): exit $service_tests"
[ "$kernels" -eq 0 ] && [ "$paged" -eq 0 ] && [ "$step" -eq 0 ] && [ "$gpu_tests" -eq 0 ] && [ "$service_tests" -eq 0 ]
