"""A step's draft plan: the drafts each running sequence verifies, decided once per step.

Speculator.schedule matches each sequence's proposals and cuts them to the sequence's cap and the
step's budget. The runner, the step's metrics and the usage accounting all read the plan; nothing
matches drafts again later in the step.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from target_service.sequence import Sequence
from target_service.speculation.proposals import HeldProposal
from target_service.step_items import Chunk, Drafts


@dataclass(frozen=True, slots=True)
class PlannedDrafts:
    """One running sequence's part of the plan."""

    seq: Sequence
    cap: int  # the most drafts it can verify: its k, the tokens it may still add, its KV room; 0 if not speculating
    drafts: Drafts | None  # matched, at most the cap, and once taken at most the budget
    awaiting: bool  # it can verify drafts, has none, and the drafter has not answered its prefix yet
    source: HeldProposal | None = None  # the held proposal the drafts come from

    @property
    def cached(self) -> bool:
        """The drafts come from a pre-draft: the speculation cache had them when the step began."""
        return self.drafts is not None and self.source is not None and bool(self.source.assumed)

    @property
    def num_drafts(self) -> int:
        return 0 if self.drafts is None else len(self.drafts.tokens)

    def chunk(self) -> Chunk:
        return self.seq.running_chunk(self.drafts)


@dataclass(frozen=True, slots=True)
class DraftPlan:
    entries: tuple[PlannedDrafts, ...]

    @property
    def seqs(self) -> list[Sequence]:
        return [e.seq for e in self.entries]

    @property
    def caps(self) -> list[int]:
        return [e.cap for e in self.entries]

    @property
    def available(self) -> list[int]:
        """The drafts each sequence has in hand, up to its cap."""
        return [e.num_drafts for e in self.entries]

    @property
    def awaiting(self) -> bool:
        return any(e.awaiting for e in self.entries)

    @property
    def num_tokens(self) -> int:
        """Rows of the step's forward pass: each sequence's last token and its drafts."""
        return sum(1 + e.num_drafts for e in self.entries)

    def within(self, budgets: list[int]) -> DraftPlan:
        """The same plan with at most budgets[i] drafts for sequence i."""
        return DraftPlan(tuple(replace(e, drafts=e.drafts.first(budget)) if e.drafts else e
                               for e, budget in zip(self.entries, budgets, strict=True)))

    def chunks(self) -> list[Chunk]:
        return [e.chunk() for e in self.entries]
