"""The feature-level head (specdec.eagle): the unrolled training forward is exactly the
chain the worker drafts, and a saved head loads back."""

from __future__ import annotations

import torch

from specdec import eagle

torch.set_num_threads(2)


def small_head(seed: int = 0) -> eagle.EagleHead:
    torch.manual_seed(seed)
    config = eagle.EagleConfig(target="none", hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8,
                               intermediate_size=48, rope_theta=10000.0, rms_norm_eps=1e-5,
                               max_position_embeddings=512, draft_vocab_size=20)
    vocab = torch.arange(0, 40, 2)
    head = eagle.EagleHead(config, torch.randn(50, 32), torch.randn(20, 32), vocab)
    for p in head.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return head.eval()


def test_unrolled_steps_equal_the_served_chain():
    head = small_head()
    length, steps = 14, 3
    tokens = torch.randint(0, 50, (1, length))
    features = torch.randn(1, length, 32)  # features[:, t] = f_{t-1}
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


def test_save_and_load_round_trip(tmp_path):
    head = small_head(2)

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
    features = torch.randn(1, 9, 32)
    with torch.no_grad():
        for a, b in zip(head.unrolled(tokens, features, 2), loaded.unrolled(tokens, features, 2)):
            torch.testing.assert_close(a, b)
    assert torch.equal(loaded.draft_vocab, head.draft_vocab)


def test_drafter_copies_a_repeated_ngram_and_uses_the_head_otherwise():
    from draft_worker.drafters.eagle import EagleDrafter, Features
    from specdec.sessions import SessionStore

    head = small_head(3)
    store = SessionStore(4, 1 << 30, 1)
    repeated = [5, 6, 7, 8, 9, 5, 6]  # "5 6" occurred before, followed by 7 8 9
    fresh = [11, 12, 13, 14, 15, 16, 17]

    def propose(drafter, session_id, context):
        synced = store.sync(session_id, 0, context)
        rows = torch.randn(len(context) - 1, 32, generator=torch.Generator().manual_seed(len(context))).half()
        return drafter.propose(synced, 3, Features(0, rows.numpy().tobytes(), 32))

    hybrid, plain = EagleDrafter("h", head), EagleDrafter("h", head, lookup_ngram=0)
    assert propose(hybrid, "a", repeated) == [7, 8, 9]
    chain = propose(plain, "b", repeated)
    assert len(chain) == 3 and all(t in head.draft_vocab.tolist() for t in chain)
    assert propose(hybrid, "c", fresh) == propose(plain, "d", fresh)  # no match: the head's chain
