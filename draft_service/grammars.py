"""Structured output on the drafter: each constrained sequence's grammar, kept at its committed tokens.

Everything here runs on the drafter's thread. The model drafter masks its logits with a cursor (a
copy of the grammar advanced over a round's prefix and drafts), so that it drafts only tokens the
target can accept; the lookup drafters' drafts are cut at the first token the grammar forbids.
Either way the target verifies against its own masked distribution: this only saves it drafts
that would surely be rejected.

Fast-forward: where the grammar forces the next tokens (compact JSON's keys and punctuation), a
draft shorter than k is extended with them, as ids or point masses (K = 1). They are drafts like
any other, verified by the target, so output stays lossless; they are simply very likely.
"""
from __future__ import annotations

import logging

from draft_service.drafter import DraftSequence, Drafted, SeqKey, common_prefix_len
from tandem_kernels.compression import point_mass
from tandem.structured import CompiledGrammar, ConstraintError, GrammarCompiler
from tandem.structured.grammar import Matcher

log = logging.getLogger(__name__)


class SequenceGrammar:
    """One sequence's matcher at its committed tokens from `start` (the prompt's end) on."""

    def __init__(self, compiled: CompiledGrammar, start: int):
        self._compiled = compiled
        self.start = start
        self._matcher = compiled.matcher()
        self._consumed: list[int] = []

    def settle(self, committed: list[int]) -> None:
        """Move the matcher to the committed tokens: roll back what changed, consume what is new."""
        tokens = committed[self.start :]
        common = common_prefix_len(self._consumed, tokens)
        if common < len(self._consumed):
            if not self._matcher.rollback(len(self._consumed) - common):
                self._matcher, common = self._compiled.matcher(), 0
            del self._consumed[common:]
        for token in tokens[common:]:
            if not self._matcher.consume_token(token):
                log.warning("the target committed token %d, which the grammar forbids", token)
                self._matcher, self._consumed = self._compiled.matcher(), []
                return
            self._consumed.append(token)

    def cursor(self, prefix: list[int]) -> Matcher | None:
        """A copy of the matcher at the end of prefix (committed tokens, then assumed ones);
        None when the grammar forbids a token of it or cannot continue after it."""
        tokens = prefix[self.start :]
        common = common_prefix_len(self._consumed, tokens)
        cursor = self._matcher.deep_copy()
        if common < len(self._consumed) and not cursor.rollback(len(self._consumed) - common):
            return None
        if not cursor.consume_tokens(tokens[common:]) or cursor.is_stopped():
            return None
        return cursor

    def fit(self, prefix: list[int], drafts: list[int], limit: int) -> tuple[int, list[int]]:
        """How many of the drafts the grammar allows, and the tokens it forces after those (at most
        limit tokens in all)."""
        cursor = self.cursor(prefix)
        if cursor is None:
            return 0, []
        allowed = cursor.validate_tokens(drafts)
        if allowed >= limit or not cursor.consume_tokens(drafts[:allowed]) or cursor.is_stopped():
            return allowed, []
        return allowed, cursor.compute_ff_tokens()[: limit - allowed]


class DraftGrammars:
    """The grammars of the constrained sequences, compiled on open, settled with each round."""

    def __init__(self, compiler: GrammarCompiler):
        self._compiler = compiler

    def open(self, sequence: DraftSequence) -> None:
        """Compile the sequence's constraint (cached by content); on failure it stays without a grammar,
        and so undrafted (DraftSequence.undraftable)."""
        if sequence.constraint is None:
            return
        try:
            sequence.grammar = SequenceGrammar(self._compiler.compile(sequence.constraint), sequence.constrained_from)
        except ConstraintError as err:
            log.warning("sequence %s: cannot draft under its constraint: %s", sequence.key, err)

    @staticmethod
    def settle(sequence: DraftSequence, committed: list[int]) -> None:
        if sequence.grammar is not None:
            sequence.grammar.settle(committed)

    @staticmethod
    def constrain(drafts: list[Drafted], sequences: dict[SeqKey, DraftSequence]) -> list[Drafted]:
        """Each constrained draft cut at the first token its grammar forbids, then extended with the
        tokens the grammar forces, up to k; pre-drafts left empty go."""
        kept = []
        for draft in drafts:
            sequence = sequences.get(draft.key)
            if sequence is not None and sequence.constraint is not None:
                _fit(draft, sequence)
            if draft.token_ids or not draft.assumed_ids:
                kept.append(draft)
        return kept


def _fit(draft: Drafted, sequence: DraftSequence) -> None:
    if sequence.grammar is None:
        cut(draft, 0)
        return
    extendable = draft.q_prime is None or draft.q_prime.k == 1  # ids only, or point masses, as forced tokens come
    limit = sequence.k if extendable else len(draft.token_ids)
    allowed, forced = sequence.grammar.fit(draft.prefix, draft.token_ids, limit)
    if allowed < len(draft.token_ids):
        cut(draft, allowed)
    if forced:
        draft.token_ids.extend(forced)
        draft.recovered_guesses.extend([] for _ in forced)
        if sequence.sampling.needs_draft_probs:
            draft.q_prime = point_mass(draft.token_ids)


def cut(draft: Drafted, keep: int) -> None:
    """Keep the first `keep` draft tokens, with their q' rows and guesses."""
    if draft.q_prime is not None:
        draft.q_prime = draft.q_prime.rows(slice(0, keep))
    del draft.token_ids[keep:]
    del draft.recovered_guesses[keep:]
