"""Prompt-lookup drafting: no model, just the tokens that followed the trailing n-gram before.

Its q' is a point mass on the proposed token (K=1, probability ONE), so rejection sampling
accepts a draft d with probability p(d): lossless, like any other q'.

Pre-drafting (predraft.py) is a lookup on the assumed prefix. With no distribution, the drafter
has no guess at a recovered token; it covers only "all drafts accepted", guessing the bonus token
as the lookup's next token after d_k, and skips that outcome too when the lookup finds none.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from draft_service.drafter import DraftJob, Drafted, SeqKey, make_drafted, never
from tandem_kernels.compression import point_mass


MAX_CANDIDATES = 8  # occurrences tried per n-gram length when the first continuations are not allowed


def lookup(tokens: list[int], k: int, min_n: int, max_n: int,
           allowed: Callable[[int], bool] | None = None) -> list[int]:
    """Up to k tokens after the most recent earlier occurrence of the longest trailing n-gram (max_n..min_n).

    allowed: whether a continuation may start with this token (a structured-output grammar's); the
    next most recent occurrences are tried, then shorter n-grams."""
    seq = np.asarray(tokens, dtype=np.int64)
    for n in range(min(max_n, len(seq) - 1), min_n - 1, -1):
        # Windows of the sequence without its last token: every match has at least one follower.
        windows = sliding_window_view(seq[:-1], n)  # [len - n, n]
        hits = np.flatnonzero((windows == seq[-n:]).all(axis=1))
        for hit in hits[::-1][: 1 if allowed is None else MAX_CANDIDATES]:
            follow = int(hit) + n
            if allowed is None or allowed(int(seq[follow])):
                return seq[follow : follow + k].tolist()
    return []


class NgramDrafter:
    """Drafts by prompt lookup in each sequence's own tokens; holds no per-sequence state."""

    kind = "ngram"
    inline_rounds = True
    probs_top_k = 1
    feature_layout = None  # it reads no target features

    def __init__(self, min_n: int, max_n: int):
        self.min_n = min_n
        self.max_n = max_n

    def open(self, key: SeqKey) -> None:
        pass

    def close(self, key: SeqKey) -> None:
        pass

    def settle(self, key: SeqKey, committed: list[int], closing: bool = False) -> None:
        pass

    def behind(self) -> list[SeqKey]:
        return []

    def draft(self, jobs: list[DraftJob], stop: Callable[[], bool] = never) -> list[Drafted]:
        """Lookups are instant: `stop` is never needed."""
        drafts = []
        for job in jobs:
            if job.sequence.closed:
                continue
            guess = lookup(job.tokens, 1, self.min_n, self.max_n) if job.guess_next else []
            if job.guess_next and not guess:
                continue  # no guess at the bonus token: this outcome is not covered
            token_ids = lookup(job.tokens + guess, job.max_drafts, self.min_n, self.max_n,
                               _first_allowed(job, job.tokens + guess))
            if job.is_predraft and not token_ids:
                continue  # "nothing" answers a prefix the target has sent, never an assumed one
            # An empty proposal tells the target there is nothing for this prefix, so it need not wait.
            q_prime = point_mass(token_ids) if token_ids and job.sequence.sampling.needs_draft_probs else None
            drafts.append(make_drafted(job, token_ids, q_prime, guessed_next=guess[0] if guess else None))
        return drafts


def _first_allowed(job: DraftJob, prefix: list[int]) -> Callable[[int], bool] | None:
    """For a constrained sequence: whether its grammar allows a token right after prefix."""
    grammar = job.sequence.grammar
    if grammar is None:
        return None
    cursor = grammar.cursor(prefix)
    return (lambda token: False) if cursor is None else (lambda token: cursor.validate_tokens([token]) == 1)
