"""Suffix decoding: drafts from earlier occurrences of the context's tail (tandem/suffix_index.py),
looked up in the request's own prompt and output and in the outputs of recently finished requests.

Like the n-gram drafter it needs no model and sends a point mass as q' (lossless: a draft d is
accepted with probability p(d)). Unlike it, it weighs every occurrence it finds, drafts only as far
as the occurrences agree, and learns from other requests: agent loops, code edits and rewrites
repeat what earlier answers said.

`SuffixFrontDrafter` runs it in front of the model drafter: a sequence whose suffix draft is
confident (its expected accepted tokens reach `confidence` x k) takes it, at no cost; the rest go to the
model in one batch.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from draft_service.drafter import DraftJob, Drafted, SeqKey, make_drafted, never
from draft_service.drafters.model import ModelDrafter
from tandem.suffix_index import NO_DRAFT, SuffixDraft, SuffixIndex, SuffixParams, speculate
from tandem_kernels.compression import point_mass


@dataclass(slots=True)
class LocalDoc:
    """One open sequence's tokens in its own index; `prompt_len` tokens were there when first seen."""

    index: SuffixIndex
    prompt_len: int


class SuffixDrafter:
    """Per-sequence indexes over prompt and output, and one shared index over finished outputs."""

    kind = "suffix"
    inline_rounds = True
    probs_top_k = 1
    feature_layout = None  # it reads no target features

    def __init__(self, params: SuffixParams = SuffixParams(), cache_tokens: int = 200_000):
        """cache_tokens: finished outputs kept for other requests to draft from (oldest dropped first)."""
        self.params = params
        self.cache_tokens = cache_tokens
        self.shared = SuffixIndex()
        self._local: dict[SeqKey, LocalDoc] = {}

    def open(self, key: SeqKey) -> None:
        self._local.pop(key, None)

    def close(self, key: SeqKey) -> None:
        """The sequence's output joins the shared index."""
        local = self._local.pop(key, None)
        if local is None or self.cache_tokens <= 0:
            return
        output = local.index.docs[0][local.prompt_len :]
        if output:
            self.shared.add(output)
            self.shared.drop_oldest(self.cache_tokens)

    def settle(self, key: SeqKey, committed: list[int], closing: bool = False) -> None:
        self._sync(key, committed)

    def behind(self) -> list[SeqKey]:
        return []

    def _sync(self, key: SeqKey, committed: list[int]) -> SuffixIndex:
        """The sequence's index, holding exactly `committed` (rebuilt if the tokens were replaced)."""
        local = self._local.get(key)
        if local is None:
            local = self._local[key] = LocalDoc(SuffixIndex(), len(committed))
            local.index.add(committed)
            return local.index
        doc = local.index.docs[0]
        if len(committed) >= len(doc) and committed[: len(doc)] == doc:
            local.index.extend(0, committed[len(doc) :])
        else:
            local.index = SuffixIndex()
            local.index.add(committed)
            local.prompt_len = min(local.prompt_len, len(committed))
        return local.index

    def propose(self, job: DraftJob, k: int) -> SuffixDraft:
        """The best suffix draft of at most k tokens after the job's tokens."""
        if job.sequence.closed:
            return NO_DRAFT
        local = self._sync(job.sequence.key, job.tokens[: job.known_len])
        found = local.occurrences(job.tokens, self.params, k + 1)
        found += self.shared.occurrences(job.tokens, self.params, k + 1)
        return speculate(found, k, self.params)

    def to_draft(self, job: DraftJob, suffix: SuffixDraft) -> Drafted | None:
        """The job's proposal from its suffix draft, or None when there is nothing to send.

        For a guess_next job (the outcome "all drafts accepted") the suffix draft's first token is
        the guess at the bonus token, the rest are the drafts after it."""
        tokens = suffix.tokens
        if job.guess_next:
            if len(tokens) < 2:
                return None  # no guess at the bonus token, or nothing after it
            guess, tokens = tokens[0], tokens[1:]
        else:
            guess = None
            if job.is_predraft and not tokens:
                return None  # "nothing" answers a prefix the target has sent, never an assumed one
        q_prime = point_mass(tokens) if tokens and job.sequence.sampling.needs_draft_probs else None
        return make_drafted(job, tokens, q_prime, guessed_next=guess)

    def draft(self, jobs: list[DraftJob], stop: Callable[[], bool] = never) -> list[Drafted]:
        """Lookups take microseconds: `stop` is never needed."""
        drafts = [self.to_draft(job, self.propose(job, job.max_drafts + job.guess_next))
                  for job in jobs if not job.sequence.closed]
        return [draft for draft in drafts if draft is not None]


class SuffixFrontDrafter:
    """The suffix drafter where it is confident, the model drafter for everything else.

    Under a structured-output grammar, a suffix draft the grammar would cut goes to the model
    instead: the copy has left what the grammar allows, and the model drafts under its mask."""

    kind = "suffix+model"
    inline_rounds = False
    feature_layout = None  # it reads no target features

    def __init__(self, suffix: SuffixDrafter, model: ModelDrafter, confidence: float):
        self.suffix = suffix
        self.model = model
        self.confidence = confidence
        self.probs_top_k = model.probs_top_k  # the suffix drafter's K=1 rows fit under it

    def open(self, key: SeqKey) -> None:
        self.suffix.open(key)
        self.model.open(key)

    def close(self, key: SeqKey) -> None:
        self.suffix.close(key)
        self.model.close(key)

    def settle(self, key: SeqKey, committed: list[int], closing: bool = False) -> None:
        self.suffix.settle(key, committed, closing)
        self.model.settle(key, committed, closing)

    def behind(self) -> list[SeqKey]:
        return self.model.behind()

    def draft(self, jobs: list[DraftJob], stop: Callable[[], bool] = never) -> list[Drafted]:
        drafts, for_model = [], []
        for job in jobs:
            if job.sequence.closed:
                continue
            suffix = NO_DRAFT if job.guess_next else self.suffix.propose(job, job.sequence.k)
            if (suffix.tokens and suffix.score >= self.confidence * job.sequence.k
                    and _follows_grammar(job, suffix.tokens)):
                if job.max_drafts > job.sequence.k:  # confident on k drafts: reach further (a lookahead job)
                    suffix = self.suffix.propose(job, job.max_drafts)
                draft = self.suffix.to_draft(job, suffix)
                if draft is not None:
                    drafts.append(draft)
                    continue
            for_model.append(job)
        self.model.metrics.suffix_proposals.inc(len(drafts))
        return drafts + self.model.draft(for_model, stop)


def _follows_grammar(job: DraftJob, tokens: list[int]) -> bool:
    grammar = job.sequence.grammar
    return grammar is None or grammar.fit(job.tokens, tokens, len(tokens))[0] == len(tokens)
