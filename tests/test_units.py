"""Plain-Python parts, without servers: the delta protocol, n-gram lookup, streaming text."""

from __future__ import annotations

import random

import pytest

from coordinator.detokenizer import IncrementalDetokenizer, StopMatcher, text_decoder
from specdec.ngram import NgramIndex, lookup
from specdec.errors import InvalidArgument
from specdec.sessions import Resync, SessionStore, SyncedContext, common_prefix_len
from tests.factories import make_tiny_tokenizer


def make_store(max_sessions=4, max_cache_bytes=10**9, bytes_per_token=1) -> SessionStore:
    return SessionStore(max_sessions, max_cache_bytes, bytes_per_token)


class TestSessionStore:
    def test_new_session_needs_start_zero(self):
        assert make_store().sync("s", 3, [1, 2]) == Resync(cached_len=0)

    def test_first_sync_returns_whole_context(self):
        synced = make_store().sync("s", 0, [1, 2, 3])
        assert isinstance(synced, SyncedContext)
        assert synced.context == [1, 2, 3] and synced.reusable == 0

    @staticmethod
    def sync_after_partly_accepted_drafts() -> SyncedContext:
        store = make_store()
        synced = store.sync("s", 0, [1, 2, 3])
        synced.session.ids = [1, 2, 3, 7, 8, 9]  # the worker fed drafts 7 8 9
        return store.sync("s", 3, [7, 8, 5])  # the target accepted 7 8, then chose 5

    def test_delta_replaces_the_rejected_draft_in_the_context(self):
        assert self.sync_after_partly_accepted_drafts().context == [1, 2, 3, 7, 8, 5]

    def test_delta_reuses_the_cache_up_to_the_first_rejected_draft(self):
        # The cached prefix (3) and the accepted drafts (2) are reused.
        assert self.sync_after_partly_accepted_drafts().reusable == 5

    def test_start_beyond_committed_asks_resync_from_what_is_held(self):
        store = make_store()
        synced = store.sync("s", 0, [1, 2, 3])
        synced.session.ids = [1, 2, 3, 4]  # 4 is speculative: never reported as held
        assert store.sync("s", 4, [5]) == Resync(cached_len=3)

    def test_lru_eviction_by_count(self):
        store = make_store(max_sessions=2)
        for name in "abc":
            store.sync(name, 0, [1])
        assert "a" not in store and "b" in store and "c" in store and store.evictions == 1

    def test_byte_budget_evicts_least_recently_used_but_not_current(self):
        store = make_store(max_cache_bytes=5)
        for name in "ab":
            session = store.sync(name, 0, [1, 2, 3]).session
            session.ids = [1, 2, 3]
            store.account(session)  # the worker fed it: 3 tokens of 1 byte
        store.enforce_budget(keep="b")
        assert "a" not in store and "b" in store

    def test_empty_delta_is_invalid(self):
        with pytest.raises(InvalidArgument, match="delta.tokens"):
            make_store().sync("s", 0, [])

    def test_release(self):
        store = make_store()
        store.sync("s", 0, [1])
        assert store.release("s") and not store.release("s")


class TestNgramLookup:
    def test_proposes_what_followed_the_most_recent_match(self):
        assert lookup([1, 2, 3, 4, 9, 1, 2, 3, 5, 6, 1, 2, 3], k=2) == [5, 6]

    def test_prefers_longer_ngrams(self):
        # last 2 tokens [7, 3] occur once (followed by 8); the unigram [3] occurs later.
        assert lookup([7, 3, 8, 0, 3, 9, 7, 3], k=1) == [8]

    def test_no_match_proposes_nothing(self):
        assert lookup([1, 2, 3, 4], k=3) == []

    def test_short_followers_are_cut_to_what_exists(self):
        assert lookup([5, 6, 5], k=4) == [6, 5]

    def test_the_index_gives_what_the_scan_gives_as_the_sequence_grows_and_rolls_back(self):
        rng = random.Random(0)
        for _ in range(200):
            vocab, max_ngram = rng.choice([2, 3, 5, 50]), rng.randint(1, 4)
            min_ngram = rng.randint(1, max_ngram)
            sequence = [rng.randrange(vocab) for _ in range(rng.randrange(1, 80))]
            index, length = NgramIndex(max_ngram, min_ngram), 1
            while length <= len(sequence):
                covered = list(index.ids)
                if rng.random() < 0.1:  # a rollback: the next context does not continue the last
                    sequence[length - 1] = rng.randrange(vocab)
                assert index.sync(sequence[:length]) == (sequence[:len(covered)] == covered)
                for k in (1, 3):
                    assert index.lookup(k) == lookup(sequence[:length], k, max_ngram, min_ngram)
                length += rng.randint(1, 4)

    def test_the_index_estimates_what_it_holds(self):
        import tracemalloc

        rng = random.Random(1)
        ids = [rng.randrange(49152) for _ in range(4000)]  # few repeats: an entry per n-gram
        tracemalloc.start()
        try:
            index = NgramIndex(3, 2)
            index.sync(ids)
            held, _ = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert 0.67 * held <= index.held_bytes() <= 1.5 * held


def test_common_prefix_len_compares_lists_and_other_sequences_alike():
    rng = random.Random(2)
    for _ in range(500):
        a = [rng.randrange(3) for _ in range(rng.randrange(0, 40))]
        b = a[:rng.randrange(0, len(a) + 1)] + [rng.randrange(3) for _ in range(rng.randrange(0, 40))]
        expected = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        assert common_prefix_len(a, b) == common_prefix_len(tuple(a), b) == expected


@pytest.fixture(scope="module")
def tokenizer():
    return make_tiny_tokenizer()


class TestIncrementalDetokenizer:
    def test_never_splits_a_multibyte_character(self, tokenizer):
        text = "naïve 日本語 🙂 ok"
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        detok = IncrementalDetokenizer(tokenizer, [])
        deltas = [detok.push(t) for t in ids] + [detok.flush()]
        assert "".join(deltas) == text
        assert not any("\ufffd" in d for d in deltas)

    def test_byte_tokens_of_one_emoji_are_released_together(self, tokenizer):
        ids = tokenizer("🙂", add_special_tokens=False)["input_ids"]
        assert len(ids) > 1  # the test needs a character spread over several tokens
        detok = IncrementalDetokenizer(tokenizer, [])
        deltas = [detok.push(t) for t in ids]
        assert deltas[:-1] == [""] * (len(ids) - 1) and deltas[-1] == "🙂"


class TestTextDecoder:
    @staticmethod
    def samples(tokenizer, count=400, seed=0):
        """Random id runs over the whole vocabulary (special tokens and bytes that end
        mid-character included), and the ids of text with multi-byte characters."""
        rng = random.Random(seed)
        runs = [[rng.randrange(len(tokenizer)) for _ in range(rng.randint(1, 12))] for _ in range(count)]
        text_ids = tokenizer("naïve 日本語 🙂 ok <|im_end|> x", add_special_tokens=False)["input_ids"]
        return runs + [text_ids[:n] for n in range(len(text_ids) + 1)]

    @pytest.mark.parametrize("which", ["tiny", "smollm2-135m"])
    def test_it_decodes_as_the_tokenizer_does_without_its_wrapper(self, tokenizer, which):
        from specdec.models import load_tokenizer

        tok = tokenizer if which == "tiny" else load_tokenizer(which)
        decode = text_decoder(tok)
        assert decode.func == tok.backend_tokenizer.decode  # the shortcut is taken
        for ids in self.samples(tok):
            assert decode(ids) == tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False), ids

    def test_a_tokenizer_that_decodes_its_own_way_is_called_as_it_is(self, tokenizer):
        from transformers import PreTrainedTokenizerFast

        class Shouting(PreTrainedTokenizerFast):
            def _decode(self, token_ids, **kwargs):
                return super()._decode(token_ids, **kwargs).upper()

        shouting = Shouting(tokenizer_object=tokenizer.backend_tokenizer)
        ids = tokenizer("hello there", add_special_tokens=False)["input_ids"]
        detok = IncrementalDetokenizer(shouting, [])
        assert "".join([detok.push(t) for t in ids] + [detok.flush()]) == "HELLO THERE"


class TestStopMatcher:
    def test_stop_split_across_deltas_is_cut(self):
        matcher = StopMatcher(["STOP"])
        out = matcher.feed("hello ST") + matcher.feed("OP and more")
        assert out == "hello " and matcher.stopped

    def test_text_is_held_back_only_as_long_as_a_stop_could_start(self):
        matcher = StopMatcher(["abc"])
        assert matcher.feed("xyzab") == "xyz"
        assert matcher.feed("q") == "a"
        assert matcher.finish() == "bq" and not matcher.stopped

    def test_no_stop_strings_holds_nothing_back(self):
        matcher = StopMatcher([])
        assert matcher.feed("abc") == "abc" and matcher.finish() == ""


class TestAdaptiveK:
    def test_full_blocks_keep_k_at_the_maximum(self):
        from coordinator.adaptive import AdaptiveK

        adaptive = AdaptiveK(k_max=4)
        for _ in range(5):
            assert adaptive.next_k() == 4
            adaptive.update(4, 4)

    def test_half_accepted_blocks_keep_drafting_long_blocks(self):
        # Verification is cheap per draft token, so at alpha ~ 0.5 long blocks still pay.
        from coordinator.adaptive import AdaptiveK

        adaptive = AdaptiveK(k_max=4)
        ks = []
        for _ in range(10):
            ks.append(adaptive.next_k())
            adaptive.update(ks[-1], ks[-1] // 2)
        assert min(ks) >= 3

    @staticmethod
    def ks_when_every_draft_is_rejected() -> list[int]:
        from coordinator.adaptive import AdaptiveK

        adaptive = AdaptiveK(k_max=4)
        ks = []
        for _ in range(80):
            ks.append(adaptive.next_k())
            adaptive.update(ks[-1], 0)
        return ks

    @classmethod
    def probes_after_the_first_pause(cls) -> tuple[list[int], list[int]]:
        """(every k, the rounds that drafted after drafting first paused)"""
        ks = cls.ks_when_every_draft_is_rejected()
        first_pause = ks.index(0)
        return ks, [i for i, k in enumerate(ks) if i > first_pause and k > 0]

    def test_rejections_pause_drafting(self):
        assert 0 in self.ks_when_every_draft_is_rejected()

    def test_probes_while_paused_draft_probe_k_tokens(self):
        from coordinator.adaptive import PROBE_K

        ks, probes = self.probes_after_the_first_pause()
        assert probes and all(ks[i] == PROBE_K for i in probes)

    def test_failed_probes_back_off_up_to_the_maximum_gap(self):
        from coordinator.adaptive import MAX_PROBE_EVERY, PROBE_EVERY

        _, probes = self.probes_after_the_first_pause()
        gaps = [b - a for a, b in zip(probes, probes[1:])]
        assert gaps[0] == 2 * PROBE_EVERY and gaps == sorted(gaps) and gaps[-1] == MAX_PROBE_EVERY

    def test_empty_proposals_pause_drafting(self):
        # A drafter that finds nothing still costs a Propose call per round.
        from coordinator.adaptive import AdaptiveK

        adaptive = AdaptiveK(k_max=4)
        ks = []
        for _ in range(24):
            ks.append(adaptive.next_k())
            adaptive.update(0, 0)
        assert ks[0] == 4 and ks[-8:].count(0) >= 7  # paused; probes only

    def test_accepted_probes_resume_drafting_up_to_the_maximum(self):
        from coordinator.adaptive import AdaptiveK

        adaptive = AdaptiveK(k_max=4, accepted=0.0, tried=10.0)
        ks = []
        for _ in range(30):
            ks.append(adaptive.next_k())
            adaptive.update(ks[-1], ks[-1])  # the text turned predictable: every draft accepted
        assert ks[0] == 0 and ks[-5:] == [4] * 5

    def test_expected_tokens_is_the_leviathan_numerator(self):
        from coordinator.adaptive import expected_tokens

        assert expected_tokens(0.0, 4) == 1.0
        assert expected_tokens(1.0, 4) == 5.0
        assert expected_tokens(0.5, 2) == pytest.approx(1.75)
