"""What the drafter knows of one running sequence, and the proposals it made for it.

The Speculator keeps one DrafterState per running sequence, on the event loop.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from target_service.sequence import Sequence
from target_service.speculation.policy import DraftRecord
from target_service.speculation.proposals import NO_MATCH, HeldProposal, ProposalMatch, match_proposal
from tandem.protos import MAX_HELD_PROPOSALS

_UPDATES_TIMED = 16  # the latest updates whose answers are timed: a round trip spans fewer steps


@dataclass(frozen=True, slots=True)
class Evicted:
    """Proposals a step dropped as never to be used, by kind, for the metrics."""

    stale: int = 0  # plain proposals never verified, which the committed tokens contradict
    predrafts: int = 0  # pre-drafts never verified, whose assumed tokens were not what was committed


@dataclass(slots=True)
class DrafterState:
    """What the drafter knows of one sequence, and the proposals it made for it (the speculation cache).

    keep, match, evict and forget are the proposals' only way in and out.
    """

    seq: Sequence
    told_len: int = 0  # committed tokens the drafter has been told about; 0: not open on this stream
    told_at: float | None = None  # when it was last told, for the draft round trip
    # (told_len, told_at) of the latest updates: an answer for an older prefix, which comes after the
    # target moved on (a round trip longer than a step), times its round trip from its own update.
    asked: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=_UPDATES_TIMED))
    open_k: int = 0  # the k it was opened with: the most drafts per proposal an Extend may ask for
    told_k: int = 0  # the drafts per proposal it was last asked for; 0: paused
    answered_len: int = 0  # the last prefix length the drafter answered, with drafts or none
    held: list[HeldProposal] = field(default_factory=list)  # oldest first
    record: DraftRecord = field(default_factory=DraftRecord)  # the verifier's verdicts, for its own alpha
    # Feature rows not yet sent, for a drafter that reads them: contiguous from position features_from.
    features: list[torch.Tensor] = field(default_factory=list)
    features_from: int = 0

    def tell(self, now: float) -> None:
        """The drafter was told the committed tokens (an Open or an Extend)."""
        self.told_len, self.told_at = len(self.seq.token_ids), now
        self.asked.append((self.told_len, now))

    def answered_after(self, base_len: int, now: float) -> float | None:
        """The round trip of a plain proposal for base_len: since the update that told it; None if
        none did (or it was answered already)."""
        for i, (length, at) in enumerate(self.asked):
            if length == base_len:
                del self.asked[i]
                return now - at
        return None

    def keep(self, proposal: HeldProposal) -> None:
        self.held.append(proposal)
        del self.held[:-MAX_HELD_PROPOSALS]

    def match(self, limit: int) -> tuple[ProposalMatch, HeldProposal | None]:
        """The held proposal whose drafts continue the committed tokens furthest (newest on ties).

        Each is a valid draw given the committed tokens, so the one with the most drafts left is
        worth the most.
        """
        best, source = NO_MATCH, None
        for held in self.held:
            match = match_proposal(held, self.seq.token_ids, limit)
            if match.drafts is not None and (best.drafts is None or len(match.drafts.tokens) >= len(best.drafts.tokens)):
                best, source = match, held
        return best, source

    def covers_committed(self) -> bool:
        """A held proposal has drafts for the committed tokens: the drafter owes no answer for them."""
        return any(match_proposal(held, self.seq.token_ids, 1).drafts is not None for held in self.held)

    def evict(self) -> Evicted:
        """Drop the proposals the committed tokens contradict or used up; they can never be verified."""
        kept, stale, predrafts = [], 0, 0
        for held in self.held:
            match = match_proposal(held, self.seq.token_ids, 1)
            if not (match.contradicted or match.exhausted):
                kept.append(held)
            elif match.contradicted and not held.used:
                stale += not held.assumed
                predrafts += bool(held.assumed)
        self.held = kept
        return Evicted(stale, predrafts)

    def forget(self) -> None:
        """A new stream: nothing was told or proposed on it yet, and the features held are not sent."""
        self.told_len = 0
        self.asked.clear()
        self.held.clear()
        self.features.clear()

    def keep_features(self, first: int, rows: torch.Tensor) -> None:
        """Feature rows [R, layers, hidden] of positions first.. for the next Extend; a row that would
        leave a gap drops the ones held (the drafter is told where the rows start)."""
        held_end = self.features_from + sum(len(r) for r in self.features)
        if not self.features or first != held_end:
            self.features.clear()
            self.features_from = first
        self.features.append(rows)

    def take_features(self, end: int) -> tuple[int, torch.Tensor | None]:
        """The held rows of positions features_from .. end - 1, with the first one's position; None when
        they do not reach end - 1 (a step ran without capturing): the Extend then carries none."""
        rows = torch.cat(self.features)[: end - self.features_from] if self.features else None
        self.features.clear()
        if rows is None or self.features_from + len(rows) != end or not len(rows):
            return 0, None
        return self.features_from, rows
