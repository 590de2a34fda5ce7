"""The target's KV events as numbered batches: what VllmEngine's SubscribeKvEvents streams.

After each step the engine publishes the events its prefix cache recorded (tandem/kv_events.py) as
one `KvEventBatch`, numbered from 1 with no gap, as vLLM numbers its event batches. A subscriber
gets every batch from the moment it subscribes. One that resumes (`start_sequence_number`, the
last batch it applied) first gets the batches after it again, from the last `history` kept; a
cursor outside them is OUT_OF_RANGE (the Shepherd Model Gateway then retries with backoff). A
subscriber more than `history` batches behind is dropped: its stream ends, and it resumes. Every
stream ends when the server drains (`close`), so that no subscription holds its shutdown.
"""
from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from collections.abc import AsyncIterator

import grpc
from smg_grpc_proto.generated import common_pb2

from target_service.errors import RequestError
from tandem.kv_events import AllBlocksCleared, BlocksRemoved, BlocksStored, KvEvent

HISTORY = 4096  # batches kept for resuming subscribers


class KvEventStream:
    def __init__(self, history: int = HISTORY):
        self._history: deque[common_pb2.KvEventBatch] = deque(maxlen=history)
        self._subscribers: set[asyncio.Queue] = set()
        self._next_batch = 1
        self._event_ids = itertools.count(1)
        self._closed = False

    @property
    def last_sequence_number(self) -> int:
        return self._next_batch - 1

    def publish(self, events: list[KvEvent]) -> None:
        """One batch of a step's events, to every subscriber (nothing when there are none)."""
        if not events:
            return
        batch = common_pb2.KvEventBatch(sequence_number=self._next_batch, timestamp=time.time(),
                                        events=[self._message(event) for event in events])
        self._next_batch += 1
        self._history.append(batch)
        for queue in list(self._subscribers):
            if queue.qsize() >= self._history.maxlen:  # too far behind: it resumes from its cursor
                self._subscribers.discard(queue)
                queue.put_nowait(None)
            else:
                queue.put_nowait(batch)

    def close(self) -> None:
        """End every stream, and those subscribed later at once."""
        self._closed = True
        for queue in self._subscribers:
            queue.put_nowait(None)
        self._subscribers.clear()

    def subscribe(self, after: int) -> AsyncIterator[common_pb2.KvEventBatch]:
        """The batches numbered past `after` (0: from now on), kept ones first, then each one published
        from this call on. OUT_OF_RANGE (a RequestError) when `after` cannot be resumed."""
        replay = self._replay(after)
        queue: asyncio.Queue = asyncio.Queue()
        if self._closed:
            queue.put_nowait(None)
        else:
            self._subscribers.add(queue)
        return self._stream(replay, queue)

    async def _stream(self, replay: list[common_pb2.KvEventBatch],
                      queue: asyncio.Queue) -> AsyncIterator[common_pb2.KvEventBatch]:
        try:
            for batch in replay:
                yield batch
            while (batch := await queue.get()) is not None:
                yield batch
        finally:
            self._subscribers.discard(queue)

    def _replay(self, after: int) -> list[common_pb2.KvEventBatch]:
        if after == 0:
            return []
        oldest = self._history[0].sequence_number if self._history else self._next_batch
        if not oldest - 1 <= after <= self.last_sequence_number:
            raise RequestError(
                grpc.StatusCode.OUT_OF_RANGE,
                f"start_sequence_number {after} cannot be resumed: this server has batches "
                f"{oldest} to {self.last_sequence_number}; subscribe with 0 for new events")
        return [batch for batch in self._history if batch.sequence_number > after]

    def _message(self, event: KvEvent) -> common_pb2.KvCacheEvent:
        message = common_pb2.KvCacheEvent(event_id=next(self._event_ids))
        if isinstance(event, BlocksStored):
            message.stored.blocks.extend(common_pb2.KvBlock(block_hash=h, token_ids=tokens, block_size=len(tokens))
                                         for h, tokens in zip(event.hashes, event.token_ids))
            if event.parent is not None:
                message.stored.parent_block_hash = event.parent
        elif isinstance(event, BlocksRemoved):
            message.removed.block_hashes.extend(event.hashes)
        elif isinstance(event, AllBlocksCleared):
            message.cleared.SetInParent()
        return message
