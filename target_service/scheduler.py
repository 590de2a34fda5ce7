"""The target's scheduler: the waiting queue, the running batch, admission and the KV slots.

A sequence is admitted with a slot and the KV blocks of its prompt and one step's growth; before
each step every running sequence gets the blocks that step may write. Free blocks that cache a
prefix give way first, the least recently used first. When the pool is still short, the newest
running sequence is preempted: it frees its slot (its full blocks stay cached) and waits at the
head of the queue; re-admitted, it recomputes the KV its new slot lacks in its next verify step
(`Sequence.replay_from`), and nothing else about it changes.

A request's n samples wait, and are admitted, together: their prefill is shared (one forward, the
prompt's full blocks shared with the other samples' slots). A new sequence's slot may already hold
the KV of its prompt's first blocks (tandem/prefix_cache.py); before each step, the blocks that the
last step filled are cached. A sequence is WAITING from submit to admission, RUNNING while it
holds a KV slot, and FINISHED once its slot is freed. A running sequence whose finish reason is
set keeps its slot until the step that used it has published its tokens: `release_finished` then
frees it.
"""
from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass

import grpc

from target_service.errors import RequestError
from target_service.metrics import TargetMetrics
from tandem.prefix_cache import PrefixCache
from target_service.sequence import FinishReason, Sequence, SequenceStatus
from tandem.model.kv_cache import KVCache


@dataclass(frozen=True, slots=True)
class ScheduledBatch:
    """One step's work: sequences to prefill (admitted now) and sequences to decode or verify."""

    prefills: list[Sequence]
    decodes: list[Sequence]


class Scheduler:
    def __init__(self, kv_cache: KVCache, max_num_seqs: int, max_queue: int, metrics: TargetMetrics,
                 prefix_caching: bool = True):
        self.kv_cache = kv_cache
        self.prefix_cache = PrefixCache(kv_cache, prefix_caching)
        self.max_num_seqs = max_num_seqs
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
        when short), then admit what fits; the live running sequences, and the preempted ones
        readmitted, decode or verify.

        full_prefills: the prefills run every prompt position (the drafter reads their features), so
        new sequences take no cached prefix."""
        live = [s for s in self.running if s.finish is None]
        for seq in live:
            self._cache_blocks(seq)
        self._grow(live)
        admitted = self._admit(full_prefills)
        decodes = [s for s in self.running if s.finish is None and s not in admitted]
        return ScheduledBatch(prefills=[s for s in admitted if s.replay_from is None],
                              decodes=decodes + [s for s in admitted if s.replay_from is not None])

    def dequeue(self, seq: Sequence) -> bool:
        """Take a waiting sequence out of the queue (an abort); False when it is not waiting."""
        if seq.status is not SequenceStatus.WAITING:
            return False
        self.waiting.remove(seq)
        self.metrics.waiting.set(len(self.waiting))
        self._forget(seq)
        return True

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

    def _admit(self, full_prefills: bool) -> list[Sequence]:
        admitted = []
        while self.can_admit():
            for seq in self._next_group():
                if seq.num_generated:  # preempted: its committed tokens, of which its new slot may hold some
                    seq.slot, seq.replay_from = self.prefix_cache.allocate(seq.token_ids)
                else:
                    reuse = not full_prefills and seq.options.prompt_logprobs is None  # else every position runs
                    seq.slot, seq.cached_tokens = self.prefix_cache.allocate(seq.prompt_ids, reuse)
                    seq.admitted_at = time.perf_counter()
                    self.metrics.queue_time.observe(seq.admitted_at - seq.arrival)
                self.kv_cache.reserve(seq.slot, self._positions_needed(seq))
                self.waiting.popleft()
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
                admitted.append(seq)
        self.metrics.waiting.set(len(self.waiting))
        self.metrics.running.set(len(self.running))
        return admitted

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
        """Cache the full blocks of the sequence's KV: every committed token but the last, or, before
        its replay has run, the tokens its slot was admitted with."""
        computed = len(seq.token_ids) - 1 if seq.replay_from is None else seq.replay_from
        self.prefix_cache.cache_blocks(seq.slot, seq.token_ids, computed)

    def _positions_needed(self, seq: Sequence) -> int:
        """The positions the sequence's next step may write: its tokens, the prefill's token or
        a verify's drafts (at most k, and never past its prompt and max_tokens)."""
        return min(len(seq.prompt_ids) + seq.options.max_tokens,
                   len(seq.token_ids) + 1 + seq.options.num_speculative_tokens)

    def _blocks_needed(self, seq: Sequence) -> int:
        return self.kv_cache.blocks_for(self._positions_needed(seq))

    def _free_capacity(self) -> int:
        """Requests the next step can admit: waiting for it is not queueing."""
        return min(self.max_num_seqs - len(self.running), self.kv_cache.num_free_slots)

    def _forget(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.FINISHED
        self.sequences.pop(seq.seq_id, None)
