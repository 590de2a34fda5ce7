"""The drafting loop in-process: coalescing and closes with the n-gram drafter, chunked prefill
with a tiny model drafter."""
from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from draft_service.drafter import DraftJob, DraftSequence, never
from draft_service.metrics import DraftMetrics
from draft_service.drafters.model import ModelDrafter
from draft_service.drafters.ngram import NgramDrafter
from draft_service.drafters.suffix import SuffixDrafter
from draft_service.scheduler import Limits
from tandem_kernels.sampling import Sampling
from bench.greedy import greedy_generate
from tandem.v1 import drafter_pb2 as pb
from tests.support.draft_schedulers import running_scheduler
from tests.support.tiny_drafter import MAX_LEN, VOCAB, tiny_draft_model

LIMITS = Limits(vocab_size=100, max_model_len=64, max_k=4, num_slots=2)
PROMPT = [1, 2, 3, 4, 1, 2]


@pytest.fixture
async def scheduler():
    async with running_scheduler(NgramDrafter(1, 4), DraftMetrics("test"), LIMITS) as running:
        yield running


def _update(opens=(), extends=(), closes=()) -> pb.TargetUpdate:
    return pb.TargetUpdate(opens=[pb.SequenceOpen(seq_id=i, prompt_ids=p, k=4) for i, p in opens],
                           extends=[pb.SequenceExtend(seq_id=i, start=s, token_ids=t) for i, s, t in extends],
                           closes=[pb.SequenceClose(seq_id=i) for i in closes])


async def test_updates_before_a_round_coalesce_into_the_newest_prefix(scheduler):
    stream = scheduler.open_stream()
    scheduler.apply(stream, _update(opens=[(1, PROMPT)]))
    scheduler.apply(stream, _update(extends=[(1, 6, [3])]))
    message = await asyncio.wait_for(stream.outbox.get(), 10)
    [proposal] = message.proposals
    assert (proposal.seq_id, proposal.base_len, list(proposal.token_ids)) == (1, 7, [4, 1, 2, 3])
    assert stream.outbox.empty()


async def test_a_sequence_closed_before_its_round_gets_no_proposal(scheduler):
    stream = scheduler.open_stream()
    scheduler.apply(stream, _update(opens=[(1, PROMPT), (2, PROMPT)], closes=[1]))
    [proposal] = (await asyncio.wait_for(stream.outbox.get(), 10)).proposals
    assert proposal.seq_id == 2
    scheduler.apply(stream, _update(opens=[(3, PROMPT)]))  # sequence 1's slot is free again
    assert [p.seq_id for p in (await asyncio.wait_for(stream.outbox.get(), 10)).proposals] == [3]


async def test_closing_a_stream_frees_its_sequences(scheduler):
    first, second = scheduler.open_stream(), scheduler.open_stream()
    scheduler.apply(first, _update(opens=[(1, PROMPT), (2, PROMPT)]))
    scheduler.close_stream(first)
    scheduler.apply(second, _update(opens=[(1, PROMPT), (2, PROMPT)]))  # both slots are free again
    proposals = (await asyncio.wait_for(second.outbox.get(), 10)).proposals
    assert sorted(p.seq_id for p in proposals) == [1, 2]
    assert first.outbox.empty()


class FailingDrafter(NgramDrafter):
    """Every round fails, as a bug or an input the kernels refuse would make it."""

    def draft(self, jobs):
        raise RuntimeError("this round fails")


async def test_a_failed_round_answers_each_of_its_sequences_with_nothing():
    metrics = DraftMetrics("test")
    async with running_scheduler(FailingDrafter(1, 4), metrics, LIMITS) as scheduler:
        stream = scheduler.open_stream()
        scheduler.apply(stream, _update(opens=[(1, PROMPT), (2, PROMPT + [3])]))
        message = await asyncio.wait_for(stream.outbox.get(), 10)
        assert sorted((p.seq_id, p.base_len, list(p.token_ids)) for p in message.proposals) == [
            (1, 6, []), (2, 7, [])]
        labels = {"model": "test", "service": "draft"}
        assert metrics.registry.get_sample_value("tandem_draft_errors_total", labels) == 1


class ThreadNoting(NgramDrafter):
    """Notes the thread each round drafts on."""

    def __init__(self, inline_rounds: bool):
        super().__init__(1, 4)
        self.inline_rounds = inline_rounds
        self.threads: list[str] = []

    def draft(self, jobs, stop=never):
        self.threads.append(threading.current_thread().name)
        return super().draft(jobs, stop)


@pytest.mark.parametrize("inline_rounds", [True, False])
async def test_a_lookup_drafters_rounds_run_on_the_event_loop_unless_they_open_or_close(inline_rounds):
    drafter = ThreadNoting(inline_rounds)
    async with running_scheduler(drafter, DraftMetrics("test"), LIMITS) as scheduler:
        stream = scheduler.open_stream()
        scheduler.apply(stream, _update(opens=[(1, PROMPT)]))
        await asyncio.wait_for(stream.outbox.get(), 10)
        for step, token in enumerate([3, 4, 1]):
            scheduler.apply(stream, _update(extends=[(1, 6 + step, [token])]))
            await asyncio.wait_for(stream.outbox.get(), 10)
        scheduler.apply(stream, _update(opens=[(2, PROMPT)], extends=[(1, 9, [2])]))
        await asyncio.wait_for(stream.outbox.get(), 10)
    loop_thread = threading.current_thread().name
    opening, *extending, opening_again = drafter.threads
    assert opening.startswith("drafter") and opening_again.startswith("drafter")
    assert len(extending) == 3
    assert all((thread == loop_thread) is inline_rounds for thread in extending)
    assert all(thread.startswith("drafter") is not inline_rounds for thread in extending)


class OutboxNoting(NgramDrafter):
    """Notes, as each round begins, how many answers wait in the stream's outbox."""

    inline_rounds = True

    def __init__(self):
        super().__init__(1, 4)
        self.outbox: asyncio.Queue | None = None
        self.waiting: list[int] = []

    def draft(self, jobs, stop=never):
        self.waiting.append(self.outbox.qsize())
        return super().draft(jobs, stop)


async def test_a_rounds_answers_go_out_before_the_next_round_runs_on_the_event_loop():
    """A lookup round on the loop is followed by its pre-draft rounds; the stream's writer sends the
    fresh answer first, rather than after the chain."""
    drafter = OutboxNoting()
    async with running_scheduler(drafter, DraftMetrics("test"), LIMITS, max_fanout=-1) as scheduler:
        stream = scheduler.open_stream()
        drafter.outbox = stream.outbox
        received = []

        async def write() -> None:
            while True:
                received.append(await stream.outbox.get())

        writer = asyncio.create_task(write())
        scheduler.apply(stream, pb.TargetUpdate(opens=[pb.SequenceOpen(seq_id=1, prompt_ids=PROMPT, k=4,
                                                                       accepts_assumed=True)]))
        for step, token in enumerate([3, 4, 1, 2]):
            await asyncio.sleep(0.05)
            scheduler.apply(stream, _update(extends=[(1, 6 + step, [token])]))
        await asyncio.sleep(0.05)
        writer.cancel()
    assert any(p.assumed_ids for message in received for p in message.proposals)  # pre-draft rounds ran
    assert len(drafter.waiting) > 5 and not any(drafter.waiting)


async def test_one_target_may_hold_no_more_than_its_quota():
    limits = Limits(vocab_size=100, max_model_len=64, max_k=4, num_slots=3, max_seqs_per_target=2)
    metrics = DraftMetrics("test")
    async with running_scheduler(NgramDrafter(1, 4), metrics, limits) as scheduler:
        greedy, other = scheduler.open_stream(), scheduler.open_stream()
        scheduler.apply(greedy, _update(opens=[(1, PROMPT), (2, PROMPT), (3, PROMPT)]))
        scheduler.apply(other, _update(opens=[(1, PROMPT)]))  # the slot the quota kept free
        assert metrics.registry.get_sample_value(
            "tandem_draft_invalid_updates_total", {"model": "test", "service": "draft", "reason": "target_quota"}) == 1
        assert sorted(greedy.sequences) == [1, 2] and sorted(other.sequences) == [1]
        scheduler.apply(greedy, _update(closes=[1]))
        scheduler.apply(greedy, _update(opens=[(4, PROMPT)]))  # room again under its quota
        assert sorted(greedy.sequences) == [2, 4]


async def test_a_closing_updates_tokens_reach_the_drafter_before_it_forgets_the_sequence():
    """The target tells a finished sequence's last tokens in the update that closes it: the suffix
    drafter's shared index gets the whole output, which a later request is drafted from."""
    drafter = SuffixDrafter()
    async with running_scheduler(drafter, DraftMetrics("test"), LIMITS) as scheduler:
        stream = scheduler.open_stream()
        scheduler.apply(stream, _update(opens=[(1, [1, 2, 3])]))
        await asyncio.wait_for(stream.outbox.get(), 10)
        scheduler.apply(stream, _update(extends=[(1, 3, [10, 11, 12])]))
        await asyncio.wait_for(stream.outbox.get(), 10)
        scheduler.apply(stream, _update(extends=[(1, 6, [13, 14, 15, 16, 17])], closes=[1]))
        scheduler.apply(stream, _update(opens=[(2, [5, 13, 14])]))
        [proposal] = (await asyncio.wait_for(stream.outbox.get(), 10)).proposals
    assert list(drafter.shared.docs.values()) == [[10, 11, 12, 13, 14, 15, 16, 17]]
    assert (proposal.seq_id, list(proposal.token_ids)) == (2, [15, 16, 17])


async def test_the_output_is_what_follows_the_opens_prompt_however_late_the_round():
    """A drafter busy elsewhere may first see a sequence with tokens after its prompt, or closed
    already: its output is still every token after the Open's prompt (prompt_len, which a
    reopened sequence's Open sets below its tokens)."""
    drafter = SuffixDrafter()
    async with running_scheduler(drafter, DraftMetrics("test"), LIMITS) as scheduler:
        stream = scheduler.open_stream()
        reopened = pb.SequenceOpen(seq_id=3, prompt_ids=[1, 2, 3, 20, 21], prompt_len=3, k=4)
        scheduler.apply(stream, pb.TargetUpdate(opens=[reopened]))
        scheduler.apply(stream, _update(opens=[(1, [1, 2, 3])], extends=[(1, 3, [10, 11])]))
        scheduler.apply(stream, _update(extends=[(1, 5, [12, 13]), (3, 5, [22])], closes=[1, 3]))
        scheduler.apply(stream, _update(opens=[(2, [5, 10, 11])]))
        [proposal] = (await asyncio.wait_for(stream.outbox.get(), 10)).proposals
    assert sorted(drafter.shared.docs.values()) == [[10, 11, 12, 13], [20, 21, 22]]
    assert (proposal.seq_id, list(proposal.token_ids)) == (2, [12, 13])


async def test_a_refused_open_and_its_extends_are_answered_at_once(scheduler):
    stream = scheduler.open_stream()
    scheduler.apply(stream, _update(opens=[(1, PROMPT), (2, PROMPT), (3, PROMPT)]))  # two slots
    scheduler.apply(stream, _update(extends=[(3, 6, [3, 4])]))
    for base_len in (6, 8):  # before the round's 0.3 s delay is over
        [refused] = (await asyncio.wait_for(stream.outbox.get(), 0.2)).proposals
        assert (refused.seq_id, refused.base_len, list(refused.token_ids)) == (3, base_len, [])
    drafted = (await asyncio.wait_for(stream.outbox.get(), 10)).proposals
    assert sorted(p.seq_id for p in drafted) == [1, 2]
    scheduler.apply(stream, _update(extends=[(3, 8, [5])], closes=[3]))  # the closing tail: nobody awaits it
    scheduler.apply(stream, _update(extends=[(3, 9, [6])]))  # closed, so no longer refused: an unknown sequence
    await asyncio.sleep(0.2)
    while not stream.outbox.empty():
        assert 3 not in [p.seq_id for p in stream.outbox.get_nowait().proposals]


async def test_a_long_prompt_prefilled_in_chunks_is_drafted_with_no_further_update():
    """A model drafter with a catch-up budget of 16: an Open of 40 tokens is answered with nothing
    for each round that prefills a chunk of it, and the scheduler runs those rounds on its own, so
    that the drafts for its prefix follow once its slot has caught up."""
    drafter = ModelDrafter(tiny_draft_model(), 8, DraftMetrics("tiny"), max_num_batched_tokens=16)
    limits = Limits(vocab_size=VOCAB, max_model_len=MAX_LEN, max_k=4, num_slots=4)
    prompt = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    async with running_scheduler(drafter, DraftMetrics("tiny"), limits) as scheduler:
        stream = scheduler.open_stream()
        scheduler.apply(stream, _update(opens=[(1, prompt)]))
        proposals = []
        while not proposals or not proposals[-1].token_ids:
            [proposal] = (await asyncio.wait_for(stream.outbox.get(), 10)).proposals
            proposals.append(proposal)
    assert [(p.seq_id, p.base_len, len(p.token_ids)) for p in proposals] == [(1, 40, 0)] * 2 + [(1, 40, 4)]
    assert list(proposals[-1].token_ids) == greedy_generate(tiny_draft_model(), prompt, 4)


REPEATING = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14] * 3  # the n-gram drafter copies it on and on


@pytest.mark.parametrize("timing, lookahead, expected", [
    ({}, True, 4),  # a target that sends no timing: its link is short
    ({"draft_round_trip_us": 5_000, "step_interval_us": 20_000}, True, 4),  # a round trip shorter than a step
    ({"draft_round_trip_us": 45_000, "step_interval_us": 20_000}, True, 8),  # a long link: up to max_k
    ({"draft_round_trip_us": 45_000, "step_interval_us": 20_000}, False, 4),  # --no-lookahead
])
async def test_over_a_long_link_a_lookup_drafter_drafts_up_to_max_k(timing, lookahead, expected):
    """The target commits tokens while a fresh proposal travels, and verifies the drafts past them: a
    proposal longer than k keeps k drafts for it."""
    limits = Limits(vocab_size=100, max_model_len=64, max_k=8, num_slots=2, lookahead=lookahead)
    async with running_scheduler(NgramDrafter(1, 4), DraftMetrics("test"), limits, max_fanout=0) as scheduler:
        stream = scheduler.open_stream()
        scheduler.apply(stream, pb.TargetUpdate(opens=[pb.SequenceOpen(seq_id=1, prompt_ids=REPEATING, k=4)],
                                                **timing))
        [proposal] = (await asyncio.wait_for(stream.outbox.get(), 10)).proposals
    assert list(proposal.token_ids) == (REPEATING[len(REPEATING) - 10:] * 2)[:expected]


def test_a_lookahead_job_reaches_as_far_as_when_it_was_made_whatever_k_becomes():
    """The target may raise a sequence's k while a round drafts it: the job still proposes at most
    the max_k it was made for, which the target accepts."""
    sequence = DraftSequence((1, 1), list(REPEATING), Sampling(temperature=0.0), k=2)
    job = DraftJob(sequence, list(REPEATING), reach=8)
    sequence.k = 4
    assert job.max_drafts == 8
    assert DraftJob(sequence, list(REPEATING)).max_drafts == 4, "no reach: the sequence's k"
