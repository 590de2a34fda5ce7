"""The target's own lookup: drafts for the steps that the drafter's proposals miss.

Over a link longer than a step, the drafter's answer to a rejected draft reaches the target after
its next step has begun, and that step decodes a single token. Yet a sequence that repeats its own
tokens (a rewrite, a code edit, a tool's output read back) says itself what comes next. So where no
held proposal continues the committed tokens, the target looks the tail of its tokens up in its
prompt and output, by the suffix drafter's rules (tandem/suffix_index.py: tens of microseconds on
the event loop), and verifies what it finds. The drafts are point masses, lossless as the suffix
drafter's are. A lookup counts only where it expects at least MIN_SCORE accepted tokens, so that a
chat's scattered one-token matches cost no verify; the policy's budget and the speed guard apply
to these drafts as to the drafter's.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from target_service.sequence import Sequence
from target_service.speculation.proposals import HeldProposal
from tandem.suffix_index import SuffixIndex, SuffixParams, speculate
from tandem_kernels.compression import point_mass

MIN_SCORE = 1.0  # expected accepted tokens, below which a lookup's drafts are not verified


@dataclass(slots=True)
class _Lookup:
    """One sequence's tokens, indexed, and its last answer (a wait for drafts plans a step again)."""

    index: SuffixIndex
    asked: tuple[int, int] = (-1, -1)  # (committed tokens, limit) the answer is for
    answer: HeldProposal | None = None


@dataclass(slots=True)
class LocalDrafts:
    """A suffix index over each running sequence's own tokens, by seq_id."""

    params: SuffixParams = field(default_factory=SuffixParams)
    _lookups: dict[int, _Lookup] = field(default_factory=dict)

    def propose(self, seq: Sequence, limit: int) -> HeldProposal | None:
        """Drafts of at most `limit` tokens for seq's committed tokens, or None where the lookup is not confident."""
        lookup = self._synced(seq)
        tokens = seq.token_ids
        if lookup.asked != (len(tokens), limit):
            draft = speculate(lookup.index.occurrences(tokens, self.params, limit + 1), limit, self.params)
            lookup.asked, lookup.answer = (len(tokens), limit), None
            if draft.score >= MIN_SCORE:
                probs = point_mass(draft.tokens) if seq.options.sampling.needs_draft_probs else None
                lookup.answer = HeldProposal(base_len=len(tokens), tokens=tuple(draft.tokens), probs=probs, local=True)
        return lookup.answer

    def release(self, seq_id: int) -> None:
        self._lookups.pop(seq_id, None)

    def _synced(self, seq: Sequence) -> _Lookup:
        """The sequence's lookup, its index holding every committed token (they are only ever appended)."""
        lookup = self._lookups.get(seq.seq_id)
        if lookup is None:
            lookup = self._lookups[seq.seq_id] = _Lookup(SuffixIndex())
            lookup.index.add(seq.token_ids)
        else:
            lookup.index.extend(0, seq.token_ids[len(lookup.index.docs[0]) :])
        return lookup
