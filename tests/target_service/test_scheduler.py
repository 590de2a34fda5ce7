"""The Scheduler on its own: what it refuses, whom it admits and in what order, how it shares a step's
token budget, and what aborting or finishing frees (the engine drives it step by step in
tests/target_service/test_engine_steps.py)."""
from __future__ import annotations

import itertools

import grpc
import pytest
import torch

from tandem_kernels.sampling import Sampling
from target_service.errors import RequestError
from target_service.metrics import TargetMetrics
from target_service.scheduler import Scheduler
from target_service.sequence import FinishReason, RequestOptions, Sequence, SequenceStatus
from tandem.model.kv_cache import KVCache
from tandem.model.random_weights import SHAPES

MAX_LEN = 64
_ids = itertools.count(1)


def _scheduler(num_slots: int = 4, max_queue: int = 8, budget: int = 512, num_blocks: int | None = None) -> Scheduler:
    cache = KVCache(SHAPES["tiny"], num_slots, MAX_LEN, torch.float32, torch.device("cpu"), num_blocks=num_blocks)
    return Scheduler(cache, max_num_seqs=num_slots, max_queue=max_queue, metrics=TargetMetrics("test"),
                     max_num_batched_tokens=budget)


def _request(prompt_len: int = 8, n: int = 1, max_tokens: int = 8) -> list[Sequence]:
    """A request's n samples, as Engine.new_sequences makes them; nothing here reads their text."""
    options = RequestOptions(sampling=Sampling(temperature=0.0, seed=1), max_tokens=max_tokens, stop=(),
                             stop_token_ids=frozenset(), ignore_eos=False, skip_special_tokens=True, speculate=True,
                             num_speculative_tokens=4, n=n)
    first = next(_ids)
    ids = [first, *(next(_ids) for _ in range(n - 1))]
    return [Sequence(seq_id=seq_id, request_id=f"r{first}", prompt_ids=list(range(100 + first, 100 + first + prompt_len)),
                     options=options, arrival=0.0, detokenizer=None, stops=None, index=index, group=first)
            for index, seq_id in enumerate(ids)]


def test_a_request_beyond_the_queue_or_the_cache_is_refused_with_its_code():
    scheduler = _scheduler(num_slots=1, max_queue=1)
    scheduler.add(_request())  # admitted by the next step: it does not count against the queue
    scheduler.add(_request())
    with pytest.raises(RequestError) as full:
        scheduler.add(_request())
    assert full.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-queue 1" in full.value.message
    small = _scheduler(num_blocks=2)
    with pytest.raises(RequestError) as big:
        small.add(_request(prompt_len=40))
    assert big.value.code is grpc.StatusCode.INVALID_ARGUMENT and "--kv-cache-tokens" in big.value.message


def test_requests_are_admitted_in_order_while_slots_are_free_and_a_requests_samples_together():
    scheduler = _scheduler(num_slots=3)
    first, pair, last = _request(), _request(n=2), _request()
    for samples in (first, pair, last):
        scheduler.add(samples)
    batch = scheduler.schedule()
    assert batch.admitted == batch.prefills == first + pair
    assert [(c.seq_id, c.copy_of, c.samples) for c in batch.ends] == [
        (first[0].seq_id, None, True), (pair[0].seq_id, None, True), (pair[1].seq_id, 1, True)], "the pair shares one run"
    assert all(seq.status is SequenceStatus.RUNNING and seq.slot is not None for seq in first + pair)
    assert list(scheduler.waiting) == last and last[0].status is SequenceStatus.WAITING
    crowded = _scheduler(num_slots=2)
    crowded.add(_request())
    crowded.add(_request(n=2))
    assert len(crowded.schedule().admitted) == 1, "a request's samples wait whole for room for all of them"


def test_a_prompt_longer_than_the_step_budget_runs_in_chunks_each_from_where_the_last_ended():
    scheduler = _scheduler(budget=16)
    [long], [short] = _request(prompt_len=40), _request(prompt_len=4)
    scheduler.add([long])
    scheduler.add([short])
    batch = scheduler.schedule()
    assert batch.prefills == [] and [(p.seq_id, p.start, p.end, p.samples) for p in batch.parts] == [
        (long.seq_id, 0, 16, False)]
    assert batch.admitted == [long], "the budget is spent: the next prompt waits for a later step"
    scheduler.update([], batch.parts)
    assert long.num_computed_tokens == 16
    batch = scheduler.schedule()
    assert [(p.start, p.end) for p in batch.parts] == [(16, 32)]
    scheduler.update([], batch.parts)
    batch = scheduler.schedule()
    assert batch.parts == [] and batch.prefills == [long, short], "its last 8 positions, then a prompt that fits"
    assert [(c.start, c.end, c.samples) for c in batch.ends] == [(32, 40, True), (0, 4, True)]
    for seq in batch.prefills:
        seq.token_ids.append(7)  # the first token, as the engine commits it
    scheduler.update(batch.prefills)
    assert (long.num_computed_tokens, short.num_computed_tokens) == (40, 4)
    assert scheduler.schedule().decodes == [long, short]


def test_when_blocks_run_short_the_newest_is_preempted_and_comes_back_replaying_what_its_slot_lacks():
    scheduler = _scheduler(num_slots=2, num_blocks=4)
    [old], [new] = _request(prompt_len=20, max_tokens=40), _request(prompt_len=20, max_tokens=40)
    scheduler.add([old])
    scheduler.add([new])
    batch = scheduler.schedule()
    for seq in batch.prefills:
        seq.token_ids.append(7)
    scheduler.update(batch.prefills)
    while new.status is SequenceStatus.RUNNING:  # old grows a block at a time until the pool is short
        batch = scheduler.schedule()
        for seq in batch.decodes:
            seq.token_ids += [8, 9, 10, 11, 12]  # all four drafts accepted, and the bonus token
        scheduler.update(batch.decodes)
    assert list(scheduler.waiting) == [new] and new.slot is None, "the newest waits first in the queue"
    assert old.status is SequenceStatus.RUNNING
    old.finish = FinishReason.STOP
    scheduler.release_finished()
    batch = scheduler.schedule()
    assert batch.decodes == [new] and batch.admitted == [], "it comes back to decode; the drafter has it already"
    assert new.num_computed_tokens == 16, "its first block was cached when it left"
    # its next step runs its 31 committed tokens past the 16 its slot holds: 14 again, then the newest
    chunk = new.running_chunk(None)
    assert (chunk.start, chunk.end, chunk.replayed) == (16, 31, 14) and chunk.token_ids == tuple(new.token_ids[16:])


def test_aborting_a_waiting_sequence_takes_it_out_of_the_queue():
    scheduler = _scheduler(num_slots=1)
    scheduler.add(_request())
    [waiting] = _request()
    scheduler.add([waiting])
    scheduler.schedule()
    assert scheduler.dequeue(waiting) and not scheduler.waiting
    assert waiting.status is SequenceStatus.FINISHED and waiting.seq_id not in scheduler.sequences
    assert not scheduler.dequeue(scheduler.running[0]), "a running sequence leaves after its step"


def test_a_finished_sequence_keeps_its_slot_until_released_and_then_frees_it():
    scheduler = _scheduler(num_slots=1)
    [seq], [next_seq] = _request(), _request()
    scheduler.add([seq])
    scheduler.add([next_seq])
    scheduler.schedule()
    seq.finish = FinishReason.ABORT
    assert scheduler.schedule().admitted == [], "its slot is held until the step that used it is published"
    assert scheduler.release_finished() == [seq]
    assert seq.slot is None and seq.status is SequenceStatus.FINISHED and scheduler.running == []
    assert scheduler.schedule().admitted == [next_seq]
