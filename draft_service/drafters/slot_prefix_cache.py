"""The model drafter's prefix cache, over KV slots: a freed slot keeps its KV for the next sequence
that starts with the same tokens. The drafter's slot table (kv_slots.py) allocates through it.

Unlike the target's cache of shared blocks (target_service/prefix_cache.py), a kept slot's KV moves whole
to its next owner: the drafter rolls back and rewrites positions of its slots, so no block of it
could be shared.

A slot holds the KV of the tokens its last sequence ran through the model. When the sequence ends,
the slot is kept with those tokens. A new sequence takes the free slot whose kept tokens share the
longest prefix with its prompt, and prefills only the rest: the next turn of a conversation, or
another request with the same system prompt. Without a match it takes a slot that keeps nothing,
else the one freed longest ago. A kept slot holds the KV blocks of its tokens (kv_cache.py); the
drafter's pool has a slot's worth of blocks for every slot, so keeping never runs it short. The
key is the tokens alone: each service holds one model, and the decoders' rows do not depend on
their batch (the native decoder bit for bit), so the kept KV is the one a prefill would compute.
"""
from __future__ import annotations

import os
from collections import OrderedDict

from tandem.model.kv_cache import KVCache


class SlotPrefixCache:
    def __init__(self, kv_cache: KVCache, enabled: bool = True):
        self.kv_cache = kv_cache
        self.enabled = enabled
        self._kept: OrderedDict[int, tuple[int, ...]] = OrderedDict()  # free slot -> its KV's tokens, oldest first

    def allocate(self, prompt_ids: list[int]) -> tuple[int, int]:
        """A free slot for the prompt, and how many of the prompt's first tokens already have their KV
        there: at most all but the last, which runs for its logits (none for an empty prompt)."""
        best, cached, prompt = None, 0, tuple(prompt_ids)
        for slot, tokens in self._kept.items():
            shared = len(os.path.commonprefix([tokens, prompt]))
            if shared > cached:
                best, cached = slot, shared
        if best is None:
            keeping_nothing = [slot for slot in self.kv_cache.free_slots if slot not in self._kept]
            best = keeping_nothing[-1] if keeping_nothing else next(iter(self._kept))
        self._kept.pop(best, None)
        cached = min(cached, max(0, len(prompt_ids) - 1))
        self.kv_cache.take(best)
        self.kv_cache.shrink(best, cached)  # blocks past the reused prefix hold nothing its new owner wants
        return best, cached

    def release(self, slot: int, tokens: list[int]) -> None:
        """Free the slot; it keeps the KV of `tokens` (nothing, when empty or caching is off), and
        the blocks past them go back to the pool."""
        keep = tokens if self.enabled else []
        self.kv_cache.free(slot, keep=len(keep))
        if keep:
            self._kept[slot] = tuple(keep)
