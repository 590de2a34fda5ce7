"""The target's prefix cache: full blocks found by the hash chained over their tokens."""
from __future__ import annotations

import torch

from tandem.kv_events import AllBlocksCleared, BlocksRemoved, BlocksStored
from tandem.model.kv_cache import DEFAULT_BLOCK_SIZE, KVCache
from tandem.model.random_weights import SHAPES
from target_service.prefix_cache import PrefixCache, chained_hashes

TOKENS = list(range(100, 150))  # three full blocks and two tokens


def block_hashes(tokens: list[int], block_size: int) -> list[int]:
    return [h for h, _ in chained_hashes(tokens, block_size)]


def _cache(num_blocks: int = 12, enabled: bool = True) -> PrefixCache:
    kv = KVCache(SHAPES["tiny"], 4, 64, torch.float32, torch.device("cpu"), num_blocks=num_blocks)
    return PrefixCache(kv, enabled)


def _run(cache: PrefixCache, tokens: list[int], computed: int) -> int:
    """A slot that holds the KV of the tokens' first `computed`, with its full blocks cached."""
    slot, _ = cache.allocate(tokens)
    cache.kv_cache.reserve(slot, len(tokens))
    cache.cache_blocks(slot, tokens, computed)
    return slot


def _found(cache: PrefixCache, tokens: list[int], reuse: bool = True) -> int:
    """How many of the tokens a new slot finds cached (the slot is released again)."""
    slot, cached = cache.allocate(tokens, reuse)
    cache.release(slot)
    return cached


def test_each_block_hash_covers_every_token_before_it():
    hashes = block_hashes(TOKENS, 16)
    assert len(hashes) == 3 and len(set(hashes)) == 3
    assert block_hashes(TOKENS[:32], 16) == hashes[:2]
    changed = [TOKENS[0] + 1, *TOKENS[1:]]
    assert not set(block_hashes(changed, 16)) & set(hashes), "a changed first token changes every later hash"


def test_a_prompt_finds_the_longest_run_of_cached_blocks_that_starts_it():
    cache = _cache()
    first = _run(cache, TOKENS, len(TOKENS))
    slot, cached = cache.allocate(TOKENS[:40] + [7] * 10)
    assert cached == 32 and cache.kv_cache.block_table(slot)[:2] == cache.kv_cache.block_table(first)[:2]
    diverged = TOKENS[:16] + [7] * 16 + TOKENS[32:]
    assert _found(cache, diverged) == 16, "a later block after a miss is not found"
    assert _found(cache, TOKENS[:48]) == 32, "the last prompt token runs: its block is not found"
    assert _found(cache, TOKENS[:49]) == 48


def test_only_blocks_whose_kv_is_computed_are_cached():
    cache = _cache()
    slot = _run(cache, TOKENS, 20)
    assert _found(cache, TOKENS) == 16
    cache.cache_blocks(slot, TOKENS, 48)
    assert _found(cache, TOKENS) == 48


def test_a_released_slots_blocks_stay_cached_until_the_pool_needs_them():
    cache = _cache(num_blocks=4)
    cache.release(_run(cache, TOKENS, len(TOKENS)))  # four blocks: three cached, one not
    assert _found(cache, TOKENS) == 48
    cache.kv_cache.reserve(cache.allocate([])[0], 2 * DEFAULT_BLOCK_SIZE)  # the uncached block, then the last block
    assert cache.kv_cache.pool.num_cached == 2 and _found(cache, TOKENS) == 32, "the first blocks are evicted last"


def test_without_reuse_or_with_caching_off_nothing_is_found():
    cache = _cache()
    _run(cache, TOKENS, len(TOKENS))
    assert _found(cache, TOKENS, reuse=False) == 0
    off = _cache(enabled=False)
    _run(off, TOKENS, len(TOKENS))
    assert _found(off, TOKENS) == 0 and off.kv_cache.pool.num_cached == 0


def test_the_blocks_cached_evicted_and_cleared_are_recorded_as_kv_events():
    cache = _cache(num_blocks=4)
    cache.release(_run(cache, TOKENS, 20))  # one block's KV computed
    slot = _run(cache, TOKENS, 48)  # finds it, computes two more
    hashes = block_hashes(TOKENS, 16)
    assert cache.events.take() == [
        BlocksStored(None, hashes[:1], [TOKENS[:16]]),
        BlocksStored(hashes[0], hashes[1:3], [TOKENS[16:32], TOKENS[32:48]]),
    ]
    cache.release(slot)
    cache.kv_cache.reserve(cache.allocate([])[0], 2 * DEFAULT_BLOCK_SIZE)  # an uncached block, then the last cached one
    assert cache.events.take() == [BlocksRemoved([hashes[2]])]
    cache.clear()
    assert cache.events.take() == [AllBlocksCleared()] and _found(cache, TOKENS) == 0


def test_a_prefix_two_slots_computed_is_stored_once_and_outlives_the_first_slot():
    """Two slots computed the same first block in one step: it is recorded once, and the second's next
    block is stored with it as its parent. When the first slot's blocks are evicted, the second's
    still serve the whole prefix, and nothing is recorded removed."""
    cache = _cache(num_blocks=8)
    a, b = _run(cache, TOKENS, 0), _run(cache, TOKENS, 0)
    cache.cache_blocks(a, TOKENS, 16)
    cache.cache_blocks(b, TOKENS, 32)
    hashes = block_hashes(TOKENS, 16)
    assert cache.events.take() == [BlocksStored(None, hashes[:1], [TOKENS[:16]]),
                                   BlocksStored(hashes[0], hashes[1:2], [TOKENS[16:32]])]
    cache.release(a)
    cache.kv_cache.reserve(cache.allocate([])[0], 4 * DEFAULT_BLOCK_SIZE)  # a's four blocks, evicted
    assert cache.events.take() == [] and _found(cache, TOKENS) == 32


def test_with_larger_blocks_prefixes_are_cached_in_whole_blocks_of_that_size():
    kv = KVCache(SHAPES["tiny"], 4, 64, torch.float32, torch.device("cpu"), num_blocks=8, block_size=32)
    cache = PrefixCache(kv)
    _run(cache, TOKENS, len(TOKENS))
    assert _found(cache, TOKENS) == 32 and _found(cache, TOKENS[:33]) == 32 and _found(cache, TOKENS[:32]) == 0
    [stored] = cache.events.take()
    assert stored.hashes == block_hashes(TOKENS, 32) and stored.token_ids == [TOKENS[:32]]
