"""The CPU fast path (specdec.runtime.cpu): the same logits within float rounding and the same
greedy tokens as the plain model, the plain model left untouched, and models it cannot pack
served as they are.

Tolerance: packed linears sum in a different order than MKL, so logits may differ by float32
rounding; LOGIT_TOLERANCE bounds that relative to the largest logit (measured: 0 on these
tiny models, ~1e-5 relative on SmolLM2-135M).
"""

from __future__ import annotations

import pytest
import torch

from specdec.runtime.cpu import KV_BLOCK_TOKENS, BufferedLayer, PackedLinear, agrees, fast_cpu_model
from specdec.runtime.load import serving_lm
from specdec.runtime.packed import SPECDEC_ATTENTION
from specdec.runtime.lm import CausalLM
from specdec.sessions import Session
from tests.factories import make_tiny_model, make_tiny_tokenizer
from tests.harness import reference_greedy

LOGIT_TOLERANCE = 1e-4  # relative to max |logit|
MAX_NEW = 24


@pytest.fixture(scope="module")
def tokenizer():
    return make_tiny_tokenizer()


@pytest.fixture(scope="module")
def plain(tokenizer):
    # 300 positions: long enough to grow a KV buffer past its first block.
    return make_tiny_model(tokenizer, seed=0, layers=2, max_positions=KV_BLOCK_TOKENS + 64)


def prompt_ids(tokenizer, n: int, seed: int = 0) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, len(tokenizer), (n,), generator=generator).tolist()


def assert_close_logits(actual: torch.Tensor, expected: torch.Tensor) -> None:
    scale = expected.abs().max().item()
    assert (actual - expected).abs().max().item() <= LOGIT_TOLERANCE * scale


def greedy_through(lm: CausalLM, ids: list[int], max_new: int, eos: int) -> list[int]:
    """Greedy decoding through the serving interface: one feed per token, on a session cache."""
    session = Session("s")
    session.cache = lm._new_cache()
    out: list[int] = []
    feed = list(ids)
    for _ in range(max_new):
        token = int(torch.argmax(lm.feed(session, feed, logits_to_keep=1)[-1]))
        out.append(token)
        if token == eos:
            break
        feed = [token]
    return out


@pytest.fixture(scope="module")
def fast(plain):
    return fast_cpu_model(plain)


def test_fast_model_packs_every_linear(fast):
    assert not any(type(m) is torch.nn.Linear for m in fast.modules())
    assert sum(isinstance(m, PackedLinear) for m in fast.modules()) == 2 * 7 + 1  # q k v o gate up down, lm_head


def test_fast_model_switches_attention(fast):
    assert fast.config._attn_implementation == SPECDEC_ATTENTION


def test_plain_model_is_left_untouched(plain, tokenizer):
    ids = torch.tensor([prompt_ids(tokenizer, 40)])
    with torch.inference_mode():
        before = plain(ids).logits
        fast_cpu_model(plain)
        after = plain(ids).logits
    assert plain.config._attn_implementation == "sdpa"
    assert all(type(m) is not PackedLinear for m in plain.modules())
    assert torch.equal(before, after)


def test_prefill_logits_match_plain_model(plain, tokenizer):
    ids = torch.tensor([prompt_ids(tokenizer, 120)])
    with torch.inference_mode():
        assert_close_logits(fast_cpu_model(plain)(ids).logits, plain(ids).logits)


def test_cached_block_logits_match_plain_model_across_buffer_growth_and_crops(plain, tokenizer):
    # A verification-shaped workload: blocks of 5 on a growing cache, rolled back and re-fed,
    # past the first KV block (the buffer regrows and copies).
    ids = prompt_ids(tokenizer, KV_BLOCK_TOKENS + 40, seed=1)
    fast, reference = serving_lm(plain), CausalLM(plain)
    sessions = {}
    for name, lm in (("fast", fast), ("plain", reference)):
        session = Session(name)
        session.cache = lm._new_cache()
        lm.feed(session, ids[:KV_BLOCK_TOKENS - 10], logits_to_keep=1)
        sessions[name] = session
    assert any(isinstance(layer, BufferedLayer) for layer in sessions["fast"].cache.layers)
    position = KV_BLOCK_TOKENS - 10
    while position + 5 <= len(ids):
        block = ids[position:position + 5]
        got = fast.feed(sessions["fast"], block, logits_to_keep=5)  # [5, V]
        want = reference.feed(sessions["plain"], block, logits_to_keep=5)
        assert_close_logits(got, want)
        # Keep 3 of the 5, as a round that accepted 2 drafts would.
        fast.crop(sessions["fast"], position + 3)
        reference.crop(sessions["plain"], position + 3)
        position += 3


def test_greedy_tokens_equal_plain_generate(plain, tokenizer):
    eos = tokenizer.eos_token_id
    for seed in range(3):
        ids = prompt_ids(tokenizer, 30, seed=seed)
        assert greedy_through(serving_lm(plain), ids, MAX_NEW, eos) == reference_greedy(plain, ids, MAX_NEW)


def test_hf_generate_on_fast_model_equals_plain(plain, tokenizer):
    # The bench runs HF generate() and prompt lookup on the fast-path model too.
    ids = prompt_ids(tokenizer, 30, seed=5)
    fast = fast_cpu_model(plain)
    assert reference_greedy(fast, ids, MAX_NEW) == reference_greedy(plain, ids, MAX_NEW)


def test_unpackable_dtype_keeps_its_linears_but_gets_the_batching_attention(tokenizer):
    # bf16 (as on a GPU) cannot take oneDNN's fp32 packing; the attention function that
    # runs packed multi-session batches (specdec.runtime.packed) still applies.
    from specdec.runtime.cpu import PackedLinear
    from specdec.runtime.packed import SPECDEC_ATTENTION
    from specdec.runtime.precision import with_fp32_logits

    model = make_tiny_model(tokenizer).to(torch.bfloat16)
    fast = fast_cpu_model(model)
    assert fast is not model and not any(isinstance(m, PackedLinear) for m in fast.modules())
    assert fast.config._attn_implementation == SPECDEC_ATTENTION and model.config._attn_implementation == "sdpa"
    lm = serving_lm(model)
    assert lm.model is not model and lm.batches_in_one_pass
    ids = prompt_ids(tokenizer, 30, seed=5)
    # Served with float32 logits (specdec.runtime.precision): the same as the model as it is,
    # given float32 logits too (its own bfloat16 logits can pick another token at a near-tie).
    assert reference_greedy(lm.model, ids, MAX_NEW) == reference_greedy(with_fp32_logits(model), ids, MAX_NEW)


def test_model_without_linear_layers_keeps_its_output():
    # GPT-2 projects with Conv1D, not nn.Linear: only its lm_head packs; output unchanged.
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=320, n_embd=64, n_layer=2, n_head=4, n_positions=128,
                                       bos_token_id=0, eos_token_id=0)).eval()
    ids = list(range(5, 45))
    fast = fast_cpu_model(model)
    with torch.inference_mode():
        assert_close_logits(fast(torch.tensor([ids])).logits, model(torch.tensor([ids])).logits)
    assert greedy_through(serving_lm(model), ids, 12, eos=0) == reference_greedy(model, ids, 12)


def test_self_check_accepts_the_copy(plain, fast):
    assert agrees(plain, fast)


def test_self_check_rejects_another_model(plain, tokenizer):
    other = make_tiny_model(tokenizer, seed=7, layers=2, max_positions=KV_BLOCK_TOKENS + 64)
    assert not agrees(plain, fast_cpu_model(other))


def test_choose_linears_gives_stock_mkl_the_row_counts_it_wins_by_the_margin(plain):
    from specdec.runtime.cpu import CHOSEN_ROWS, STOCK_MARGIN, choose_linears, linear_shape

    # Timings stand in for the machine: per shape, rows 1..CHOSEN_ROWS, stock then packed.
    stock = {1: 0.5, 2: 1.0 - STOCK_MARGIN / 2, 3: 0.9}
    calls = []

    def timer(fn) -> float:
        index = len(calls)
        calls.append(fn)
        rows = (index // 2) % CHOSEN_ROWS + 1
        return stock.get(rows, 2.0) if index % 2 == 0 else 1.0

    chosen = choose_linears(plain, timer)
    shapes = {linear_shape(m) for m in plain.modules() if type(m) is torch.nn.Linear}
    assert set(chosen) == shapes and len(calls) == 2 * CHOSEN_ROWS * len(shapes)
    assert all(rows == {1, 3} for rows in chosen.values())


def test_a_mixed_linear_runs_each_row_count_on_its_kernel(plain, tokenizer):
    from specdec.runtime.cpu import MixedLinear, choose_linears, linear_shape

    linear = plain.model.layers[0].mlp.gate_proj
    mixed, packed = MixedLinear(linear, frozenset({1, 3})), PackedLinear(linear)
    with torch.inference_mode():
        for rows in range(1, 6):
            x = torch.randn(1, rows, linear.in_features)
            kernel = torch.nn.functional.linear(x, linear.weight, linear.bias) if rows in (1, 3) else packed(x)
            assert torch.equal(mixed(x), kernel), rows
    # A model served with stock MKL at one row everywhere: same greedy tokens, close logits.
    everywhere = {linear_shape(m): frozenset({1}) for m in plain.modules() if type(m) is torch.nn.Linear}
    fast = fast_cpu_model(plain, stock_rows=everywhere)
    assert sum(isinstance(m, MixedLinear) for m in fast.modules()) == 2 * 7 + 1
    assert agrees(plain, fast)
    ids = prompt_ids(tokenizer, 30)
    eos = tokenizer.eos_token_id
    assert greedy_through(CausalLM(fast), ids, MAX_NEW, eos) == reference_greedy(plain, ids, MAX_NEW)
    # What the workers serve times both kernels for every shape of the model.
    chosen = choose_linears(plain)
    assert set(chosen) == set(everywhere) and all(rows <= set(range(1, 9)) for rows in chosen.values())
