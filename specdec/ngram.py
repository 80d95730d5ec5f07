"""N-gram prompt lookup: no model. Match the last n tokens of the context against earlier
context and propose what followed the most recent match (Saxena 2023, "prompt lookup
decoding"; the same idea as HF `prompt_lookup_num_tokens`). Longer n-grams are tried
first because they predict better; it pays when the output copies the prompt
(summarise, rewrite, extract, code edits) and costs nothing when it finds no match.
"""


from __future__ import annotations

DEFAULT_MAX_NGRAM = 3
DEFAULT_MIN_NGRAM = 1
# What an NgramIndex holds per token, about: a Python int in its ids, and per n-gram size a
# small tuple and its dict entry (tests/test_units.py checks it against tracemalloc).
ID_BYTES = 8
NGRAM_ENTRY_BYTES = 112


def lookup(context: list[int], k: int, max_ngram: int = DEFAULT_MAX_NGRAM,
           min_ngram: int = DEFAULT_MIN_NGRAM) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the context's
    last n tokens, for the largest n in max_ngram..min_ngram that occurs; [] if none."""
    length = len(context)
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        pattern = context[length - n:]
        # Scan from the most recent candidate backwards; a candidate window must end
        # before the pattern itself so it has at least one follower.
        for begin in range(length - n - 1, -1, -1):
            if context[begin:begin + n] == pattern:
                follow = context[begin + n:begin + n + k]
                if follow:
                    return follow
    return []


class NgramIndex:
    """`lookup` over a sequence that grows a few tokens at a time, without scanning it: every
    n-gram (min_ngram … max_ngram tokens) that has a follower, mapped to the end of its most
    recent occurrence. Taking in m new tokens costs m dict updates per n-gram size and a
    lookup one dict read per size, where `lookup` scans the whole context on every call — on
    a worker serving many long sessions the scan would be a step's largest host cost, once
    per session that drafts. Gives what `lookup` gives for the same sequence."""

    def __init__(self, max_ngram: int = DEFAULT_MAX_NGRAM, min_ngram: int = DEFAULT_MIN_NGRAM):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.ids: list[int] = []
        self._ends: dict[tuple[int, ...], int] = {}

    def sync(self, context: list[int]) -> bool:
        """Makes the index cover `context`: the tokens past what it covers are taken in; where
        the context does not continue them (a rollback or a resync, rare) it is rebuilt.
        Returns whether the context continued them."""
        covered = len(self.ids)
        continued = covered <= len(context) and self.ids == context[:covered]
        if not continued:
            self.ids, self._ends, covered = [], {}, 0
        for token in context[covered:]:
            self._append(token)
        return continued

    def _append(self, token: int) -> None:
        ids = self.ids
        ids.append(token)
        end = len(ids) - 1  # the n-grams ending here now have a follower: this token
        for n in range(self.min_ngram, min(self.max_ngram, end) + 1):
            self._ends[tuple(ids[end - n:end])] = end

    def lookup(self, k: int) -> list[int]:
        """`lookup(self.ids, k, max_ngram, min_ngram)`."""
        ids, length = self.ids, len(self.ids)
        for n in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            end = self._ends.get(tuple(ids[length - n:]))
            if end is not None:
                return ids[end:end + k]
        return []

    def held_bytes(self) -> int:
        """About what the index holds: its ids and, per n-gram size, a tuple and a dict entry per token."""
        return len(self.ids) * (ngram_bytes_per_token(self.max_ngram, self.min_ngram) - ID_BYTES)


def ngram_bytes_per_token(max_ngram: int, min_ngram: int) -> int:
    """What an n-gram session holds per context token, about: its ids and its index's."""
    return 2 * ID_BYTES + NGRAM_ENTRY_BYTES * (max_ngram - min_ngram + 1)
