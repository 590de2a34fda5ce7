"""The KV event stream: numbered batches, what each event says, resuming, and ending."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from target_service.errors import RequestError
from target_service.kv_event_stream import KvEventStream
from tandem.kv_events import AllBlocksCleared, BlocksRemoved, BlocksStored

STORED = BlocksStored(parent=None, hashes=[11, -12], token_ids=[list(range(16)), list(range(16, 32))])


async def _next(stream, count: int = 1) -> list:
    return [await asyncio.wait_for(anext(stream), 5) for _ in range(count)]


async def test_batches_are_numbered_from_one_and_say_what_the_cache_did():
    events = KvEventStream()
    stream = events.subscribe(0)
    events.publish([STORED, BlocksStored(parent=-12, hashes=[13], token_ids=[list(range(32, 48))])])
    events.publish([])  # nothing happened: no batch
    events.publish([BlocksRemoved([11, -12]), AllBlocksCleared()])
    first, second = await _next(stream, 2)
    assert (first.sequence_number, second.sequence_number) == (1, 2)
    stored, chained = first.events
    assert [(b.block_hash, list(b.token_ids), b.block_size) for b in stored.stored.blocks] == [
        (11, list(range(16)), 16), (-12, list(range(16, 32)), 16)]
    assert not stored.stored.HasField("parent_block_hash") and chained.stored.parent_block_hash == -12
    removed, cleared = second.events
    assert list(removed.removed.block_hashes) == [11, -12] and cleared.HasField("cleared")
    assert [e.event_id for e in (*first.events, *second.events)] == [1, 2, 3, 4]
    await stream.aclose()


async def test_a_subscriber_resumes_after_the_last_batch_it_applied():
    events = KvEventStream(history=3)
    for _ in range(5):
        events.publish([STORED])
    resumed = events.subscribe(3)
    assert [b.sequence_number for b in await _next(resumed, 2)] == [4, 5]
    events.publish([STORED])
    assert [b.sequence_number for b in await _next(resumed)] == [6]
    await resumed.aclose()


@pytest.mark.parametrize("cursor", [1, 9], ids=["older than the history", "never published"])
def test_a_cursor_outside_the_history_is_out_of_range(cursor):
    events = KvEventStream(history=3)
    for _ in range(5):
        events.publish([STORED])
    with pytest.raises(RequestError) as refused:
        events.subscribe(cursor)
    assert refused.value.code is grpc.StatusCode.OUT_OF_RANGE
    assert "batches 3 to 5; subscribe with 0" in refused.value.message


async def test_a_subscriber_too_far_behind_is_dropped_and_close_ends_every_stream():
    events = KvEventStream(history=2)
    slow, live = events.subscribe(0), events.subscribe(0)
    events.publish([STORED])
    assert [(await _next(s))[0].sequence_number for s in (slow, live)] == [1, 1]
    for _ in range(3):  # the slow one reads nothing more; the live one keeps up
        events.publish([STORED])
        assert (await _next(live))[0].sequence_number == events.last_sequence_number
    assert [b.sequence_number for b in await _next(slow, 2)] == [2, 3]
    with pytest.raises(StopAsyncIteration):
        await anext(slow)
    events.close()
    with pytest.raises(StopAsyncIteration):
        await anext(live)
    with pytest.raises(StopAsyncIteration):
        await anext(events.subscribe(0))
