"""The coordinator's text per token: IncrementalDetokenizer.push through the tokenizer's public
`decode` against through coordinator.detokenizer.text_decoder (the Rust backend called
directly), on the served model's tokenizer, side by side in one run.

    python benchmarks/detokenizer.py                # SmolLM2's tokenizer, ~20 s

Both decoders stream the ids of the same texts (prose, code, multi-byte characters) token by
token, alternating, `--repeats` times; the script checks that both give the same text as
`tokenizer.decode` of all the ids, and reports microseconds per token (medians) and their
ratio. Every request's every token goes through push() on the coordinator's event loop, so
this is CPU the coordinator spends per token whatever the worker's device.
Writes --out/NAME.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from coordinator.detokenizer import IncrementalDetokenizer, text_decoder  # noqa: E402
from specdec.bench.machine import describe  # noqa: E402
from specdec.models import load_tokenizer  # noqa: E402

TEXTS = [
    "Speculative decoding drafts a block of tokens with a small model and verifies the block "
    "in one forward pass of the large one; the output is exactly the large model's. " * 8,
    "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n" * 8,
    "naïve café — 日本語のテキスト、绝对 🙂🚀 Ünïcödé … ok. " * 8,
]


def stream(tokenizer, ids: list[int], decode) -> tuple[str, float]:
    """The text of ids streamed one push at a time, and the seconds it took."""
    began = time.perf_counter()
    detok = IncrementalDetokenizer(tokenizer, [], decode)
    text = "".join(detok.push(t) for t in ids) + detok.flush()
    return text, time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="the tokenizer of this model")
    parser.add_argument("--repeats", type=int, default=30, help="alternating repeats")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    parser.add_argument("--name", default="detokenizer")
    args = parser.parse_args()

    tokenizer = load_tokenizer(args.model)
    decoders = {
        "tokenizer.decode": lambda ids: tokenizer.decode(ids, skip_special_tokens=True,
                                                         clean_up_tokenization_spaces=False),
        "text_decoder": text_decoder(tokenizer),
    }
    runs = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in TEXTS]
    tokens = sum(len(ids) for ids in runs)
    per_token: dict[str, list[float]] = {name: [] for name in decoders}
    for repeat in range(args.repeats + 1):  # the first is a warm-up
        order = list(decoders) if repeat % 2 == 0 else list(reversed(decoders))
        for name in order:
            seconds = 0.0
            for ids in runs:
                text, took = stream(tokenizer, ids, decoders[name])
                expected = tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
                if text != expected:
                    sys.exit(f"{name} streamed {text[:60]!r}… where decode gives {expected[:60]!r}…")
                seconds += took
            if repeat:
                per_token[name].append(seconds / tokens * 1e6)
    medians = {name: statistics.median(values) for name, values in per_token.items()}
    report = {
        "command": "python benchmarks/detokenizer.py " + " ".join(sys.argv[1:]),
        "machine": describe(1),
        "tokenizer": args.model,
        "tokenizer_class": type(tokenizer).__name__,
        "tokens_per_pass": tokens,
        "repeats": args.repeats,
        "us_per_token": {name: round(value, 2) for name, value in medians.items()},
        "text_decoder_over_decode": round(medians["text_decoder"] / medians["tokenizer.decode"], 3),
        "identical_text": True,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(report, indent=1) + "\n")
    for name, value in medians.items():
        print(f"{name:18s} {value:6.2f} µs per token")
    print(f"text_decoder / tokenizer.decode: {report['text_decoder_over_decode']:.3f}  ({tokens} tokens a pass, "
          f"{args.repeats} alternating repeats) -> {out / (args.name + '.json')}")


if __name__ == "__main__":
    main()
