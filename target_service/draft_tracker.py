"""The target's side of the drafter protocol, and each step's draft plan.

For every running sequence the tracker keeps what the drafter was told (Open, then Extends), what
it answered, and its proposals. The engine calls admit, plan, take, extend and release; the
drafter link calls on_proposals and reopen_all. All of it runs on the event loop.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import torch

from target_service.draft_messages import extend_message, open_message
from target_service.draft_plan import DraftPlan, PlannedDrafts
from target_service.drafts import (
    NO_MATCH,
    HeldProposal,
    InvalidProposal,
    Proposal,
    ProposalMatch,
    match_proposal,
    validate_proposal,
)
from target_service.metrics import TargetMetrics
from target_service.sequence import Sequence
from target_service.speculation import SpeculationPolicy
from tandem.v1 import drafter_pb2

log = logging.getLogger(__name__)


# Proposals a sequence keeps: the one under verification and the pre-drafts of its outcomes
# (k + 1 at most for k <= 16), with room for a fresh proposal beside them.
MAX_HELD_PROPOSALS = 20


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
    open_k: int = 0  # the k it was opened with: the most drafts per proposal an Extend may ask for
    told_k: int = 0  # the drafts per proposal it was last asked for; 0: paused
    answered_len: int = 0  # the last prefix length the drafter answered, with drafts or none
    held: list[HeldProposal] = field(default_factory=list)  # oldest first
    # Feature rows not yet sent, for a drafter that reads them: contiguous from position features_from.
    features: list[torch.Tensor] = field(default_factory=list)
    features_from: int = 0

    def keep(self, proposal: Proposal) -> None:
        self.held.append(HeldProposal(proposal))
        del self.held[:-MAX_HELD_PROPOSALS]

    def match(self, limit: int) -> tuple[ProposalMatch, HeldProposal | None]:
        """The held proposal whose drafts continue the committed tokens furthest (newest on ties).

        Each is a valid draw given the committed tokens, so the one with the most drafts left is
        worth the most.
        """
        best, source = NO_MATCH, None
        for held in self.held:
            match = match_proposal(held.proposal, self.seq.token_ids, limit)
            if match.drafts is not None and (best.drafts is None or len(match.drafts.tokens) >= len(best.drafts.tokens)):
                best, source = match, held
        return best, source

    def covers_committed(self) -> bool:
        """A held proposal has drafts for the committed tokens: the drafter owes no answer for them."""
        return any(match_proposal(h.proposal, self.seq.token_ids, 1).drafts is not None for h in self.held)

    def evict(self) -> Evicted:
        """Drop the proposals the committed tokens contradict or used up; they can never be verified."""
        kept, stale, predrafts = [], 0, 0
        for held in self.held:
            match = match_proposal(held.proposal, self.seq.token_ids, 1)
            if not (match.contradicted or match.exhausted):
                kept.append(held)
            elif match.contradicted and not held.used:
                stale += not held.proposal.assumed
                predrafts += bool(held.proposal.assumed)
        self.held = kept
        return Evicted(stale, predrafts)

    def forget(self) -> None:
        """A new stream: nothing was told or proposed on it yet, and the features held are not sent."""
        self.told_len = 0
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


class DraftTracker:
    """Each running sequence's drafter state, the messages that keep the drafter in step, and the plans."""

    def __init__(self, policy: SpeculationPolicy, metrics: TargetMetrics, *, vocab_size: int, max_len: int,
                 wake: Callable[[], None]):
        self.policy = policy
        self.metrics = metrics
        self.vocab_size = vocab_size
        self.max_len = max_len  # of the KV cache: no draft may run past it
        self.wake = wake  # called when proposals arrive, to end a wait for them
        self.link = None  # a DrafterLink, attached by the server when --drafter is set
        self._states: dict[int, DrafterState] = {}  # by seq_id, in admission order

    @property
    def connected(self) -> bool:
        return self.link is not None and self.link.connected

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The target layers whose features the connected drafter reads; empty for most drafters."""
        layout = self.link.feature_layout if self.connected else None
        return layout.layers if layout is not None else ()

    # ---- the engine's verbs -----------------------------------------------------------------

    def admit(self, seqs: list[Sequence]) -> None:
        """Track newly admitted sequences, and open the speculating ones on the drafter.

        Called before their prefill, so that the drafter's prefill runs beside it.
        """
        for seq in seqs:
            self._states[seq.seq_id] = DrafterState(seq)
        self._send(opens=[self._open(self._states[seq.seq_id]) for seq in seqs if self._speculates(seq)])

    def plan(self, seqs: list[Sequence]) -> DraftPlan:
        """Each sequence's drafts, matched once and cut to its cap; no metrics yet, so it may be redone."""
        return DraftPlan(tuple(self._planned(self._states[seq.seq_id]) for seq in seqs))

    def take(self, plan: DraftPlan, budgets: list[int]) -> DraftPlan:
        """The drafts the step verifies: at most budgets[i] for sequence i. Counts misses and stale proposals.

        A sequence with no draft is a miss; one that its budget held to none is not. A proposal
        that the committed tokens contradict is dropped.
        """
        m = self.metrics
        for entry, budget in zip(plan.entries, budgets, strict=True):
            state = self._states[entry.seq.seq_id]
            m.draft_cache_held.observe(len(state.held))
            evicted = state.evict()
            if evicted.stale:
                m.child(m.draft_stale, outcome="dropped").inc(evicted.stale)
            m.draft_cache_evicted.inc(evicted.predrafts)
            if entry.cap == 0:
                continue
            if entry.drafts is None:
                m.draft_miss.inc()
            elif budget > 0:
                entry.source.used = True
                if entry.cached:
                    m.draft_cache_hits.inc()
                if entry.drafts.salvaged:
                    m.child(m.draft_stale, outcome="salvaged").inc()
        return plan.within(budgets)

    def extend(self, seqs: list[Sequence]) -> None:
        """Tell the drafter the tokens these sequences committed, in one update, and how many drafts
        the policy now wants of them (SpeculationPolicy.drafts_to_request) where that changed."""
        now = time.perf_counter()
        extends = []
        owed = False  # an answer: a fresh proposal, unless a held pre-draft covers the new prefix
        wanted = self._drafts_wanted()
        for seq in [s for s in seqs if s.finish is None]:
            state = self._states[seq.seq_id]
            if state.told_len and len(seq.token_ids) > state.told_len:
                message = extend_message(seq, state.told_len)
                first, rows = state.take_features(len(seq.token_ids) - 1)
                if rows is not None:
                    message.hidden_start = first
                    message.hidden_states = self.link.feature_layout.encode(rows)
                    self.metrics.hidden_state_bytes.inc(len(message.hidden_states))
                k = min(wanted[seq.seq_id], state.open_k)
                if k != state.told_k:
                    message.k = state.told_k = k
                extends.append(message)
                state.told_len, state.told_at = len(seq.token_ids), now
                if k == 0:  # paused: the drafter answers nothing, and no step waits for it
                    state.answered_len = len(seq.token_ids)
                owed |= k > 0 and not state.covers_committed()
        self._send(extends=extends, answer_owed=owed)

    def _drafts_wanted(self) -> dict[int, int]:
        """The drafts the policy wants of each running sequence (by seq_id) for its next steps."""
        running = [state.seq for state in self._states.values() if state.seq.finish is None]
        wanted = self.policy.drafts_to_request([seq.draft_record for seq in running],
                                               [self._cap(seq) for seq in running])
        self.metrics.drafts_requested.set(sum(wanted) / len(wanted) if wanted else 0)
        return {seq.seq_id: k for seq, k in zip(running, wanted)}

    def keep_features(self, seq: Sequence, first: int, rows: torch.Tensor) -> None:
        """A step's features of seq's positions first.. (rows [R, layers, hidden]); the committed ones
        go with its next Extend."""
        state = self._states.get(seq.seq_id)
        end = len(seq.token_ids) - 1  # the last committed token has no feature yet
        if state is not None and state.told_len and end > first:
            state.keep_features(first, rows[: end - first])

    def release(self, seq: Sequence) -> None:
        """Forget the sequence, and close it on the drafter if this stream opened it."""
        state = self._states.pop(seq.seq_id, None)
        if state is not None and state.told_len:
            self._send(closes=[drafter_pb2.SequenceClose(seq_id=seq.seq_id)])

    # ---- the link's verbs -------------------------------------------------------------------

    def reopen_all(self) -> drafter_pb2.TargetUpdate:
        """After a (re)connect: every running sequence, opened with its committed tokens.

        The new stream knows only the sequences opened on it, so the others (finished ones not yet
        released) must send it no Extend or Close.
        """
        for state in self._states.values():
            state.forget()
        return drafter_pb2.TargetUpdate(opens=[self._open(state) for state in self._states.values()
                                               if state.seq.finish is None and self._speculates(state.seq)])

    def on_proposals(self, message: drafter_pb2.DraftProposals, wire_bytes: int) -> None:
        """Called on the event loop by the drafter link for every message it receives."""
        now = time.perf_counter()
        self.metrics.draft_wire_bytes.inc(wire_bytes)
        self.policy.observe_answer()
        for msg in message.proposals:
            state = self._states.get(msg.seq_id)
            if state is None or state.seq.finish is not None:
                continue  # closed meanwhile: not the drafter's fault
            self._receive(state, msg, now)
        self.wake()

    # ---- internals ----------------------------------------------------------------------------

    def _speculates(self, seq: Sequence) -> bool:
        return seq.options.speculate and seq.options.num_speculative_tokens > 0 and self.connected

    def _cap(self, seq: Sequence) -> int:
        """The most drafts this sequence can verify: its k, the tokens it may still add, the cache."""
        if not self._speculates(seq):
            return 0
        return max(0, min(seq.options.num_speculative_tokens, seq.remaining_tokens - 1,
                          self.max_len - len(seq.token_ids)))

    def _planned(self, state: DrafterState) -> PlannedDrafts:
        seq = state.seq
        cap = self._cap(seq)
        match, source = state.match(cap)
        awaiting = cap > 0 and match.drafts is None and state.answered_len != len(seq.token_ids)
        return PlannedDrafts(seq=seq, cap=cap, drafts=match.drafts, awaiting=awaiting, source=source)

    def _receive(self, state: DrafterState, msg: drafter_pb2.DraftProposal, now: float) -> None:
        """Note the answer; keep the proposal if it is valid, count it by reason if not."""
        seq = state.seq
        if not msg.assumed_ids:  # a pre-draft answers the prefix it assumes, once that is committed
            state.answered_len = max(state.answered_len, min(msg.base_len, len(seq.token_ids)))
        if not msg.token_ids:
            return  # nothing for this prefix
        try:
            proposal = validate_proposal(msg, seq, self.vocab_size, self.link.max_k, self.link.probs_top_k, now,
                                         accepts_assumed=self.policy.accepts_predrafts)
        except InvalidProposal as err:
            self.metrics.child(self.metrics.draft_rejected, reason=err.reason).inc()
            log.debug("dropped a proposal for %s: %s", seq.request_id, err)
            return
        if proposal.base_len == state.told_len and state.told_at is not None:
            self.metrics.draft_rtt.observe(now - state.told_at)
            self.policy.observe_draft_rtt(now - state.told_at)
        state.keep(proposal)
        if proposal.base_len == len(seq.token_ids) and state.covers_committed():
            state.answered_len = len(seq.token_ids)

    def _open(self, state: DrafterState) -> drafter_pb2.SequenceOpen:
        seq = state.seq
        state.told_len, state.told_at = len(seq.token_ids), time.perf_counter()
        state.open_k = state.told_k = min(seq.options.num_speculative_tokens, self.link.max_k)
        return open_message(seq, state.open_k, accepts_assumed=self.policy.accepts_predrafts)

    def _send(self, opens: Collection[drafter_pb2.SequenceOpen] = (),
              extends: Collection[drafter_pb2.SequenceExtend] = (),
              closes: Collection[drafter_pb2.SequenceClose] = (), answer_owed: bool = True) -> None:
        """answer_owed: whether the drafter owes an answer for the extends (it does for opens, not closes)."""
        if not self.connected or not (opens or extends or closes):
            return
        if opens or (extends and answer_owed):
            self.policy.observe_update_sent(time.perf_counter())
        self.link.send(drafter_pb2.TargetUpdate(opens=opens, extends=extends, closes=closes))
