"""The feature-level head (specdec.eagle): the unrolled training forward is exactly the
chain the worker drafts, and a saved head loads back."""

from __future__ import annotations

import pytest
import torch

from specdec import eagle

torch.set_num_threads(2)


def small_head(seed: int = 0, aux_layers: tuple[int, ...] = ()) -> eagle.EagleHead:
    torch.manual_seed(seed)
    config = eagle.EagleConfig(target="none", hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8,
                               intermediate_size=48, rope_theta=10000.0, rms_norm_eps=1e-5,
                               max_position_embeddings=512, draft_vocab_size=20, aux_layers=list(aux_layers))
    vocab = torch.arange(0, 40, 2)
    head = eagle.EagleHead(config, torch.randn(50, 32), torch.randn(20, 32), vocab)
    for p in head.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return head.eval()


AUX = pytest.mark.parametrize("aux_layers", [(), (0, 3)], ids=["final-features", "aux-layers"])


@AUX
def test_unrolled_steps_equal_the_served_chain(aux_layers):
    head = small_head(aux_layers=aux_layers)
    length, steps = 14, 3
    tokens = torch.randint(0, 50, (1, length))
    features = torch.randn(1, length, head.config.feature_size)  # features[:, t] = f_{t-1} (+ aux states)
    features[:, 0] = 0
    with torch.no_grad():
        unrolled = head.unrolled(tokens, features, steps)
    for committed in range(2, length - steps):  # the last committed position c
        cache = eagle.HeadCache(2, 8, torch.float32)
        # Committed positions 0..c, fed with the true features, as the worker feeds them.
        out = head.extend(cache, features[0, :committed + 1], tokens[0, :committed + 1].tolist())
        chain = out[-1]
        torch.testing.assert_close(chain, unrolled[0][0, committed], atol=1e-4, rtol=1e-4)
        for s in range(2, steps + 1):  # then its own predictions, along the reference tokens
            position = committed + s - 1
            chain = head.extend(cache, chain[None], [int(tokens[0, position])])[0]
            torch.testing.assert_close(chain, unrolled[s - 1][0, position], atol=1e-4, rtol=1e-4)
        cache.crop(committed + 1)
        assert cache.length == committed + 1


def test_cache_crop_and_regrow_give_the_same_result():
    head = small_head(1)
    tokens = torch.randint(0, 50, (300,)).tolist()
    features = torch.randn(300, 32)
    cache = eagle.HeadCache(2, 8, torch.float32)
    whole = head.extend(cache, features, tokens)
    cache.crop(100)
    again = head.extend(cache, features[100:], tokens[100:])
    torch.testing.assert_close(again, whole[100:], atol=1e-4, rtol=1e-4)


@AUX
def test_save_and_load_round_trip(tmp_path, aux_layers):
    head = small_head(2, aux_layers)

    class Target(torch.nn.Module):  # what eagle.load takes from a target: its embeddings
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(50, 32)
            self.emb.weight.data = head.embed.clone()
            self.out = torch.nn.Linear(32, 50, bias=False)
            self.out.weight.data[head.draft_vocab] = head.head.clone()

        def get_input_embeddings(self):
            return self.emb

        def get_output_embeddings(self):
            return self.out

    eagle.save(head, tmp_path, dtype=torch.float32)
    assert eagle.is_eagle_dir(str(tmp_path))
    loaded = eagle.load(tmp_path, target=Target())
    tokens = torch.randint(0, 50, (1, 9))
    features = torch.randn(1, 9, head.config.feature_size)
    with torch.no_grad():
        for a, b in zip(head.unrolled(tokens, features, 2), loaded.unrolled(tokens, features, 2)):
            torch.testing.assert_close(a, b)
    assert torch.equal(loaded.draft_vocab, head.draft_vocab)
    assert loaded.config.aux_layers == list(aux_layers)


def test_a_head_with_aux_layers_starts_as_the_head_it_is_warm_started_from(tmp_path):
    plain = small_head(7)
    eagle.save(plain, tmp_path, dtype=torch.float32)
    wide = eagle.EagleHead(eagle.EagleConfig(**{**vars(plain.config), "aux_layers": [1, 2]}), plain.embed,
                           plain.head, plain.draft_vocab)  # as distill --init-from builds it
    lacked = eagle.warm_start(wide, tmp_path)
    assert lacked == ["aux_fc.weight", "aux_norm.weight"]
    tokens = torch.randint(0, 50, (1, 12))
    features = torch.randn(1, 12, wide.config.feature_size)
    with torch.no_grad():
        # aux_fc starts at zero: the aux states change nothing yet.
        for a, b in zip(wide.unrolled(tokens, features, 3), plain.unrolled(tokens, features[..., :32], 3)):
            torch.testing.assert_close(a, b)
        torch.nn.init.normal_(wide.aux_fc.weight, std=0.3)
        trained = wide.unrolled(tokens, features, 1)[0]
        assert not torch.allclose(trained, plain.unrolled(tokens, features[..., :32], 1)[0])
        # The head's own predictions (width H) are fed without the aux term.
        torch.testing.assert_close(wide.inputs(features[..., :32], tokens), plain.inputs(features[..., :32], tokens))
    other = small_head(9)
    other.draft_vocab = other.draft_vocab + 1
    with pytest.raises(ValueError, match="draft vocabulary"):
        eagle.warm_start(other, tmp_path)


REPEATED = [5, 6, 7, 8, 9, 5, 6]  # "5 6" occurred before, followed by 7 8 9
FRESH = [11, 12, 13, 14, 15, 16, 17]  # no n-gram repeats


def propose_from_seed_3(lookup: bool, context: list[int]) -> list[int]:
    """What a drafter over small_head(3), with n-gram lookup or without, proposes (k = 3) for a
    new session's context, given features seeded by the context's length."""
    from specdec.eagle.policy import EagleDrafter, Features
    from specdec.sessions import SessionStore

    options = {} if lookup else {"lookup_ngram": 0}
    drafter = EagleDrafter("h", small_head(3), min_chain_prob=0.0, **options)
    synced = SessionStore(4, 1 << 30, 1).sync("s", 0, context)
    rows = torch.randn(len(context) - 1, 32, generator=torch.Generator().manual_seed(len(context))).half()
    return drafter.propose(synced, 3, Features(0, rows.numpy().tobytes(), 32))


def test_drafter_copies_a_repeated_ngram():
    assert propose_from_seed_3(True, REPEATED) == [7, 8, 9]


def test_drafter_without_lookup_drafts_from_the_heads_vocabulary():
    chain = propose_from_seed_3(False, REPEATED)
    assert len(chain) == 3 and all(t in small_head(3).draft_vocab.tolist() for t in chain)


def test_drafter_uses_the_heads_chain_without_a_repeated_ngram():
    assert propose_from_seed_3(True, FRESH) == propose_from_seed_3(False, FRESH)


def _features(context: list[int], seed: int):
    from specdec.eagle.policy import Features

    rows = torch.randn(len(context) - 1, 32, generator=torch.Generator().manual_seed(seed)).half()
    return Features(0, rows.numpy().tobytes(), 32)


def test_the_chain_stops_where_the_heads_confidence_in_it_runs_out():
    from specdec.eagle.policy import EagleDrafter
    from specdec.sessions import SessionStore

    head = small_head(4)
    store = SessionStore(8, 1 << 30, 1)
    context = [11, 12, 13, 14, 15, 16, 17]
    features = _features(context, 4)
    full = EagleDrafter("h", head, lookup_ngram=0, min_chain_prob=0.0).propose(store.sync("all", 0, context), 6,
                                                                               features)
    assert len(full) == 6
    # The head's probability of each prefix of its chain, recomputed step by step.
    cache = eagle.HeadCache(2, 8, torch.float32)
    rows = torch.cat([torch.zeros(1, 32), features.rows.float()])
    predicted = head.extend(cache, rows, context)[-1]
    chain, prefix = 1.0, []
    for token in full:
        probs = torch.softmax(head.logits(predicted), -1)
        assert int(head.draft_vocab[int(probs.argmax())]) == token
        chain *= float(probs.max())
        prefix.append(chain)
        predicted = head.extend(cache, predicted[None], [token])[0]
    assert prefix[0] > prefix[-1]
    for cut in range(len(full)):  # a threshold between prefix cut-1 and cut keeps `cut` tokens
        above = prefix[cut - 1] if cut else 1.0
        threshold = (above * prefix[cut]) ** 0.5
        drafter = EagleDrafter("h", head, lookup_ngram=0, min_chain_prob=threshold)
        assert drafter.propose(store.sync(f"cut{cut}", 0, context), 6, features) == full[:cut]


def test_served_head_kernels_are_timed_per_row_count():
    from specdec.eagle.cpu import TIMED_ROWS, ChosenHeadLinear, choose_kernels

    ran: list[tuple[str, int]] = []

    def kernel(name):
        def run(x):
            ran.append((name, x.shape[0]))
            return x
        return run

    kernels = {"stock": kernel("stock"), "fp32": kernel("fp32"), "bf16": kernel("bf16")}
    # bf16 fastest at one row, fp32 from 4 rows on; a 3% lead is within the margin: stock.
    costs = {"stock": lambda r: 1.0 * r, "fp32": lambda r: 0.97 * r if r < 4 else 0.5 * r,
             "bf16": lambda r: 0.5 if r == 1 else 2.0 * r}

    def timer(call):
        call()
        name, rows = ran[-1]
        return costs[name](rows)

    choice = choose_kernels(kernels, 8, timer)
    assert choice == ("bf16", "stock", "stock") + ("fp32",) * (len(TIMED_ROWS) - 3)
    linear = ChosenHeadLinear(torch.zeros(4, 8), kernels, choice)
    assert set(linear.kernels) == {"bf16", "stock", "fp32"}
    ran.clear()
    for rows in (1, 2, 3, 4, 5, 1000):
        linear(torch.zeros(rows, 8))
    assert [name for name, _ in ran] == ["bf16", "stock", "stock", "fp32", "fp32", "fp32"]


@AUX
def test_the_served_head_with_fp32_kernels_computes_what_the_plain_head_does(aux_layers):
    if eagle.fast_cpu_dtype() is None:
        pytest.skip("this torch has no oneDNN")
    head = small_head(6, aux_layers)
    tokens = torch.randint(0, 50, (40,)).tolist()
    features = torch.randn(40, head.config.feature_size)
    plain_out = head.extend(eagle.HeadCache(2, 8, torch.float32), features, tokens)
    from specdec.eagle.cpu import PackedHeadLinear

    def packed_fp32_fastest(call):  # the kernel a timed call runs is its default argument
        kernel = call.__defaults__[0]
        return 0.0 if isinstance(kernel, PackedHeadLinear) and kernel.dtype == torch.float32 else 1.0

    for timer, kernel in ((lambda call: 0.0, "stock"), (packed_fp32_fastest, "fp32")):
        served = eagle.fast_cpu_head(head, timer=timer)
        assert {name for m in served.modules() for name in getattr(m, "choice", ())} == {kernel}
        for fed in (1, 3, 40):  # one-row, few-row and many-row passes
            cache = eagle.HeadCache(2, 8, torch.float32)
            out = torch.cat([served.extend(cache, features[i:i + fed], tokens[i:i + fed])
                             for i in range(0, 40, fed)])
            torch.testing.assert_close(out, plain_out, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(served.logits(plain_out), head.logits(plain_out), atol=1e-3, rtol=1e-4)


@AUX
def test_the_packed_head_computes_what_the_plain_head_does(aux_layers):
    head = small_head(5, aux_layers)
    tokens = torch.randint(0, 50, (40,)).tolist()
    features = torch.randn(40, head.config.feature_size)
    plain_out = head.extend(eagle.HeadCache(2, 8, torch.float32), features, tokens)
    if eagle.fast_cpu_dtype() is None:
        pytest.skip("this torch has no oneDNN")
    fp32 = eagle.fast_cpu_head(head, torch.float32)
    assert isinstance(head.fc, torch.nn.Linear) and head.lm_head is None  # the given head is untouched
    out = fp32.extend(eagle.HeadCache(2, 8, torch.float32), features, tokens)
    torch.testing.assert_close(out, plain_out, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(fp32.logits(out), head.logits(plain_out), atol=1e-3, rtol=1e-4)
    bf16 = eagle.fast_cpu_head(head, torch.bfloat16)
    out16 = bf16.extend(eagle.HeadCache(2, 8, torch.float32), features, tokens)
    assert out16.dtype == torch.float32
    # bfloat16 weights and activations: ~3 significant digits.
    assert float((out16 - plain_out).abs().max()) < 0.05 * float(plain_out.abs().max())
