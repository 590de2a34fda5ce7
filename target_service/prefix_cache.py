"""Automatic prefix caching over shared KV blocks: the target's scheduler allocates every slot here.

Each full block of a sequence's tokens has a hash chained over the hashes before it: block i's
hash covers tokens [0, block_size * (i + 1)), so equal hashes mean equal prefixes. Once a block's KV is
computed, the block is cached under its hash (`cache_blocks`), while its sequence runs and after.
A new slot takes the longest run of cached blocks that starts its tokens (`allocate`): the next
turn of a conversation, or every request with the same system prompt, holds those blocks beside
the slots that computed them and prefills only the rest. Cached blocks that no slot holds stay in
the pool's free blocks until new KV needs them, the least recently used first (block_pool.py).

Each block cached and each one evicted is recorded in `events` (tandem/kv_events.py), which the
target publishes to gateways that route on exact prefixes.

A block is found only when it lies wholly before the prompt's last token, which always runs, for
its logits; so a slot never writes a position of a block it found, and the blocks it writes are
its own. The key is the tokens alone: the service holds one model, and the decoders' rows do not
depend on their batch (the native decoder bit for bit), so a cached block holds the KV a prefill
would compute.
"""
from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterator, Sequence

from tandem.kv_events import BlocksStored, KvEventLog
from tandem.model.kv_cache import KVCache

ROOT_HASH = 0  # the parent of a sequence's first block


def block_hash(parent: int, tokens: Sequence[int]) -> int:
    """The hash of a block of tokens following the prefix whose last block hashed to `parent`: a
    signed 64-bit integer, as KV events carry it."""
    data = parent.to_bytes(8, "little", signed=True) + array("q", tokens).tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little", signed=True)


def chained_hashes(tokens: Sequence[int], block_size: int, first: int = 0,
                   parent: int = ROOT_HASH) -> Iterator[tuple[int, Sequence[int]]]:
    """Each full block of the tokens from block `first` on (whose parent hashed to `parent`): its
    chained hash and its tokens, computed as the caller asks for them."""
    for start in range(first * block_size, len(tokens) - block_size + 1, block_size):
        block_tokens = tokens[start : start + block_size]
        parent = block_hash(parent, block_tokens)
        yield parent, block_tokens


class PrefixCache:
    def __init__(self, kv_cache: KVCache, enabled: bool = True):
        self.kv_cache = kv_cache
        self.enabled = enabled
        self.events = KvEventLog()
        kv_cache.pool.events = self.events
        self._hashes: dict[int, list[int]] = {}  # allocated slot -> the hashes of its cached blocks

    def allocate(self, tokens: list[int], reuse: bool = True) -> tuple[int, int]:
        """A free slot holding the longest cached prefix of the tokens, and that prefix's length: whole
        blocks before the last token (none with `reuse` off, when every position must run)."""
        slot = self.kv_cache.allocate()
        found: list[int] = []
        hashes: list[int] = []
        if self.enabled and reuse:
            for prefix_hash, _ in chained_hashes(tokens[: len(tokens) - 1], self.kv_cache.block_size):
                block = self.kv_cache.pool.cached(prefix_hash)  # the walk, and the hashing, stop at a miss
                if block is None:
                    break
                found.append(block)
                hashes.append(prefix_hash)
        self.kv_cache.attach(slot, found)
        self._hashes[slot] = hashes
        return slot, len(found) * self.kv_cache.block_size

    def cache_blocks(self, slot: int, tokens: list[int], computed: int) -> None:
        """Cache the slot's full blocks among its first `computed` tokens, whose KV it holds."""
        hashes, size = self._hashes[slot], self.kv_cache.block_size
        if not self.enabled or len(hashes) == computed // size:
            return
        table = self.kv_cache.block_table(slot)
        runs: list[BlocksStored] = []  # runs of blocks whose hash is new
        blocks = chained_hashes(tokens[:computed], size, len(hashes), hashes[-1] if hashes else ROOT_HASH)
        for i, (new_hash, block_tokens) in enumerate(blocks, start=len(hashes)):
            parent = hashes[-1] if hashes else None
            hashes.append(new_hash)
            if not self.kv_cache.pool.cache(table[i], new_hash):
                continue  # another block caches this prefix already: no event
            if runs and runs[-1].hashes[-1] == parent:
                runs[-1].hashes.append(hashes[-1])
                runs[-1].token_ids.append(block_tokens)
            else:
                runs.append(BlocksStored(parent, [hashes[-1]], [block_tokens]))
        for run in runs:
            self.events.add(run)

    def clear(self) -> None:
        """Forget every cached block (a flush)."""
        self.kv_cache.pool.clear_cached()

    def release(self, slot: int) -> None:
        """Free the slot; its cached blocks stay cached until the pool needs them."""
        del self._hashes[slot]
        self.kv_cache.free(slot)
