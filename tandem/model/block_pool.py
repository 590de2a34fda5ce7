"""The KV pool's blocks: which are free, how many slots hold each, and which hold a cached prefix.

A block is held by every slot whose block table lists it (a reference count); it is free when none
does. A full block of a prompt can be cached under the chained hash of its tokens
(target_service/prefix_cache.py); it then stays cached while free, and a later slot that finds its hash
holds it again instead of recomputing its KV. Two slots that computed the same prefix in one step
cache two blocks under one hash, as vLLM does: a later slot finds the first, and the hash stays
cached until the last of them is evicted. Taking a block for new KV takes the free blocks that
cache nothing first, then the cached ones, the one freed longest ago first (least recently used),
and forgets what they cached. With an event log, each block forgotten is recorded (kv_events.py).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from tandem.kv_events import AllBlocksCleared, BlocksRemoved, KvEventLog


class CacheFullError(RuntimeError):
    """Every KV slot, or every KV block, is taken."""


class BlockPool:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # taken from the front
        self._refs = [0] * num_blocks
        self._hash_of: dict[int, int] = {}  # cached block -> its hash
        self._blocks_of: dict[int, list[int]] = {}  # hash -> the blocks caching it, the one found first
        self.events: KvEventLog | None = None  # where evictions are recorded, when someone publishes them

    @property
    def num_free(self) -> int:
        """Blocks no slot holds, cached ones included: those give way when taken."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Hashes cached."""
        return len(self._blocks_of)

    def take(self, count: int) -> list[int]:
        """Blocks for new KV, each held once; what they cached is forgotten."""
        if count > len(self._free):
            raise CacheFullError(f"{count} KV blocks needed, {len(self._free)} free")
        blocks = [self._free.popitem(last=False)[0] for _ in range(count)]
        evicted = []
        for block in blocks:
            self._refs[block] = 1
            block_hash = self._hash_of.pop(block, None)
            if block_hash is None:
                continue
            caching = self._blocks_of[block_hash]
            caching.remove(block)
            if not caching:
                del self._blocks_of[block_hash]
                evicted.append(block_hash)
        if evicted and self.events is not None:
            self.events.add(BlocksRemoved(evicted))
        return blocks

    def hold(self, block: int) -> None:
        """One more slot holds the block (a cached prefix found, or a prefix shared)."""
        if self._refs[block] == 0:
            del self._free[block]
        self._refs[block] += 1

    def release(self, blocks: Iterable[int]) -> None:
        """A slot lets go of the blocks, given in the order they should be evicted when free."""
        for block in blocks:
            self._refs[block] -= 1
            if self._refs[block]:
                continue
            self._free[block] = None
            if block not in self._hash_of:  # caches nothing: the first to take
                self._free.move_to_end(block, last=False)

    def cached(self, block_hash: int) -> int | None:
        """A block caching this hash, if any."""
        caching = self._blocks_of.get(block_hash)
        return caching[0] if caching else None

    def cache(self, block: int, block_hash: int) -> bool:
        """The block's KV is that of the tokens with this hash. True when the hash was not cached
        before (by this block or another)."""
        if block in self._hash_of:
            return False
        self._hash_of[block] = block_hash
        caching = self._blocks_of.setdefault(block_hash, [])
        caching.append(block)
        return len(caching) == 1

    def clear_cached(self) -> None:
        """Forget every cached hash; the blocks stay with their holders, or free."""
        for block in self._hash_of:
            if not self._refs[block]:
                self._free.move_to_end(block, last=False)
        self._hash_of.clear()
        self._blocks_of.clear()
        if self.events is not None:
            self.events.add(AllBlocksCleared())

    def refs(self, block: int) -> int:
        return self._refs[block]
