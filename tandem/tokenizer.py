"""Text to token ids and back, built with `tokenizers` from a tokenizer.json folder or GGUF metadata.

A GGUF file carries no tokenizer.json, only llama.cpp's description of one: the vocabulary, the
merges (or sentencepiece scores), each token's type and the name of the pre-tokenizer
(`tokenizer.ggml.pre`). `Tokenizer.from_gguf` rebuilds the equivalent `tokenizers.Tokenizer`.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from datetime import datetime
from functools import cached_property, lru_cache
from os import PathLike
from pathlib import Path
from typing import Any, Callable, Sequence

import gguf
import jinja2
import jinja2.ext
import tokenizers
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors

from tandem.loaders import CheckpointError
from tandem.loaders.gguf_reader import GGUFFile


class TokenizerError(ValueError):
    """The tokenizer files are missing, malformed or describe a tokenizer we cannot build."""


class ChatTemplateError(TokenizerError):
    """The chat template rejected the messages (its `raise_exception`) or failed to render."""


@dataclass(frozen=True, slots=True)
class SpecialTokenIds:
    """Ids with a role: `eos` is the one chat templates print, `stop` every id that ends generation."""

    bos: int | None = None
    eos: int | None = None
    pad: int | None = None
    unk: int | None = None
    stop: frozenset[int] = frozenset()


class Tokenizer:
    """Encoding, decoding and chat rendering for one model, over a `tokenizers.Tokenizer`."""

    def __init__(self, backend: tokenizers.Tokenizer, special: SpecialTokenIds, chat_template: str | None = None):
        self._backend = backend
        self._special = special
        self._chat_template = chat_template
        # The backend's post-processor decides whether plain encoding adds BOS; chat encoding follows it.
        leading = backend.encode("", add_special_tokens=True).ids[:1]
        self._adds_bos = special.bos is not None and leading == [special.bos]

    @classmethod
    def from_gguf(cls, source: str | PathLike[str] | gguf.GGUFReader) -> Tokenizer:
        """From the tokenizer.* metadata of a GGUF file, or of a reader already opened on one."""
        if isinstance(source, gguf.GGUFReader):
            return _tokenizer_from_gguf_metadata(_reader_metadata(source))
        return _tokenizer_from_gguf_metadata(_read_gguf_metadata(Path(source)))

    @classmethod
    def from_dir(cls, folder: str | PathLike[str]) -> Tokenizer:
        """From an HF folder: tokenizer.json, tokenizer_config.json and, if present, generation_config.json."""
        return _tokenizer_from_dir(Path(folder))

    @property
    def backend(self) -> tokenizers.Tokenizer:
        return self._backend

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        return self._special.bos

    @property
    def eos_token_id(self) -> int | None:
        return self._special.eos

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Every id that ends generation."""
        primary = {self._special.eos} if self._special.eos is not None else set()
        return self._special.stop | primary

    @property
    def pad_token_id(self) -> int | None:
        return self._special.pad

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    @cached_property
    def special_token_ids(self) -> frozenset[int]:
        """Ids that `skip_special_tokens` drops when decoding."""
        return frozenset(i for i, tok in self._backend.get_added_tokens_decoder().items() if tok.special)

    @cached_property
    def fingerprint(self) -> str:
        """sha256 over the id space (vocabulary, merges, added tokens): equal when two sides can swap ids."""
        return _fingerprint(json.loads(self._backend.to_str()))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def with_chat_template(self, source: str) -> Tokenizer:
        """The same tokenizer rendering chats with another template (the target's --chat-template)."""
        _compile_template(source)
        return Tokenizer(self._backend, self._special, source)

    def apply_chat_template(
        self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Renders messages the way transformers' `apply_chat_template(tokenize=False)` does."""
        if self._chat_template is None:
            raise TokenizerError("this tokenizer has no chat template")
        context = {"tools": None, "documents": None, **self._template_tokens, **kwargs}
        try:
            return _compile_template(self._chat_template).render(
                messages=list(messages), add_generation_prompt=add_generation_prompt, **context
            )
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template: {exc}") from exc

    def encode_chat(
        self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> list[int]:
        """The rendered chat as ids, with BOS added only if the model wants one and the template left it out."""
        text = self.apply_chat_template(messages, add_generation_prompt, **kwargs)
        ids = self.encode(text, add_special_tokens=False)
        if self._adds_bos and ids[:1] != [self._special.bos]:
            ids.insert(0, self._special.bos)
        return ids

    def hf_files(self) -> dict[str, str]:
        """The tokenizer as an HF folder's files (tokenizer.json, tokenizer_config.json with the chat
        template, generation_config.json with the stop ids), which `from_dir` reads back as this one."""
        config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", **self._template_tokens}
        if self._chat_template is not None:
            config["chat_template"] = self._chat_template
        generation: dict[str, Any] = {"eos_token_id": sorted(self.eos_token_ids)}
        if self._special.bos is not None:
            generation["bos_token_id"] = self._special.bos
        return {"tokenizer.json": self._backend.to_str(), "tokenizer_config.json": json.dumps(config, indent=2),
                "generation_config.json": json.dumps(generation, indent=2)}

    @cached_property
    def _template_tokens(self) -> dict[str, str]:
        roles = {"bos_token": self._special.bos, "eos_token": self._special.eos,
                 "pad_token": self._special.pad, "unk_token": self._special.unk}
        return {name: self._backend.id_to_token(i) for name, i in roles.items() if i is not None}


def _fingerprint(spec: dict[str, Any]) -> str:
    model = spec["model"]
    vocab = model.get("vocab")
    if isinstance(vocab, dict):
        vocab = sorted(vocab, key=vocab.__getitem__)
    merges = [m.split(" ", 1) if isinstance(m, str) else list(m) for m in model.get("merges") or ()]
    added = sorted((t["id"], t["content"], bool(t["special"])) for t in spec.get("added_tokens") or ())
    canonical = {"type": model["type"], "vocab": vocab, "merges": merges, "added": added}
    return hashlib.sha256(json.dumps(canonical, ensure_ascii=False).encode()).hexdigest()


# --- chat templates -------------------------------------------------------------------------------


class _GenerationTag(jinja2.ext.Extension):
    """Accepts transformers' `{% generation %}` training marker and renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Callable[[], str]) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """Unlike jinja's own tojson, this does not HTML-escape: templates build prompts, not web pages."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=1)
def _template_environment() -> ImmutableSandboxedEnvironment:
    """Templates come from model files, so they run sandboxed; the options match transformers'."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _GenerationTag]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@lru_cache(maxsize=16)
def _compile_template(source: str) -> jinja2.Template:
    try:
        return _template_environment().from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"chat template does not compile: {exc}") from exc


# --- HF folders -----------------------------------------------------------------------------------


def _tokenizer_from_dir(folder: Path) -> Tokenizer:
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise TokenizerError(f"{folder}: no tokenizer.json")
    try:
        backend = tokenizers.Tokenizer.from_file(str(path))
    except Exception as exc:
        raise TokenizerError(f"{path}: {exc}") from exc
    config = {**_read_json(folder / "special_tokens_map.json"), **_read_json(folder / "tokenizer_config.json")}
    generation = _read_json(folder / "generation_config.json")
    special = _dir_special_ids(backend, config, generation)
    if "add_bos_token" in config or "add_eos_token" in config:
        backend.post_processor = _bos_eos_processor(
            backend,
            special.bos if config.get("add_bos_token") else None,
            special.eos if config.get("add_eos_token") else None,
        )
    return Tokenizer(backend, special, _dir_chat_template(folder, config))


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise TokenizerError(f"{path}: {exc}") from exc


def _dir_special_ids(
    backend: tokenizers.Tokenizer, config: dict[str, Any], generation: dict[str, Any]
) -> SpecialTokenIds:
    def token_id(name: str) -> int | None:
        value = config.get(f"{name}_token")
        content = value.get("content") if isinstance(value, dict) else value
        if isinstance(content, str) and (found := backend.token_to_id(content)) is not None:
            return found
        fallback = generation.get(f"{name}_token_id")
        return fallback if isinstance(fallback, int) else None

    stop = generation.get("eos_token_id")
    stop_ids = stop if isinstance(stop, list) else [stop] if isinstance(stop, int) else []
    eos = token_id("eos")
    if eos is None and stop_ids:
        eos = stop_ids[0]
    return SpecialTokenIds(bos=token_id("bos"), eos=eos, pad=token_id("pad"), unk=token_id("unk"),
                           stop=frozenset(stop_ids))


def _dir_chat_template(folder: Path, config: dict[str, Any]) -> str | None:
    """transformers now saves the template as chat_template.jinja; older folders keep it in the config."""
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = _read_json(folder / "chat_template.json").get("chat_template", config.get("chat_template"))
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _bos_eos_processor(
    backend: tokenizers.Tokenizer, bos: int | None, eos: int | None
) -> processors.TemplateProcessing | None:
    if bos is None and eos is None:
        return None
    def sequence(name: str, type_id: int) -> list[str]:
        head = [f"{backend.id_to_token(bos)}:{type_id}"] if bos is not None else []
        tail = [f"{backend.id_to_token(eos)}:{type_id}"] if eos is not None else []
        return [*head, f"${name}:{type_id}", *tail]

    specials = [(backend.id_to_token(i), i) for i in (bos, eos) if i is not None]
    single = sequence("A", 0)
    return processors.TemplateProcessing(single=single, pair=single + sequence("B", 1), special_tokens=specials)


# --- GGUF -----------------------------------------------------------------------------------------

# llama.cpp's pre-tokenizer regexes (llama-vocab.cpp), by `tokenizer.ggml.pre`.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT2_PRES = {"default", "gpt2", "gpt-2", "mpt", "olmo", "jais"}
# These first cut every digit out on its own (llama.cpp's "\p{N}" split; `Digits` in tokenizer.json).
_DIGIT_PRES = {"smollm", "starcoder", "refact", "codeshell", "command-r"}
_SPLIT_PRES = {
    "llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT,
    "falcon3": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT, "stablelm2": _QWEN2_SPLIT,
}
# Llama 3's tokenizer.json sets `ignore_merges`: a piece that is itself a token is not merged up.
_IGNORE_MERGES_PRES = {"llama-bpe", "llama3", "llama-v3", "smaug-bpe", "falcon3"}
_GGUF_STOP_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
_SPACE = "\u2581"


def _byte_level_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    if pre in _GPT2_PRES:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGIT_PRES:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    if pre in _SPLIT_PRES:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLIT_PRES[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    known = sorted(_GPT2_PRES | _DIGIT_PRES | set(_SPLIT_PRES))
    raise TokenizerError(
        f"unsupported GGUF pre-tokenizer tokenizer.ggml.pre={pre!r}; supported: {', '.join(known)}"
    )


def _byte_level_backend(meta: dict[str, Any]) -> tokenizers.Tokenizer:
    """GPT-2 style byte-level BPE (`tokenizer.ggml.model == "gpt2"`)."""
    pre = meta.get("tokenizer.ggml.pre", "default")
    pre_tokenizer = _byte_level_pre_tokenizer(pre)
    vocab = {token: i for i, token in enumerate(meta["tokenizer.ggml.tokens"])}
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", ())]
    backend = tokenizers.Tokenizer(models.BPE(vocab, merges, ignore_merges=pre in _IGNORE_MERGES_PRES))
    backend.pre_tokenizer = pre_tokenizer
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_backend(meta: dict[str, Any]) -> tokenizers.Tokenizer:
    """Sentencepiece BPE with byte fallback (`tokenizer.ggml.model == "llama"`), as HF's Llama tokenizer."""
    tokens = meta["tokenizer.ggml.tokens"]
    scores = meta.get("tokenizer.ggml.scores")
    if scores is None:
        raise TokenizerError("GGUF sentencepiece vocabulary without tokenizer.ggml.scores")
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    bpe = models.BPE(
        {token: i for i, token in enumerate(tokens)},
        _merges_from_scores(tokens, scores, _token_types(meta)),
        unk_token=tokens[unk] if unk is not None else None,
        fuse_unk=True,
        byte_fallback=True,
    )
    backend = tokenizers.Tokenizer(bpe)
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    # A normalizer, not `Metaspace`: Metaspace skips the prefix when the text already starts with a space,
    # and sentencepiece and llama.cpp do not (llama.cpp also prefixes the text after each special token).
    spaces = [normalizers.Replace(" ", _SPACE)]
    backend.normalizer = normalizers.Sequence([normalizers.Prepend(_SPACE), *spaces] if prefix else spaces)
    steps = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(steps + [decoders.Strip(" ", 1, 0)] if prefix else steps)
    return backend


def _merges_from_scores(
    tokens: Sequence[str], scores: Sequence[float], types: Sequence[int]
) -> list[tuple[str, str]]:
    """Sentencepiece merges the adjacent pair whose union scores best, so that score is the merge rank."""
    normal = {token: score for token, score, kind in zip(tokens, scores, types) if kind == gguf.TokenType.NORMAL}
    ranked = [
        (score, token[:k], token[k:])
        for token, score in normal.items()
        for k in range(1, len(token))
        if token[:k] in normal and token[k:] in normal
    ]
    ranked.sort(key=lambda r: (-r[0], -len(r[1]), -len(r[2])))
    return [(left, right) for _, left, right in ranked]


def _token_types(meta: dict[str, Any]) -> list[int]:
    types = meta.get("tokenizer.ggml.token_type")
    return list(types) if types is not None else [gguf.TokenType.NORMAL] * len(meta["tokenizer.ggml.tokens"])


def _add_typed_tokens(backend: tokenizers.Tokenizer, tokens: Sequence[str], types: Sequence[int]) -> None:
    """Control tokens become special (matched whole, skippable); user-defined ones are matched whole only."""
    special = {gguf.TokenType.CONTROL, gguf.TokenType.UNKNOWN}
    typed = list(zip(tokens, types))
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, k in typed if k in special])
    backend.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t, k in typed if k == gguf.TokenType.USER_DEFINED]
    )


_GGUF_BACKENDS: dict[str, Callable[[dict[str, Any]], tokenizers.Tokenizer]] = {
    "gpt2": _byte_level_backend,
    "llama": _sentencepiece_backend,
}


def _tokenizer_from_gguf_metadata(meta: dict[str, Any]) -> Tokenizer:
    kind = meta.get("tokenizer.ggml.model")
    if kind not in _GGUF_BACKENDS:
        raise TokenizerError(
            f"unsupported GGUF tokenizer tokenizer.ggml.model={kind!r}; supported: {', '.join(_GGUF_BACKENDS)}"
        )
    if "tokenizer.ggml.tokens" not in meta:
        raise TokenizerError("GGUF file has no tokenizer.ggml.tokens")
    backend = _GGUF_BACKENDS[kind](meta)
    _add_typed_tokens(backend, meta["tokenizer.ggml.tokens"], _token_types(meta))
    special = SpecialTokenIds(
        bos=meta.get("tokenizer.ggml.bos_token_id"),
        eos=meta.get("tokenizer.ggml.eos_token_id"),
        pad=meta.get("tokenizer.ggml.padding_token_id"),
        unk=meta.get("tokenizer.ggml.unknown_token_id"),
        stop=frozenset(meta[key] for key in _GGUF_STOP_KEYS if key in meta),
    )
    # llama.cpp adds BOS to sentencepiece vocabularies that do not say otherwise.
    add_bos = meta.get("tokenizer.ggml.add_bos_token", kind == "llama")
    add_eos = meta.get("tokenizer.ggml.add_eos_token", False)
    backend.post_processor = _bos_eos_processor(
        backend, special.bos if add_bos else None, special.eos if add_eos else None
    )
    return Tokenizer(backend, special, meta.get("tokenizer.chat_template"))


def _reader_metadata(reader: gguf.GGUFReader) -> dict[str, Any]:
    return {name: field.contents() for name, field in reader.fields.items() if name.startswith("tokenizer.")}


def _read_gguf_metadata(path: Path) -> dict[str, Any]:
    try:
        return GGUFFile(path).metadata
    except CheckpointError as exc:
        raise TokenizerError(str(exc)) from exc
