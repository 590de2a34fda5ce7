"""The Speculator: the one object the target's engine talks to about drafts.

It owns the speculation policy, each running sequence's DrafterState (what the drafter was told,
what it answered, the proposals it holds) and the link to the drafter. The engine calls:

  admit(seqs)               open the new sequences on the drafter, before their prefill
  schedule(seqs, ...)       the step's DraftPlan: matched, budgeted and waited for, decided once
  account(plan, ...)        the verifier's verdicts and the step's cost, for usage, metrics and policy
  publish(seqs, ...)        tell the drafter the committed tokens (and, in sync mode, wait for drafts)
  keep_features(seq, ...)   hold a prompt chunk's target features for the Extend after its first token
  release(seq)              close a finished sequence on the drafter

The link calls on_proposals and reopen_all (the DrafterPeer protocol). Nothing else calls the
policy. All of it runs on the event loop. A target started without a drafter (no link) has nothing
to plan, count or tell: admit, schedule, account and publish return at once. A step in which no
sequence can verify drafts (the drafter is away, or no request asked for speculation) plans and
measures nothing either, and a drafter that is away is told nothing until it is back.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Collection
from dataclasses import replace
from typing import Protocol

import torch

from target_service.metrics import TargetMetrics
from target_service.step_items import ChunkResult
from target_service.sequence import Output, Sequence
from target_service.speculation.drafter_state import DrafterState
from target_service.speculation.local_drafts import LocalDrafts
from target_service.speculation.messages import extend_message, open_message
from target_service.speculation.plan import DraftPlan, PlannedDrafts
from target_service.speculation.policy import SpeculationPolicy
from target_service.speculation.proposals import InvalidProposal, match_proposal, validate_proposal
from target_service.speculation.speed_guard import GuardFigures
from tandem.hidden_states import FeatureLayout
from tandem.v1 import drafter_pb2

log = logging.getLogger(__name__)

PAUSED_EXTEND_TOKENS = 16  # committed tokens per Extend while a sequence stays paused


class DrafterPeer(Protocol):
    """What a link tells its owner: every message from the drafter, and each (re)connect."""

    def on_proposals(self, message: drafter_pb2.DraftProposals, wire_bytes: int) -> None: ...

    def reopen_all(self) -> drafter_pb2.TargetUpdate: ...


class Link(Protocol):
    """The stream to the drafter (DrafterLink; a fake one in tests)."""

    connected: bool
    feature_layout: FeatureLayout | None
    info: drafter_pb2.DrafterInfo | None

    @property
    def max_k(self) -> int: ...

    @property
    def probs_top_k(self) -> int: ...

    def send(self, update: drafter_pb2.TargetUpdate) -> None: ...


class Speculator:
    def __init__(self, policy: SpeculationPolicy, metrics: TargetMetrics, *, vocab_size: int, max_len: int,
                 connect: Callable[[DrafterPeer], Link] | None = None, local_drafts: LocalDrafts | None = None):
        """connect: makes the link to the drafter, given this speculator as its peer; None: no drafter.
        local_drafts: the target's own lookup, for the steps the drafter's proposals miss; None: off."""
        self.policy = policy
        self.local_drafts = local_drafts
        self.metrics = metrics
        self.vocab_size = vocab_size
        self.max_len = max_len  # of the KV cache: no draft may run past it
        self._states: dict[int, DrafterState] = {}  # by seq_id, in admission order
        self._news = asyncio.Event()  # proposals arrived, or a request did: a wait for drafts looks again
        self._guard_figures = GuardFigures()  # the speed guard's figures as the metrics last counted them
        self.link = connect(self) if connect is not None else None

    @property
    def connected(self) -> bool:
        return self.link is not None and self.link.connected

    @property
    def drafter_model(self) -> str | None:
        """The connected drafter's model; None when no drafter is connected."""
        return self.link.info.model if self.connected and self.link.info is not None else None

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The target layers whose features the connected drafter reads; empty for most drafters."""
        layout = self.link.feature_layout if self.connected else None
        return layout.layers if layout is not None else ()

    def notify(self) -> None:
        """Something a wait for drafts should look at again happened (a request arrived)."""
        self._news.set()

    # ---- the engine's verbs -----------------------------------------------------------------

    def admit(self, seqs: list[Sequence]) -> None:
        """Track newly admitted sequences, and open the speculating ones on the drafter.

        Called before their prefill, so that the drafter's prefill runs beside it.
        """
        if self.link is None:
            return
        for seq in seqs:
            self._states[seq.seq_id] = DrafterState(seq, record=self.policy.new_record())
        self._send(opens=[self._open(self._states[seq.seq_id]) for seq in seqs if self._speculates(seq)])

    async def schedule(self, seqs: list[Sequence], admission: Callable[[], bool]) -> DraftPlan:
        """The drafts each sequence verifies this step: its budget (the policy's, decided once from
        the caps), waited for where missing, and cut to the budget. Counts misses and stale proposals.

        admission: whether a prompt waits (to be admitted, or for its next chunk), which ends the wait
        when the policy says so.
        """
        if self.link is None:
            return DraftPlan(tuple(PlannedDrafts(seq=seq, cap=0, drafts=None, awaiting=False) for seq in seqs))
        states = [self._states[seq.seq_id] for seq in seqs]
        plan = self._plan(states)
        if not any(plan.caps):  # the drafter is away, or no sequence asked for speculation
            return plan
        budgets = self.policy.draft_limits([state.record for state in states], plan.caps)
        plan = await self._wait_for_drafts(plan, budgets, admission)
        return self._take(states, plan, budgets)

    def account(self, plan: DraftPlan, results: list[ChunkResult], outputs: list[Output | None], seconds: float,
                cycle: float) -> None:
        """The step's verdicts: results[i] is entry i's, outputs[i] what it committed (None if it ended
        before). Usage and metrics count the accepted drafts that were committed, as a stop discards
        the rest; the policy learns from the verifier's verdict, which judges the drafter, not the stop.
        seconds: the forward pass; cycle: the step's whole cycle since the last one's account.
        """
        if not any(plan.caps):
            self.policy.skip_step()
            return
        self.policy.observe_step(plan.num_tokens, seconds, len(plan.seqs))
        fixed, per_token = self.policy.cost_model()
        self.metrics.step_fixed_cost.set(fixed)
        self.metrics.step_token_cost.set(per_token)
        self._observe_cycle(plan, outputs, cycle)
        m = self.metrics
        verified = drafted = 0
        accepted_at: list[int] = []  # sequences whose draft at each position was accepted
        for entry, result, output in zip(plan.entries, results, outputs, strict=True):
            if output is None or not entry.num_drafts:
                continue
            seq, accepted = entry.seq, output.num_accepted
            self.policy.observe_verify(result.num_accepted, entry.num_drafts, self._states[seq.seq_id].record)
            seq.count_draft_step(entry.num_drafts, accepted)
            verified, drafted = verified + 1, drafted + entry.num_drafts
            m.acceptance_length.observe(accepted + 1)
            accepted_at.extend([0] * (accepted - len(accepted_at)))
            for position in range(accepted):
                accepted_at[position] += 1
        if verified:  # the counters once per step, not once per sequence
            m.num_drafts.inc(verified)
            m.num_draft_tokens.inc(drafted)
            m.num_accepted_tokens.inc(sum(accepted_at))
            for position, count in enumerate(accepted_at):
                if count:
                    m.child(m.accepted_per_pos, position=str(position)).inc(count)

    def _observe_cycle(self, plan: DraftPlan, outputs: list[Output | None], cycle: float) -> None:
        """The speed guard's view of the step: a sequence speculated in it if it could verify drafts,
        the guard allowed it, and the drafter was drafting for it."""
        states = [self._states[seq.seq_id] for seq in plan.seqs]
        records = [state.record for state in states]
        allowed = self.policy.allowed(records)
        speculating = [ok and entry.cap > 0 and state.told_k > 0
                       for ok, entry, state in zip(allowed, plan.entries, states, strict=True)]
        tokens = [len(output.token_ids) if output is not None else 0 for output in outputs]
        self.policy.observe_cycle(records, speculating, tokens, cycle)
        figures = replace(self.policy.guard.figures)
        self.metrics.observe_guard(self._guard_figures, figures, self.policy.guard.speedup)
        self._guard_figures = figures

    async def publish(self, seqs: list[Sequence], results: list[ChunkResult], firsts: list[int]) -> None:
        """Tell the drafter the tokens these sequences committed, with the features of those
        positions (results[i].features start at position firsts[i]) for a drafter that reads them.

        The synchronous baseline then waits for the drafts of the new prefixes.
        """
        if not self.connected:  # nothing to tell: a reconnect reopens every sequence, with no features held
            self.metrics.drafts_requested.set(0)
            return
        for seq, result, first in zip(seqs, results, firsts, strict=True):
            if result.features is not None:
                self.keep_features(seq, first, result.features)
        if self._extend(seqs):  # the next step may wait for the answer: the link hands the update to gRPC
            await asyncio.sleep(0)  # now, not after that step's planning (0.29 -> 0.10 ms, p50 on loopback)
        if self.policy.drafts_before_publish:
            live = [self._states[s.seq_id] for s in seqs if s.finish is None]
            plan = self._plan(live)
            await self._wait_for_drafts(plan, plan.caps, admission=lambda: False)

    def release(self, seq: Sequence) -> None:
        """Forget the sequence, and close it on the drafter if this stream opened it, in the update
        that tells it the tokens it was not told (the last step's, a paused sequence's tail): a
        suffix drafter indexes the whole output, a model drafter keeps the slot with the most of it."""
        if self.local_drafts is not None:
            self.local_drafts.release(seq.seq_id)
        state = self._states.pop(seq.seq_id, None)
        if state is None or not state.told_len or not self.connected:
            return
        state.features.clear()  # nothing is drafted from them any more
        tail = [self._told(state, 0, time.perf_counter())] if len(seq.token_ids) > state.told_len else []
        self._send(extends=tail, closes=[drafter_pb2.SequenceClose(seq_id=seq.seq_id)], answer_owed=False)

    # ---- the link's verbs (DrafterPeer) ------------------------------------------------------

    def reopen_all(self) -> drafter_pb2.TargetUpdate:
        """After a (re)connect: every running sequence, opened with its committed tokens.

        The new stream knows only the sequences opened on it, so the others (finished ones not yet
        released) must send it no Extend or Close.
        """
        for state in self._states.values():
            state.forget()
        self.policy.new_drafter([state.record for state in self._states.values()])
        return self._update(opens=[self._open(state) for state in self._states.values()
                                   if state.seq.finish is None and self._speculates(state.seq)])

    def on_proposals(self, message: drafter_pb2.DraftProposals, wire_bytes: int) -> None:
        """Every message the link receives, on the event loop."""
        now = time.perf_counter()
        self.metrics.draft_wire_bytes.inc(wire_bytes)
        self.policy.observe_answer()
        for msg in message.proposals:
            state = self._states.get(msg.seq_id)
            if state is None or state.seq.finish is not None:
                continue  # closed meanwhile: not the drafter's fault
            self._receive(state, msg, now)
        self._news.set()

    # ---- planning and waiting ------------------------------------------------------------------

    def _plan(self, states: list[DrafterState]) -> DraftPlan:
        """Each sequence's drafts, matched and cut to its cap; no metrics yet, so it may be redone."""
        return DraftPlan(tuple(self._planned(state) for state in states))

    def _planned(self, state: DrafterState) -> PlannedDrafts:
        seq = state.seq
        cap = self._cap(seq)
        match, source = state.match(cap)
        # Where nothing the drafter sent continues the tokens, and it was asked to draft: the target's own lookup.
        if match.drafts is None and cap > 0 and state.told_k > 0 and self.local_drafts is not None:
            if (own := self.local_drafts.propose(seq, cap)) is not None:
                match, source = match_proposal(own, seq.token_ids, cap), own
        awaiting = cap > 0 and match.drafts is None and state.answered_len != len(seq.token_ids)
        return PlannedDrafts(seq=seq, cap=cap, drafts=match.drafts, awaiting=awaiting, source=source)

    async def _wait_for_drafts(self, plan: DraftPlan, budgets: list[int], admission: Callable[[], bool]) -> DraftPlan:
        """Wait a bounded time while a sequence with a budget awaits drafts; the plan as the wait leaves it.

        No wait while the drafter has left an update unanswered past its patience (hung or busy).
        A request to admit ends the wait when the policy says so: waiting then never delays a prefill.
        """
        if not _awaits(plan, budgets):
            return plan
        started = time.perf_counter()
        awaiting = [self._states[e.seq.seq_id] for e, budget in zip(plan.entries, budgets, strict=True)
                    if e.awaiting and budget > 0]
        asked_at = max(state.told_at or started for state in awaiting)
        # The wait holds up every sequence of the step; only the awaiting ones, and only where the answer
        # carries drafts, gain from it: the expected share of the step's sequences that it brings drafts to.
        drafted = sum(self.policy.drafted_share(state.record) for state in awaiting) / len(plan.entries)
        deadline = self.policy.wait_deadline(started, asked_at, drafted)
        slept = False
        while _awaits(plan, budgets):
            remaining = deadline - time.perf_counter()
            if remaining <= 0 or (self.policy.admission_ends_wait and admission()):
                break
            slept = True
            self._news.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._news.wait(), remaining)
            plan = self._plan([self._states[seq.seq_id] for seq in plan.seqs])
        if slept:
            self.metrics.draft_wait.observe(time.perf_counter() - started)
        return plan

    def _take(self, states: list[DrafterState], plan: DraftPlan, budgets: list[int]) -> DraftPlan:
        """The drafts the step verifies: at most budgets[i] for sequence i. Counts misses and stale proposals.

        A sequence with no draft is a miss; one that its budget held to none is not. A proposal
        that the committed tokens contradict is dropped.
        """
        m = self.metrics
        stale = predrafts = missed = hits = salvaged = local = 0  # counted once per step, as in account
        for state, entry, budget in zip(states, plan.entries, budgets, strict=True):
            m.draft_cache_held.observe(len(state.held))
            evicted = state.evict()
            stale, predrafts = stale + evicted.stale, predrafts + evicted.predrafts
            if entry.cap == 0 or budget == 0:
                continue
            if entry.drafts is None:
                missed += 1
            else:
                entry.source.used = True
                hits += entry.cached
                salvaged += entry.drafts.salvaged
                local += entry.source.local
        for metric, count in ((m.draft_cache_evicted, predrafts), (m.draft_miss, missed), (m.draft_cache_hits, hits),
                              (m.draft_local, local)):
            if count:
                metric.inc(count)
        for outcome, count in (("dropped", stale), ("salvaged", salvaged)):
            if count:
                m.child(m.draft_stale, outcome=outcome).inc(count)
        return plan.within(budgets)

    # ---- telling the drafter ---------------------------------------------------------------------

    def _extend(self, seqs: list[Sequence]) -> bool:
        """The tokens these sequences committed, in one update, and how many drafts the policy now
        wants of them (SpeculationPolicy.drafts_to_request) where that changed. A sequence that stays
        paused is told its tokens PAUSED_EXTEND_TOKENS at a time, or with the update that asks it
        for drafts again: an update per step costs the target's step (measured, docs/benchmarks-speculation.md).
        Whether the drafter owes an answer to what was sent."""
        now = time.perf_counter()
        extends = []
        owed = False  # an answer: a fresh proposal, unless a held pre-draft covers the new prefix
        untold = [(seq, self._states[seq.seq_id]) for seq in seqs if seq.finish is None]
        untold = [(seq, state) for seq, state in untold if state.told_len and len(seq.token_ids) != state.told_len]
        if not untold:  # no sequence open on the drafter has news
            self.metrics.drafts_requested.set(0)
            return False
        wanted = self._drafts_wanted()
        for seq, state in untold:
            k = min(wanted[seq.seq_id], state.open_k)
            if k == 0:  # paused: the drafter answers nothing, and no step waits for it
                state.answered_len = len(seq.token_ids)
                if state.told_k == 0 and len(seq.token_ids) - state.told_len < PAUSED_EXTEND_TOKENS:
                    continue
            extends.append(self._told(state, k, now))
            owed |= k > 0 and not state.covers_committed()
        self._send(extends=extends, answer_owed=owed)
        return owed

    def _told(self, state: DrafterState, k: int, now: float) -> drafter_pb2.SequenceExtend:
        """The Extend of the sequence's untold tokens (with their features, where kept), leaving k."""
        seq = state.seq
        message = extend_message(seq, state.told_len)
        first, rows = state.take_features(len(seq.token_ids) - 1)
        if rows is not None:
            message.hidden_start = first
            message.hidden_states = self.link.feature_layout.encode(rows)
            self.metrics.hidden_state_bytes.inc(len(message.hidden_states))
        if k != state.told_k:
            message.k = state.told_k = k
        state.tell(now)
        return message

    def _drafts_wanted(self) -> dict[int, int]:
        """The drafts the policy wants of each running sequence (by seq_id) for its next steps."""
        running = [state for state in self._states.values() if state.seq.finish is None]
        wanted = self.policy.drafts_to_request([state.record for state in running],
                                               [self._cap(state.seq) for state in running])
        self.metrics.drafts_requested.set(sum(wanted) / len(wanted) if wanted else 0)
        return {state.seq.seq_id: k for state, k in zip(running, wanted)}

    def keep_features(self, seq: Sequence, first: int, rows: torch.Tensor) -> None:
        """A step's features of seq's positions first.. (rows [R, layers, hidden]): a verify's, a
        prompt's or a chunk of it; the committed ones go with its next Extend."""
        if seq.finish is not None or not self.connected:  # a reconnect reopens it with no features held
            return
        state = self._states.get(seq.seq_id)
        end = len(seq.token_ids) - 1  # the last committed token has no feature yet
        if state is not None and state.told_len and end > first:
            state.keep_features(first, rows[: end - first])

    def _speculates(self, seq: Sequence) -> bool:
        return seq.options.speculate and seq.options.num_speculative_tokens > 0 and self.connected

    def _cap(self, seq: Sequence) -> int:
        """The most drafts this sequence can verify: its k, the tokens it may still add, the cache."""
        if not self._speculates(seq):
            return 0
        return max(0, min(seq.options.num_speculative_tokens, seq.remaining_tokens - 1,
                          self.max_len - len(seq.token_ids)))

    def _receive(self, state: DrafterState, msg: drafter_pb2.DraftProposal, now: float) -> None:
        """Note the answer; keep the proposal if it is valid, count it by reason if not."""
        seq = state.seq
        if not msg.assumed_ids:  # a pre-draft answers the prefix it assumes, once that is committed
            state.answered_len = max(state.answered_len, min(msg.base_len, len(seq.token_ids)))
            self.policy.observe_drafts_answer(bool(msg.token_ids), state.record)
        if not msg.token_ids:
            return  # nothing for this prefix
        try:
            proposal = validate_proposal(msg, seq, self.vocab_size, self.link.max_k, self.link.probs_top_k,
                                         accepts_assumed=self.policy.accepts_predrafts)
        except InvalidProposal as err:
            self.metrics.child(self.metrics.draft_rejected, reason=err.reason).inc()
            log.debug("dropped a proposal for %s: %s", seq.request_id, err)
            return
        if not proposal.assumed and (rtt := state.answered_after(proposal.base_len, now)) is not None:
            self.metrics.draft_rtt.observe(rtt)
            self.policy.observe_draft_rtt(rtt)
        state.keep(proposal)
        if proposal.base_len == len(seq.token_ids) and state.covers_committed():
            state.answered_len = len(seq.token_ids)

    def _open(self, state: DrafterState) -> drafter_pb2.SequenceOpen:
        seq = state.seq
        state.tell(time.perf_counter())
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
        self.link.send(self._update(opens=opens, extends=extends, closes=closes))

    def _update(self, **messages: Collection) -> drafter_pb2.TargetUpdate:
        """An update with the target's timing, by which the drafter sets how far ahead it pre-drafts."""
        return drafter_pb2.TargetUpdate(**messages, draft_round_trip_us=round(self.policy.late_round_trip() * 1e6),
                                        step_interval_us=round(self.policy.mean_cycle * 1e6))


def _awaits(plan: DraftPlan, budgets: list[int]) -> bool:
    """A sequence that the step would verify drafts of has none yet, and the drafter owes them."""
    return any(entry.awaiting and budget > 0 for entry, budget in zip(plan.entries, budgets, strict=True))
