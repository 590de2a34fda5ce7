"""Suffix matching over token documents, for the suffix drafter (suffix decoding).

A `SuffixIndex` holds token documents (a request's prompt and output, or finished outputs of
earlier requests) and, for each anchor length n in ANCHORS, where every n-gram of them ends. To
draft after a context, `speculate` finds earlier occurrences of the context's tail: it looks up the
longest anchor that occurs, measures how far back each occurrence keeps matching the context (up
to `max_depth` tokens), and reads what followed each one.

From those occurrences it builds the draft greedily, token by token: the continuation most of the
still-agreeing occurrences took, while the product of those shares (the chance the whole draft so
far is right, by frequency) stays at or above `min_token_prob`. It tries every match length m the
occurrences offer (the occurrences matching at least m tokens), drafts at most
`max_spec_factor * m` tokens from each, and keeps the draft with the highest score, the expected
number of accepted tokens (the sum of those products). Long, frequent matches thus draft long;
a one-token match drafts one token at most.

Own implementation rather than a suffix tree: the index costs a few list entries per token, and
a lookup scans at most `max_occurrences` occurrences per index, so that memory and time stay
bounded on long, repetitive documents.
"""
from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field

ANCHORS = (8, 4, 2, 1)  # n-gram lengths indexed, longest first
DOC_SHIFT = 32  # an occurrence is packed as doc_id << DOC_SHIFT | end (the position after the n-gram)


@dataclass(frozen=True, slots=True)
class SuffixParams:
    max_depth: int = 24  # the longest match measured, in tokens
    # Draft at most this many tokens per matched token. 4 drafts k=4 after a one-token match when
    # the occurrences agree: on the bench prompts it beat 1 and 2 (bench/README.md, drafter_mal).
    max_spec_factor: float = 4.0
    min_token_prob: float = 0.1  # stop drafting once the draft's estimated chance falls below this
    max_occurrences: int = 64  # most recent occurrences scanned per index and lookup


@dataclass(frozen=True, slots=True)
class SuffixDraft:
    tokens: list[int]
    score: float  # expected accepted tokens: the sum over the draft of P(every token up to here is right)
    match_len: int


NO_DRAFT = SuffixDraft([], 0.0, 0)


@dataclass(slots=True)
class Occurrence:
    """An earlier place where the context's tail occurred: how far back it matches, what followed it."""

    match_len: int
    continuation: list[int]


@dataclass(slots=True)
class SuffixIndex:
    """Token documents and where each of their n-grams (n in ANCHORS) ends."""

    docs: dict[int, list[int]] = field(default_factory=dict)
    ends: dict[int, dict[tuple[int, ...], list[int]]] = field(
        default_factory=lambda: {n: defaultdict(list) for n in ANCHORS})
    num_tokens: int = 0  # in live documents
    first_live: int = 0  # documents with smaller ids were dropped; the index may still name them
    next_id: int = 0
    dead_entries: int = 0

    def add(self, tokens: list[int]) -> int:
        """A new document; returns its id."""
        doc_id = self.next_id
        self.next_id += 1
        self.docs[doc_id] = []
        self.extend(doc_id, tokens)
        return doc_id

    def extend(self, doc_id: int, tokens: list[int]) -> None:
        """Appends tokens to a document and indexes the n-grams they end."""
        doc = self.docs[doc_id]
        for token in tokens:
            doc.append(token)
            end = len(doc)
            packed = doc_id << DOC_SHIFT | end
            for n in ANCHORS:
                if end >= n:
                    self.ends[n][tuple(doc[end - n :])].append(packed)
        self.num_tokens += len(tokens)

    def drop_oldest(self, max_tokens: int) -> None:
        """Drops the oldest documents until at most max_tokens remain; rebuilds once most entries are dead."""
        while self.num_tokens > max_tokens and self.docs:
            dropped = self.docs.pop(self.first_live, None)
            if dropped is not None:
                self.num_tokens -= len(dropped)
                self.dead_entries += len(dropped) * len(ANCHORS)
            self.first_live += 1
        if self.dead_entries > self.num_tokens * len(ANCHORS):
            self._rebuild()

    def _rebuild(self) -> None:
        docs = self.docs
        self.docs, self.num_tokens, self.dead_entries = {}, 0, 0
        self.ends = {n: defaultdict(list) for n in ANCHORS}
        for doc_id, tokens in docs.items():
            self.docs[doc_id] = []
            self.extend(doc_id, tokens)

    def occurrences(self, context: list[int], params: SuffixParams, horizon: int) -> list[Occurrence]:
        """Earlier occurrences of the context's longest indexed tail that occurs, each with up to
        `horizon` following tokens; occurrences with nothing after them are left out."""
        for n in ANCHORS:
            if len(context) < n:
                continue
            entries = self.ends[n].get(tuple(context[-n:]))
            if not entries:
                continue
            found = []
            for packed in reversed(entries[-params.max_occurrences :]):
                doc_id, end = packed >> DOC_SHIFT, packed & ((1 << DOC_SHIFT) - 1)
                doc = self.docs.get(doc_id)
                if doc is None or end >= len(doc):
                    continue
                found.append(Occurrence(_match_len(doc, end, context, n, params.max_depth),
                                        doc[end : end + horizon]))
            if found:
                return found
        return []


def _match_len(doc: list[int], end: int, context: list[int], known: int, max_depth: int) -> int:
    """How many tokens before doc[end] equal the context's last ones (the first `known` are known to)."""
    length = known
    limit = min(max_depth, end, len(context))
    while length < limit and doc[end - length - 1] == context[-length - 1]:
        length += 1
    return length


def speculate(occurrences: list[Occurrence], k: int, params: SuffixParams) -> SuffixDraft:
    """The best-scoring draft of at most k tokens over every match length the occurrences offer."""
    best = NO_DRAFT
    for match_len in sorted({o.match_len for o in occurrences}, reverse=True):
        limit = min(k, max(1, int(params.max_spec_factor * match_len)))
        draft = _greedy_path([o.continuation for o in occurrences if o.match_len >= match_len], limit,
                             params.min_token_prob)
        if draft[1] > best.score:
            best = SuffixDraft(draft[0], draft[1], match_len)
    return best


def _greedy_path(continuations: list[list[int]], limit: int, min_prob: float) -> tuple[list[int], float]:
    """The most frequent continuation, token by token; (tokens, expected accepted tokens)."""
    tokens: list[int] = []
    chance, score = 1.0, 0.0
    alive = continuations
    for step in range(limit):
        counts = Counter(c[step] for c in alive if len(c) > step)
        if not counts:
            break
        token, count = counts.most_common(1)[0]
        chance *= count / sum(counts.values())
        if chance < min_prob:
            break
        tokens.append(token)
        score += chance
        alive = [c for c in alive if len(c) > step and c[step] == token]
    return tokens, score
