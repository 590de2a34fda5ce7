"""Streaming detokenization: deltas add up to the full decode and never end inside a character."""
from __future__ import annotations

from pathlib import Path

import gguf
import pytest

from tandem.detokenizer import IncrementalDetokenizer
from tandem.tokenizer import Tokenizer
from tests.support.tiny_gguf import write_tokenizer_gguf

STREAMS = [
    "Hello, world! How are you today?",
    "emoji 🤗🚀 family 👩‍👩‍👧 flag 🇫🇷 done",
    "日本語のテキストと中文文本、한국어도",
    "naïve café — Ελληνικά Русский हिन्दी",
    "def f(x):\n    return x * 2  # ✓\n",
    "<|im_start|>assistant\nSure 👍<|im_end|>\n",
]


@pytest.fixture(scope="module")
def tokenizer(smollm2_path: Path) -> Tokenizer:
    return Tokenizer.from_gguf(smollm2_path)


def _stream(tokenizer: Tokenizer, ids: list[int], chunk: int = 1, **options) -> list[str]:
    detokenizer = IncrementalDetokenizer(tokenizer, **options)
    deltas = [detokenizer.feed(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    return [*deltas, detokenizer.flush()]


def test_streams_split_characters(tokenizer: Tokenizer) -> None:
    """Guards the tests below: these texts do put one character across several tokens."""
    split = [i for text in STREAMS for i in tokenizer.encode(text) if "\ufffd" in tokenizer.decode([i])]
    assert len(split) > 10


@pytest.mark.parametrize("chunk", [1, 3])
@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("text", STREAMS)
def test_deltas_concatenate_to_decode(
    tokenizer: Tokenizer, text: str, chunk: int, skip_special_tokens: bool
) -> None:
    ids = tokenizer.encode(text)
    deltas = _stream(tokenizer, ids, chunk, skip_special_tokens=skip_special_tokens)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    assert not any("\ufffd" in delta for delta in deltas)
    assert deltas[-1] == ""


def test_skips_special_tokens(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("<|im_start|>hi<|im_end|>")
    assert "".join(_stream(tokenizer, ids)) == "hi"
    assert "".join(_stream(tokenizer, ids, skip_special_tokens=False)) == "<|im_start|>hi<|im_end|>"


def test_holds_back_a_partial_character_until_flush(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("a🤗")
    partial = ids[:-1]
    detokenizer = IncrementalDetokenizer(tokenizer)
    assert [detokenizer.feed(i) for i in partial] == ["a"] + [""] * (len(partial) - 1)
    assert detokenizer.flush() == tokenizer.decode(partial)[1:]
    assert detokenizer.flush() == ""


def test_completes_after_held_back_bytes(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("🤗!")
    detokenizer = IncrementalDetokenizer(tokenizer)
    assert "".join(detokenizer.feed(i) for i in ids) == "🤗!"


def test_context_ids_are_not_repeated(tokenizer: Tokenizer) -> None:
    prompt, completion = tokenizer.encode("User: 日本"), tokenizer.encode("語 🤗 ok")
    deltas = _stream(tokenizer, completion, context_ids=prompt)
    full = tokenizer.decode(prompt + completion)
    assert "".join(deltas) == full[len(tokenizer.decode(prompt)):]


def test_decodes_a_bounded_window(tokenizer: Tokenizer) -> None:
    """Per-token cost stays flat: no step decodes the whole sequence."""
    ids = tokenizer.encode("streaming 🤗 日本語 text " * 100)
    spy = _DecodeSpy(tokenizer)
    deltas = _stream(spy, ids)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)
    assert max(spy.lengths) <= 12


def test_sentencepiece_leading_space(tmp_path: Path) -> None:
    """Sentencepiece's decoder strips the first space of a decode; windows must not strip it mid-stream."""
    tokenizer = Tokenizer.from_gguf(_write_sentencepiece_gguf(tmp_path / "spm.gguf"))
    ids = tokenizer.encode("hello hello world 中", add_special_tokens=True)
    deltas = _stream(tokenizer, ids)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True) == "hello hello world 中"
    assert not any("\ufffd" in delta for delta in deltas)


class _DecodeSpy:
    """A tokenizer that records how many ids each decode call gets."""

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer
        self.special_token_ids = tokenizer.special_token_ids
        self.lengths: list[int] = []

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        self.lengths.append(len(ids))
        return self._tokenizer.decode(ids, skip_special_tokens)


def _write_sentencepiece_gguf(path: Path) -> Path:
    """A hand-made sentencepiece vocabulary; 中 is not in it, so it goes out as three byte tokens."""
    pieces = ["▁", "h", "e", "l", "o", "w", "r", "d",
              "he", "ll", "llo", "hello", "▁hello", "▁w", "or", "ld", "orld", "▁world"]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL,
             *[gguf.TokenType.BYTE] * 256, *[gguf.TokenType.NORMAL] * len(pieces)]
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    return write_tokenizer_gguf(path, "llama", tokens, scores, types)
