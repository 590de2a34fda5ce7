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

    @property
    def free_slots(self) -> list[int]:
        """The free slots, the one allocate() hands out next last."""
        return list(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise CacheFullError(f"all {self.num_slots} KV slots are in use")
        return self._free.pop()

    def take(self, slot: int) -> int:
        """Allocate this free slot (one whose KV its next owner wants to keep)."""
        if slot not in self._free:
            raise ValueError(f"slot {slot} is not free")
        self._free.remove(slot)
        return slot

    def free(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots or slot in self._free:
            raise ValueError(f"slot {slot} is not allocated")
        self._free.append(slot)

    def bytes_per_token(self) -> int:
        return self._bytes_per_token

    def copy_positions(self, source: int, dest: int, start: int, end: int) -> None:
        """Copies the K and V of positions [start, end) of slot `source` into slot `dest`, in every layer.

        Lets one sequence's context continue in several slots (a drafter's pre-drafted outcomes)
        without recomputing the prefix they share. Positions outside the range are left as they are.
        """
        if source == dest or not (0 <= source < self.num_slots and 0 <= dest < self.num_slots):
            raise ValueError(f"cannot copy slot {source} to slot {dest} of {self.num_slots}")
        if not 0 <= start <= end <= self.max_len:
            raise ValueError(f"positions [{start}, {end}) are not inside [0, {self.max_len})")
        for k, v in zip(self.k, self.v):
            v[dest, :, start:end] = v[source, :, start:end]
            if self.key_block is None:
                k[dest, :, start:end] = k[source, :, start:end]
            else:
                _copy_blocked(k, source, dest, start, end, self.key_block)


def _copy_blocked(k: torch.Tensor, source: int, dest: int, start: int, end: int, block: int) -> None:
    """Positions [start, end) of a blocked K [slots, heads, blocks, head_dim, block]: at most three copies,
    the partial block at each end and the whole blocks between them."""
    first_whole, end_whole = -(-start // block), end // block
    if first_whole > end_whole:  # the range lies inside one block
        b, lo, hi = start // block, start % block, end - start // block * block
        k[dest, :, b, :, lo:hi] = k[source, :, b, :, lo:hi]
        return
    if start % block:
        k[dest, :, first_whole - 1, :, start % block :] = k[source, :, first_whole - 1, :, start % block :]
    k[dest, :, first_whole:end_whole] = k[source, :, first_whole:end_whole]
    if end % block:
        k[dest, :, end_whole, :, : end % block] = k[source, :, end_whole, :, : end % block]
