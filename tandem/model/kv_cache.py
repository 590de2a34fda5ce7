"""A preallocated KV cache with one slot per running sequence."""
from __future__ import annotations

import torch

from tandem.config import ModelConfig


class CacheFullError(RuntimeError):
    """Every KV slot is taken."""


class KVCache:
    """Per-layer K and V tensors of shape [num_slots, num_kv_heads, max_len, head_dim].

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
    ):
        shape = (num_slots, config.num_kv_heads, max_len, config.head_dim)
        # Zeros, not empty: masked-out entries are multiplied by a zero weight, and 0 * NaN = NaN.
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
        self.num_slots = num_slots
        self.max_len = max_len
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
        layer = self.k[0]
        per_layer = layer.shape[1] * layer.shape[3] * layer.element_size()
        return 2 * per_layer * len(self.k)
