"""The target's Engine in-process, step by step: a scripted runner instead of a model, a fake link
instead of a drafter. Proposals go in through the speculator, as the link would deliver them; what
comes out is what the runner was asked to verify, what the drafter was told, and the metrics."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import pytest
import torch

from tandem_kernels.compression import encode, pack
from tandem_kernels.logprobs import TokenLogprob
from tandem_kernels.sampling import Sampling
from target_service.config import TargetConfig
from target_service.engine import Engine
from target_service.errors import RequestError
from target_service.metrics import TargetMetrics
from target_service.step_items import Chunk, ChunkResult
from target_service.scheduler import Scheduler
from target_service.sequence import FinishReason, Output, RequestOptions, Sequence, SequenceStatus
from target_service.speculation.policy import speculation_policy
from target_service.speculation.local_drafts import LocalDrafts
from target_service.speculation.speculator import Speculator
from tandem.model.kv_cache import KVCache
from tandem.model.random_weights import SHAPES
from tandem.v1 import drafter_pb2

PROMPT = (1, 2, 3)
OTHER_PROMPT = (4, 5, 6, 7)
LONG_PROMPT = tuple(range(30, 50))  # one full KV block and four positions of the next
BLOCK_PROMPT = LONG_PROMPT[:16]  # one full block
CHUNKED_PROMPT = tuple(range(500, 540))  # two full blocks and eight positions of a third
# The target's greedy continuation of each prompt: T[i] is the token at position len(prompt) + i.
T = (10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25)
COPY_PROMPT = (60, 61, 62, 63, 64, 65, 66, 67, 68, 60, 61)  # its continuation copies it, then goes its own way
CONTINUATIONS = {PROMPT: T, OTHER_PROMPT: tuple(t + 100 for t in T), LONG_PROMPT: tuple(t + 200 for t in T),
                 BLOCK_PROMPT: tuple(t + 300 for t in T), CHUNKED_PROMPT: tuple(t + 400 for t in T),
                 COPY_PROMPT: (62, 63, 64, 65, 66, 90, 91, 92, 93, 94, 95, 96, 97, 98, 99, 100)}
N = len(PROMPT) + 1  # committed after the prefill: the prompt and T[0]
MAX_K = 4
VOCAB = 1000
WRONG = 99  # a token the target never emits


class FakeTokenizer:
    eos_token_ids = frozenset({0})
    special_token_ids = frozenset()

    def decode(self, ids, skip_special_tokens=False) -> str:
        return "".join(f"<{i}>" for i in ids)


def _scored(run: Chunk) -> list[TokenLogprob] | None:
    """Scripted prompt logprobs: each token it scores, with the logprob -token."""
    return None if run.prompt_logprobs is None else [TokenLogprob(t, -float(t), 1, ()) for t in run.scored]


class ScriptedRunner:
    """A greedy target without a model: each prompt's continuation is scripted in CONTINUATIONS.

    Verification accepts drafts while they equal the continuation, then adds its next token.
    """

    def __init__(self, events: list, prompt_of: Callable[[int], tuple[int, ...]]):
        self.events = events
        self.prompt_of = prompt_of  # slot -> the prompt of the sequence running in it
        self.verified: list[list[Chunk]] = []  # the chunks of every call that ran the running sequences
        self.prefilled: list[list[Chunk]] = []  # the prompts' last chunks of every call that ran prompts
        self.parts: list[list[Chunk]] = []  # the prompts' earlier chunks of every such call
        self.prompts: dict[int, tuple[int, ...]] = {}  # slot -> the prompt last prefilled into it

    def run(self, chunks: list[Chunk], capture: tuple[int, ...] = ()) -> list[ChunkResult]:
        """The engine runs a step's prompts, then its running sequences, in two calls."""
        prompts = [c for c in chunks if not c.samples or c.end == len(self.prompt_of(c.slot))]
        assert all(c.token_ids == self.prompt_of(c.slot)[c.start:c.end] for c in prompts), "its prompt's positions"
        if prompts:
            self.events.append("prefill")
            self.prefilled.append([c for c in prompts if c.samples])
            self.parts.append([c for c in prompts if not c.samples])
            return [self._prefill(c) for c in chunks]
        self.verified.append(chunks)
        return [self._verify(c) for c in chunks]

    def _prefill(self, chunk: Chunk) -> ChunkResult:
        if not chunk.samples:
            return ChunkResult([], 0, prompt_logprobs=_scored(chunk))
        self.prompts[chunk.slot] = prompt = self.prompt_of(chunk.slot)
        return ChunkResult([CONTINUATIONS[prompt][0]], 0, prompt_logprobs=_scored(chunk))

    def _verify(self, chunk: Chunk) -> ChunkResult:
        if chunk.replayed:  # readmitted after a preemption, into any slot
            self.prompts[chunk.slot] = self.prompt_of(chunk.slot)
        prompt = self.prompts[chunk.slot]
        ahead = CONTINUATIONS[prompt][chunk.end - len(prompt):]
        drafts = chunk.drafts.tokens if chunk.drafts else ()
        accepted = next((j for j, (d, t) in enumerate(zip(drafts, ahead)) if d != t), len(drafts))
        return ChunkResult(tokens=list(ahead[: accepted + 1]), num_accepted=accepted)


@dataclass
class FakeLink:
    """Records the updates the target sends; proposals are injected through the speculator."""

    events: list
    max_k: int = MAX_K
    probs_top_k: int = 4
    connected: bool = True
    feature_layout: None = None  # a drafter that reads no target features
    info: None = None
    updates: list[drafter_pb2.TargetUpdate] = field(default_factory=list)

    def send(self, update: drafter_pb2.TargetUpdate) -> None:
        self.events.append("update")
        self.updates.append(update)

    def told(self, seq: Sequence) -> list[tuple]:
        """What this sequence's updates said, in order: ("open", tokens, k), ("extend", start, tokens), ("close",)."""
        said = []
        for update in self.updates:
            said += [("open", list(o.prompt_ids), o.k) for o in update.opens if o.seq_id == seq.seq_id]
            said += [("extend", e.start, list(e.token_ids)) for e in update.extends if e.seq_id == seq.seq_id]
            said += [("close",) for c in update.closes if c.seq_id == seq.seq_id]
        return said


@dataclass
class Harness:
    engine: Engine
    runner: ScriptedRunner
    link: FakeLink
    events: list

    def submit(self, prompt: tuple[int, ...] = PROMPT, temperature: float = 0.0, **overrides) -> Sequence:
        options = dict(max_tokens=12, stop=(), stop_token_ids=frozenset(), ignore_eos=False, skip_special_tokens=True,
                       speculate=True, num_speculative_tokens=MAX_K)
        options.update(overrides)
        sampling = Sampling(temperature=temperature, seed=1)
        [seq] = self.engine.new_sequences("", list(prompt), RequestOptions(sampling=sampling, **options))
        self.engine.submit([seq])
        return seq

    def propose(self, seq: Sequence, base_len: int, tokens=(), **extra) -> None:
        message = drafter_pb2.DraftProposals(proposals=[
            drafter_pb2.DraftProposal(seq_id=seq.seq_id, base_len=base_len, token_ids=list(tokens), **extra)])
        self.engine.speculator.on_proposals(message, message.ByteSize())

    def verified_drafts(self, seq: Sequence) -> list[int]:
        """The drafts the last verify call handed the runner for this sequence."""
        [chunk] = [c for c in self.runner.verified[-1] if self.runner.prompts[c.slot] == tuple(seq.prompt_ids)]
        return list(chunk.drafts.tokens) if chunk.drafts else []

    def count(self, name: str, **labels: str) -> float:
        value = self.engine.metrics.registry.get_sample_value(name, {"model": "test", "service": "target", **labels})
        return value or 0.0


@pytest.fixture
def make():
    """Builds a Harness; the drafter is connected (none with drafter=False), and steps never wait
    unless draft_wait_ms is given."""
    engines = []

    def build(num_slots: int = 4, max_len: int = 64, max_k: int = MAX_K, kv_blocks: int | None = None,
              drafter: bool = True, **config) -> Harness:
        config.setdefault("draft_wait_ms", 0)
        events: list = []
        link = FakeLink(events, max_k=max_k)
        target_config, metrics = TargetConfig(**config), TargetMetrics("test")
        speculator = Speculator(speculation_policy(target_config), metrics, vocab_size=VOCAB, max_len=max_len,
                                connect=(lambda peer: link) if drafter else None,
                                local_drafts=LocalDrafts() if target_config.local_drafts else None)
        cache = KVCache(SHAPES["tiny"], num_slots, max_len, torch.float32, torch.device("cpu"), num_blocks=kv_blocks)
        scheduler = Scheduler(cache, target_config.max_num_seqs, target_config.max_queue, metrics,
                              target_config.prefix_caching, target_config.max_num_batched_tokens)
        runner = ScriptedRunner(events, lambda slot: tuple(
            next(s for s in scheduler.running if s.slot == slot).prompt_ids))
        engine = Engine(runner, scheduler, speculator, FakeTokenizer(), target_config, metrics)
        engines.append(engine)
        return Harness(engine, runner, link, events)

    yield build
    for engine in engines:
        engine.executor.shutdown()


def outputs(seq: Sequence) -> list[Output]:
    got = []
    while not seq.outbox.empty():
        got.append(seq.outbox.get_nowait())
    return got


@pytest.mark.parametrize("case", ["no drafter", "drafter away", "request not speculating"])
async def test_steps_in_which_no_sequence_can_verify_drafts_do_no_speculation_work(make, case):
    """Started without --drafter, with the drafter disconnected, or for a request that asked for no
    speculation, the target commits the same tokens, and the policy hears of no step: nothing is
    planned or measured for drafts that cannot come."""
    h = make(drafter=case != "no drafter")
    h.link.connected = case != "drafter away"
    seq = h.submit(speculate=case != "request not speculating")
    for _ in range(4):
        await h.engine.step()
    assert seq.token_ids == [*PROMPT, *T[:4]]
    policy = h.engine.speculator.policy
    assert policy.mean_cycle == 0.0 and policy.mean_step == policy.max_wait  # as constructed: no step fed it


async def test_a_drafter_back_from_away_finds_its_sequences_as_it_left_them(make):
    """While the drafter is away, steps verify nothing and nothing is asked of it, so the policy
    learns nothing from them: once it is back, a sequence whose drafts were paying verifies the
    drafts it proposes at once, not only after the policy's next exploring step."""
    h = make()
    seq = h.submit(max_tokens=len(T))
    await h.engine.step()
    h.propose(seq, N, T[1:3])
    await h.engine.step()
    assert h.verified_drafts(seq) == list(T[1:3])
    h.link.connected = False
    for _ in range(3):
        await h.engine.step()
    h.link.connected = True
    h.link.send(h.engine.speculator.reopen_all())
    n = len(seq.token_ids)
    drafts = CONTINUATIONS[PROMPT][n - len(PROMPT):][:2]
    h.propose(seq, n, drafts)
    await h.engine.step()
    assert h.verified_drafts(seq) == list(drafts)


async def test_the_drafter_is_handed_a_steps_tokens_before_the_client_is(make):
    """With a link that sends as DrafterLink does (a queue that a writer task drains), the Extend of a
    step's tokens is on its way before the step's output reaches the client or the next step plans:
    the drafter's answer is what the next step may wait for."""
    h, seq = await _prefilled(make)
    outputs(seq)  # the prefill's token
    queue: asyncio.Queue[drafter_pb2.TargetUpdate] = asyncio.Queue()
    h.link.send = queue.put_nowait
    handed = []  # each update's extends, and the outputs the client had when the writer took it

    async def writer() -> None:
        while True:
            update = await queue.get()
            handed.append(([(e.start, list(e.token_ids)) for e in update.extends], seq.outbox.qsize()))

    task = asyncio.create_task(writer())
    try:
        await h.engine.step()
        assert handed == [([(N, [T[1]])], 0)]
    finally:
        task.cancel()


async def _prefilled(make, **overrides) -> tuple[Harness, Sequence]:
    """A harness whose one sequence has committed T[0] on its prefill."""
    h = make()
    seq = h.submit(**overrides)
    await h.engine.step()
    assert seq.token_ids == [*PROMPT, T[0]]
    return h, seq


# ---- one step's drafts: hits, misses, salvage, stale drops ---------------------------------------

PROPOSAL_CASES = {
    # name: (base_len, drafts) -> (verified, committed, accepted, miss, salvaged, dropped)
    "all accepted": ((N, T[1:5]), (T[1:5], T[1:6], 4, 0, 0, 0)),
    "rejected at the second": ((N, (T[1], WRONG, T[3])), ((T[1], WRONG, T[3]), T[1:3], 1, 0, 0, 0)),
    "salvaged past the prefill token": ((N - 1, T[0:3]), (T[1:3], T[1:4], 2, 0, 1, 0)),
    "stale and contradicted": ((N - 1, (WRONG, T[1])), ((), T[1:2], 0, 1, 0, 1)),
    "used up by the prefill token": ((N - 1, T[0:1]), ((), T[1:2], 0, 1, 0, 0)),
    "nothing for this prefix": ((N, ()), ((), T[1:2], 0, 1, 0, 0)),
}


@pytest.mark.parametrize("proposal, expected", PROPOSAL_CASES.values(), ids=PROPOSAL_CASES.keys())
async def test_a_step_verifies_the_drafts_that_continue_the_committed_tokens(make, proposal, expected):
    verified, committed, accepted, miss, salvaged, dropped = expected
    h, seq = await _prefilled(make)
    h.propose(seq, *proposal)
    await h.engine.step()
    assert h.verified_drafts(seq) == list(verified)
    assert seq.token_ids[N:] == list(committed)
    assert (seq.draft_tokens, seq.accepted_tokens, seq.draft_steps) == (len(verified), accepted, int(bool(verified)))
    assert h.count("tandem_spec_decode_num_draft_tokens_total") == len(verified)
    assert h.count("tandem_spec_decode_num_accepted_tokens_total") == accepted
    assert h.count("tandem_draft_miss_total") == miss
    assert h.count("tandem_draft_stale_total", outcome="salvaged") == salvaged
    assert h.count("tandem_draft_stale_total", outcome="dropped") == dropped


@pytest.mark.parametrize("case", ["drafter silent", "drafter paused", "request not speculating", "turned off"])
async def test_where_no_proposal_continues_the_tokens_the_target_verifies_its_own_lookup(make, monkeypatch, case):
    """A sequence that copies its prompt, and a drafter that has sent nothing for it: the step verifies
    what the sequence's own tokens say comes next, counted as local drafts, not as a miss. Not for a
    sequence the drafter was told to pause, one that asked for no speculation, nor with --no-local-drafts."""
    h = make(local_drafts=case != "turned off")
    seq = h.submit(COPY_PROMPT, speculate=case != "request not speculating")
    if case == "drafter paused":
        monkeypatch.setattr(h.engine.speculator.policy, "drafts_to_request", lambda records, caps: [0] * len(caps))
    await h.engine.step()  # the prefill commits 62, told to the drafter with k = 0 when paused
    await h.engine.step()  # [60, 61, 62] occurred in the prompt, followed by 63 64 65 66
    copied = case == "drafter silent"
    assert h.verified_drafts(seq) == ([63, 64, 65, 66] if copied else [])
    assert seq.token_ids[len(COPY_PROMPT):] == ([62, 63, 64, 65, 66, 90] if copied else [62, 63])
    assert h.count("tandem_draft_local_total") == copied
    assert h.count("tandem_draft_miss_total") == (case in ("drafter paused", "turned off"))
    await h.engine.step()  # 90 occurs nowhere before: nothing to look up
    assert h.verified_drafts(seq) == [] and h.count("tandem_draft_local_total") == copied


async def test_a_contradicted_proposal_is_dropped_once_and_not_counted_again(make):
    h, seq = await _prefilled(make)
    h.propose(seq, N - 1, (WRONG, T[1]))
    await h.engine.step()
    await h.engine.step()
    assert h.count("tandem_draft_stale_total", outcome="dropped") == 1
    assert h.count("tandem_draft_miss_total") == 2


@pytest.mark.parametrize("newest_first", [False, True])
async def test_of_the_proposals_that_continue_the_tokens_the_one_with_most_drafts_is_verified(make, newest_first):
    """The target keeps several proposals (the speculation cache); each usable one is a valid draw
    given the committed tokens, so the step verifies the one with the most drafts left, whatever
    their order of arrival."""
    h, seq = await _prefilled(make)
    proposals = [(N, T[1:3]), (N - 1, (T[0], WRONG))]
    for proposal in reversed(proposals) if newest_first else proposals:
        h.propose(seq, *proposal)
    await h.engine.step()
    assert h.verified_drafts(seq) == list(T[1:3])


async def test_of_two_usable_proposals_with_as_many_drafts_the_newest_is_verified(make):
    h, seq = await _prefilled(make)
    h.propose(seq, N, (T[1], WRONG))
    h.propose(seq, N, (T[1], T[2]))
    await h.engine.step()
    assert h.verified_drafts(seq) == list(T[1:3])


# ---- the speculation cache: pre-drafts that assume the outcome of the step being verified --------

CACHE_CASES = {
    # name: the root (base_len, drafts) and pre-drafts [(assumed, drafts)] sent while the root is
    # verified -> (drafts of the second step, cache hits, pre-drafts evicted unused after three steps)
    "the bonus outcome is cached": ((N, T[1:3]), [(T[1:4], T[4:8]), ((T[1], WRONG), (1, 2))], (T[4:8], 1, 1)),
    "a recovered outcome is cached": ((N, (T[1], WRONG)), [((T[1], T[2]), T[3:7]), (T[1:4], (5, 6))], (T[3:7], 1, 1)),
    "no outcome guessed right": ((N, (T[1], WRONG)), [((T[1], WRONG), (5, 6)), ((WRONG,), (7,))], ((), 0, 2)),
    "after a plain decode step": ((N, ()), [((T[1],), T[2:6])], (T[2:6], 1, 0)),
}


@pytest.mark.parametrize("root, predrafts, expected", CACHE_CASES.values(), ids=CACHE_CASES.keys())
async def test_a_step_verifies_the_pre_draft_whose_assumed_tokens_it_committed(make, root, predrafts, expected):
    second_drafts, hits, evicted = expected
    h, seq = await _prefilled(make)
    h.propose(seq, *root)
    for assumed, drafts in predrafts:  # pre-drafts for outcomes of the root's verification
        h.propose(seq, N + len(assumed), drafts, assumed_ids=list(assumed))
    await h.engine.step()  # verifies the root; the pre-drafts are pending until now
    await h.engine.step()
    assert h.verified_drafts(seq) == list(second_drafts)
    await h.engine.step()  # by now every pre-draft is used, or contradicted by what was committed
    committed = seq.token_ids[N:]
    assert committed == list(T[1 : 1 + len(committed)])  # greedy output is the target's alone
    assert h.count("tandem_draft_cache_hits_total") == hits
    assert h.count("tandem_draft_cache_evicted_total") == evicted
    assert h.count("tandem_draft_stale_total", outcome="dropped") == 0


async def test_a_pre_draft_two_verifications_ahead_is_held_until_both_commit_its_assumed_tokens(make):
    """Over a long link the drafter pre-drafts the outcomes of its pre-drafts: such a proposal assumes
    what two verifications commit (here 6 tokens, more than k + 1) and is verified in the third step."""
    h, seq = await _prefilled(make)
    h.propose(seq, N, T[1:3])
    h.propose(seq, N + 3, T[4:6], assumed_ids=list(T[1:4]))  # the root's bonus outcome
    h.propose(seq, N + 6, T[7:10], assumed_ids=list(T[1:7]))  # that pre-draft's bonus outcome
    for drafts in (T[1:3], T[4:6], T[7:10]):
        await h.engine.step()
        assert h.verified_drafts(seq) == list(drafts)
    assert seq.token_ids[N:] == list(T[1:11])
    assert h.count("tandem_draft_cache_hits_total") == 2
    assert h.count("tandem_draft_rejected_proposals_total", reason="assumed") == 0


async def test_each_update_tells_the_drafter_the_targets_timing(make):
    h, seq = await _prefilled(make)
    h.propose(seq, N, T[1:3])
    await h.engine.step()
    await h.engine.step()
    policy, update = h.engine.speculator.policy, h.link.updates[-1]
    assert update.extends and policy.mean_cycle > 0 and policy.late_round_trip() > 0
    assert update.step_interval_us == round(policy.mean_cycle * 1e6)
    assert update.draft_round_trip_us == round(policy.late_round_trip() * 1e6)
    assert h.engine.speculator.reopen_all().step_interval_us == update.step_interval_us  # a new drafter too


async def test_the_step_cost_model_is_exported_after_each_step(make):
    """The line the policy prices drafts with, as gauges: operators see what a draft costs."""
    h, seq = await _prefilled(make)
    h.propose(seq, N, T[1:3])
    await h.engine.step()  # a verify of 3 tokens
    await h.engine.step()  # a decode of 1
    fixed, per_token = h.engine.speculator.policy.cost_model()
    assert fixed > 0
    assert h.count("tandem_spec_decode_step_fixed_seconds") == fixed
    assert h.count("tandem_spec_decode_step_token_seconds") == per_token


async def test_an_answer_that_comes_after_the_target_moved_on_times_its_own_round_trip(make):
    """Over a link longer than a step the answer for a prefix arrives steps later: its round trip
    runs from the update that told that prefix, not from the newest one."""
    h, seq = await _prefilled(make)
    await h.engine.step()  # no drafts: decodes T[1], and tells the drafter N + 1 tokens
    told = time.perf_counter()
    await asyncio.sleep(0.02)  # timed from the newest update, the round trip would miss these 20 ms
    await h.engine.step()  # decodes T[2]: tells N + 2
    await asyncio.sleep(0.05)
    answered = time.perf_counter()  # the answer's own clock reads no earlier
    h.propose(seq, N + 1, T[2:4])
    h.propose(seq, N + 1, T[2:4])  # the same prefix again: timed once
    assert h.count("tandem_draft_rtt_seconds_count") == 1
    assert h.count("tandem_draft_rtt_seconds_sum") >= answered - told
    h.propose(seq, N + 2, T[3:5], assumed_ids=[T[2]])  # a pre-draft answers no update
    assert h.count("tandem_draft_rtt_seconds_count") == 1


async def test_a_pre_draft_that_covers_the_committed_tokens_means_no_answer_is_owed(make):
    """The drafter sends no fresh proposal for a prefix its pre-draft covers, so the Extend for it
    must not count as unanswered: that would make the target think a working drafter silent."""
    h, seq = await _prefilled(make)
    h.propose(seq, N, T[1:3])
    h.propose(seq, N + 3, T[4:8], assumed_ids=list(T[1:4]))
    policy = h.engine.speculator.policy
    policy._unanswered_since = None
    await h.engine.step()
    assert seq.token_ids[N:] == list(T[1:4])
    assert policy._unanswered_since is None, "an Extend covered by a held pre-draft owes no answer"
    h.propose(seq, N + 3, T[4:8])  # a plain proposal for the same prefix is an answer, not a pre-draft
    await h.engine.step()
    assert h.verified_drafts(seq) == list(T[4:8])


ASSUMED_CASES = {
    # name: (base_len, drafts, assumed) of an invalid pre-draft -> reason
    "assumes more than 8 verifications of k + 1 tokens": (N + 8 * (MAX_K + 1) + 1, (5,), (1,) * (8 * (MAX_K + 1) + 1),
                                                          "assumed"),
    "an assumed id outside the vocabulary": (N + 1, (5,), (VOCAB,), "token_id"),
    "drafted from a prefix longer than the committed one": (N + 3, (5,), (1,), "base_len"),
}


@pytest.mark.parametrize("base_len, drafts, assumed, reason", ASSUMED_CASES.values(), ids=ASSUMED_CASES.keys())
async def test_an_invalid_pre_draft_is_dropped_and_counted(make, base_len, drafts, assumed, reason):
    h, seq = await _prefilled(make)
    h.propose(seq, base_len, drafts, assumed_ids=list(assumed))
    assert h.count("tandem_draft_rejected_proposals_total", reason=reason) == 1


async def test_the_synchronous_baseline_takes_no_pre_drafts(make):
    h = make(sync_speculation=True)
    seq = h.submit()
    h.engine.speculator.admit([seq])  # what the step's admission does, without its synchronous wait
    [open_msg] = h.link.updates[0].opens
    assert not open_msg.accepts_assumed
    h.engine.speculator.on_proposals(drafter_pb2.DraftProposals(proposals=[drafter_pb2.DraftProposal(
        seq_id=seq.seq_id, base_len=len(PROMPT) + 1, token_ids=[5], assumed_ids=[T[0]])]), 0)
    assert h.count("tandem_draft_rejected_proposals_total", reason="assumed") == 1


async def test_the_asynchronous_target_opens_sequences_for_pre_drafts(make):
    h = make()
    h.submit()
    await h.engine.step()
    assert [o.accepts_assumed for o in h.link.updates[0].opens] == [True]


# ---- how many: each sequence's cap, then the step's budget ---------------------------------------

CAP_CASES = {
    # name: (sequence options, max_len) -> drafts verified out of MAX_K offered
    "its k": (dict(num_speculative_tokens=2), 64, 2),
    "all of them": (dict(), 64, 4),
    "two tokens left: one draft and the bonus": (dict(max_tokens=3), 64, 1),
    "one token left: none": (dict(max_tokens=2), 64, 0),
    "two positions left in the cache": (dict(), N + 2, 2),
    "not speculating": (dict(speculate=False), 64, 0),
}


@pytest.mark.parametrize("options, max_len, cap", CAP_CASES.values(), ids=CAP_CASES.keys())
async def test_each_sequence_verifies_at_most_its_cap(make, monkeypatch, options, max_len, cap):
    h = make(max_len=max_len)
    seq = h.submit(**options)
    await h.engine.step()
    limits = []
    policy_limits = h.engine.speculator.policy.draft_limits

    def draft_limits(records: list, available: list[int]) -> list[int]:
        limits.append(available)
        return policy_limits(records, available)

    monkeypatch.setattr(h.engine.speculator.policy, "draft_limits", draft_limits)
    h.propose(seq, N, T[1:5])
    await h.engine.step()
    assert h.verified_drafts(seq) == list(T[1 : 1 + cap])
    # The budget sees the drafts after the cap; a step in which no sequence can verify any asks no budget.
    assert limits == ([[cap]] if cap else [])
    assert h.count("tandem_draft_miss_total") == 0


@pytest.mark.parametrize("budget, salvaged", [(0, 0), (1, 2), (2, 2), (9, 2)])
async def test_the_budget_caps_every_sequence_and_is_no_miss(make, monkeypatch, budget, salvaged):
    h = make()
    seqs = [h.submit(PROMPT), h.submit(OTHER_PROMPT)]
    await h.engine.step()
    monkeypatch.setattr(h.engine.speculator.policy, "draft_limits", lambda records, available: [budget] * len(available))
    for seq in seqs:  # drafted from the prompt: the prefill token salvages them, three drafts remain
        h.propose(seq, len(seq.prompt_ids), CONTINUATIONS[tuple(seq.prompt_ids)][:4])
    await h.engine.step()
    for seq in seqs:
        assert h.verified_drafts(seq) == list(CONTINUATIONS[tuple(seq.prompt_ids)][1 : 1 + min(budget, 3)])
    assert h.count("tandem_draft_miss_total") == 0
    assert h.count("tandem_draft_stale_total", outcome="salvaged") == salvaged
    kind = "verify" if budget else "decode"
    assert h.count("tandem_step_duration_seconds_count", kind=kind) == 1


# ---- committing: stops inside accepted runs --------------------------------------------------------

async def test_a_stop_inside_an_accepted_run_counts_only_the_committed_drafts(make):
    h, seq = await _prefilled(make, stop_token_ids=frozenset({T[2]}))
    h.propose(seq, N, T[1:5])
    await h.engine.step()
    assert h.verified_drafts(seq) == list(T[1:5])  # the verifier accepts all four
    *tokens, last = outputs(seq)
    assert [t for o in tokens for t in o.token_ids] == [T[0], T[1], T[2]]
    assert (tokens[-1].num_accepted, last.finish) == (2, FinishReason.STOP)
    assert (seq.draft_tokens, seq.accepted_tokens, seq.draft_steps) == (4, 2, 1)
    assert h.count("tandem_spec_decode_num_accepted_tokens_total") == 2
    assert [h.count("tandem_spec_decode_num_accepted_tokens_per_pos_total", position=str(p))
            for p in range(4)] == [1, 1, 0, 0]
    assert h.count("tandem_acceptance_length_sum") == 3
    assert h.engine.speculator.policy.alpha == 1.0, "the policy learns from the verifier's verdict, not from the stop"


# ---- what the drafter is told ----------------------------------------------------------------------

MESSAGE_CASES = {
    # name: sequence options -> what the drafter is told about it, start to end; the last tokens
    # come with the Close, so that the drafter has the whole sequence before it forgets it
    "ends on its prefill token": (dict(max_tokens=1), [("open", list(PROMPT), MAX_K), ("extend", 3, [T[0]]),
                                                       ("close",)]),
    "ends after one decode": (dict(max_tokens=2), [("open", list(PROMPT), MAX_K), ("extend", 3, [T[0]]),
                                                   ("extend", 4, [T[1]]), ("close",)]),
    "k above the drafter's max_k": (dict(max_tokens=2, num_speculative_tokens=8),
                                    [("open", list(PROMPT), MAX_K), ("extend", 3, [T[0]]),
                                     ("extend", 4, [T[1]]), ("close",)]),
    "not speculating": (dict(max_tokens=2, speculate=False), []),
}


@pytest.mark.parametrize("options, told", MESSAGE_CASES.values(), ids=MESSAGE_CASES.keys())
async def test_the_drafter_is_told_open_extends_and_close(make, options, told):
    h = make()
    seq = h.submit(**options)
    while seq.finish is None:
        await h.engine.step()
    assert h.link.told(seq) == told


async def test_a_sequence_that_ends_while_the_drafter_is_away_is_told_nothing_more(make):
    """No tail and no Close on a link that is down: a drafter that comes back has a new stream,
    which never opened the sequence."""
    h = make()
    seq = h.submit(max_tokens=3)
    await h.engine.step()
    told = h.link.told(seq)
    assert told[0] == ("open", list(PROMPT), MAX_K)
    h.link.connected = False
    while seq.finish is None:
        await h.engine.step()
    assert seq.slot is None, "released with its last step"
    assert h.link.told(seq) == told


async def test_the_open_goes_out_before_the_prefill(make):
    """So that the drafter's prefill runs beside the target's."""
    h = make()
    h.submit()
    await h.engine.step()
    assert h.events[:2] == ["update", "prefill"]


async def test_an_aborted_sequence_is_closed_after_the_step_that_uses_it(make):
    h, seq = await _prefilled(make)
    other = h.submit(OTHER_PROMPT)
    await h.engine.step()
    h.engine.abort(seq)
    assert h.link.told(seq)[-1] != ("close",), "a running sequence is released only by the next step"
    await h.engine.step()
    assert h.link.told(seq)[-1] == ("close",)
    assert seq.slot is None and other.finish is None


async def test_a_requests_samples_wait_for_room_for_all_then_share_one_prefill(make):
    """n samples are admitted in one step or not at all; the first runs the prompt, the others copy
    its KV (copy_of), and sample i is seeded seed + i."""
    h = make(num_slots=3)
    single = h.submit(OTHER_PROMPT)
    await h.engine.step()
    options = RequestOptions(sampling=Sampling(temperature=0.0, seed=40), max_tokens=12, stop=(),
                             stop_token_ids=frozenset(), ignore_eos=False, skip_special_tokens=True, speculate=True,
                             num_speculative_tokens=MAX_K, n=3)
    samples = h.engine.new_sequences("", list(PROMPT), options)
    h.engine.submit(samples)
    await h.engine.step()
    assert [s.status for s in samples] == [SequenceStatus.WAITING] * 3, "two free slots admit none of three"
    h.engine.abort(single)
    await h.engine.step()
    assert [s.status for s in samples] == [SequenceStatus.RUNNING] * 3
    assert [c.copy_of for c in h.runner.prefilled[-1]] == [None, 0, 0]
    assert [s.options.sampling.seed for s in samples] == [40, 41, 42] and [s.index for s in samples] == [0, 1, 2]
    assert all(s.token_ids == [*PROMPT, T[0]] for s in samples)


async def test_a_group_that_cannot_be_admitted_whole_counts_as_waiting_in_full(make):
    """Three samples wait behind a running sequence for three free slots: the two free ones admit
    nothing next step, so they do not make room in the queue."""
    h = make(num_slots=3, max_queue=3)
    h.submit(OTHER_PROMPT)
    await h.engine.step()
    options = RequestOptions(sampling=Sampling(temperature=0.0, seed=1), max_tokens=12, stop=(),
                             stop_token_ids=frozenset(), ignore_eos=False, skip_special_tokens=True, speculate=True,
                             num_speculative_tokens=MAX_K, n=3)
    h.engine.submit(h.engine.new_sequences("", list(PROMPT), options))
    with pytest.raises(RequestError) as refused:
        h.submit()
    assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED


# ---- KV blocks ----------------------------------------------------------------------------------------

async def test_sequences_are_admitted_by_free_kv_blocks_not_by_slots(make):
    """Four blocks hold one sequence of max_len 64, or four whose prompt and max_tokens fit a block:
    four run at once, the fifth waits for blocks and goes in when one finishes."""
    h = make(num_slots=8, max_len=64, kv_blocks=4)
    seqs = [h.submit(max_tokens=12) for _ in range(5)]
    await h.engine.step()
    assert [s.status for s in seqs] == [SequenceStatus.RUNNING] * 4 + [SequenceStatus.WAITING]
    assert h.engine.scheduler.kv_usage == 1.0
    h.engine.abort(seqs[0])
    await h.engine.step()
    await h.engine.step()
    assert seqs[4].status is SequenceStatus.RUNNING and seqs[4].token_ids[: N] == [*PROMPT, T[0]]


async def test_a_prompt_finds_the_full_blocks_another_sequence_computed_and_shares_them(make):
    """Once a running sequence's first block is full, a request with the same prompt holds that block
    too: it prefills only the rest, and the pool counts the block once."""
    h = make(num_slots=4, max_len=64)
    first = h.submit(LONG_PROMPT, max_tokens=12)
    await h.engine.step()
    second = h.submit(LONG_PROMPT, max_tokens=12)
    await h.engine.step()
    assert (first.cached_tokens, second.cached_tokens) == (0, 16)
    assert [(c.start, c.end) for call in h.runner.prefilled for c in call] == [(0, 20), (16, 20)]
    kv = h.engine.scheduler.kv_cache
    assert kv.block_table(first.slot)[0] == kv.block_table(second.slot)[0]
    assert kv.block_table(first.slot)[1] != kv.block_table(second.slot)[1]
    held = {block for s in (first, second) for block in kv.block_table(s.slot)}
    assert kv.usage == len(held) / kv.num_blocks and len(held) == kv.num_blocks_of(first.slot) * 2 - 1


async def test_only_full_blocks_before_the_last_prompt_token_are_found(make):
    """A prompt of one block finds nothing (its last token runs, for its logits); a longer prompt with
    the same first block finds that block."""
    h = make(num_slots=4, max_len=64)
    for prompt, cached in ((BLOCK_PROMPT, 0), (BLOCK_PROMPT, 0), (LONG_PROMPT, 16)):
        seq = h.submit(prompt, max_tokens=12)
        while seq.status is not SequenceStatus.FINISHED:
            await h.engine.step()
        assert seq.cached_tokens == cached


async def test_cached_blocks_give_way_to_new_sequences(make):
    """A finished sequence's full block stays cached while free; when two new sequences need the
    pool's two blocks, it is taken last, and its prefix forgotten."""
    h = make(num_slots=4, max_len=64, kv_blocks=2)
    first = h.submit(LONG_PROMPT, max_tokens=2)
    while first.status is not SequenceStatus.FINISHED:
        await h.engine.step()
    kv = h.engine.scheduler.kv_cache
    assert kv.pool.num_cached == 1 and kv.num_free_blocks == 2
    a = h.submit(max_tokens=12)
    await h.engine.step()
    assert kv.pool.num_cached == 1, "the block that caches nothing is taken first"
    b = h.submit(max_tokens=12)
    await h.engine.step()
    assert a.status is b.status is SequenceStatus.RUNNING
    assert kv.pool.num_cached == 0 and kv.num_free_blocks == 0
    again = h.submit(LONG_PROMPT, max_tokens=2)
    h.engine.abort(a)
    h.engine.abort(b)
    await h.engine.step()
    await h.engine.step()
    assert again.status is not SequenceStatus.WAITING and again.cached_tokens == 0


async def test_a_request_waiting_for_blocks_counts_against_the_queue(make):
    """Free slots do not make room in the queue when the blocks are taken: with --max-queue 0, a
    request the next step cannot admit is refused."""
    h = make(num_slots=8, max_len=64, kv_blocks=1, max_queue=0)
    h.submit(max_tokens=12)
    await h.engine.step()
    with pytest.raises(RequestError) as refused:
        h.submit(max_tokens=12)
    assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED


async def test_a_request_that_needs_more_blocks_than_the_cache_has_to_start_is_refused(make):
    """Three samples of a 40-token prompt need 45 positions each (the prompt, the prefill's token and
    k drafts): 9 blocks, of a cache of 4."""
    h = make(num_slots=8, max_len=64, kv_blocks=4)
    options = RequestOptions(sampling=Sampling(temperature=0.0, seed=1), max_tokens=20, stop=(),
                             stop_token_ids=frozenset(), ignore_eos=False, skip_special_tokens=True, speculate=True,
                             num_speculative_tokens=MAX_K, n=3)
    with pytest.raises(RequestError) as refused:
        h.engine.submit(h.engine.new_sequences("", list(range(100, 140)), options))
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "need 144 KV positions to start; the cache holds 64 (--kv-cache-tokens)" in str(refused.value)


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["recomputed", "cached"])
async def test_a_sequence_short_of_blocks_is_preempted_and_resumes_with_the_same_tokens(make, prefix_caching):
    """Four blocks for two sequences that end up needing two and three: the newest is preempted when
    the pool runs dry, waits while the other finishes, and resumes. Its next verify runs again, in
    front, the committed tokens whose KV its new slot lacks: all of them without the prefix cache;
    with it, only those past its first block, which stayed cached."""
    h = make(num_slots=4, max_len=64, kv_blocks=4, prefix_caching=prefix_caching)
    a, b = h.submit(PROMPT, max_tokens=16), h.submit(LONG_PROMPT, max_tokens=16)
    for _ in range(60):
        if a.status is b.status is SequenceStatus.FINISHED:
            break
        await h.engine.step()
    assert a.token_ids == [*PROMPT, *T] and b.token_ids == [*LONG_PROMPT, *CONTINUATIONS[LONG_PROMPT]]
    assert h.count("tandem_num_preemptions_total") == 1
    [chunk] = [c for call in h.runner.verified for c in call if c.replayed]
    held = 16 if prefix_caching else 0
    # it had its prompt (20) and 9 tokens when preempted: all but the newest run again past what its slot held
    assert (chunk.start, chunk.end, chunk.replayed) == (held, 29, 28 - held)
    assert list(chunk.token_ids) == b.token_ids[held : chunk.end]


# ---- chunked prefill ------------------------------------------------------------------------------

def chunks_run(h: Harness) -> list[list[tuple[int, int]]]:
    """Each prefill call's prompt parts, as (start, end) positions."""
    return [[(c.start, c.end) for c in call] for call in h.runner.parts]


async def test_a_long_prompt_is_prefilled_in_chunks_while_the_running_sequence_decodes(make):
    """A budget of 23 tokens a step: the running sequence's step takes 5 (its token and 4 drafts), so
    the 40-token prompt runs 18 positions a step and gets its first token on the third, with its last
    4. The running sequence commits a token every step, and the drafter hears of the new one before
    its first chunk runs."""
    h = make(max_num_batched_tokens=23)
    running = h.submit(PROMPT, max_tokens=12)
    await h.engine.step()
    seq = h.submit(CHUNKED_PROMPT, max_tokens=12)
    for step in range(3):
        before, events = len(running.token_ids), len(h.events)
        await h.engine.step()
        assert len(running.token_ids) == before + 1, f"step {step}: the running sequence waited"
        if step == 0:
            assert h.link.told(seq) == [("open", list(CHUNKED_PROMPT), MAX_K)]
            assert h.events[events:events + 2] == ["update", "prefill"], "the Open goes out before the first chunk"
        assert seq.token_ids == (list(CHUNKED_PROMPT) if step < 2 else [*CHUNKED_PROMPT, CONTINUATIONS[CHUNKED_PROMPT][0]])
    assert chunks_run(h)[1:] == [[(0, 18)], [(18, 36)], []]
    assert [(c.start, c.end) for c in h.runner.prefilled[-1]] == [(36, 40)]
    assert h.count("tandem_prompt_tokens_total") == len(PROMPT) + len(CHUNKED_PROMPT)


async def test_the_blocks_a_chunk_fills_are_found_before_its_prompt_ends(make):
    """A budget of 16: the first request's chunks fill two blocks in two steps, which leave nothing for
    a second request with the same prompt. On the third step the first ends its prompt with 8
    positions, and the second, admitted with the 8 left, finds both blocks and ends its prompt too."""
    h = make(max_num_batched_tokens=16)
    first = h.submit(CHUNKED_PROMPT)
    await h.engine.step()
    second = h.submit(CHUNKED_PROMPT)
    await h.engine.step()
    assert second.status is SequenceStatus.WAITING, "the budget was spent"
    await h.engine.step()
    assert (first.cached_tokens, second.cached_tokens) == (0, 32)
    assert chunks_run(h) == [[(0, 16)], [(16, 32)], []]
    assert [(c.start, c.end) for c in h.runner.prefilled[-1]] == [(32, 40), (32, 40)]
    assert first.token_ids[40:] == second.token_ids[40:] == [CONTINUATIONS[CHUNKED_PROMPT][0]]


def prompt_scored(seq: Sequence) -> list[int]:
    """The prompt tokens its first output's prompt logprobs score, in order."""
    return [lp.token for lp in seq.outbox.get_nowait().prompt_logprobs]


async def test_a_prompt_whose_logprobs_are_asked_runs_in_chunks_and_scores_each_token_once(make):
    """prompt_logprobs read every prompt position, and such a prompt is chunked like any other:
    admitted with the 8 positions a chunked prompt leaves on its last step, it runs in the budget,
    takes no cached prefix (the first request's blocks hold its prompt's start), and its first
    output carries the logprobs of prompt tokens 1.., those its chunks scored first."""
    h = make(max_num_batched_tokens=16)
    chunked = h.submit(CHUNKED_PROMPT)
    await h.engine.step()
    scored = h.submit(CHUNKED_PROMPT, prompt_logprobs=1)
    await h.engine.step()
    await h.engine.step()
    assert scored.status is SequenceStatus.RUNNING and h.link.told(scored)[0][0] == "open"
    while len(scored.token_ids) == len(CHUNKED_PROMPT):
        await h.engine.step()
    assert chunks_run(h) == [[(0, 16)], [(16, 32)], [(0, 8)], [(8, 24)], []]
    assert [[(c.start, c.end) for c in call] for call in h.runner.prefilled][2:] == [[(32, 40)], [], [(24, 40)]]
    assert scored.cached_tokens == 0 and chunked.token_ids[40:41] == scored.token_ids[40:41]
    assert prompt_scored(scored) == list(CHUNKED_PROMPT[1:])


async def test_a_requests_samples_share_the_prompt_their_first_sample_ran_in_chunks(make):
    """The first sample runs the prompt in chunks alone; the others copy its KV once it ends."""
    h = make(max_num_batched_tokens=16)
    options = RequestOptions(sampling=Sampling(temperature=0.0, seed=3), max_tokens=12, stop=(),
                             stop_token_ids=frozenset(), ignore_eos=False, skip_special_tokens=True, speculate=True,
                             num_speculative_tokens=MAX_K, n=2)
    samples = h.engine.new_sequences("", list(CHUNKED_PROMPT), options)
    h.engine.submit(samples)
    for _ in range(3):
        await h.engine.step()
    assert [c.slot for call in h.runner.parts for c in call] == [samples[0].slot] * 2
    assert [(c.copy_of, c.start) for c in h.runner.prefilled[-1]] == [(None, 32), (0, 0)]
    assert all(s.token_ids == [*CHUNKED_PROMPT, CONTINUATIONS[CHUNKED_PROMPT][0]] for s in samples)


async def test_a_sequence_preempted_between_chunks_resumes_its_prompt_from_its_cached_blocks(make):
    """Four blocks: a running sequence of one block and a 40-token prompt of three. The prompt runs 16
    positions a step beside the other's 5; after its second chunk the other needs a second block, and
    the prompt, newest, is preempted with two full blocks computed. Those stay cached while it waits;
    readmitted, it runs only its last 8 positions. The drafter opened it once, and its queue time
    counts once."""
    h = make(num_slots=4, max_len=64, kv_blocks=4, max_num_batched_tokens=21)
    running = h.submit(PROMPT, max_tokens=16)
    while len(running.token_ids) < 10:
        await h.engine.step()
    seq = h.submit(CHUNKED_PROMPT, max_tokens=4)
    for _ in range(3):
        await h.engine.step()
    assert seq.status is SequenceStatus.WAITING and h.count("tandem_num_preemptions_total") == 1
    assert chunks_run(h)[-2:] == [[(0, 16)], [(16, 32)]]
    while seq.status is not SequenceStatus.FINISHED:
        await h.engine.step()
    assert [(c.start, c.end) for c in h.runner.prefilled[-1]] == [(32, 40)]
    assert seq.token_ids == [*CHUNKED_PROMPT, *CONTINUATIONS[CHUNKED_PROMPT][:4]] and seq.cached_tokens == 0
    assert [said[0] for said in h.link.told(seq)].count("open") == 1
    assert h.count("tandem_request_queue_time_seconds_count") == 2



async def test_a_prompt_whose_logprobs_are_asked_runs_again_from_its_start_after_a_preemption(make):
    """The preemption above with prompt_logprobs asked: readmitted, the prompt takes none of its
    cached blocks (they hold no logprobs) and runs from position 0; each token is scored once."""
    h = make(num_slots=4, max_len=64, kv_blocks=4, max_num_batched_tokens=21)
    running = h.submit(PROMPT, max_tokens=16)
    while len(running.token_ids) < 10:
        await h.engine.step()
    seq = h.submit(CHUNKED_PROMPT, max_tokens=4, prompt_logprobs=1)
    for _ in range(3):
        await h.engine.step()
    assert seq.status is SequenceStatus.WAITING and chunks_run(h)[-2:] == [[(0, 16)], [(16, 32)]]
    while len(seq.token_ids) == len(CHUNKED_PROMPT):
        await h.engine.step()
    assert [c for call in chunks_run(h) for c in call] == [(0, 16), (16, 32), (0, 21)]  # the budget is all its own
    assert [(c.start, c.end) for c in h.runner.prefilled[-1]] == [(21, 40)]
    assert prompt_scored(seq) == list(CHUNKED_PROMPT[1:])

# ---- reconnect ----------------------------------------------------------------------------------------

async def test_reopen_all_opens_running_sequences_afresh_and_forgets_their_proposals(make):
    h = make(max_k=3)
    finished, running = h.submit(PROMPT), h.submit(OTHER_PROMPT)
    await h.engine.step()
    h.propose(running, len(OTHER_PROMPT) + 1, CONTINUATIONS[OTHER_PROMPT][1:4])
    h.engine.abort(finished)  # finished, but released only at the next step
    h.link.updates.clear()  # a new stream
    h.link.updates.append(h.engine.speculator.reopen_all())
    assert h.link.told(running) == [("open", running.token_ids, 3)]
    assert h.link.told(finished) == []
    await h.engine.step()
    assert h.link.told(finished) == [], "the new stream never opened it: no Close"
    assert h.verified_drafts(running) == [], "a proposal from the old stream was used"
    assert h.count("tandem_draft_miss_total") == 1
    assert h.link.told(running)[1:] == [("extend", len(OTHER_PROMPT) + 1, running.token_ids[-1:])]


# ---- invalid proposals ----------------------------------------------------------------------------------

INVALID_CASES = {
    "token_id": (N, (VOCAB,)),
    "length": (N, T[1 : 2 + MAX_K]),
    "base_len": (N + 1, T[2:3]),
}


@pytest.mark.parametrize("reason, proposal", INVALID_CASES.items(), ids=INVALID_CASES.keys())
async def test_an_invalid_proposal_is_counted_by_reason_and_never_verified(make, reason, proposal):
    h, seq = await _prefilled(make)
    h.propose(seq, *proposal)
    await h.engine.step()
    assert h.count("tandem_draft_rejected_proposals_total", reason=reason) == 1
    assert h.verified_drafts(seq) == []


async def test_a_sampled_request_needs_valid_probabilities(make):
    h, seq = await _prefilled(make, temperature=0.8)
    h.propose(seq, N, T[1:2], probs=b"\x07garbage", probs_top_k=4)
    assert h.count("tandem_draft_rejected_proposals_total", reason="probs") == 1


@pytest.mark.parametrize("top_k, rejected", [(1, 0), (4, 0), (5, 1)])
async def test_a_proposal_may_carry_fewer_probability_entries_than_announced(make, top_k, rejected):
    """A drafter may send point masses (K=1, the suffix drafter in front of the model) under the K it
    announced (4 here), never more."""
    h, seq = await _prefilled(make, temperature=0.8)
    q = torch.zeros(1, VOCAB)
    q[0, T[1]], q[0, 1:top_k] = 1.0, 0.5
    h.propose(seq, N, T[1:2], probs=pack(encode(q, top_k)), probs_top_k=top_k)
    await h.engine.step()
    assert h.count("tandem_draft_rejected_proposals_total", reason="probs") == rejected
    assert h.verified_drafts(seq) == ([] if rejected else [T[1]])


# ---- waiting for drafts ------------------------------------------------------------------------------

async def _timed_step(h: Harness) -> float:
    started = time.perf_counter()
    await h.engine.step()
    return time.perf_counter() - started


async def test_a_step_waits_for_missing_drafts_until_they_arrive(make):
    h = make(draft_wait_ms=1000)
    seq = h.submit()
    await h.engine.step()
    asyncio.get_running_loop().call_later(0.05, h.propose, seq, N, T[1:3])
    assert await _timed_step(h) < 0.5
    assert h.verified_drafts(seq) == list(T[1:3])
    assert h.count("tandem_draft_wait_seconds_count") == 1


async def test_a_sequence_that_can_verify_no_drafts_is_not_waited_for(make):
    h = make(draft_wait_ms=1000)
    ready, last = h.submit(PROMPT), h.submit(OTHER_PROMPT, max_tokens=2)  # `last` has one token to go
    await h.engine.step()
    h.propose(ready, N, T[1:3])
    assert await _timed_step(h) < 0.5
    assert h.count("tandem_draft_wait_seconds_count") == 0
    assert last.finish is FinishReason.LENGTH


@pytest.mark.parametrize("answers_carry_drafts", [True, False])
async def test_a_step_waits_only_for_a_drafter_whose_answers_carry_drafts(make, answers_carry_drafts):
    """A lookup drafter on a chat answers most prefixes with nothing. Waiting for its answer saves a
    step only in the share of answers that carry drafts: after four answers of nothing, each 250 ms
    after its update, a step no longer waits the 250 ms that it waits for a drafter whose answers
    carried drafts."""
    h = make(draft_wait_ms=1000)
    seq = h.submit(max_tokens=len(T))
    await h.engine.step()
    loop = asyncio.get_running_loop()

    def answer_later(with_drafts: bool) -> None:
        n = len(seq.token_ids)
        drafts = CONTINUATIONS[PROMPT][n - len(PROMPT):][:2] if with_drafts else ()
        loop.call_later(0.25, h.propose, seq, n, drafts)

    for _ in range(4):
        answer_later(answers_carry_drafts)
        await h.engine.step()
    answer_later(True)
    waited = await _timed_step(h)
    if answers_carry_drafts:
        assert waited >= 0.25 and h.verified_drafts(seq)
    else:
        assert waited < 0.2 and not h.verified_drafts(seq)


@pytest.mark.parametrize("batch", [1, 2])
async def test_a_wait_is_weighed_against_every_sequence_it_holds_up(make, batch):
    """The drafter's answers have come 250 ms after each update; a draft saves one step of 0.4 s.
    A sequence awaiting its answer alone in a step is worth the 0.26 s wait (0.4 s saved); beside a
    sequence whose drafts are in, it is not: the wait would hold up both, and save one of them 0.4 s."""
    h = make(draft_wait_ms=1000)
    awaiting, *others = [h.submit(prompt, max_tokens=len(T)) for prompt in (PROMPT, OTHER_PROMPT)[:batch]]
    await h.engine.step()
    policy = h.engine.speculator.policy
    for _ in range(200):
        policy.observe_draft_rtt(0.25)
        policy.observe_step(1, 0.4, batch=1)
        policy.observe_verify(1, 2, policy.new_record())
    for seq in others:
        h.propose(seq, len(seq.token_ids), CONTINUATIONS[OTHER_PROMPT][1:3])
    asyncio.get_running_loop().call_later(0.25, h.propose, awaiting, N, T[1:3])
    waited = await _timed_step(h)
    if batch == 1:
        assert waited >= 0.25 and h.verified_drafts(awaiting) == list(T[1:3])
    else:
        assert waited < 0.2 and h.verified_drafts(awaiting) == []
        assert h.verified_drafts(others[0]) == list(CONTINUATIONS[OTHER_PROMPT][1:3])


async def test_a_request_to_admit_ends_the_wait_for_drafts(make):
    """Waiting for drafts never delays a prefill."""
    h = make(draft_wait_ms=1000)
    seq = h.submit()
    await h.engine.step()
    loop = asyncio.get_running_loop()
    loop.call_later(0.02, h.submit, OTHER_PROMPT)
    loop.call_later(0.3, h.propose, seq, N, T[1:3])
    assert await _timed_step(h) < 0.25
    assert h.verified_drafts(seq) == []
    assert h.count("tandem_draft_miss_total") == 1


async def test_synchronous_speculation_publishes_tokens_only_once_the_next_drafts_arrive(make):
    """Even when a request could be admitted meanwhile: the baseline blocks."""
    h = make(sync_speculation=True)
    seq = h.submit()
    loop = asyncio.get_running_loop()
    queued_at_100ms = []
    loop.call_later(0.02, h.submit, OTHER_PROMPT)
    loop.call_later(0.1, lambda: queued_at_100ms.append(seq.outbox.qsize()))
    loop.call_later(0.15, h.propose, seq, N, T[1:3])
    assert 0.15 <= await _timed_step(h) < 0.9
    assert queued_at_100ms == [0]
    assert [o.token_ids for o in outputs(seq)] == [[T[0]]]
    assert len(h.engine.scheduler.waiting) == 1
