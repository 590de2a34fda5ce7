"""A preallocated KV cache with one slot per running sequence."""
from __future__ import annotations

import torch

from tandem.config import ModelConfig


class CacheFullError(RuntimeError):
    """Every KV slot is taken."""


class KVCache:
    """Per-layer K and V tensors, one slot per sequence.

    V is [num_slots, num_kv_heads, positions, head_dim]. K has the same shape, or, with
    `key_block` set (the native CPU decoder), [num_slots, num_kv_heads, positions / key_block,
    head_dim, key_block]: blocks of positions stored transposed, so that the scores of a block are
    key_block-wide vector operations. `positions` is max_len rounded up to whole blocks.

    With `spare_slot`, the tensors hold one more slot, `padding_slot`, that allocate() never hands
    out: the padding rows of static-shape steps (static_steps.py) write their K/V there.

    A sequence's length lives with its owner (the scheduler), not here: rolling back rejected
    positions only shortens that length, and later writes overwrite the stale entries.
    """

    def __init__(
        self,
        config: ModelConfig,
        num_slots: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device,
        key_block: int | None = None,
        spare_slot: bool = False,
    ):
        self.positions = max_len if key_block is None else -(-max_len // key_block) * key_block
        self.padding_slot = num_slots if spare_slot else None
        slots = num_slots + (1 if spare_slot else 0)
        v_shape = (slots, config.num_kv_heads, self.positions, config.head_dim)
        k_shape = v_shape if key_block is None else (
            slots, config.num_kv_heads, self.positions // key_block, config.head_dim, key_block)
        # Zeros, not empty: masked-out entries are multiplied by a zero weight, and 0 * NaN = NaN.
        self.k = [torch.zeros(k_shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
        self.v = [torch.zeros(v_shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
        self.key_block = key_block
        self.num_slots = num_slots
        self.max_len = max_len
        self._bytes_per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim * dtype.itemsize
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise CacheFullError(f"all {self.num_slots} KV slots are in use")
        return self._free.pop()

    def free(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots or slot in self._free:
            raise ValueError(f"slot {slot} is not allocated")
        self._free.append(slot)

    def bytes_per_token(self) -> int:
        return self._bytes_per_token
