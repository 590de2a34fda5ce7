"""The drafting loop: each stream's sequences, the target's updates applied to them, batched rounds.

Updates are applied on the event loop as they arrive; they only edit token lists and mark the
sequence dirty. One loop task then runs rounds: it snapshots every dirty sequence, drafts them
all in one batch on the drafter's thread (a lookup drafter's round that opens or closes nothing,
on the event loop), and queues the proposals on each sequence's stream. Updates that arrive during
a round, or in the loop's pass between two rounds, make their sequences dirty again, so the next
round drafts from the newest prefix; a proposal for a prefix that moved on is still sent, since
the target salvages stale drafts by base_len.

Every Open and Extend gets an answer, so that the target knows it need not wait: a round's drafts,
or an empty proposal ("nothing for this prefix") for a refused Open, an Extend of a refused
sequence (unless the same update closes it), a job over the drafter's budget, a round that
failed, or a round that left the sequence behind (it prefilled only a chunk of its long prompt,
or it waited while another's chunk ran: it is drafted again in the next round, with no update
needed); or, for a sequence whose target keeps pre-drafts, the pre-draft already sent for
exactly the tokens the Extend committed. The exception is a paused sequence (an Extend set its k
to 0): the target will verify no drafts of its prefixes, so it is neither drafted nor answered
until an Extend asks for drafts again.

Rounds are ordered: fresh prefixes, which no sent proposal covers, first, all in one batch; when
none waits, the pre-drafts of the outcomes of the proposals the target is verifying (predraft.py),
best expected gain first, all in one batch, and over a long link one more such round per level of
pre-drafts the target's timing asks for. An update that brings fresh work stops a running
pre-draft round at its next forward pass: its pre-drafts go out with the tokens drafted so far,
and the fresh round starts at once instead of after the whole pre-draft round.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from draft_service.drafter import DraftJob, DraftSequence, Drafter, Drafted, SeqKey, never, sampling_of
from draft_service.features import SequenceFeatures
from draft_service.grammars import DraftGrammars
from draft_service.metrics import DraftMetrics
from draft_service.predraft import Predrafter
from tandem_kernels.sampling import Sampling
from tandem.hidden_states import FeatureError, extend_feature_rows
from tandem.structured import Constraint, ConstraintError
from tandem.v1 import drafter_pb2

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Limits:
    """What an Open or Extend must fit."""

    vocab_size: int
    max_model_len: int
    max_k: int
    num_slots: int
    max_seqs_per_target: int = 0  # sequences one stream (one target) may hold; 0: up to num_slots
    lookahead: bool = True  # over a link longer than a step, fresh lookup drafts run up to max_k


@dataclass(slots=True)
class Stream:
    """One Speculate stream (one target): its sequences, and the messages waiting to be sent."""

    id: int
    sequences: dict[int, DraftSequence] = field(default_factory=dict)
    # Sequences whose Open was refused: their later Extends and Close are dropped without a count.
    refused: set[int] = field(default_factory=set)
    # Empty proposals for refused sequences, sent when the update that asked is applied.
    undrafted: list[drafter_pb2.DraftProposal] = field(default_factory=list)
    outbox: asyncio.Queue[drafter_pb2.DraftProposals | None] = field(default_factory=asyncio.Queue)


class InvalidUpdate(ValueError):
    """An Open, Extend or Close that cannot be applied; `reason` labels the metric."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


@dataclass(slots=True)
class SlotOp:
    """An open or close for the drafter's thread, applied in arrival order before the next round."""

    key: SeqKey
    opening: bool
    sequence: DraftSequence | None = None  # an opening's sequence, whose constraint is compiled then
    committed: list[int] = field(default_factory=list)  # settled with it: an opening's prompt, a closing's last tokens


@dataclass(slots=True)
class Round:
    """One batched draft: fresh prefixes, or, when none waits, pre-drafts."""

    jobs: list[DraftJob]
    predraft: bool
    # The committed tokens of every sequence whose tokens changed, for Drafter.settle before drafting.
    settled: list[tuple[DraftSequence, list[int]]]


class DraftScheduler:
    def __init__(self, drafter: Drafter, metrics: DraftMetrics, limits: Limits,
                 max_fanout: int = 0, guesses: int = 1, grammars: DraftGrammars | None = None,
                 max_predraft_depth: int = 1):
        """max_fanout: outcomes pre-drafted per proposal at most; -1: all of them, 0: none.
        guesses: the drafter's guesses at each recovered token; with the bonus outcome, k * guesses + 1 in all.
        grammars: compiles structured-output constraints; without it, constrained sequences are refused.
        max_predraft_depth: verifications ahead that pre-drafts reach at most (a target's timing sets how many)."""
        self._drafter = drafter
        self._grammars = grammars
        self._metrics = metrics
        self._limits = limits
        self._predrafter = Predrafter(limits.max_k * guesses + 1 if max_fanout < 0 else max_fanout, metrics,
                                      max_predraft_depth)
        # One thread: forwards never overlap, and the event loop stays free for Info, health and metrics.
        # A lookup drafter's rounds that open or close nothing run on the event loop instead: they take
        # microseconds, and the hop to the thread and back cost a fresh answer about 0.26 ms (p50, loopback).
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="drafter")
        self._streams: dict[int, Stream] = {}
        self._stream_ids = itertools.count(1)
        self._num_sequences = 0
        self._dirty: dict[SeqKey, DraftSequence] = {}
        self._slot_ops: list[SlotOp] = []
        self._wake = asyncio.Event()
        self._stop_predrafts = threading.Event()  # set on the event loop, polled on the drafter's thread
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="drafting-loop")

    async def drain(self, grace_seconds: float) -> None:
        """Ends every stream (the targets see it close and reconnect elsewhere); nothing else to finish."""
        for stream in self._streams.values():
            stream.outbox.put_nowait(None)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await asyncio.to_thread(self._executor.shutdown, wait=True)

    def open_stream(self) -> Stream:
        stream = Stream(next(self._stream_ids))
        self._streams[stream.id] = stream
        self._metrics.streams.inc()
        return stream

    def close_stream(self, stream: Stream) -> None:
        """The target is gone: free all its sequences."""
        for sequence in stream.sequences.values():
            self._release(sequence)
        stream.sequences.clear()
        self._predrafter.close_stream(stream.id)
        del self._streams[stream.id]
        self._metrics.streams.dec()
        self._wake.set()

    def apply(self, stream: Stream, update: drafter_pb2.TargetUpdate) -> None:
        """Opens, then Extends, then Closes: one update may open, extend and close a sequence.

        A refused Open, and an Extend of a refused sequence, are answered at once with nothing.
        """
        self._metrics.updates.inc()
        if update.step_interval_us:
            self._predrafter.on_timing(stream.id, update.draft_round_trip_us / 1e6, update.step_interval_us / 1e6)
        for kind, messages, handler in (("Open", update.opens, self._open),
                                        ("Extend", update.extends, self._extend),
                                        ("Close", update.closes, self._close)):
            for msg in messages:
                try:
                    handler(stream, msg)
                except InvalidUpdate as e:
                    self._metrics.count_invalid(e.reason)
                    log.warning("stream %d: skipped %s of sequence %d: %s", stream.id, kind, msg.seq_id, e)
        if stream.undrafted:
            self._metrics.proposals.inc(len(stream.undrafted))
            stream.outbox.put_nowait(drafter_pb2.DraftProposals(proposals=stream.undrafted))
            stream.undrafted = []
        if self._dirty or self._slot_ops:
            self._wake.set()
            self._stop_predrafts.set()

    def _open(self, stream: Stream, msg: drafter_pb2.SequenceOpen) -> None:
        if msg.seq_id in stream.sequences:
            raise InvalidUpdate("duplicate_seq", "the sequence is already open")
        sampling = sampling_of(msg.sampling)
        try:
            self._check_open(stream, msg, sampling)
            constraint = self._constraint(msg)
        except InvalidUpdate:
            stream.refused.add(msg.seq_id)
            stream.undrafted.append(nothing_for(msg.seq_id, len(msg.prompt_ids)))
            raise
        stream.refused.discard(msg.seq_id)
        sequence = DraftSequence((stream.id, msg.seq_id), list(msg.prompt_ids), sampling, msg.k,
                                 accepts_assumed=msg.accepts_assumed, constraint=constraint,
                                 constrained_from=msg.constrained_from, prompt_len=msg.prompt_len or len(msg.prompt_ids),
                                 min_tokens=msg.sampling.min_tokens,
                                 min_tokens_banned=tuple(msg.sampling.min_tokens_banned_ids))
        if self._drafter.feature_layout is not None:
            sequence.features = SequenceFeatures(self._drafter.feature_layout)
        stream.sequences[msg.seq_id] = sequence
        self._predrafter.open(sequence)
        self._num_sequences += 1
        self._metrics.sequences.inc()
        self._slot_ops.append(SlotOp(sequence.key, opening=True, sequence=sequence,
                                     committed=sequence.tokens[:sequence.prompt_len]))
        self._dirty[sequence.key] = sequence

    def _check_open(self, stream: Stream, msg: drafter_pb2.SequenceOpen, sampling: Sampling) -> None:
        limits = self._limits
        if not msg.prompt_ids:
            raise InvalidUpdate("empty_prompt", "the prompt is empty")
        if len(msg.prompt_ids) > limits.max_model_len:
            raise InvalidUpdate("prompt_too_long",
                                f"{len(msg.prompt_ids)} prompt tokens exceed max_model_len={limits.max_model_len}")
        if not 1 <= msg.k <= limits.max_k:
            raise InvalidUpdate("bad_k", f"k={msg.k} is not in [1, max_k={limits.max_k}]")
        self._check_token_ids(msg.prompt_ids)
        self._check_token_ids(msg.sampling.min_tokens_banned_ids)
        if msg.prompt_len > len(msg.prompt_ids):
            raise InvalidUpdate("bad_prompt_len", f"prompt_len={msg.prompt_len} is past the {len(msg.prompt_ids)} "
                                                  "tokens sent")
        if (problem := sampling.problem(limits.vocab_size)) is not None:
            raise InvalidUpdate("bad_sampling", f"sampling.{problem.field} {problem.message}")
        if self._num_sequences >= limits.num_slots:
            raise InvalidUpdate("no_free_slot", f"all {limits.num_slots} slots are in use")
        if limits.max_seqs_per_target and len(stream.sequences) >= limits.max_seqs_per_target:
            raise InvalidUpdate("target_quota", f"this target holds {len(stream.sequences)} sequences, "
                                                f"max_seqs_per_target={limits.max_seqs_per_target}")

    def _constraint(self, msg: drafter_pb2.SequenceOpen) -> Constraint | None:
        """The Open's structured-output constraint, None without one; InvalidUpdate when it cannot be used."""
        try:
            constraint = Constraint.from_proto(msg.structured_outputs)
        except ConstraintError as err:
            raise InvalidUpdate("bad_constraint", str(err)) from err
        if constraint is not None and self._grammars is None:
            raise InvalidUpdate("bad_constraint", "this drafter does not draft under structured-output constraints")
        if constraint is not None and msg.constrained_from > len(msg.prompt_ids):
            raise InvalidUpdate("bad_constraint", f"constrained_from={msg.constrained_from} is past the "
                                                  f"{len(msg.prompt_ids)} tokens sent")
        return constraint

    def _check_token_ids(self, token_ids: Iterable[int]) -> None:
        if token_ids and max(token_ids) >= self._limits.vocab_size:
            raise InvalidUpdate("bad_token_id",
                                f"token id {max(token_ids)} is outside the vocabulary of {self._limits.vocab_size}")

    def _extend(self, stream: Stream, msg: drafter_pb2.SequenceExtend) -> None:
        sequence = self._find(stream, msg.seq_id)
        if sequence is None:  # refused: no round will draft it
            stream.undrafted.append(nothing_for(msg.seq_id, msg.start + len(msg.token_ids)))
            return
        if msg.start > len(sequence.tokens):
            raise InvalidUpdate("bad_start", f"start={msg.start} is past the sequence's {len(sequence.tokens)} tokens")
        self._check_token_ids(msg.token_ids)
        token_ids = list(msg.token_ids)
        if sequence.tokens[msg.start :] != token_ids:
            self._predrafter.on_extend(sequence, msg.start, token_ids, time.perf_counter())
            del sequence.tokens[msg.start :]
            sequence.tokens.extend(token_ids)
            if sequence.features is not None:
                sequence.features.rollback(msg.start)
            self._dirty[sequence.key] = sequence
        if msg.HasField("k"):
            self._set_k(sequence, msg.k)
        if msg.hidden_states:
            self._take_features(sequence, msg)

    def _set_k(self, sequence: DraftSequence, k: int) -> None:
        """The drafts per proposal the target now wants; the tokens of the Extend stand either way."""
        if k > sequence.open_k:
            raise InvalidUpdate("bad_k", f"k={k} is more than the Open's k={sequence.open_k}")
        if sequence.paused and k:
            self._dirty[sequence.key] = sequence  # drafting resumes from the committed tokens
        sequence.k = k

    def _take_features(self, sequence: DraftSequence, msg: drafter_pb2.SequenceExtend) -> None:
        """The Extend's feature rows into the sequence; the tokens stand even when they are refused."""
        layout = self._drafter.feature_layout
        if layout is None:
            raise InvalidUpdate("bad_hidden_states", "this drafter reads no hidden states; its Info names no layers")
        try:
            rows = layout.decode(msg.hidden_states, extend_feature_rows(msg.start, len(msg.token_ids),
                                                                        msg.hidden_start))
        except FeatureError as err:
            raise InvalidUpdate("bad_hidden_states", str(err)) from None
        if not bool(torch.isfinite(rows).all()):
            raise InvalidUpdate("bad_hidden_states", "hidden states hold NaN or infinity")
        sequence.features.write(msg.hidden_start, rows)
        self._dirty[sequence.key] = sequence

    def _close(self, stream: Stream, msg: drafter_pb2.SequenceClose) -> None:
        sequence = self._find(stream, msg.seq_id)
        if sequence is not None:
            del stream.sequences[msg.seq_id]
            self._release(sequence)
        elif msg.seq_id in stream.refused:  # the closing tail's nothing-answer: nobody awaits it
            stream.refused.discard(msg.seq_id)
            stream.undrafted = [p for p in stream.undrafted if p.seq_id != msg.seq_id]

    def _find(self, stream: Stream, seq_id: int) -> DraftSequence | None:
        """The open sequence, None for a refused one; InvalidUpdate for an id never opened."""
        sequence = stream.sequences.get(seq_id)
        if sequence is None and seq_id not in stream.refused:
            raise InvalidUpdate("unknown_seq", "no such open sequence on this stream")
        return sequence

    def _release(self, sequence: DraftSequence) -> None:
        sequence.closed = True
        self._dirty.pop(sequence.key, None)
        self._predrafter.close(sequence.key)
        self._slot_ops.append(SlotOp(sequence.key, opening=False, committed=list(sequence.tokens)))
        self._num_sequences -= 1
        self._metrics.sequences.dec()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._work()
            slot_ops, self._slot_ops = self._slot_ops, []
            self._stop_predrafts.clear()  # before the round is planned: later updates stop it
            work = self._next_round()
            began = time.perf_counter()
            try:
                if self._drafter.inline_rounds and not slot_ops:
                    drafts = self._round(slot_ops, work)
                else:
                    drafts = await loop.run_in_executor(self._executor, self._round, slot_ops, work)
            except Exception:
                self._metrics.errors.inc()
                log.exception("a drafting round of %d jobs failed", len(work.jobs))
                if work.predraft:
                    self._predrafter.on_failed_round()
                else:
                    self._deliver(work.jobs, [], 0.0)  # nothing for each of them: the target need not wait
                continue
            elapsed = time.perf_counter() - began
            if work.jobs:
                self._metrics.step_duration.observe(elapsed)
                self._metrics.batch_size.observe(len(work.jobs))
            if work.predraft:
                self._deliver_predrafts(drafts, elapsed)
            else:
                self._deliver(work.jobs, drafts, elapsed)
                self._redraft_behind(work.jobs)

    async def _work(self) -> None:
        """Returns after one pass of the event loop while there is work, so that the last round's
        answers go out and updates come in before a round that runs on the loop; otherwise waits
        for an update, counting the time as idle."""
        if self._dirty or self._slot_ops or self._predrafter.has_pending():
            await asyncio.sleep(0)
        else:
            self._metrics.idle.begin()
            try:
                await self._wake.wait()
            finally:
                self._metrics.idle.end()
        self._wake.clear()

    def _next_round(self) -> Round:
        """The changed sequences that no sent proposal covers, drafted afresh; when there are none, pre-drafts."""
        fresh: list[DraftJob] = []
        settled: list[tuple[DraftSequence, list[int]]] = []
        for sequence in self._dirty.values():
            if not sequence.tokens:  # rolled back to nothing: no prefix to draft from
                continue
            committed = list(sequence.tokens)
            settled.append((sequence, committed))
            if sequence.paused:
                self._predrafter.pause(sequence)
            elif not self._predrafter.covers(sequence):
                fresh.append(DraftJob(sequence, committed, reach=self._reach(sequence)))
        self._dirty.clear()
        if fresh:
            return Round(fresh, predraft=False, settled=settled)
        return Round(self._predrafter.take_jobs(), predraft=True, settled=settled)

    def _reach(self, sequence: DraftSequence) -> int:
        """The drafts a fresh job reaches for: max_k when its target's round trip spans a step (lookup
        drafters draft them for free; a model drafter ignores them), else 0 (its k)."""
        if not self._limits.lookahead or self._predrafter.spans(sequence.key[0]) < 2:
            return 0
        return self._limits.max_k

    def _round(self, slot_ops: list[SlotOp], work: Round) -> list[Drafted]:
        """On the drafter's thread: opens and closes in arrival order, then what the target committed, then a draft."""
        for op in slot_ops:
            if op.opening:  # the prompt first, so that a drafter told more before this round knows which is which
                self._drafter.open(op.key)
                self._drafter.settle(op.key, op.committed)
                if self._grammars is not None:
                    self._grammars.open(op.sequence)
                continue
            try:  # the tokens of its last Extend, which no round drafted from
                self._drafter.settle(op.key, op.committed, closing=True)
            finally:
                self._drafter.close(op.key)
        for sequence, committed in work.settled:
            self._drafter.settle(sequence.key, committed)
            DraftGrammars.settle(sequence, committed)
        jobs = [job for job in work.jobs if not job.sequence.undraftable]
        if not jobs:
            return []
        drafts = self._drafter.draft(jobs, stop=self._stop_predrafts.is_set if work.predraft else never)
        constrained = {job.sequence.key: job.sequence for job in jobs if job.sequence.constraint is not None}
        return DraftGrammars.constrain(drafts, constrained) if constrained else drafts

    def _deliver(self, jobs: list[DraftJob], drafts: list[Drafted], elapsed: float) -> None:
        """One DraftProposals message per stream, with an answer for every job: its draft, or nothing.

        Jobs of sequences closed meanwhile are dropped.
        """
        drafted = {draft.key: draft for draft in drafts}
        by_stream: dict[int, list[drafter_pb2.DraftProposal]] = {}
        for job in jobs:
            key = job.sequence.key
            if not job.sequence.closed:
                draft = drafted.get(key)
                self._predrafter.on_drafted(job, draft)
                proposal = draft.to_proto() if draft is not None else nothing_for(key[1], job.base_len)
                by_stream.setdefault(key[0], []).append(proposal)
        self._send(by_stream, elapsed)

    def _redraft_behind(self, jobs: list[DraftJob]) -> None:
        """The sequences the drafter left behind (a long prompt prefilled in chunks, or one that
        waited for such a chunk) are drafted in the next round, as if an update had come, and
        ahead of the sequences that updates made dirty meanwhile: they waited longer."""
        behind = set(self._drafter.behind())
        again = {job.sequence.key: job.sequence for job in jobs
                 if job.sequence.key in behind and not job.sequence.closed and not job.sequence.paused}
        if again:
            self._dirty = again | self._dirty
            self._wake.set()

    def _deliver_predrafts(self, drafts: list[Drafted], elapsed: float) -> None:
        """The pre-drafts still worth sending, one DraftProposals message per stream."""
        by_stream: dict[int, list[drafter_pb2.DraftProposal]] = {}
        for draft in self._predrafter.on_predrafted(drafts, time.perf_counter(), elapsed):
            by_stream.setdefault(draft.key[0], []).append(draft.to_proto())
            self._metrics.predraft_proposals.inc()
        self._send(by_stream, elapsed)

    def _send(self, by_stream: dict[int, list[drafter_pb2.DraftProposal]], elapsed: float) -> None:
        for stream_id, proposals in by_stream.items():
            self._metrics.proposals.inc(len(proposals))
            self._metrics.tokens.inc(sum(len(p.token_ids) for p in proposals))
            message = drafter_pb2.DraftProposals(proposals=proposals, draft_time_ns=int(elapsed * 1e9))
            self._streams[stream_id].outbox.put_nowait(message)


def nothing_for(seq_id: int, base_len: int) -> drafter_pb2.DraftProposal:
    """The empty proposal: the drafter has no drafts for this prefix, so the target need not wait."""
    return drafter_pb2.DraftProposal(seq_id=seq_id, base_len=base_len)
