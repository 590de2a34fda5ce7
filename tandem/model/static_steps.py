"""Decode and verify steps through a forward whose shapes do not move: CUDA graphs on CUDA.

A step in which every sequence brings the same number T of new tokens and wants logits at all
of them (T = 1 to decode, k + 1 to verify k drafts) runs `TorchDecoder.forward_uniform` on
preallocated inputs sized for a bucket of batch sizes (1, 2, 4, 8, ...). A batch of B sequences
is padded up to the next bucket with rows on the KV cache's padding slot, which no sequence owns.

On CUDA each (bucket, T) is captured once, on first use, into a CUDA graph, and each step copies
its token ids, first positions and slots into the graph's input and replays it: one launch per
step instead of some twenty kernels per layer, each waiting on Python. On CPU the same forward
runs eagerly, which is how the CPU tests check it against the dynamic path.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tandem.model.batch import SequenceChunk
from tandem.model.kv_cache import KVCache

if TYPE_CHECKING:
    from tandem.model.torch_decoder import TorchDecoder

MAX_STEP_TOKENS = 8  # decode, and verify of up to 7 drafts; longer uniform chunks take the dynamic path
WARMUP_RUNS = 2  # before a capture: compiles the Triton kernel and sets up cuBLAS outside the graph


@dataclass(slots=True)
class UniformBatch:
    """A decode or verify step: every chunk brings num_new tokens and wants logits at all of them."""

    chunks: list[SequenceChunk]
    num_new: int


@dataclass(slots=True)
class StaticInputs:
    """One (bucket, T)'s input, rewritten before each step; its CUDA graph reads it in place."""

    packed: torch.Tensor  # [bucket, T + 2] int64: a row's T token ids, its first position, its slot
    graph: torch.cuda.CUDAGraph | None = None
    logits: torch.Tensor | None = None  # [bucket * T, head_rows] float32, the graph's output


def batch_buckets(max_batch: int) -> list[int]:
    """Powers of two up to the first one >= max_batch: the batch sizes steps are padded to."""
    buckets = [1]
    while buckets[-1] < max_batch:
        buckets.append(buckets[-1] * 2)
    return buckets


class StaticStepRunner:
    """Runs uniform steps for a TorchDecoder, captured into CUDA graphs when it is on CUDA."""

    def __init__(self, decoder: TorchDecoder, kv_cache: KVCache):
        if kv_cache.padding_slot is None:
            raise ValueError("static steps pad batches on a spare KV slot: build the cache with spare_slot=True")
        if kv_cache.num_blocks_of(kv_cache.padding_slot) * kv_cache.block_size < MAX_STEP_TOKENS:
            raise ValueError(f"the padding slot's blocks hold fewer than the {MAX_STEP_TOKENS} positions a padded "
                             "step writes")
        self.decoder = decoder
        self.padding_slot = kv_cache.padding_slot
        self.buckets = batch_buckets(kv_cache.num_slots)
        self.use_graphs = decoder.device.type == "cuda"
        self.steps_run: Counter[tuple[int, int]] = Counter()  # per (bucket, T): what ran, for checks
        self._inputs: dict[tuple[int, int], StaticInputs] = {}
        # One memory pool for every graph: steps run one at a time, so their activations can share it.
        self._pool = torch.cuda.graph_pool_handle() if self.use_graphs else None

    @property
    def num_graphs(self) -> int:
        return sum(inputs.graph is not None for inputs in self._inputs.values())

    def accepts(self, chunks: list[SequenceChunk]) -> bool:
        """Whether these chunks make a uniform step (prefills and mixed batches do not)."""
        num_new = len(chunks[0].token_ids)
        return (num_new <= MAX_STEP_TOKENS and len(chunks) <= self.buckets[-1]
                and all(len(c.token_ids) == num_new and c.num_logits == num_new for c in chunks))

    def run(self, batch: UniformBatch) -> torch.Tensor:
        """float32 logits [B * T, head_rows], rows in chunk order, as the dynamic forward returns them."""
        bucket = next(size for size in self.buckets if size >= len(batch.chunks))
        inputs = self._inputs_for(bucket, batch.num_new)
        inputs.packed.copy_(_packed_rows(batch.chunks, batch.num_new, bucket, self.padding_slot))
        if inputs.graph is not None:
            inputs.graph.replay()
            logits = inputs.logits
        else:
            logits = self._forward(inputs.packed, batch.num_new)
        self.steps_run[(bucket, batch.num_new)] += 1
        # A copy: the next replay overwrites the graph's output.
        return logits[: len(batch.chunks) * batch.num_new].clone()

    def _inputs_for(self, bucket: int, num_new: int) -> StaticInputs:
        key = (bucket, num_new)
        if key not in self._inputs:
            # Until the first step writes it, every row is padding: warm-up runs write only there.
            packed = _packed_rows([], num_new, bucket, self.padding_slot).to(self.decoder.device)
            inputs = StaticInputs(packed)
            if self.use_graphs:
                inputs.graph, inputs.logits = self._capture(packed, num_new)
            self._inputs[key] = inputs
        return self._inputs[key]

    def _capture(self, packed: torch.Tensor, num_new: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):
                self._forward(packed, num_new)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: CUDA calls of other threads (a server's event loop) must not void the capture.
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            logits = self._forward(packed, num_new)
        return graph, logits

    def _forward(self, packed: torch.Tensor, num_new: int) -> torch.Tensor:
        """packed [bucket, T + 2] -> logits [bucket * T, head_rows]; only device ops, so it can be captured."""
        token_ids = packed[:, :num_new]  # [bucket, T]
        positions = packed[:, num_new : num_new + 1] + torch.arange(num_new, device=packed.device)  # [bucket, T]
        slot_ids = packed[:, num_new + 1].contiguous()  # [bucket]
        return self.decoder.forward_uniform(token_ids, positions, slot_ids)


def _packed_rows(chunks: list[SequenceChunk], num_new: int, bucket: int, padding_slot: int) -> torch.Tensor:
    """[bucket, T + 2] on the host: the chunks' rows, then padding rows (token 0 from position 0 of
    the padding slot)."""
    rows = [[*c.token_ids, c.start, c.slot] for c in chunks]
    padding = [0] * num_new + [0, padding_slot]
    return torch.tensor(rows + [padding] * (bucket - len(rows)), dtype=torch.long)
