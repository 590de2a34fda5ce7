"""KV cache events: the prefix blocks a cache stored and removed, for a gateway's prefix index.

The target's prefix cache records them as they happen (block_pool.py, prefix_cache.py); the step
loop takes them after each step and publishes them as one numbered batch
(target_service/kv_event_stream.py), as vLLM publishes its KV events.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class BlocksStored:
    """Consecutive full blocks of one sequence, cached: each block's hash and its tokens."""

    parent: int | None  # the hash of the block before the first; None when they start a sequence
    hashes: list[int]
    token_ids: list[list[int]]  # [blocks][block size]


@dataclass(frozen=True, slots=True)
class BlocksRemoved:
    """Cached blocks evicted: their KV is gone."""

    hashes: list[int]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """Every cached block forgotten (a flush)."""


KvEvent = BlocksStored | BlocksRemoved | AllBlocksCleared


@dataclass(slots=True)
class KvEventLog:
    """The events recorded since the last `take`."""

    _pending: list[KvEvent] = field(default_factory=list)

    def add(self, event: KvEvent) -> None:
        self._pending.append(event)

    def take(self) -> list[KvEvent]:
        events, self._pending = self._pending, []
        return events
