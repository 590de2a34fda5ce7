"""A paged KV cache: a pool of fixed-size blocks, and a block table per sequence slot."""
from __future__ import annotations

import mmap
import math

import numpy as np
import torch

from tandem.config import ModelConfig
from tandem.model.block_pool import BlockPool, CacheFullError

__all__ = ["DEFAULT_BLOCK_SIZE", "KV_CACHE_DTYPES", "PAGE_SIZE", "CacheFullError", "KVCache"]

PAGE_SIZE = 16  # positions per page: what every attention path reads a block table in; the native decoder's K pages
DEFAULT_BLOCK_SIZE = 16  # positions per KV block, as in vLLM: a multiple of PAGE_SIZE (--block-size)
# --kv-cache-dtype; auto (None): build_model's choice. --dtype takes these names too (runtime._DTYPES):
# a type only a cache can hold (fp8, say) needs --dtype's table to leave it out.
KV_CACHE_DTYPES = {"auto": None, "bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
KV_CACHE_DTYPE_HELP = ("auto, bfloat16, float16 or float32: the KV cache's element type (auto: --dtype, but "
                       "float16 for bfloat16 when a GGUF runs in its own block types on the native CPU decoder, "
                       "as llama.cpp keeps it); one other than --dtype needs the native CPU decoder")


class KVCache:
    """Per-layer K and V tensors holding a pool of blocks; a slot is one sequence's block table.

    A block (`block_size` positions, what the pool allocates and the prefix cache keys) is
    block_size / PAGE_SIZE consecutive pages, and the attention paths read pages: block b holds
    pages b * pages_per_block onwards. V is [kv_heads, pool positions, head_dim], where pool
    position g * PAGE_SIZE + i is entry i of page g. K has the same shape, or, with
    `transposed_keys` (the native CPU decoder), [kv_heads, pages, head_dim, PAGE_SIZE]: each page
    stored transposed, so that its scores are PAGE_SIZE-wide vector operations. Heads come first so
    that a run of consecutive pages is a view of [kv_heads, positions, head_dim], as a slot of a
    contiguous cache would be.

    `block_tables` [slots, max pages] int32 maps a slot's position p to page
    block_tables[slot, p // PAGE_SIZE]; every attention path reads K and V through it. A slot
    gets blocks as it grows (`reserve`); freeing it returns the blocks past what it keeps. Slots
    may hold the same block (`attach`, `share_prefix`): the pool counts them (block_pool.py), and
    a shared block is one whose positions no holder writes again.

    With `spare_slot`, there is one more slot, `padding_slot`, that allocate() never hands out,
    with one block of its own: the padding rows of static-shape steps (static_steps.py) write their
    K/V there.

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
        transposed_keys: bool = False,
        spare_slot: bool = False,
        num_blocks: int | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
    ):
        """num_blocks: the pool's size; by default every slot can reach max_len at once."""
        if block_size < PAGE_SIZE or block_size % PAGE_SIZE:
            raise ValueError(f"the KV block size must be a multiple of {PAGE_SIZE}, got {block_size}")
        self.block_size = block_size
        self.pages_per_block = block_size // PAGE_SIZE
        self.max_blocks = -(-max_len // block_size)  # per slot
        self.positions = self.max_blocks * block_size  # max_len rounded up to whole blocks
        self.num_blocks = num_blocks if num_blocks is not None else num_slots * self.max_blocks
        self.padding_slot = num_slots if spare_slot else None
        pages = (self.num_blocks + (1 if spare_slot else 0)) * self.pages_per_block
        v_shape = (config.num_kv_heads, pages * PAGE_SIZE, config.head_dim)
        k_shape = (config.num_kv_heads, pages, config.head_dim, PAGE_SIZE) if transposed_keys else v_shape
        # Zeros, not empty: masked-out entries are multiplied by a zero weight, and 0 * NaN = NaN.
        self.k = [_zeros(k_shape, dtype, device) for _ in range(config.num_layers)]
        self.v = [_zeros(v_shape, dtype, device) for _ in range(config.num_layers)]
        self.dtype = dtype
        self.transposed_keys = transposed_keys
        self.num_slots = num_slots
        self.max_len = max_len
        self._bytes_per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim * dtype.itemsize
        self._free = list(range(num_slots - 1, -1, -1))
        self.pool = BlockPool(self.num_blocks)
        slots = num_slots + (1 if spare_slot else 0)
        self._tables: list[list[int]] = [[] for _ in range(slots)]
        # Unused entries point at page 0: attention never reads past a query's position.
        self.block_tables = torch.zeros(slots, self.max_blocks * self.pages_per_block, dtype=torch.int32,
                                        device=device)
        if spare_slot:
            self._append(num_slots, [self.num_blocks])

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    @property
    def free_slots(self) -> list[int]:
        """The free slots, the one allocate() hands out next last."""
        return list(self._free)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def usage(self) -> float:
        """The share of the pool's blocks held by allocated slots, each block once however many hold it
        (blocks that free slots keep, or that cache a prefix, are not counted)."""
        free = set(self._free)
        held = {block for slot, table in enumerate(self._tables[: self.num_slots]) if slot not in free
                for block in table}
        return len(held) / self.num_blocks

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

    def free(self, slot: int, keep: int = 0) -> None:
        """Free the slot; it keeps the blocks that hold its first `keep` positions, the rest go back."""
        if not 0 <= slot < self.num_slots or slot in self._free:
            raise ValueError(f"slot {slot} is not allocated")
        self._free.append(slot)
        self.shrink(slot, keep)

    def shrink(self, slot: int, keep: int) -> None:
        """Return the slot's blocks past those that hold its first `keep` positions to the pool."""
        table = self._tables[slot]
        kept = self.blocks_for(keep)
        self.pool.release(reversed(table[kept:]))  # its last blocks are evicted first
        del table[kept:]

    def blocks_for(self, positions: int) -> int:
        return -(-positions // self.block_size)

    def num_blocks_of(self, slot: int) -> int:
        return len(self._tables[slot])

    def bytes_per_token(self) -> int:
        return self._bytes_per_token

    def reserve(self, slot: int, length: int) -> None:
        """Give the slot blocks for positions [0, length)."""
        if length > self.positions:
            raise ValueError(f"{length} positions do not fit a slot of {self.positions}")
        table = self._tables[slot]
        needed = self.blocks_for(length) - len(table)
        if needed <= 0:
            return
        self._append(slot, self.pool.take(needed))

    def attach(self, slot: int, blocks: list[int]) -> None:
        """The slot, holding no blocks, holds these (a cached prefix) for its first positions."""
        if self._tables[slot]:
            raise ValueError(f"slot {slot} already holds blocks")
        for block in blocks:
            self.pool.hold(block)
        self._append(slot, blocks)

    def share_prefix(self, source: int, dest: int, length: int) -> None:
        """Slot `dest` gets the KV of slot `source`'s positions [0, length): their full blocks are
        shared (neither slot writes them again), the last partial block is copied."""
        self.reserve(dest, length)
        full = length // self.block_size
        src, dst = self._tables[source], self._tables[dest]
        differ = [i for i in range(full) if dst[i] != src[i]]
        for i in differ:
            self.pool.hold(src[i])
        self.pool.release([dst[i] for i in differ])
        dst[:full] = src[:full]
        pages = full * self.pages_per_block
        self.block_tables[dest, :pages] = self.block_tables[source, :pages]
        if length > full * self.block_size:
            self.copy_positions(source, dest, full * self.block_size, length)

    def _append(self, slot: int, blocks: list[int]) -> None:
        table, m = self._tables[slot], self.pages_per_block
        pages = [block * m + i for block in blocks for i in range(m)]
        self.block_tables[slot, len(table) * m : (len(table) + len(blocks)) * m] = torch.tensor(pages, dtype=torch.int32)
        table.extend(blocks)

    def block_table(self, slot: int) -> list[int]:
        """The slot's blocks, in position order."""
        return list(self._tables[slot])

    def pool_index(self, slots: list[int], length: int) -> torch.Tensor:
        """[len(slots), length] int64 on the cache's device: where each slot's positions 0..length-1
        sit in the pool, read from the block tables (past a slot's reserved blocks: stale entries)."""
        device = self.block_tables.device
        positions = torch.arange(length, device=device)
        tables = self.block_tables[torch.tensor(slots, device=device)]  # [S, max pages]
        return tables[:, positions // PAGE_SIZE].long() * PAGE_SIZE + positions % PAGE_SIZE

    def contiguous_start(self, slot: int, length: int) -> int | None:
        """The pool position of the slot's position 0 when positions [0, length) are one run of
        consecutive blocks (then K/V can be read as a view), else None."""
        table = self._tables[slot][: self.blocks_for(length)]
        if not table or table != list(range(table[0], table[0] + len(table))):
            return None
        return table[0] * self.block_size

    def copy_positions(self, source: int, dest: int, start: int, end: int) -> None:
        """Copies the K and V of positions [start, end) of slot `source` into slot `dest`, in every layer.

        Lets one sequence's context continue in several slots (a drafter's pre-drafted outcomes,
        the samples of one prompt) without recomputing the prefix they share. Positions outside the
        range are left as they are.
        """
        if source == dest or not (0 <= source < self.num_slots and 0 <= dest < self.num_slots):
            raise ValueError(f"cannot copy slot {source} to slot {dest} of {self.num_slots}")
        if not 0 <= start <= end <= self.max_len:
            raise ValueError(f"positions [{start}, {end}) are not inside [0, {self.max_len})")
        self.reserve(dest, end)
        src, dst = self.pool_index([source, dest], end)[:, start:]  # [end - start] each
        for k, v in zip(self.k, self.v):
            v[:, dst] = v[:, src]
            if self.transposed_keys:
                k[:, dst // PAGE_SIZE, :, dst % PAGE_SIZE] = k[:, src // PAGE_SIZE, :, src % PAGE_SIZE]
            else:
                k[:, dst] = k[:, src]


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.zeros; on CPU in anonymous memory that the OS zero-fills a page at a time on first
    write, so that the blocks no sequence has written yet take no resident memory."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    pages = np.frombuffer(mmap.mmap(-1, max(math.prod(shape) * dtype.itemsize, 1)), dtype=np.uint8)  # keeps the map
    return torch.from_numpy(pages).view(dtype)[: math.prod(shape)].view(shape)
