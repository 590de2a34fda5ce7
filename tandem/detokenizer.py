"""Streaming detokenization: token ids in, UTF-8-safe text deltas out.

A byte-level BPE token can end in the middle of a multi-byte character (an emoji is often four
one-byte tokens). Decoding such a prefix yields U+FFFD in place of the partial character, so the
text is held back until the character completes. Only a short window of ids is decoded per step,
as in vLLM and TGI: `prefix` is the last emitted window (context for decoders that look at the
previous token, like sentencepiece's leading-space strip), `read` is where unemitted ids begin.
"""
from __future__ import annotations

from typing import Iterable

from tandem.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"
# Prompt ids kept as decoding context, as vLLM does: enough for any decoder's look-back.
_CONTEXT_IDS = 5


class IncrementalDetokenizer:
    """Feeds ids one or several at a time and returns the new text; `flush` releases a held-back tail.

    The deltas concatenate to `tokenizer.decode(ids, skip_special_tokens)` of all fed ids. With
    `context_ids` (the prompt's), they concatenate to the text the fed ids add after the context.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True, context_ids: Iterable[int] = ()):
        self._tokenizer = tokenizer
        self._skipped = tokenizer.special_token_ids if skip_special_tokens else frozenset()
        self._ids = self._visible(context_ids)[-_CONTEXT_IDS:]
        self._read = len(self._ids)
        self._prefix_text = self._decode(self._ids)

    def feed(self, ids: int | Iterable[int]) -> str:
        """Appends ids and returns the text they complete; '' while a character is still partial."""
        self._ids.extend(self._visible([ids] if isinstance(ids, int) else ids))
        return self._emit(final=False)

    def flush(self) -> str:
        """Returns whatever is held back, a partial character included (as U+FFFD)."""
        return self._emit(final=True)

    def _visible(self, ids: Iterable[int]) -> list[int]:
        return [i for i in ids if i not in self._skipped]

    def _decode(self, ids: list[int]) -> str:
        # Special ids were filtered out already, so decode keeps what is left.
        return self._tokenizer.decode(ids, skip_special_tokens=False)

    def _emit(self, final: bool) -> str:
        if len(self._ids) == self._read:
            return ""
        text = self._decode(self._ids)
        if not final and (len(text) <= len(self._prefix_text) or text.endswith(_REPLACEMENT)):
            return ""
        delta = text[len(self._prefix_text):]
        # The emitted ids become the next window's context; older ones are no longer needed.
        self._ids = self._ids[self._read:]
        self._read = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        return delta
