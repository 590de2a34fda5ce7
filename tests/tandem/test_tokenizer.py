"""The tokenizer against its oracles: transformers on the embedded GGUF, sentencepiece on a tiny vocabulary."""
from __future__ import annotations

import io
import json
from pathlib import Path

import gguf
import pytest

from tandem.tokenizer import ChatTemplateError, SpecialTokenIds, Tokenizer, TokenizerError
from tests.support.tiny_gguf import write_tokenizer_gguf

# No whitespace run right before a digit here: see test_smollm_splits_digits_like_llama_cpp.
TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "naïve café résumé — Ünïcödé façade",
    "日本語のテキストと中文文本",
    "emoji: 🤗🚀 👩‍👩‍👧 🇫🇷",
    "Ελληνικά Русский العربية हिन्दी",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n",
    "for (int i = 0; i < n; ++i) { x[i] *= 2; }",
    "tabs\tand   spaces    and\n\n\nnewlines\r\n",
    "   leading and trailing   ",
    "\u00a0non-breaking\u2009thin\u3000ideographic",
    "price: $1,234.56 on 2024-01-31",
    "it's they're we've I'm you'll he'd IT'S",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "mixed<|im_end|>special<repo_name>tokens",
    "",
]

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And in Japanese? 日本語で 🤗"},
]


@pytest.fixture(scope="module")
def ours(smollm2_path: Path) -> Tokenizer:
    return Tokenizer.from_gguf(smollm2_path)


@pytest.fixture(scope="module")
def hf(hf_smollm2_tokenizer):
    return hf_smollm2_tokenizer


@pytest.fixture(scope="module")
def saved_dir(hf, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("smollm2-tokenizer")
    hf.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("text", TEXTS)
def test_ids_match_transformers(ours: Tokenizer, hf, text: str) -> None:
    assert ours.encode(text) == hf.encode(text)


@pytest.mark.parametrize("text", TEXTS)
def test_decode_round_trips(ours: Tokenizer, hf, text: str) -> None:
    ids = ours.encode(text)
    assert ours.decode(ids) == text
    assert ours.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True)


def test_smollm_splits_digits_like_llama_cpp(ours: Tokenizer, hf) -> None:
    """SmolLM2 cuts digits out first (its tokenizer.json's `Digits`; llama.cpp's "smollm" pre-tokenizer).

    transformers' GGUF converter ignores tokenizer.ggml.pre="smollm", so it differs only when a
    whitespace run precedes a digit.
    """
    tokens = [ours.backend.id_to_token(i) for i in ours.encode("x  1")]
    assert tokens == ["x", "ĠĠ", "1"]
    assert hf.convert_ids_to_tokens(hf.encode("x  1")) == ["x", "Ġ", "Ġ", "1"]


def test_special_tokens_are_atomic_and_skippable(ours: Tokenizer) -> None:
    ids = ours.encode("a<|im_end|>b")
    assert ids[1] == ours.eos_token_id == 2
    assert len(ids) == 3
    assert ours.decode(ids, skip_special_tokens=True) == "ab"


def test_metadata(ours: Tokenizer, hf) -> None:
    assert ours.vocab_size == len(hf) == 49152
    assert ours.bos_token_id == hf.bos_token_id
    assert ours.eos_token_ids == {hf.eos_token_id}
    assert ours.pad_token_id == hf.pad_token_id
    assert ours.encode("hi", add_special_tokens=True) == ours.encode("hi", add_special_tokens=False)
    assert len(ours.fingerprint) == 64


@pytest.mark.parametrize("messages", [MESSAGES, MESSAGES[1:]], ids=["system", "default-system"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(ours: Tokenizer, hf, messages, add_generation_prompt: bool) -> None:
    expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected
    ids = hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, return_dict=False)
    assert ours.encode_chat(messages, add_generation_prompt=add_generation_prompt) == list(ids)


def test_chat_template_raise_exception(ours: Tokenizer) -> None:
    template = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}ok"
    strict = Tokenizer(ours.backend, SpecialTokenIds(), chat_template=template)
    assert strict.apply_chat_template([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(ChatTemplateError, match="user first"):
        strict.apply_chat_template([{"role": "assistant", "content": "x"}])


def test_chat_template_is_sandboxed(ours: Tokenizer) -> None:
    template = "{{ messages.__class__.__mro__ }}"
    with pytest.raises(ChatTemplateError):
        Tokenizer(ours.backend, SpecialTokenIds(), chat_template=template).apply_chat_template([])


def test_from_dir_matches_from_gguf(ours: Tokenizer, hf, saved_dir: Path) -> None:
    loaded = Tokenizer.from_dir(saved_dir)
    for text in TEXTS:
        assert loaded.encode(text) == hf.encode(text)
    assert loaded.fingerprint == ours.fingerprint
    assert loaded.eos_token_ids == ours.eos_token_ids
    assert (loaded.bos_token_id, loaded.pad_token_id) == (ours.bos_token_id, ours.pad_token_id)
    assert loaded.apply_chat_template(MESSAGES) == ours.apply_chat_template(MESSAGES)


def test_from_dir_generation_config_adds_stop_ids(saved_dir: Path, tmp_path: Path) -> None:
    folder = _copy_dir(saved_dir, tmp_path)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    assert Tokenizer.from_dir(folder).eos_token_ids == {0, 2}


def test_encode_chat_adds_bos_once(saved_dir: Path, tmp_path: Path) -> None:
    folder = _copy_dir(saved_dir, tmp_path)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": True}))
    plain = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (folder / "chat_template.jinja").write_text("{{ bos_token }}" + plain)
    tokenizer = Tokenizer.from_dir(folder)
    bos = tokenizer.bos_token_id
    assert tokenizer.encode("hi")[0] == bos
    assert tokenizer.encode_chat([{"role": "user", "content": "hi"}]).count(bos) == 1
    (folder / "chat_template.jinja").write_text(plain)
    assert Tokenizer.from_dir(folder).encode_chat([{"role": "user", "content": "hi"}])[:1] == [bos]


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2", "gpt2"])
def test_byte_level_pre_tokenizers_match_transformers(ours: Tokenizer, tmp_path: Path, pre: str) -> None:
    """The other pre-tokenizer regexes, on SmolLM2's first 3000 tokens (all bytes and early merges)."""
    from transformers import AutoTokenizer

    path = _write_small_byte_level_gguf(ours, tmp_path / f"{pre}.gguf", pre)
    small, hf_small = Tokenizer.from_gguf(path), AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in [*TEXTS, "x  1", "abc 1234 def", "  \n\n 42", "I'M HERE, You'Re"]:
        assert small.encode(text) == hf_small.encode(text), text


def test_gguf_reader_source_gives_same_tokenizer(spm_gguf: Path) -> None:
    from_path = Tokenizer.from_gguf(spm_gguf)
    assert Tokenizer.from_gguf(gguf.GGUFReader(spm_gguf)).fingerprint == from_path.fingerprint


def test_errors(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
    with pytest.raises(TokenizerError, match="no such GGUF"):
        Tokenizer.from_gguf(tmp_path / "missing.gguf")
    (tmp_path / "bad.gguf").write_bytes(b"nope")
    with pytest.raises(TokenizerError, match="not a GGUF"):
        Tokenizer.from_gguf(tmp_path / "bad.gguf")
    with pytest.raises(TokenizerError, match="tokenizer.ggml.model='bert'"):
        Tokenizer.from_gguf(write_tokenizer_gguf(tmp_path / "bert.gguf", model="bert", tokens=["a"]))
    with pytest.raises(TokenizerError, match="tokenizer.ggml.pre='mystery'"):
        Tokenizer.from_gguf(write_tokenizer_gguf(tmp_path / "pre.gguf", model="gpt2", tokens=["a"], pre="mystery"))
    with pytest.raises(TokenizerError, match="no chat template"):
        plain = write_tokenizer_gguf(tmp_path / "plain.gguf", model="gpt2", tokens=["a"])
        Tokenizer.from_gguf(plain).apply_chat_template([])


# --- sentencepiece (tokenizer.ggml.model == "llama") ----------------------------------------------

SPM_TEXTS = [
    "Hello world",
    "the quick  brown   fox",
    "  leading spaces",
    "trailing  ",
    "日本 🤗 ünïcode",
    "1234 x",
    "\tTab\nnewline",
    "",
]


@pytest.fixture(scope="module")
def spm_processor():
    spm = pytest.importorskip("sentencepiece")
    lines = [
        "The quick brown fox jumps over the lazy dog.",
        "Speculative decoding drafts tokens and verifies them in one pass.",
        "the theory of the thing: 1234 5678",
        "    indented code  with   spaces",
        "Hello world! Hello there. Hello again.",
    ] * 40
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=model, model_type="bpe", vocab_size=400, byte_fallback=True,
        normalization_rule_name="identity", remove_extra_whitespaces=False, split_digits=True,
        character_coverage=1.0, allow_whitespace_only_pieces=True, unk_id=0, bos_id=1, eos_id=2, minloglevel=2,
    )
    return spm.SentencePieceProcessor(model_proto=model.getvalue())


@pytest.fixture(scope="module")
def spm_gguf(spm_processor, tmp_path_factory) -> Path:
    """The trained vocabulary written the way llama.cpp's converter writes a sentencepiece model."""
    sp = spm_processor
    size = sp.get_piece_size()
    return write_tokenizer_gguf(
        tmp_path_factory.mktemp("spm") / "spm.gguf",
        model="llama",
        tokens=[sp.id_to_piece(i) for i in range(size)],
        scores=[sp.get_score(i) for i in range(size)],
        types=[_sentencepiece_type(sp, i) for i in range(size)],
    )


@pytest.mark.parametrize("text", SPM_TEXTS)
def test_sentencepiece_ids_match_sentencepiece(spm_processor, spm_gguf: Path, text: str) -> None:
    tokenizer = Tokenizer.from_gguf(spm_gguf)
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids == spm_processor.encode(text)
    assert tokenizer.decode(ids) == spm_processor.decode(ids)
    assert tokenizer.encode(text) == [1, *ids]


def test_sentencepiece_special_tokens_like_llama_cpp(spm_gguf: Path) -> None:
    """`<s>` in text is BOS, and the text after a special token gets the space prefix, as in llama.cpp."""
    tokenizer = Tokenizer.from_gguf(spm_gguf)
    ids = tokenizer.encode("Hello<s>world", add_special_tokens=False)
    plain = {word: tokenizer.encode(word, add_special_tokens=False) for word in ("Hello", "world")}
    assert ids == [*plain["Hello"], 1, *plain["world"]]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "Hello world"


def _sentencepiece_type(sp, i: int) -> int:
    kinds = [(sp.is_unknown, gguf.TokenType.UNKNOWN), (sp.is_control, gguf.TokenType.CONTROL),
             (sp.is_byte, gguf.TokenType.BYTE), (sp.is_unused, gguf.TokenType.UNUSED)]
    return next((kind for check, kind in kinds if check(i)), gguf.TokenType.NORMAL)


def _write_small_byte_level_gguf(source: Tokenizer, path: Path, pre: str, size: int = 3000) -> Path:
    """SmolLM2 has no multi-digit tokens; three are added so that each regex groups "1234" its own way."""
    spec = json.loads(source.backend.to_str())["model"]
    tokens = sorted(spec["vocab"], key=spec["vocab"].get)[:size]
    kept = set(tokens)
    merges = [f"{a} {b}" for a, b in spec["merges"] if {a, b, a + b} <= kept]
    types = [gguf.TokenType.CONTROL if i in source.special_token_ids else gguf.TokenType.NORMAL for i in range(size)]
    digits = ["34", "12", "123"]
    return write_tokenizer_gguf(path, model="gpt2", tokens=tokens + digits, types=types + [gguf.TokenType.NORMAL] * 3,
                       pre=pre, merges=merges + ["3 4", "1 2", "12 3"])


def _copy_dir(source: Path, target: Path) -> Path:
    folder = target / source.name
    folder.mkdir()
    for file in source.iterdir():
        (folder / file.name).write_bytes(file.read_bytes())
    return folder
