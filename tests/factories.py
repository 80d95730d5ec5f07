"""Builders of valid test inputs: tiny tokenizers and models saved as real HF directories,
so the services load them exactly as they load a user's model."""

from __future__ import annotations

from pathlib import Path

import os

import torch

# Where the tiny models run: "cpu" here and in CI; "cuda" to check the services and the
# compiled Triton kernels on a GPU (SPECDEC_TEST_DEVICE=cuda pytest tests/test_services.py ...).
TEST_DEVICE = os.environ.get("SPECDEC_TEST_DEVICE", "cpu")
TINY_VOCAB = 320
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Speculative decoding drafts tokens cheaply and verifies them with the target model.",
    "A coordinator streams tokens back to the client over gRPC while workers hold caches.",
    "Summarise the following paragraph in one sentence: the cat sat on the mat and slept.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n",
    "Héllo wörld — naïve café, 日本語のテキスト, emoji 🙂 and more unicode: ß, ø, ü.",
]


def make_tiny_tokenizer(vocab_size: int = TINY_VOCAB, extra_text: str = ""):
    """A byte-level BPE tokenizer trained in memory, with a chat template and EOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS + [extra_text], trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|im_start|>",
                                   pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE)


def make_tiny_model(tokenizer, seed: int = 0, layers: int = 2, hidden: int = 64, max_positions: int = 256):
    """A random-initialised llama-architecture model over the tokenizer's vocabulary."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    # Sharpen the output layer so greedy choices are far from ties: exact token-for-token
    # comparisons then test the protocol, not float rounding between batched and
    # step-by-step forward passes.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model.to(TEST_DEVICE).eval()


def save_model_dir(path: Path, model, tokenizer) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
