"""The model drafter's KV slots: each sequence's own slot, and scratch slots for its pre-drafts.

A pre-draft (predraft.py) continues a context that the sequence's own slot holds only in part:
the committed tokens and the drafts d1..dj are there, the assumed next token b is not. It gets a
scratch slot with that shared prefix copied in (KVCache.copy_positions), so that every outcome of
every sequence is one more row of the same forwards. When the target then commits exactly one
outcome's tokens, that outcome's scratch slot already holds the context, and `settle` makes it the
sequence's own slot: no recompute.

Scratch slots come from the same pool as the sequences' own slots, and an Open always gets one:
it takes a scratch slot when none is free, so pre-drafts never keep a sequence from being drafted.
A scratch slot drafted since the sequence last settled is live (the target may yet commit its
outcome); after `settle` it is spare. The same sequence's next pre-drafts reuse its spare slots
first (only the positions that changed are copied again), other sequences' take them when no slot
is free, and only an Open takes a live one.

Every slot comes from a prefix cache (slot_prefix_cache.py): a closed sequence's slots keep their
tokens, and a sequence's first catch-up (`adopt`) moves it to the free slot holding the longest
prefix of its tokens, so that the next turn of a conversation prefills only what is new. Opens and
scratch slots take a slot that keeps nothing, else the one kept longest. An
EAGLE-3 slot keeps its target features with it; the head's catch-up trims what the target's
features did not compute (`FeatureCache.exact_rows`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from draft_service.drafter import SeqKey, common_prefix_len
from tandem.model.kv_cache import CacheFullError, KVCache
from draft_service.drafters.slot_prefix_cache import SlotPrefixCache


@dataclass(slots=True)
class SlotState:
    slot: int
    cached: list[int]  # the tokens whose KV the slot holds at positions 0..len-1
    # The committed length when the slot was last drafted from: beyond it lie drafts or assumed tokens.
    committed_len: int = 0
    live: bool = False  # a scratch slot drafted since its sequence last settled


@dataclass(slots=True)
class SequenceSlots:
    own: SlotState
    scratch: list[SlotState] = field(default_factory=list)


class SlotTable:
    """Which slot holds what; runs on the drafter's thread, like every drafter method."""

    def __init__(self, kv_cache: KVCache, prefix_caching: bool = True):
        self._kv = kv_cache
        self._cache = SlotPrefixCache(kv_cache, prefix_caching)
        self._sequences: dict[SeqKey, SequenceSlots] = {}

    def open(self, key: SeqKey) -> None:
        self._sequences[key] = SequenceSlots(SlotState(self._slot_for_open(), []))

    def close(self, key: SeqKey) -> None:
        """Frees the sequence's slots, its own last: the one with its whole history is evicted last."""
        slots = self._sequences.pop(key)
        for state in (*slots.scratch, slots.own):
            self._cache.release(state.slot, state.cached)

    def own(self, key: SeqKey) -> SlotState:
        return self._sequences[key].own

    def adopt(self, key: SeqKey, tokens: list[int]) -> None:
        """Before a sequence's first catch-up: its own slot becomes the free one holding the longest
        prefix of `tokens` (its own, when none holds more)."""
        own = self._sequences[key].own
        if own.cached or own.committed_len:
            return
        self._cache.release(own.slot, [])
        own.slot, held = self._cache.allocate(tokens)
        own.cached = tokens[:held]

    def scratch(self, key: SeqKey) -> list[SlotState]:
        return self._sequences[key].scratch

    def settle(self, key: SeqKey, committed: list[int]) -> int:
        """The slot that holds the longest prefix of the committed tokens becomes the sequence's own
        (a scratch slot, when the target committed its outcome); every scratch slot becomes spare.

        Returns the committed tokens that a scratch slot made own held already: KV not recomputed.
        """
        slots = self._sequences.get(key)
        if slots is None:  # closed in this round
            return 0
        best = max(slots.scratch, key=lambda s: common_prefix_len(s.cached, committed), default=None)
        held = 0 if best is None else common_prefix_len(best.cached, committed)
        swapped = best is not None and held > common_prefix_len(slots.own.cached, committed, slots.own.committed_len)
        if swapped:
            slots.scratch.remove(best)
            slots.scratch.append(slots.own)
            slots.own = best
        for state in slots.scratch:
            state.live = False
        slots.own.live = False
        if not swapped:
            return 0
        reused = max(0, held - best.committed_len)
        best.committed_len = max(best.committed_len, held)
        return reused

    def scratch_for(self, key: SeqKey, tokens: list[int]) -> SlotState | None:
        """A live scratch slot holding the KV of a prefix of `tokens`, copied from the sequence's own slot
        up to (not including) the last token, which the drafter feeds for its logits. None: no room."""
        slots = self._sequences[key]
        state = self._spare_of(slots, tokens) or self._free_slot(slots) or self._spare_of_others(key, slots)
        if state is None:
            return None
        state.live = True
        have = common_prefix_len(state.cached, tokens)
        copy_to = min(common_prefix_len(slots.own.cached, tokens, slots.own.committed_len), len(tokens) - 1)
        if copy_to > have:
            self._kv.copy_positions(slots.own.slot, state.slot, have, copy_to)
        state.cached = tokens[: max(have, copy_to)]
        return state

    def _spare_of(self, slots: SequenceSlots, tokens: list[int]) -> SlotState | None:
        spare = [s for s in slots.scratch if not s.live]
        return max(spare, key=lambda s: common_prefix_len(s.cached, tokens), default=None)

    def _free_slot(self, slots: SequenceSlots) -> SlotState | None:
        """A free slot: one that keeps nothing, else the one kept longest (not the best match, which
        another conversation's next turn may want)."""
        if not self._kv.num_free_slots:
            return None
        state = SlotState(self._cache.allocate([])[0], [])  # the prefix is copied from the sequence's own slot
        slots.scratch.append(state)
        return state

    def _spare_of_others(self, key: SeqKey, slots: SequenceSlots) -> SlotState | None:
        """A spare slot taken from another sequence; its tokens may still share a prefix (a system prompt)."""
        for other_key, other in self._sequences.items():
            spare = next((s for s in other.scratch if not s.live), None)
            if other_key != key and spare is not None:
                other.scratch.remove(spare)
                slots.scratch.append(spare)
                return spare
        return None

    def _slot_for_open(self) -> int:
        """A free slot, else a scratch slot: spare ones first, live ones last."""
        if self._kv.num_free_slots:
            return self._cache.allocate([])[0]
        for live in (False, True):
            for other in self._sequences.values():
                state = next((s for s in other.scratch if s.live == live), None)
                if state is not None:
                    other.scratch.remove(state)
                    return state.slot
        raise CacheFullError(f"all {self._kv.num_slots} KV slots are in use")
