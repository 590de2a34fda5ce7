"""The model drafter's prefix cache over KV slots: which slot a sequence gets and how much of it is cached."""
from __future__ import annotations

import torch

from tandem.model.kv_cache import KVCache
from tandem.model.random_weights import SHAPES
from draft_service.drafters.slot_prefix_cache import SlotPrefixCache


def _cache(num_slots: int = 3, enabled: bool = True) -> SlotPrefixCache:
    return SlotPrefixCache(KVCache(SHAPES["tiny"], num_slots, 32, torch.float32, torch.device("cpu")), enabled)


def test_a_prompt_takes_the_slot_holding_its_longest_prefix():
    cache = _cache()
    slots = [cache.allocate([9])[0] for _ in range(3)]
    cache.release(slots[0], [1, 2, 3, 4, 5])
    cache.release(slots[1], [1, 2, 7])
    assert cache.allocate([1, 2, 3, 4, 8, 8]) == (slots[0], 4)
    cache.release(slots[0], [1, 2, 3, 4, 5])
    assert cache.allocate([1, 2, 3, 4, 5]) == (slots[0], 4), "the last prompt token runs, for its logits"
    cache.release(slots[2], [])
    assert cache.allocate([30, 31]) == (slots[2], 0), "a miss takes a slot that keeps nothing"
    assert cache.allocate([40]) == (slots[1], 0), "then the slot freed longest ago"
    assert cache.kv_cache.num_free_slots == 0


def test_without_prefix_caching_nothing_is_kept():
    cache = _cache(1, enabled=False)
    slot, _ = cache.allocate([1, 2, 3])
    cache.release(slot, [1, 2, 3])
    assert cache.allocate([1, 2, 3, 4]) == (slot, 0)


def test_an_empty_prompt_takes_a_slot_that_keeps_nothing_and_finds_nothing_cached():
    """The drafter opens a sequence before it knows its tokens."""
    cache = _cache(2)
    kept, _ = cache.allocate([1])
    cache.release(kept, [1, 2, 3])
    slot, cached = cache.allocate([])
    assert slot != kept and cached == 0
    assert cache.allocate([1, 2, 3, 4]) == (kept, 3)
