"""N-gram prompt lookup: no model. Match the last n tokens of the context against earlier
context and propose what followed the most recent match (Saxena 2023, "prompt lookup
decoding"; the same idea as HF `prompt_lookup_num_tokens`). Longer n-grams are tried
first because they predict better; it pays when the output copies the prompt
(summarise, rewrite, extract, code edits) and costs nothing when it finds no match.
"""


from __future__ import annotations

DEFAULT_MAX_NGRAM = 3
DEFAULT_MIN_NGRAM = 1


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
