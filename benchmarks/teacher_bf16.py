"""Could `specdec distill`'s teacher run in bfloat16? Its data phase (the target answering the
prompts, batched) is compute-bound on CPU, and this CPU multiplies bf16 matrices ~2.3x faster
than fp32 (AVX512-BF16); but the draft must learn the target as served (fp32), so a bf16
teacher is only worth it if it is the same teacher.

1. Fidelity, on the stored teacher data of a distill work directory (the fp32 target's greedy
   answers): both models teacher-forced over every sequence; at each answer position, whether
   their argmax agrees, the KL(fp32 ‖ bf16) of their next-token distributions, and whether the
   bf16 argmax is the stored (fp32 greedy) token.
2. Throughput: `teacher_generate` (the data phase's own batched generation) on the same
   prompts, fp32 as the data phase runs it (the CPU fast path) and bf16, alternated, tokens/s.

    python benchmarks/teacher_bf16.py --work WORK [--sequences 128] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


@torch.inference_mode()
def next_token_logprobs(model, sequences: list[list[int]], pad_id: int) -> list[torch.Tensor]:
    """Right-padded teacher-forced pass: per sequence [len - 1, V] float32 log-probs."""
    longest = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), longest), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(sequences):
        ids[i, :len(s)] = torch.tensor(s)
        mask[i, :len(s)] = 1
    logits = model(input_ids=ids, attention_mask=mask).logits.float()  # [B, L, V]
    return [torch.log_softmax(logits[i, :len(s) - 1], -1) for i, s in enumerate(sequences)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--sequences", type=int, default=128, help="stored sequences to compare on")
    parser.add_argument("--gen-prompts", type=int, default=64)
    parser.add_argument("--gen-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from specdec.train.teacher import teacher_for_generation, teacher_generate
    from specdec.models import eos_token_ids, load_model

    target, tokenizer = load_model(args.target)
    half, _ = load_model(args.target)
    half = half.to(torch.bfloat16).eval()
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    prompts, answers = [], []
    for path in sorted((args.work / "data").glob("*-s0.pt")):
        shard = torch.load(path, weights_only=True)
        prompts += shard["prompts"]
        answers += shard["answers"]
    pairs = [(p, a) for p, a in zip(prompts, answers) if a][:args.sequences]
    if not pairs:
        sys.exit(f"{args.work}: no stored greedy answers")

    agree = same_as_stored = positions = 0
    kls: list[float] = []
    for start in range(0, len(pairs), 8):
        chunk = pairs[start:start + 8]
        sequences = [p + a for p, a in chunk]
        full = next_token_logprobs(target, sequences, pad_id)
        low = next_token_logprobs(half, sequences, pad_id)
        for (p, a), f, h in zip(chunk, full, low):
            f, h = f[len(p) - 1:], h[len(p) - 1:]  # the answer positions
            agree += int((f.argmax(-1) == h.argmax(-1)).sum())
            same_as_stored += int((h.argmax(-1) == torch.tensor(a)).sum())
            kls += (f.exp() * (f - h)).sum(-1).tolist()
            positions += len(a)

    fast, cache_factory = teacher_for_generation(target)
    eos = eos_token_ids(target, tokenizer)
    gen_prompts = [p for p, _ in pairs][:args.gen_prompts]
    rates: dict[str, list[float]] = {"fp32 (data phase)": [], "bf16": []}
    for _ in range(2):
        for name, model, factory in (("fp32 (data phase)", fast, cache_factory), ("bf16", half, None)):
            began = time.perf_counter()
            out = teacher_generate(model, gen_prompts, pad_id=pad_id, eos_ids=eos, max_new_tokens=args.gen_tokens,
                                   top_k=20, new_cache=factory)
            tokens = sum(len(a) for a in out.answers)
            rates[name].append(tokens / (time.perf_counter() - began))

    report = {
        "work": str(args.work), "sequences": len(pairs), "answer_positions": positions,
        "argmax_agreement_fp32_bf16": agree / positions,
        "bf16_argmax_is_stored_greedy": same_as_stored / positions,
        "kl_fp32_bf16_mean": statistics.fmean(kls), "kl_fp32_bf16_p99": sorted(kls)[int(0.99 * (len(kls) - 1))],
        "gen_prompts": len(gen_prompts), "gen_tokens": args.gen_tokens, "threads": args.threads,
        "tokens_per_s": {k: statistics.median(v) for k, v in rates.items()},
    }
    report["bf16_throughput_ratio"] = report["tokens_per_s"]["bf16"] / report["tokens_per_s"]["fp32 (data phase)"]
    text = json.dumps(report, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
