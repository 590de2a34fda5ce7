"""The target's scheduler: the waiting queue, the running batch, admission and the KV slots.

A sequence is admitted with a slot and the KV blocks of its prompt and one step's growth; before
each step every running sequence gets the blocks that step may write. Free blocks that cache a
prefix give way first, the least recently used first. When the pool is still short, the newest
running sequence is preempted: it frees its slot (its full blocks stay cached) and waits at the
head of the queue; re-admitted, it recomputes the KV its new slot lacks in its next verify step
(`Chunk.replayed`), and nothing else about it changes. Each sequence's `num_computed_tokens` says
which positions its slot holds; admission sets it (the prefix cache's hit) and `update`, after each
step, advances it.

A request's n samples wait, and are admitted, together: their prefill is shared (one forward, the
prompt's full blocks shared with the other samples' slots). A new sequence's slot may already hold
the KV of its prompt's first blocks (target_service/prefix_cache.py); before each step, the blocks that the
last step filled are cached. A sequence is WAITING from submit to admission, RUNNING while it
holds a KV slot, and FINISHED once its slot is freed. A running sequence whose finish reason is
set keeps its slot until the step that used it has published its tokens: `release_finished` then
frees it.

Each step runs at most `max_num_batched_tokens` tokens (vLLM's token budget, chunked prefill): the
running sequences' tokens and drafts first, then prompts in the order they came, a long prompt in
chunks over several steps. A chunk writes KV and samples nothing (it scores its tokens when the
prompt's logprobs are asked); the prompt's last chunk gives its first token.
"""
from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass

import grpc

from tandem.model.batch import DEFAULT_MAX_NUM_BATCHED_TOKENS, MIN_PREFILL_TOKENS
from target_service.errors import RequestError
from target_service.metrics import TargetMetrics
from target_service.prefix_cache import PrefixCache
from target_service.sequence import FinishReason, Sequence, SequenceStatus
from target_service.step_items import Chunk
from tandem.model.kv_cache import KVCache


@dataclass(frozen=True, slots=True)
class ScheduledBatch:
    """One step's work: prompts that end this step (they get their first token), earlier chunks of
    long prompts, sequences to decode or verify, and the sequences new to the drafter."""

    prefills: list[Sequence]
    parts: list[Chunk]  # earlier chunks of long prompts: they write KV and sample nothing
    decodes: list[Sequence]
    admitted: list[Sequence]

    @property
    def ends(self) -> list[Chunk]:
        """The prefills' last chunks, in their order, each sampling its first token: a request's first
        sample runs its prompt from what its slot holds (prefix caching, earlier chunks); its other
        samples, right after it, share its KV (copy_of)."""
        leaders: dict[int, int] = {}  # group -> the index of its first sample
        ends = []
        for b, seq in enumerate(self.prefills):
            ends.append(seq.prompt_chunk(len(seq.prompt_ids), copy_of=leaders.get(seq.group)))
            leaders.setdefault(seq.group, b)
        return ends


class Scheduler:
    def __init__(self, kv_cache: KVCache, max_num_seqs: int, max_queue: int, metrics: TargetMetrics,
                 prefix_caching: bool = True, max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS):
        self.kv_cache = kv_cache
        self.prefix_cache = PrefixCache(kv_cache, prefix_caching)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_queue = max_queue
        self.metrics = metrics
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.sequences: dict[int, Sequence] = {}  # every sequence not yet finished, by seq_id
        metrics.watch_kv_usage(lambda: self.kv_usage)

    @property
    def idle(self) -> bool:
        return not self.running and not self.waiting

    @property
    def kv_usage(self) -> float:
        """The share of the KV cache's blocks that running sequences hold."""
        return self.kv_cache.usage

    def add(self, samples: list[Sequence]) -> None:
        """Queue a request's samples; RESOURCE_EXHAUSTED when the queue is full beyond what the next step
        admits, INVALID_ARGUMENT when they need more KV blocks than the cache has."""
        needed = sum(self._blocks_needed(seq) for seq in samples)
        if needed > self.kv_cache.num_blocks:
            raise RequestError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{len(samples)} sequence(s) need {needed * self.kv_cache.block_size} KV positions to start; the "
                f"cache holds {self.kv_cache.num_blocks * self.kv_cache.block_size} (--kv-cache-tokens): lower n or "
                "shorten the prompt",
            )
        head = self._next_group() if self.waiting else samples
        admitted = self._free_capacity() if self._fits(head) else 0  # a group waits whole
        if len(self.waiting) + len(samples) - admitted > self.max_queue:
            raise RequestError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self.max_queue} sequences are already waiting for a free slot "
                f"(--max-queue {self.max_queue}); retry later",
            )
        for seq in samples:
            self.sequences[seq.seq_id] = seq
            self.waiting.append(seq)
        self.metrics.waiting.set(len(self.waiting))

    def can_admit(self) -> bool:
        """A request waits, and running slots, KV slots and KV blocks are free for all its waiting samples."""
        return bool(self.waiting) and self._fits(self._next_group())

    def _fits(self, group: list[Sequence]) -> bool:
        """Whether the next step can admit this group whole: its slots, and its blocks from the free
        ones (a cached prefix it finds is counted as needed: a bound)."""
        return (self._free_capacity() >= len(group)
                and sum(map(self._blocks_needed, group)) <= self.kv_cache.num_free_blocks)

    def schedule(self, full_prefills: bool = False) -> ScheduledBatch:
        """Cache the blocks the last step filled, give the running sequences their blocks (preempting
        when short), then share the step's token budget: the running sequences decode or verify,
        prompts already admitted go on, and new ones are admitted while tokens are left.

        full_prefills: the prefills run every prompt position (the drafter reads their features), so
        new sequences take no cached prefix."""
        live = [s for s in self.running if s.finish is None]
        for seq in live:
            self._cache_blocks(seq)
        self._grow(live)
        live = [s for s in self.running if s.finish is None]
        decodes = [s for s in live if s.num_generated]
        budget = _Budget(self.max_num_batched_tokens - sum(map(self._step_tokens, decodes)))
        prefills: list[Sequence] = []
        parts: list[Chunk] = []
        prompts: dict[int, list[Sequence]] = {}  # group -> its samples before their first token
        for seq in live:
            if not seq.num_generated:
                prompts.setdefault(seq.group, []).append(seq)
        for samples in prompts.values():
            self._take_prompt(samples, budget, prefills, parts)
        admitted = self._admit(full_prefills, budget, prefills, parts, decodes)
        return ScheduledBatch(prefills=prefills, parts=parts, decodes=decodes, admitted=admitted)

    def prompts_pending(self) -> bool:
        """A prompt waits for its next chunk, or a request waits to be admitted: a step should not wait on drafts."""
        return self.can_admit() or any(not s.num_generated and s.finish is None for s in self.running)

    def dequeue(self, seq: Sequence) -> bool:
        """Take a waiting sequence out of the queue (an abort); False when it is not waiting."""
        if seq.status is not SequenceStatus.WAITING:
            return False
        self.waiting.remove(seq)
        self.metrics.waiting.set(len(self.waiting))
        self._forget(seq)
        return True

    def update(self, ran: list[Sequence], parts: list[Chunk] = ()) -> None:
        """After a step: each sequence in `ran` committed its tokens (a prompt's first, or a verify's),
        and its slot holds the KV of all of them but the newest; each part's prompt positions up to
        its end were written."""
        for seq in ran:
            seq.num_computed_tokens = len(seq.token_ids) - 1
        for part in parts:
            if (seq := self.sequences.get(part.seq_id)) is not None:  # else released while the step ran
                seq.num_computed_tokens = part.end

    def release_finished(self) -> list[Sequence]:
        """Free the KV slots of the running sequences whose finish is set; returns them."""
        finished = [s for s in self.running if s.finish is not None]
        for seq in finished:
            self.running.remove(seq)
            # Its KV holds every committed token but the last; an aborted one may have lost a step.
            if seq.finish in (FinishReason.STOP, FinishReason.LENGTH):
                self._cache_blocks(seq)
            self.prefix_cache.release(seq.slot)
            seq.slot = None
            self._forget(seq)
        self.metrics.running.set(len(self.running))
        return finished

    def _admit(self, full_prefills: bool, budget: "_Budget", prefills: list[Sequence], parts: list[Chunk],
               decodes: list[Sequence]) -> list[Sequence]:
        """Admit waiting groups while they fit and the budget has tokens left; returns the sequences
        new to the drafter (not the preempted ones coming back)."""
        admitted = []
        while budget.left > 0 and self.can_admit():
            group = self._next_group()
            for seq in group:
                if seq.num_generated:  # preempted: its committed tokens, of which its new slot may hold some
                    seq.slot, seq.num_computed_tokens = self.prefix_cache.allocate(seq.token_ids)
                    decodes.append(seq)
                    budget.take(self._step_tokens(seq))
                else:
                    reuse = not full_prefills and seq.options.prompt_logprobs is None  # else every position runs
                    seq.slot, seq.num_computed_tokens = self.prefix_cache.allocate(seq.prompt_ids, reuse)
                    del seq.scored_prompt_logprobs[seq.num_computed_tokens:]  # after a preemption: what runs again
                    if seq.admitted_at is None:  # else preempted before its first token: the drafter has it
                        seq.cached_tokens = seq.num_computed_tokens
                        seq.admitted_at = time.perf_counter()
                        self.metrics.queue_time.observe(seq.admitted_at - seq.arrival)
                        admitted.append(seq)
                self.kv_cache.reserve(seq.slot, self._positions_needed(seq))
                self.waiting.popleft()
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
            fresh = [s for s in group if not s.num_generated]
            if fresh and not self._prompt_running(fresh):
                self._take_prompt(fresh, budget, prefills, parts)
        self.metrics.waiting.set(len(self.waiting))
        self.metrics.running.set(len(self.running))
        return admitted

    def _take_prompt(self, samples: list[Sequence], budget: "_Budget", prefills: list[Sequence],
                     parts: list[Chunk]) -> None:
        """The first sample runs the prompt to its end if the budget allows (the others then share it),
        else a chunk of it."""
        leader = samples[0]
        start = leader.num_computed_tokens
        remaining = len(leader.prompt_ids) - start
        if remaining <= budget.left:
            prefills.extend(samples)
            budget.take(remaining)
        elif budget.left > 0:
            parts.append(leader.prompt_chunk(start + budget.left))
            budget.take(budget.left)

    def _prompt_running(self, samples: list[Sequence]) -> bool:
        """Another sample of their request still runs its prompt (they were preempted between its
        chunks): they join it next step and share its prefill."""
        return any(s.group == samples[0].group and not s.num_generated and s.finish is None and s not in samples
                   for s in self.running)

    def _next_group(self) -> list[Sequence]:
        """The first waiting request's waiting samples: they stand together at the head of the queue."""
        group = self.waiting[0].group
        return list(itertools.takewhile(lambda seq: seq.group == group, self.waiting))

    def _grow(self, running: list[Sequence]) -> None:
        """Each running sequence, the oldest first, gets the blocks of its next step; when the pool is
        short, the newest running sequence is preempted, until it fits (or is itself preempted)."""
        for seq in running:
            while seq.status is SequenceStatus.RUNNING and not self._reserve(seq):
                self._preempt(next(s for s in reversed(self.running) if s.finish is None))

    def _reserve(self, seq: Sequence) -> bool:
        short = self._blocks_needed(seq) - self.kv_cache.num_blocks_of(seq.slot)
        if short > self.kv_cache.num_free_blocks:
            return False
        self.kv_cache.reserve(seq.slot, self._positions_needed(seq))
        return True

    def _preempt(self, seq: Sequence) -> None:
        """Free a running sequence's slot, its full blocks cached, and queue it first."""
        self.running.remove(seq)
        self._cache_blocks(seq)
        self.prefix_cache.release(seq.slot)
        seq.slot = None
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.metrics.preemptions.inc()
        self.metrics.waiting.set(len(self.waiting))
        self.metrics.running.set(len(self.running))

    def _cache_blocks(self, seq: Sequence) -> None:
        """Cache the full blocks of the sequence's computed KV."""
        self.prefix_cache.cache_blocks(seq.slot, seq.token_ids, seq.num_computed_tokens)

    def _positions_needed(self, seq: Sequence) -> int:
        """The positions the sequence's next step may write: its tokens, the prefill's token or
        a verify's drafts (at most k, and never past its prompt and max_tokens)."""
        return min(len(seq.prompt_ids) + seq.options.max_tokens,
                   len(seq.token_ids) + 1 + seq.options.num_speculative_tokens)

    def _step_tokens(self, seq: Sequence) -> int:
        """The tokens a decode or verify step runs for the sequence at most: its replay, its last
        token and its drafts."""
        drafts = seq.options.num_speculative_tokens if seq.options.speculate else 0
        return len(seq.token_ids) - seq.num_computed_tokens + drafts

    def _blocks_needed(self, seq: Sequence) -> int:
        return self.kv_cache.blocks_for(self._positions_needed(seq))

    def _free_capacity(self) -> int:
        """Requests the next step can admit: waiting for it is not queueing."""
        return min(self.max_num_seqs - len(self.running), self.kv_cache.num_free_slots)

    def _forget(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.FINISHED
        self.sequences.pop(seq.seq_id, None)


class _Budget:
    """The tokens a step has left to give, at least MIN_PREFILL_TOKENS for prompts."""

    def __init__(self, left: int):
        self.left = max(left, MIN_PREFILL_TOKENS)

    def take(self, tokens: int) -> None:
        self.left -= tokens
