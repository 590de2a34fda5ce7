"""The target's step loop: admit, prefill and emit at once, verify or decode, emit, tell the drafter.

All sequence state lives on the event loop's thread. Each step hands snapshots to the executor
thread, which runs the model, so streaming, health and metrics stay responsive during a step.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import grpc

from target_service.config import TargetConfig
from target_service.draft_messages import extend_message, open_message
from target_service.drafts import InvalidProposal, is_stale_mismatch, usable_drafts, validate_proposal
from target_service.errors import RequestError
from target_service.metrics import TargetMetrics
from target_service.sequence import FinishReason, Output, SamplingOptions, Sequence
from target_service.speculation import speculation_policy
from target_service.step import PrefillItem, StepRunner, Verified, VerifyItem
from target_service.stops import StopChecker
from tandem.detokenizer import IncrementalDetokenizer
from tandem.runtime import LoadedModel
from tandem.v1 import drafter_pb2

log = logging.getLogger(__name__)


class Engine:
    def __init__(self, loaded: LoadedModel, config: TargetConfig, metrics: TargetMetrics):
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.config = config
        self.metrics = metrics
        self.runner = StepRunner(loaded.model)
        self.kv_cache = loaded.model.kv_cache
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="target-step")
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.sequences: dict[int, Sequence] = {}
        self.policy = speculation_policy(config)
        self.link = None  # a DrafterLink, attached by the server when --drafter is set
        self._ids = itertools.count(1)
        self._work = asyncio.Event()
        self._wake = asyncio.Event()  # drafts arrived, or a request did
        self._accepting = True
        self._task: asyncio.Task | None = None

    # ---- requests ---------------------------------------------------------------------------

    def new_sequence(self, request_id: str, prompt_ids: list[int], options: SamplingOptions) -> Sequence:
        seq_id = next(self._ids)
        eos = frozenset() if options.ignore_eos else self.tokenizer.eos_token_ids
        return Sequence(
            seq_id=seq_id,
            request_id=request_id or f"req-{seq_id}",
            prompt_ids=prompt_ids,
            options=options,
            arrival=time.perf_counter(),
            detokenizer=IncrementalDetokenizer(
                self.tokenizer, skip_special_tokens=options.skip_special_tokens, context_ids=prompt_ids
            ),
            stops=StopChecker(options.stop, options.stop_token_ids | eos),
        )

    def submit(self, seq: Sequence) -> None:
        if not self._accepting:
            raise RequestError(grpc.StatusCode.UNAVAILABLE, "the server is shutting down")
        if len(self.waiting) - self._free_capacity() >= self.config.max_queue:
            raise RequestError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self.config.max_queue} requests are already waiting for a free slot "
                f"(--max-queue {self.config.max_queue}); retry later",
            )
        self.sequences[seq.seq_id] = seq
        self.waiting.append(seq)
        self.metrics.waiting.set(len(self.waiting))
        self._work.set()
        self._wake.set()

    def _free_capacity(self) -> int:
        """Requests the next step can admit: waiting for it is not queueing."""
        return min(self.config.max_num_seqs - len(self.running), self.kv_cache.num_free_slots)

    def abort(self, seq: Sequence) -> None:
        """Free the sequence here at once when it waits, or after the step that uses it when it runs."""
        if seq.finish is not None:
            return
        seq.finish = FinishReason.ABORT
        if seq in self.waiting:
            self.waiting.remove(seq)
            self._retire(seq)
        self._work.set()

    # ---- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="target-step-loop")

    async def drain(self, grace_seconds: float) -> None:
        """Refuse new requests and let running ones finish, up to the grace period."""
        self._accepting = False
        deadline = time.monotonic() + grace_seconds
        while self.sequences and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for seq in list(self.sequences.values()):
            self.abort(seq)  # a waiting one leaves the queue: the step loop must not prefill it
        self._release_finished()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self.executor.shutdown(wait=False, cancel_futures=True)

    # ---- the step loop ----------------------------------------------------------------------

    async def _run(self) -> None:
        while True:
            try:
                await self._step()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug in one step must not take the server down
                log.exception("step failed; aborting the running sequences")
                for seq in self.running:
                    self._finish(seq, FinishReason.ABORT)
                self._release_finished()

    async def _step(self) -> None:
        self._release_finished()
        if not self.running and not self.waiting:
            self._work.clear()
            await self._work.wait()
            return
        admitted = self._admit()
        if admitted:
            await self._prefill(admitted)
        decoding = [s for s in self.running if s.finish is None and s not in admitted]
        if decoding:
            await self._wait_for_drafts(decoding)
            await self._verify(decoding)

    def _admit(self) -> list[Sequence]:
        admitted = []
        while self.waiting and len(self.running) < self.config.max_num_seqs and self.kv_cache.num_free_slots:
            seq = self.waiting.popleft()
            seq.slot = self.kv_cache.allocate()
            seq.admitted_at = time.perf_counter()
            self.metrics.queue_time.observe(seq.admitted_at - seq.arrival)
            self.running.append(seq)
            admitted.append(seq)
        if admitted:
            # Before our prefill, so that the drafter's prefill runs beside it.
            self._send_update(opens=[self._open_message(s) for s in admitted if self._speculates(s)])
        self.metrics.waiting.set(len(self.waiting))
        self.metrics.running.set(len(self.running))
        return admitted

    async def _prefill(self, admitted: list[Sequence]) -> None:
        items = [PrefillItem(slot=s.slot, prompt_ids=s.prompt_ids, options=s.options) for s in admitted]
        started = time.perf_counter()
        tokens = await self._in_executor(self.runner.prefill, items)
        self.metrics.child(self.metrics.step, kind="prefill").observe(time.perf_counter() - started)
        self.metrics.prompt_tokens.inc(sum(len(s.prompt_ids) for s in admitted))
        outputs = self._commit(admitted, [Verified(tokens=[token], num_accepted=0) for token in tokens])
        await self._publish(admitted, outputs)

    async def _verify(self, decoding: list[Sequence]) -> None:
        budget = self.policy.draft_limit(len(decoding), [self._num_usable(s) for s in decoding])
        items = [self._verify_item(s, budget) for s in decoding]
        kind = "verify" if any(i.num_drafts for i in items) else "decode"
        started = time.perf_counter()
        results = await self._in_executor(self.runner.verify, items)
        elapsed = time.perf_counter() - started
        self.metrics.child(self.metrics.step, kind=kind).observe(elapsed)
        self.policy.observe_step(sum(1 + i.num_drafts for i in items), elapsed)
        live = [(seq, item, result) for seq, item, result in zip(decoding, items, results) if seq.finish is None]
        seqs = [seq for seq, _, _ in live]
        outputs = self._commit(seqs, [result for _, _, result in live])
        for (seq, item, result), output in zip(live, outputs):
            self._record_verification(seq, item, result, output)
        await self._publish(seqs, outputs)

    def _draft_cap(self, seq: Sequence) -> int:
        """The most drafts this sequence can verify: its k, the tokens it may still add, the cache."""
        if not self._speculates(seq):
            return 0
        return max(0, min(seq.options.num_speculative_tokens, seq.remaining_tokens - 1,
                          self.kv_cache.max_len - len(seq.token_ids)))

    def _num_usable(self, seq: Sequence) -> int:
        drafts = usable_drafts(seq, self._draft_cap(seq))
        return 0 if drafts is None else len(drafts.tokens)

    def _verify_item(self, seq: Sequence, budget: int) -> VerifyItem:
        """At most `budget` of the sequence's drafts: having none is a miss, the budget's cap is not."""
        drafts = None
        cap = self._draft_cap(seq)
        if cap > 0:
            if usable_drafts(seq, cap) is None:
                self.metrics.draft_miss.inc()
                if is_stale_mismatch(seq):
                    self.metrics.child(self.metrics.draft_stale, outcome="dropped").inc()
                    seq.proposal = None
            else:
                drafts = usable_drafts(seq, min(cap, budget))
                if drafts is not None and drafts.salvaged:
                    self.metrics.child(self.metrics.draft_stale, outcome="salvaged").inc()
        return VerifyItem(slot=seq.slot, length=len(seq.token_ids), last_token=seq.token_ids[-1],
                          drafts=drafts, options=seq.options)

    def _record_verification(self, seq: Sequence, item: VerifyItem, result: Verified, output: Output) -> None:
        """Usage and metrics count the accepted drafts that were committed: a stop discards the rest.

        The policy learns from the verifier's verdict, which judges the drafter, not the stop.
        """
        if not item.num_drafts:
            return
        self.policy.observe_verify(result.num_accepted, item.num_drafts)
        accepted = output.num_accepted
        seq.draft_tokens += item.num_drafts
        seq.draft_steps += 1
        seq.accepted_tokens += accepted
        m = self.metrics
        m.num_drafts.inc()
        m.num_draft_tokens.inc(item.num_drafts)
        m.num_accepted_tokens.inc(accepted)
        m.acceptance_length.observe(accepted + 1)
        for position in range(accepted):
            m.child(m.accepted_per_pos, position=str(position)).inc()

    async def _wait_for_drafts(self, decoding: list[Sequence]) -> None:
        """Wait a bounded time for sequences that have no usable draft yet.

        A new request ends the wait at once when the policy says so, so that waiting for drafts
        never delays a prefill (the synchronous baseline's point is to block).
        No wait when the step would verify no drafts even if every sequence had all it can use,
        nor while the drafter has left an update unanswered past its patience (hung or busy).
        """
        if self.link is None or not self.link.connected:
            return
        if self.policy.draft_limit(len(decoding), [self._draft_cap(s) for s in decoding]) == 0:
            return
        started = time.perf_counter()
        if await self._sleep_until_drafts(decoding, self.policy.wait_deadline(started)):
            self.metrics.draft_wait.observe(time.perf_counter() - started)

    async def _sleep_until_drafts(self, decoding: list[Sequence], deadline: float) -> bool:
        """Sleep until no sequence awaits drafts, the deadline, or a request to admit; whether it slept."""
        slept = False
        while True:
            missing = any(self._awaits_drafts(s) for s in decoding)
            remaining = deadline - time.perf_counter()
            admissible = self.waiting and self._free_capacity() > 0
            if not missing or remaining <= 0 or (admissible and self.policy.admission_ends_wait):
                return slept
            slept = True
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), remaining)
            except asyncio.TimeoutError:
                return slept

    def _awaits_drafts(self, seq: Sequence) -> bool:
        """Speculating, no usable draft, and the drafter has not yet answered for this prefix."""
        return (self._speculates(seq) and usable_drafts(seq, 1) is None
                and seq.drafter_answered_len != len(seq.token_ids))

    async def _in_executor(self, fn, items):
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, items)

    # ---- committing and publishing ----------------------------------------------------------

    def _commit(self, seqs: list[Sequence], results: list[Verified]) -> list[Output]:
        """Append a step's tokens to each sequence, up to a stop or its budget, which ends it."""
        outputs = []
        for seq, result in zip(seqs, results):
            output, finish = seq.commit(result.tokens, result.num_accepted, self.kv_cache.max_len)
            outputs.append(output)
            if finish is not None:
                self._finish(seq, finish)
        return outputs

    async def _publish(self, seqs: list[Sequence], outputs: list[Output]) -> None:
        """Tell the drafter about the committed tokens, and send them to the clients.

        The synchronous baseline first waits for the drafts of the new prefixes.
        """
        self._send_extends(seqs)
        if self.policy.drafts_before_publish:
            await self._wait_for_drafts([s for s in seqs if s.finish is None])
        now = time.perf_counter()
        for seq, output in zip(seqs, outputs):
            self._observe_tokens(seq, len(output.token_ids), now)
            seq.outbox.put_nowait(output)
        # At once: a request that ended on its prefill token must not wait for the decode step.
        self._release_finished()

    def _observe_tokens(self, seq: Sequence, count: int, now: float) -> None:
        m = self.metrics
        m.generation_tokens.inc(count)
        if seq.last_token_at is None:
            m.ttft.observe(now - seq.arrival)
        else:
            gap = (now - seq.last_token_at) / count
            for _ in range(count):
                m.itl.observe(gap)
        seq.last_token_at = now

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Mark a sequence done; _release_finished frees its slot once its tokens are published."""
        if seq.finish is None or seq.finish is reason:
            seq.finish = reason
        self._work.set()

    def _release_finished(self) -> None:
        for seq in [s for s in self.running if s.finish is not None]:
            self.running.remove(seq)
            self.kv_cache.free(seq.slot)
            seq.slot = None
            self._retire(seq)
        self.metrics.running.set(len(self.running))

    def _retire(self, seq: Sequence) -> None:
        """Last message to the client, metrics, and Close to the drafter."""
        self.sequences.pop(seq.seq_id, None)
        seq.proposal = None
        reason = seq.finish or FinishReason.ABORT
        seq.outbox.put_nowait(Output(token_ids=[], text="", num_accepted=0, finish=reason))
        self.metrics.child(self.metrics.request_success, finish_reason=reason.value).inc()
        self.metrics.e2e.observe(time.perf_counter() - seq.arrival)
        if seq.drafter_len:
            self._send_update(closes=[drafter_pb2.SequenceClose(seq_id=seq.seq_id)])

    # ---- the drafter ------------------------------------------------------------------------

    def _speculates(self, seq: Sequence) -> bool:
        return (seq.options.speculate and seq.options.num_speculative_tokens > 0
                and self.link is not None and self.link.connected)

    def _open_message(self, seq: Sequence) -> drafter_pb2.SequenceOpen:
        seq.drafter_sent_at = time.perf_counter()
        return open_message(seq, self.link.max_k)

    def reopen_all(self) -> drafter_pb2.TargetUpdate:
        """After a (re)connect: every running sequence, opened with its committed tokens.

        The new stream knows only the sequences opened on it, so the others (finished ones not yet
        released) must send it no Extend or Close.
        """
        for seq in self.running:
            seq.proposal = None
            seq.drafter_len = 0
        return drafter_pb2.TargetUpdate(
            opens=[self._open_message(s) for s in self.running if s.finish is None and self._speculates(s)]
        )

    def _send_extends(self, seqs: list[Sequence]) -> None:
        now = time.perf_counter()
        extends = [extend_message(seq, now) for seq in seqs
                   if seq.drafter_len and seq.finish is None and len(seq.token_ids) > seq.drafter_len]
        self._send_update(extends=extends)

    def _send_update(self, opens=(), extends=(), closes=()) -> None:
        if self.link is None or not self.link.connected or not (opens or extends or closes):
            return
        if opens or extends:  # the drafter answers these, not Closes
            self.policy.observe_update_sent(time.perf_counter())
        self.link.send(drafter_pb2.TargetUpdate(opens=opens, extends=extends, closes=closes))

    def on_proposals(self, message: drafter_pb2.DraftProposals, wire_bytes: int) -> None:
        """Called on the event loop by the drafter link for every message it receives."""
        now = time.perf_counter()
        self.metrics.draft_wire_bytes.inc(wire_bytes)
        self.policy.observe_answer()
        for msg in message.proposals:
            seq = self.sequences.get(msg.seq_id)
            if seq is None or seq.finish is not None or seq.slot is None:
                continue  # closed meanwhile: not the drafter's fault
            seq.drafter_answered_len = max(seq.drafter_answered_len, min(msg.base_len, len(seq.token_ids)))
            if not msg.token_ids:
                continue  # nothing for this prefix
            try:
                proposal = validate_proposal(msg, seq, self.loaded.config.vocab_size, self.link.max_k,
                                             self.link.probs_top_k, now)
            except InvalidProposal as err:
                self.metrics.child(self.metrics.draft_rejected, reason=err.reason).inc()
                log.debug("dropped a proposal for %s: %s", seq.request_id, err)
                continue
            if proposal.base_len == seq.drafter_len and seq.drafter_sent_at is not None:
                self.metrics.draft_rtt.observe(now - seq.drafter_sent_at)
                self.policy.observe_draft_rtt(now - seq.drafter_sent_at)
            seq.proposal = proposal
        self._wake.set()
