"""The target's step loop: admit, prefill and emit at once; then schedule, verify or decode, commit, emit.

All sequence state lives on the event loop's thread. Each step hands snapshots to the executor
thread, which runs the model, so streaming, health and metrics stay responsive during a step.
The drafter's side of each sequence, and which drafts a step verifies, are the DraftTracker's.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import grpc

from target_service.config import TargetConfig
from target_service.draft_plan import DraftPlan, PlannedDrafts
from target_service.draft_tracker import DraftTracker
from target_service.errors import RequestError
from target_service.metrics import TargetMetrics
from target_service.sequence import FinishReason, Output, SamplingOptions, Sequence
from target_service.speculation import speculation_policy
from target_service.step import PrefillItem, StepRunner, Verified
from target_service.stops import StopChecker
from tandem.detokenizer import IncrementalDetokenizer
from tandem.model.kv_cache import KVCache
from tandem.structured.grammar import Matcher
from tandem.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class Engine:
    def __init__(self, runner: StepRunner, kv_cache: KVCache, tokenizer: Tokenizer, vocab_size: int,
                 config: TargetConfig, metrics: TargetMetrics):
        self.runner = runner
        self.kv_cache = kv_cache
        self.tokenizer = tokenizer
        self.config = config
        self.metrics = metrics
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="target-step")
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.sequences: dict[int, Sequence] = {}
        self.policy = speculation_policy(config)
        self._ids = itertools.count(1)
        self._work = asyncio.Event()
        self._wake = asyncio.Event()  # drafts arrived, or a request did
        self._accepting = True
        self._task: asyncio.Task | None = None
        self.tracker = DraftTracker(self.policy, metrics, vocab_size=vocab_size, max_len=kv_cache.max_len,
                                    wake=self._wake.set)
        metrics.watch_kv_usage(lambda: self.kv_usage)

    # ---- requests ---------------------------------------------------------------------------

    def new_sequence(self, request_id: str, prompt_ids: list[int], options: SamplingOptions,
                     grammar: Matcher | None = None) -> Sequence:
        """grammar: the matcher of options.constraint, fresh (RequestGrammars.matcher_for)."""
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
            grammar=grammar,
        )

    @property
    def accepting(self) -> bool:
        """False once draining has begun: new requests get UNAVAILABLE."""
        return self._accepting

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

    @property
    def kv_usage(self) -> float:
        """The share of the KV cache in use: each running sequence holds one whole slot."""
        return 1 - self.kv_cache.num_free_slots / self.kv_cache.num_slots

    def _free_capacity(self) -> int:
        """Requests the next step can admit: waiting for it is not queueing."""
        return min(self.config.max_num_seqs - len(self.running), self.kv_cache.num_free_slots)

    def _can_admit(self) -> bool:
        """A request waits, and a running slot and a KV slot are free for it."""
        return bool(self.waiting) and self._free_capacity() > 0

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
                await self.step()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug in one step must not take the server down
                log.exception("step failed; aborting the running sequences")
                for seq in self.running:
                    self._finish(seq, FinishReason.ABORT)
                self._release_finished()

    async def step(self) -> None:
        """Prefill the admitted and emit their first tokens; then verify or decode the others.

        Each half schedules, runs the model, commits and publishes. The loop runs this; tests too.
        """
        self._release_finished()
        if not self.running and not self.waiting:
            self._work.clear()
            await self._work.wait()
            return
        admitted = self._admit()
        if admitted:
            results = await self._run_prefill(admitted)
            await self._publish(admitted, self._commit(admitted, results, first_positions=[0] * len(admitted)))
        decoding = [s for s in self.running if s.finish is None and s not in admitted]
        if decoding:
            plan = await self._schedule(decoding)
            results = await self._run_verify(plan)
            live, outputs = self._commit_verified(plan, results)
            await self._publish(live, outputs)

    def _admit(self) -> list[Sequence]:
        admitted = []
        while self._can_admit():
            seq = self.waiting.popleft()
            seq.slot = self.kv_cache.allocate()
            seq.admitted_at = time.perf_counter()
            self.metrics.queue_time.observe(seq.admitted_at - seq.arrival)
            self.running.append(seq)
            admitted.append(seq)
        self.tracker.admit(admitted)  # before our prefill, so that the drafter's prefill runs beside it
        self.metrics.waiting.set(len(self.waiting))
        self.metrics.running.set(len(self.running))
        return admitted

    async def _run_prefill(self, admitted: list[Sequence]) -> list[Verified]:
        items = [PrefillItem(slot=s.slot, prompt_ids=s.prompt_ids, options=s.options, grammar=s.grammar)
                 for s in admitted]
        started = time.perf_counter()
        results = await self._in_executor(self.runner.prefill, items, self.tracker.feature_layers)
        self.metrics.child(self.metrics.step, kind="prefill").observe(time.perf_counter() - started)
        self.metrics.prompt_tokens.inc(sum(len(s.prompt_ids) for s in admitted))
        return results

    async def _schedule(self, decoding: list[Sequence]) -> DraftPlan:
        """Each sequence's drafts: matched, waited for where missing (bounded), cut to the step's budget."""
        plan = await self._wait_for_drafts(self.tracker.plan(decoding))
        return self.tracker.take(plan, self.policy.draft_limits(plan.records, plan.available))

    async def _wait_for_drafts(self, plan: DraftPlan) -> DraftPlan:
        """Wait a bounded time while the plan awaits drafts; returns the plan as the wait leaves it.

        No wait when the step would verify no drafts even if every sequence had all it can use,
        nor while the drafter has left an update unanswered past its patience (hung or busy).
        A request to admit ends the wait when the policy says so: waiting then never delays a prefill.
        """
        if not plan.awaiting or not any(self.policy.draft_limits(plan.records, plan.caps)):
            return plan
        started = time.perf_counter()
        deadline = self.policy.wait_deadline(started)
        slept = False
        while plan.awaiting:
            remaining = deadline - time.perf_counter()
            if remaining <= 0 or (self.policy.admission_ends_wait and self._can_admit()):
                break
            slept = True
            self._wake.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), remaining)
            plan = self.tracker.plan(plan.seqs)
        if slept:
            self.metrics.draft_wait.observe(time.perf_counter() - started)
        return plan

    async def _run_verify(self, plan: DraftPlan) -> list[Verified]:
        kind = "verify" if any(plan.available) else "decode"
        started = time.perf_counter()
        results = await self._in_executor(self.runner.verify, plan.verify_items(), self.tracker.feature_layers)
        elapsed = time.perf_counter() - started
        if elapsed < self.config.min_step_ms / 1000:  # a test's stand-in for a larger model
            await asyncio.sleep(self.config.min_step_ms / 1000 - elapsed)
            elapsed = time.perf_counter() - started
        self.metrics.child(self.metrics.step, kind=kind).observe(elapsed)
        self.policy.observe_step(plan.num_tokens, elapsed)
        return results

    async def _in_executor(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    # ---- committing and publishing ----------------------------------------------------------

    def _commit(self, seqs: list[Sequence], results: list[Verified], first_positions: list[int]) -> list[Output]:
        """Append a step's tokens to each sequence, up to a stop or its budget, which ends it.

        first_positions: the position of each result's first feature row, when the step captured features.
        """
        outputs = []
        for seq, result, first in zip(seqs, results, first_positions):
            output, finish = seq.commit(result.tokens, result.num_accepted, self.kv_cache.max_len)
            outputs.append(output)
            if finish is not None:
                self._finish(seq, finish)
            elif result.features is not None:
                self.tracker.keep_features(seq, first, result.features)
        return outputs

    def _commit_verified(self, plan: DraftPlan, results: list[Verified]) -> tuple[list[Sequence], list[Output]]:
        """Commit the sequences still live after the forward pass, and account for their drafts."""
        live = [(entry, result) for entry, result in zip(plan.entries, results) if entry.seq.finish is None]
        seqs = [entry.seq for entry, _ in live]
        committed_before = [len(seq.token_ids) for seq in seqs]
        outputs = self._commit(seqs, [result for _, result in live], [n - 1 for n in committed_before])
        for (entry, result), output in zip(live, outputs):
            self._account(entry, result, output)
        return seqs, outputs

    def _account(self, entry: PlannedDrafts, result: Verified, output: Output) -> None:
        """Usage and metrics count the accepted drafts that were committed: a stop discards the rest.

        The policy learns from the verifier's verdict, which judges the drafter, not the stop.
        """
        if not entry.num_drafts:
            return
        seq, accepted = entry.seq, output.num_accepted
        self.policy.observe_verify(result.num_accepted, entry.num_drafts, seq.draft_record)
        seq.count_draft_step(entry.num_drafts, accepted)
        m = self.metrics
        m.num_drafts.inc()
        m.num_draft_tokens.inc(entry.num_drafts)
        m.num_accepted_tokens.inc(accepted)
        m.acceptance_length.observe(accepted + 1)
        for position in range(accepted):
            m.child(m.accepted_per_pos, position=str(position)).inc()

    async def _publish(self, seqs: list[Sequence], outputs: list[Output]) -> None:
        """Tell the drafter about the committed tokens, and send them to the clients.

        The synchronous baseline first waits for the drafts of the new prefixes.
        """
        self.tracker.extend(seqs)
        if self.policy.drafts_before_publish:
            await self._wait_for_drafts(self.tracker.plan([s for s in seqs if s.finish is None]))
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
        reason = seq.finish or FinishReason.ABORT
        seq.outbox.put_nowait(Output(token_ids=[], text="", num_accepted=0, finish=reason))
        self.metrics.child(self.metrics.request_success, finish_reason=reason.value).inc()
        self.metrics.e2e.observe(time.perf_counter() - seq.arrival)
        self.tracker.release(seq)
