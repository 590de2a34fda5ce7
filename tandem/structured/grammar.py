"""Constraints compiled into llguidance matchers, cached by content hash, and the masks they give.

llguidance rather than xgrammar: both mask a token in well under 1% of a decode step here, but
llguidance compiled our bench schemas 8 times faster (compiling is on the request's path),
computes a verify step's k + 1 masks in one call, and has no dependencies, where xgrammar brings
transformers, triton and a TVM runtime. The figures are in docs/design/lossless.md, Structured output.
"""
from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import llguidance
import torch
from llguidance.gbnf_to_lark import gbnf_to_lark

from tandem.structured.closed_objects import closed_objects
from tandem.structured.constraint import Constraint, ConstraintError
from tandem.tokenizer import Tokenizer

Matcher = llguidance.LLMatcher


@dataclass(frozen=True, slots=True)
class GrammarLimits:
    """Bounds on what one constraint may cost; past them its request gets INVALID_ARGUMENT."""

    compile_seconds: float = 10.0  # the target stops waiting for a compile after this long
    cache_size: int = 256  # compiled grammars kept, least recently used dropped first
    max_grammar_size: int = 200_000  # symbols in the grammar's productions
    initial_lexer_fuel: int = 1_000_000  # work building the lexer's regexes (about 50k a millisecond)
    step_lexer_fuel: int = 200_000  # work per mask (about 14k a millisecond)

    def parser_limits(self) -> llguidance.LLParserLimits:
        return llguidance.LLParserLimits(max_grammar_size=self.max_grammar_size,
                                         initial_lexer_fuel=self.initial_lexer_fuel,
                                         step_lexer_fuel=self.step_lexer_fuel, verbose_errors=False)


@dataclass(frozen=True, slots=True)
class CompiledGrammar:
    """A constraint's matcher in its start state; each sequence gets its own copy from `matcher`."""

    constraint: Constraint
    template: Matcher
    compile_seconds: float

    def matcher(self) -> Matcher:
        return self.template.deep_copy()


class GrammarCompiler:
    """Compiles constraints for one tokenizer; safe to call from several threads."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, limits: GrammarLimits = GrammarLimits()):
        self.limits = limits
        self.vocab_size = vocab_size
        self._tokenizer: llguidance.LLTokenizer | None = None
        self.unavailable = ""  # why this tokenizer cannot be constrained, when it cannot
        try:
            self._tokenizer = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size,
                                                     eos_token=sorted(tokenizer.eos_token_ids))
        except ValueError as err:  # llguidance needs to know how tokens spell bytes (the decoder)
            self.unavailable = str(err)
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()

    def cached(self, constraint: Constraint) -> CompiledGrammar | None:
        with self._lock:
            compiled = self._cache.get(constraint.key)
            if compiled is not None:
                self._cache.move_to_end(constraint.key)
            return compiled

    def compile(self, constraint: Constraint) -> CompiledGrammar:
        """The cached grammar, or a new one; ConstraintError naming the field when it is invalid."""
        compiled = self.cached(constraint)
        if compiled is not None:
            return compiled
        if self._tokenizer is None:
            raise ConstraintError(constraint.field, "this model's tokenizer does not support structured output "
                                                    f"({self.unavailable}); send the request without it")
        started = time.perf_counter()
        template = Matcher(self._tokenizer, _grammar_text(constraint), log_level=0,
                           limits=self.limits.parser_limits())
        if template.is_error():
            raise ConstraintError(constraint.field, _one_line(template.get_error()))
        _check_start_mask(constraint, template, self.vocab_size)
        compiled = CompiledGrammar(constraint, template, time.perf_counter() - started)
        with self._lock:
            self._cache[constraint.key] = compiled
            while len(self._cache) > self.limits.cache_size:
                self._cache.popitem(last=False)
        return compiled


class TokenMasker:
    """Bitmasks for a batch's constrained rows: at each matcher's state, then after each of its drafts."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.words = words_for(vocab_size)
        self._executor = llguidance.LLExecutor(num_threads=1)

    def fill(self, jobs: list[tuple[Matcher, list[int]]]) -> torch.Tensor:
        """[sum(len(drafts) + 1), W] int32: job j's rows are its mask now, then after drafts[:1], drafts[:2]...

        The matchers end where they began. Rows after a draft its grammar forbids allow every token:
        verification rejects that draft, so no token is ever drawn from them.
        """
        total = sum(len(drafts) + 1 for _, drafts in jobs)
        bitmask = torch.full((total, self.words), -1, dtype=torch.int32)
        plain, drafted, offset = [], [], 0
        for matcher, drafts in jobs:
            if drafts:
                drafted.append((matcher, offset, list(drafts)))
            else:
                plain.append((matcher, offset))
            offset += len(drafts) + 1
        pointer, row_bytes = bitmask.data_ptr(), self.words * 4
        if plain:
            self._executor.unsafe_compute_mask_ptr(plain, pointer, row_bytes, total)
        if drafted:
            self._executor.unsafe_compute_mask_ptr_with_draft_token(drafted, pointer, row_bytes, total)
        return bitmask


def words_for(vocab_size: int) -> int:
    """int32 words per bitmask row: token t is bit t % 32 of word t // 32 (tandem_kernels/bitmask.py reads it)."""
    return (vocab_size + 31) // 32


def _grammar_text(constraint: Constraint) -> str:
    """The constraint in llguidance's grammar format."""
    kind, spec = constraint.kind, constraint.spec
    if kind == "json":
        try:
            schema = json.loads(spec)
        except json.JSONDecodeError as err:
            raise ConstraintError(constraint.field, f"is not valid JSON: {err}") from err
        if not isinstance(schema, dict):
            raise ConstraintError(constraint.field, "must be a JSON object (a schema)")
        return Matcher.grammar_from_json_schema(closed_objects(schema),
                                                defaults={"whitespace_flexible": not constraint.compact})
    if kind == "json_object":
        return Matcher.grammar_from_json_schema({"type": "object"}, defaults={"whitespace_flexible": not constraint.compact})
    if kind == "regex":
        return Matcher.grammar_from_regex(spec)
    if kind == "choice":
        return Matcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec))
    if "::=" in spec:  # GBNF's rule operator; Lark uses ':'
        try:
            spec = gbnf_to_lark(spec)
        except Exception as err:  # the converter raises plain exceptions on malformed GBNF
            raise ConstraintError(constraint.field, f"is not valid GBNF: {err}") from err
    return Matcher.grammar_from_lark(spec)


def _check_start_mask(constraint: Constraint, template: Matcher, vocab_size: int) -> None:
    """A grammar that allows no first token (nothing the tokenizer can spell) can never be followed."""
    bitmask = torch.zeros(1, words_for(vocab_size), dtype=torch.int32)
    template.unsafe_compute_mask_ptr(bitmask.data_ptr(), bitmask.numel() * 4)
    if template.is_error() or not bool(bitmask.any()):  # no bit set: no token allowed
        raise ConstraintError(constraint.field, "allows no output that the model's tokens can spell")


def _one_line(error: str, limit: int = 400) -> str:
    """llguidance's multi-line error (message, then the grammar line with a caret) on one line."""
    text = " ".join(error.split())
    return (text[: limit - 3] + "...") if len(text) > limit else (text or "is invalid")
