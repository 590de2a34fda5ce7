"""The model drafter's slot table over a prefix cache: which slot a new sequence ends up in."""
from __future__ import annotations

import torch

from draft_service.drafters.kv_slots import SlotTable
from tandem.model.kv_cache import KVCache
from tandem.model.random_weights import SHAPES


def _table(num_slots: int) -> tuple[SlotTable, KVCache]:
    cache = KVCache(SHAPES["tiny"], num_slots, 32, torch.float32, torch.device("cpu"))
    return SlotTable(cache), cache


def _ran(table: SlotTable, cache: KVCache, key: tuple[int, int], tokens: list[int]) -> None:
    """The sequence's slot holds the KV of these tokens, as if the model had run them."""
    table.own(key).cached = tokens
    cache.reserve(table.own(key).slot, len(tokens))


def test_a_closed_sequences_own_slot_outlives_its_scratch_slots_for_the_next_turn():
    """With every free slot keeping something, an Open evicts the slot kept longest: the closed
    sequence's scratch slot, not its own, which holds the whole history."""
    table, cache = _table(2)
    table.open((1, 1))
    _ran(table, cache, (1, 1), [1, 2, 3, 4])
    scratch = table.scratch_for((1, 1), [1, 2, 3, 9])
    assert scratch.cached == [1, 2, 3]  # copied from the own slot, up to the fed last token
    table.close((1, 1))
    table.open((1, 2))
    table.adopt((1, 2), [1, 2, 3, 4, 5])
    assert table.own((1, 2)).cached == [1, 2, 3, 4]


def test_a_scratch_slot_leaves_another_conversations_history_alone():
    """A pre-draft copies its prefix from its own sequence's slot: it takes a slot that keeps
    nothing, even when a kept history shares its first tokens."""
    table, cache = _table(4)
    table.open((1, 1))
    _ran(table, cache, (1, 1), [5, 6, 7, 8])
    table.close((1, 1))
    table.open((1, 2))
    _ran(table, cache, (1, 2), [5, 6, 1])  # the same system prompt, another conversation
    table.scratch_for((1, 2), [5, 6, 1, 2])
    table.open((1, 3))
    table.adopt((1, 3), [5, 6, 7, 8, 9])  # the first conversation's next turn
    assert table.own((1, 3)).cached == [5, 6, 7, 8]
