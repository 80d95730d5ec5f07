"""A training step of the feature-level head (`specdec distill --kind eagle`), side by side:
its draft-vocabulary LM head in fp32 (`fp32-logits`, how heads were trained so far) and under
bf16 autocast like the rest of the head (`bf16-logits`), on the stored teacher data of a
distill work directory.

Both variants start from the same weights and take the same batches, one step each in turn
(A, B, A, B, …), so the machine's noise hits both alike; the ratio of their median step times
is the speedup. Then each is evaluated on the held-out split exactly as `specdec distill`
does (greedy k = 4 chains): a faster step is only worth having if the head learns as much
per step.

    python benchmarks/head_train_step.py --work WORK [--steps 200] [--aux-layers 1,14] [--json out.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

VARIANTS = {"fp32-logits": False, "bf16-logits": True}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True, help="a `specdec distill --kind eagle` work dir")
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--aux-layers", default="1,14", help="as the data was made with ('' for none)")
    parser.add_argument("--steps", type=int, default=200, help="steps of each variant")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--unroll", type=int, default=3)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup-steps", type=int, default=50)
    parser.add_argument("--draft-vocab", type=int, default=8192)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, help="also write the report here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from specdec import eagle
    from specdec.train.evaluate import EVAL_K, evaluate_eagle
    from specdec.train.examples import choose_vocab, collate_eagle, load_eagle_examples
    from specdec.train.loop import learning_rate, new_optimizer
    from specdec.train.losses import eagle_step_loss
    from specdec.train.prompts import HELDOUT, TRAIN
    from specdec.models import eos_token_ids, load_model

    aux = tuple(int(x) for x in args.aux_layers.split(",") if x)
    target, tokenizer = load_model(args.target)
    train = load_eagle_examples(args.work, TRAIN, aux)
    heldout = load_eagle_examples(args.work, HELDOUT, aux)
    if not train or not heldout:
        sys.exit(f"{args.work}: no training or no held-out data")
    vocab_size = int(target.get_output_embeddings().weight.shape[0])
    draft_vocab = choose_vocab(train, min(args.draft_vocab, vocab_size), eos_token_ids(target, tokenizer), vocab_size)
    index_of = torch.full((vocab_size,), -1, dtype=torch.long)
    index_of[draft_vocab] = torch.arange(len(draft_vocab))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    torch.manual_seed(0)
    first = eagle.build(eagle.new_config(target, args.target, len(draft_vocab), aux_layers=aux), target, draft_vocab)
    heads = {name: copy.deepcopy(first) for name in VARIANTS}
    schedule = SimpleNamespace(lr=args.lr, warmup_steps=args.warmup_steps, weight_decay=0.01)
    optimizers = {name: new_optimizer(head, schedule) for name, head in heads.items()}
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    losses: dict[str, list[float]] = {name: [] for name in VARIANTS}
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(0)).tolist()
    cursor = 0
    for step in range(args.steps):
        if cursor + args.batch_size > len(order):
            cursor = 0
        batch = collate_eagle([train[i] for i in order[cursor:cursor + args.batch_size]], pad_id, index_of,
                              first.config.hidden_size)
        cursor += args.batch_size
        lr = learning_rate(schedule, step, step / args.steps)
        for name, bf16_logits in VARIANTS.items():
            head, optimizer = heads[name], optimizers[name]
            for group in optimizer.param_groups:
                group["lr"] = lr
            began = time.perf_counter()
            loss, _ = eagle_step_loss(head, batch, args.unroll, 0.5, 1.0, True, bf16_logits)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            optimizer.step()
            times[name].append(time.perf_counter() - began)
            losses[name].append(loss.item())
        if (step + 1) % 25 == 0:
            print(f"step {step + 1}: " + ", ".join(
                f"{n} {statistics.median(times[n][-25:]):.3f} s loss {statistics.fmean(losses[n][-25:]):.4f}"
                for n in VARIANTS), file=sys.stderr, flush=True)

    report = {"work": str(args.work), "steps": args.steps, "batch_size": args.batch_size, "unroll": args.unroll,
              "threads": args.threads, "torch": torch.__version__, "train_sequences": len(train),
              "heldout_sequences": len(heldout), "variants": {}}
    for name in VARIANTS:
        metrics = evaluate_eagle(heads[name], heldout, pad_id, index_of, EVAL_K)
        report["variants"][name] = {"median_step_s": statistics.median(times[name]),
                                    "mean_step_s": statistics.fmean(times[name]),
                                    "loss_last_25": statistics.fmean(losses[name][-25:]), **metrics}
    a, b = (report["variants"][n] for n in VARIANTS)
    report["speedup_bf16_logits"] = a["median_step_s"] / b["median_step_s"]
    text = json.dumps(report, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
