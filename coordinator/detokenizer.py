"""Streaming text out of token ids: incremental detokenization that never splits a
multi-byte character, and stop strings that never leak into the output.

Decoding each token alone is wrong twice over: byte-level BPE tokens can end mid-character
(the decoder then yields U+FFFD), and SentencePiece-style tokenizers drop a token's leading
space when it starts the decoded text. So text is decoded over a sliding window that keeps a
few tokens of left context, and a delta is released only when it no longer ends in U+FFFD.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

REPLACEMENT_CHAR = "\ufffd"
# Tokens of left context decoded along with new ones (prompt tokens at first).
LEFT_CONTEXT_TOKENS = 5


def text_decoder(tokenizer) -> Callable[[list[int]], str]:
    """ids -> text as `tokenizer.decode(ids, skip_special_tokens=True,
    clean_up_tokenization_spaces=False)` gives it.

    A transformers fast tokenizer that overrides neither `decode` nor `_decode` does exactly
    that by calling its Rust backend's `decode(ids, skip_special_tokens=True)` after
    converting the ids to a Python list (transformers' PreTrainedTokenizerBase.decode and
    PreTrainedTokenizerFast._decode); the ids here are a list already, so the backend is
    called directly, without the wrapper's per-call overhead, which is paid twice per token
    per request. Any other tokenizer is called as it is.
    """
    try:
        from transformers import PreTrainedTokenizerFast
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
    except ImportError:  # pragma: no cover - transformers is a dependency
        PreTrainedTokenizerFast = PreTrainedTokenizerBase = None
    kind = type(tokenizer)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if (PreTrainedTokenizerFast is not None and isinstance(tokenizer, PreTrainedTokenizerFast)
            and backend is not None and kind.decode is PreTrainedTokenizerBase.decode
            and kind._decode is PreTrainedTokenizerFast._decode):
        return functools.partial(backend.decode, skip_special_tokens=True)
    return functools.partial(tokenizer.decode, skip_special_tokens=True, clean_up_tokenization_spaces=False)


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int], decode: Callable[[list[int]], str] | None = None):
        """decode: text_decoder(tokenizer), made once per tokenizer by whoever makes many of these."""
        self._decode = decode or text_decoder(tokenizer)
        self._ids = list(prompt_ids[-LEFT_CONTEXT_TOKENS:])
        # Text of ids[prefix:read] has been released; ids[read:] are pending.
        self._prefix = 0
        self._read = len(self._ids)

    def push(self, token: int) -> str:
        """Adds one generated token; returns the text it completes ('' while pending)."""
        self._ids.append(token)
        return self._release(final=False)

    def flush(self) -> str:
        """Text of any pending tokens, incomplete characters included (end of stream)."""
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self._read == len(self._ids):
            return ""
        released = self._decode(self._ids[self._prefix:self._read])
        full = self._decode(self._ids[self._prefix:])
        if not final and (len(full) <= len(released) or full.endswith(REPLACEMENT_CHAR)):
            return ""
        delta = full[len(released):]
        self._prefix, self._read = self._read, len(self._ids)
        return delta


class StopMatcher:
    """Holds back just enough text that a stop string split across deltas is still caught,
    and cuts the text before the first stop string found."""

    def __init__(self, stops: list[str]):
        self._stops = [s for s in stops if s]
        self._holdback = max((len(s) for s in self._stops), default=1) - 1
        self._text = ""
        self._emitted = 0
        self.stopped = False

    def feed(self, delta: str) -> str:
        """Adds text; returns what is safe to emit now. Sets `stopped` on a match."""
        if self.stopped:
            return ""
        search_from = max(0, len(self._text) - self._holdback)
        self._text += delta
        hits = [i for i in (self._text.find(s, search_from) for s in self._stops) if i >= 0]
        if hits:
            self.stopped = True
            return self._emit_to(min(hits))
        return self._emit_to(len(self._text) - self._holdback)

    def finish(self) -> str:
        """Releases the held-back tail at the end of the stream."""
        return "" if self.stopped else self._emit_to(len(self._text))

    def _emit_to(self, end: int) -> str:
        if end <= self._emitted:
            return ""
        out = self._text[self._emitted:end]
        self._emitted = end
        return out
