"""The target's step loop: schedule, run the model, commit, publish.

Each step prefills the sequences the Scheduler admitted and emits their first tokens at once;
then it verifies (or decodes) the running ones with the drafts the Speculator planned. All
sequence state lives on the event loop's thread; the model runs on the executor thread, over
snapshots, so streaming, health and metrics stay responsive during a step.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import grpc

from tandem_kernels.random import sample_seed
from target_service.config import TargetConfig
from target_service.errors import RequestError
from target_service.kv_event_stream import KvEventStream
from target_service.metrics import TargetMetrics
from target_service.model_runner import ModelRunner
from target_service.step_items import ChunkResult
from target_service.scheduler import ScheduledBatch, Scheduler
from target_service.sequence import FinishReason, Output, RequestOptions, Sequence
from target_service.speculation.plan import DraftPlan
from target_service.speculation.speculator import Speculator
from target_service.stops import StopChecker
from tandem.detokenizer import IncrementalDetokenizer
from tandem.structured.grammar import Matcher
from tandem.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class Engine:
    def __init__(self, runner: ModelRunner, scheduler: Scheduler, speculator: Speculator, tokenizer: Tokenizer,
                 config: TargetConfig, metrics: TargetMetrics):
        self.runner = runner
        self.scheduler = scheduler
        self.speculator = speculator
        self.tokenizer = tokenizer
        self.config = config
        self.metrics = metrics
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="target-step")
        self._ids = itertools.count(1)
        self._work = asyncio.Event()
        self._accepting = True
        self._task: asyncio.Task | None = None
        self.kv_events = KvEventStream()  # the prefix cache's events, published after each step
        self._cycle_from: float | None = None  # when the last step's decodes were accounted; None after a step without

    # ---- requests ---------------------------------------------------------------------------

    def new_sequences(self, request_id: str, prompt_ids: list[int], options: RequestOptions,
                      grammars: list[Matcher | None] | None = None) -> list[Sequence]:
        """The request's options.n samples, sample i seeded seed + i, sharing one outbox.

        grammars: one fresh matcher of options.constraint per sample (RequestGrammars.matchers_for)."""
        eos = frozenset() if options.ignore_eos else self.tokenizer.eos_token_ids
        arrival, outbox, first_id = time.perf_counter(), asyncio.Queue(), next(self._ids)
        seq_ids = [first_id, *(next(self._ids) for _ in range(options.n - 1))]
        name = request_id or f"req-{first_id}"
        return [Sequence(
            seq_id=seq_id,
            request_id=name if options.n == 1 else f"{name}-{index}",
            prompt_ids=prompt_ids,
            options=options if index == 0 else replace(
                options, sampling=replace(options.sampling, seed=sample_seed(options.sampling.seed, index))),
            arrival=arrival,
            detokenizer=IncrementalDetokenizer(
                self.tokenizer, skip_special_tokens=options.skip_special_tokens, context_ids=prompt_ids
            ),
            stops=StopChecker(options.stop, options.stop_token_ids | eos, options.include_stop_str_in_output),
            outbox=outbox,
            index=index,
            group=first_id,
            grammar=grammars[index] if grammars else None,
        ) for index, seq_id in enumerate(seq_ids)]

    @property
    def accepting(self) -> bool:
        """False once draining has begun: new requests get UNAVAILABLE."""
        return self._accepting

    def submit(self, samples: list[Sequence]) -> None:
        """Queue one request's samples (new_sequences)."""
        if not self._accepting:
            raise RequestError(grpc.StatusCode.UNAVAILABLE, "the server is shutting down")
        self.scheduler.add(samples)
        self._work.set()
        self.speculator.notify()  # a wait for drafts may end for it

    def abort(self, seq: Sequence) -> None:
        """Free the sequence here at once when it waits, or after the step that uses it when it runs."""
        if seq.finish is not None:
            return
        seq.finish = FinishReason.ABORT
        if self.scheduler.dequeue(seq):
            self._retire(seq)
        self._work.set()

    # ---- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="target-step-loop")

    async def drain(self, grace_seconds: float) -> None:
        """Refuse new requests and let running ones finish, up to the grace period."""
        self._accepting = False
        deadline = time.monotonic() + grace_seconds
        while self.scheduler.sequences and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for seq in list(self.scheduler.sequences.values()):
            self.abort(seq)  # a waiting one leaves the queue: the step loop must not prefill it
        self._release_finished()
        self.kv_events.close()

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
                for seq in self.scheduler.running:
                    self._finish(seq, FinishReason.ABORT)
                self._release_finished()

    async def step(self) -> None:
        """Prefill the admitted and emit their first tokens; then verify or decode the others; then
        publish the KV events of the step."""
        self._release_finished()
        self.publish_kv_events()
        if self.scheduler.idle:
            self._cycle_from = None
            self._work.clear()
            await self._work.wait()
            return
        started = time.perf_counter()
        batch = self.scheduler.schedule(full_prefills=bool(self.speculator.feature_layers))
        self.speculator.admit(batch.admitted)  # before our prefill, so that the drafter's runs beside it
        if batch.prefills or batch.parts:
            results, firsts = await self._prefill(batch)
            outputs = self._commit(batch.prefills, results)
            self.scheduler.update(batch.prefills, batch.parts)
            await self._publish(batch.prefills, results, outputs, firsts)
        prefilled = time.perf_counter()
        decodes = [seq for seq in batch.decodes if seq.finish is None]
        if decodes:
            plan = await self.speculator.schedule(decodes, admission=self.scheduler.prompts_pending)
            firsts = [len(seq.token_ids) - 1 for seq in plan.seqs]  # where each result's feature rows start
            results, seconds = await self._verify(plan)
            outputs = self._commit(plan.seqs, results)
            self.scheduler.update(plan.seqs)
            self.speculator.account(plan, results, outputs, seconds, self._cycle(started, prefilled))
            await self._publish(plan.seqs, results, outputs, firsts)
        else:
            self._cycle_from = None
        self.publish_kv_events()

    def _cycle(self, started: float, prefilled: float) -> float:
        """The decode part's whole cycle: since the last step's decodes were accounted (or since this
        step began, after a step without), less this step's prefills."""
        now = time.perf_counter()
        since = self._cycle_from if self._cycle_from is not None else started
        self._cycle_from = now
        return now - since - (prefilled - started)

    def publish_kv_events(self) -> None:
        """Publish what the prefix cache stored and evicted since the last call, as one batch."""
        self.kv_events.publish(self.scheduler.prefix_cache.events.take())

    async def _prefill(self, batch: ScheduledBatch) -> tuple[list[ChunkResult], list[int]]:
        """The prompts' first tokens (their last chunks), and the earlier chunks' KV, in one forward;
        and where each prompt's run (its feature rows) starts."""
        ends, parts = batch.ends, batch.parts
        started = time.perf_counter()
        results = await self._in_executor(self.runner.run, ends + parts, self.speculator.feature_layers)
        self.metrics.child(self.metrics.step, kind="prefill").observe(time.perf_counter() - started)
        results, part_results = results[:len(ends)], results[len(ends):]
        for part, result in zip(parts, part_results, strict=True):
            seq = self.scheduler.sequences.get(part.seq_id)
            if seq is None:  # released while the step ran (a drain aborts every sequence)
                continue
            if result.features is not None:
                self.speculator.keep_features(seq, part.start, result.features)
            if result.prompt_logprobs is not None:
                seq.scored_prompt_logprobs += result.prompt_logprobs
        prompts = [s for s, c in zip(batch.prefills, ends, strict=True) if c.copy_of is None]
        self.metrics.prompt_tokens.inc(sum(len(s.prompt_ids) for s in prompts))
        self.metrics.prefix_cache_queries.inc(sum(len(s.prompt_ids) for s in prompts))
        self.metrics.prefix_cache_hits.inc(sum(s.cached_tokens for s in prompts))
        return results, [ends[c.copy_of].start if c.copy_of is not None else c.start for c in ends]

    async def _verify(self, plan: DraftPlan) -> tuple[list[ChunkResult], float]:
        """The verify (or, without drafts, decode) step's results, and how long it took."""
        kind = "verify" if any(plan.available) else "decode"
        started = time.perf_counter()
        results = await self._in_executor(self.runner.run, plan.chunks(), self.speculator.feature_layers)
        elapsed = time.perf_counter() - started
        self.metrics.child(self.metrics.step, kind=kind).observe(elapsed)
        return results, elapsed

    async def _in_executor(self, fn: Callable, *args):
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    # ---- committing and publishing ----------------------------------------------------------

    def _commit(self, seqs: list[Sequence], results: list[ChunkResult]) -> list[Output | None]:
        """Append a step's tokens to each sequence, up to a stop or its budget, which ends it.

        None for a sequence that ended while the step ran (aborted): it commits nothing.
        """
        outputs: list[Output | None] = []
        for seq, result in zip(seqs, results, strict=True):
            if seq.finish is not None:
                outputs.append(None)
                continue
            output, finish = seq.commit(result.tokens, result.num_accepted, self.scheduler.kv_cache.max_len,
                                        result.logprobs)
            if result.prompt_logprobs is not None:  # with those its earlier chunks scored
                output = replace(output, prompt_logprobs=seq.scored_prompt_logprobs + result.prompt_logprobs)
                seq.scored_prompt_logprobs = []
            outputs.append(output)
            if finish is not None:
                self._finish(seq, finish)
        return outputs

    async def _publish(self, seqs: list[Sequence], results: list[ChunkResult], outputs: list[Output | None],
                       firsts: list[int]) -> None:
        """Tell the drafter about the committed tokens, and send them to the clients.

        firsts[i]: the position of results[i]'s first feature row, when the step captured features.
        """
        kept = [i for i, output in enumerate(outputs) if output is not None]
        await self.speculator.publish([seqs[i] for i in kept], [results[i] for i in kept], [firsts[i] for i in kept])
        now = time.perf_counter()
        for i in kept:
            self._observe_tokens(seqs[i], len(outputs[i].token_ids), now)
            seqs[i].outbox.put_nowait(outputs[i])
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
        for seq in self.scheduler.release_finished():
            self._retire(seq)

    def _retire(self, seq: Sequence) -> None:
        """Last message to the client, metrics, and Close to the drafter."""
        reason = seq.finish or FinishReason.ABORT
        seq.outbox.put_nowait(Output(token_ids=[], text="", num_accepted=0, finish=reason, index=seq.index))
        self.metrics.child(self.metrics.request_success, finish_reason=reason.value).inc()
        self.metrics.e2e.observe(time.perf_counter() - seq.arrival)
        self.speculator.release(seq)
