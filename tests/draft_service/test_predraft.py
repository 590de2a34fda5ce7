"""Pre-drafting in-process: the wire field, the drafters' outcome rows and slots, the scheduler's order and fan-out.

The model drafter runs on a tiny random model; every pre-draft is compared with what a fresh round
from the same prefix drafts, computed by a second drafter that saw only fresh rounds.
"""
from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from draft_service.drafter import DraftJob, DraftSequence, Guess, Drafted, make_drafted, never
from tandem_kernels.sampling import Sampling
from draft_service.metrics import DraftMetrics
from draft_service.drafters.model import ModelDrafter, noise_seed
from draft_service.drafters.ngram import NgramDrafter, lookup
from draft_service.predraft import Fanout, Predrafter
from draft_service.scheduler import Limits
from tandem_kernels.compression import sample_compressed, unpack
from bench.greedy import greedy_generate
from tandem.protos import MAX_HELD_PROPOSALS
from tandem.model.batch import SequenceChunk
from tandem.v1 import drafter_pb2 as pb
from tests.support.draft_schedulers import running_scheduler
from tests.support.tiny_drafter import MAX_LEN, VOCAB, tiny_draft_model

TOP_K = 8
K = 3
LABELS = {"model": "tiny", "service": "draft"}
SAMPLED = Sampling(temperature=0.8, top_k=50, top_p=0.9, seed=1234)
MODES = {"greedy": Sampling(), "sampled": SAMPLED, "invariant": Sampling(temperature=1.0, seed=99, drafter_invariant=True)}
WAIT_S = 10


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _drafter(num_slots: int = 12) -> ModelDrafter:
    return ModelDrafter(tiny_draft_model(num_slots=num_slots), TOP_K, DraftMetrics("tiny"))


def _open(drafter, seq_id: int, prompt: list[int], sampling: Sampling = Sampling()) -> DraftSequence:
    sequence = DraftSequence((1, seq_id), list(prompt), sampling, K, accepts_assumed=True)
    drafter.open(sequence.key)
    return sequence


def _certain(tokens: list[int]) -> list[list[Guess]]:
    """One guess per draft, each as likely as can be: the gains are then P(j) alone."""
    return [[Guess(token, 1.0)] for token in tokens]


def _fresh(drafter, sequence: DraftSequence, tokens: list[int]) -> Drafted:
    [draft] = drafter.draft([DraftJob(sequence, list(tokens))])
    return draft


def _all_outcomes(sequence: DraftSequence, fresh: Drafted) -> list[DraftJob]:
    """A pre-draft job for every outcome of `fresh`: j drafts accepted, then the recovered token the drafter
    guessed (j < k); all k accepted, then a bonus token the drafter guesses as it drafts."""
    prefix, drafts = list(sequence.tokens), fresh.token_ids
    jobs = [DraftJob(sequence, prefix + drafts[:j] + [guess.token], num_assumed=j + 1)
            for j, guesses in enumerate(fresh.recovered_guesses) for guess in guesses]
    return jobs + [DraftJob(sequence, prefix + drafts, num_assumed=len(drafts), guess_next=True)]


def _logits_after(model, prompt: list[int], fed: list[int]) -> torch.Tensor:
    """Logits [len(fed) + 1, V] at positions len(prompt) - 1 ..: the prompt prefilled, then each token fed alone."""
    rows = [model.run([SequenceChunk(slot=0, start=0, token_ids=prompt)])]
    for i, token in enumerate(fed):
        rows.append(model.run([SequenceChunk(slot=0, start=len(prompt) + i, token_ids=[token])]))
    return torch.cat(rows)


def _reused(metrics: DraftMetrics) -> float:
    return metrics.registry.get_sample_value("tandem_draft_reused_tokens_total", LABELS)


def test_assumed_ids_round_trip_and_proposals_without_them_parse_as_before():
    proposal = pb.DraftProposal(seq_id=3, base_len=12, token_ids=[7, 8], assumed_ids=[5, 6])
    parsed = pb.DraftProposal.FromString(proposal.SerializeToString())
    assert (parsed.base_len, list(parsed.token_ids), list(parsed.assumed_ids)) == (12, [7, 8], [5, 6])
    plain = pb.DraftProposal.FromString(pb.DraftProposal(seq_id=3, base_len=10, token_ids=[7]).SerializeToString())
    assert list(plain.assumed_ids) == []
    assert pb.SequenceOpen.FromString(pb.SequenceOpen(seq_id=1, k=2).SerializeToString()).accepts_assumed is False
    draft = Drafted((1, 3), base_len=12, token_ids=[7, 8], assumed_ids=[5, 6], recovered_guesses=_certain([9, 9]))
    assert draft.to_proto() == proposal  # the recovered guesses stay with the drafter


@pytest.mark.parametrize("mode", MODES)
def test_each_outcome_is_predrafted_as_a_fresh_round_from_its_prefix_would_draft(mode):
    drafter, prompt = _drafter(), _prompt(10, 1)
    sequence = _open(drafter, 1, prompt, MODES[mode])
    fresh = _fresh(drafter, sequence, prompt)
    drafts = fresh.token_ids
    logits = _logits_after(tiny_draft_model(), prompt, drafts)  # [k + 1, V]: row j predicts position L + j
    runner_up = [int(row.index_fill(0, torch.tensor([d]), float("-inf")).argmax()) for row, d in zip(logits, drafts)]
    # the most likely token other than each draft, with the drafter's probability of it given a rejection
    assert [[g.token for g in guesses] for guesses in fresh.recovered_guesses] == [[t] for t in runner_up]
    probs = torch.softmax(logits.float(), dim=1)
    for j, [guess] in enumerate(fresh.recovered_guesses):
        expected = probs[j, runner_up[j]] / (1 - probs[j, drafts[j]])
        assert guess.probability == pytest.approx(float(expected), rel=1e-4)

    predrafts = drafter.draft(_all_outcomes(sequence, fresh))
    expected_assumed = [drafts[:j] + [runner_up[j]] for j in range(K)] + [drafts + [int(logits[K].argmax())]]
    assert [p.assumed_ids for p in predrafts] == expected_assumed
    assert [p.base_len for p in predrafts] == [len(prompt) + len(a) for a in expected_assumed]

    for predraft in predrafts:  # a drafter that sees only fresh rounds, along the same computation path
        alone = _drafter(num_slots=1)
        again = _open(alone, 1, prompt, MODES[mode])
        _fresh(alone, again, prompt)
        if len(predraft.assumed_ids) > K:  # "all accepted": d_k is fed on its own, as the pre-draft feeds it
            _fresh(alone, again, prompt + drafts)
        reference = _fresh(alone, again, prompt + predraft.assumed_ids)
        assert (predraft.token_ids, predraft.to_proto().probs) == (reference.token_ids, reference.to_proto().probs)
        if mode == "sampled":  # drawn from the q' it sends, keyed by the seed, its prefix and the positions
            q_prime = unpack(predraft.to_proto().probs, K, TOP_K, VOCAB)
            positions = torch.arange(predraft.base_len, predraft.base_len + K)
            seeds = torch.full((K,), noise_seed(SAMPLED.seed, predraft.prefix))
            assert sample_compressed(q_prime, seeds, positions).tolist() == predraft.token_ids


def test_a_hit_makes_the_outcomes_slot_the_sequences_own_and_drafts_as_a_recompute_would():
    drafter, prompt = _drafter(), _prompt(11, 2)
    sequence = _open(drafter, 1, prompt)
    predrafts = drafter.draft(_all_outcomes(sequence, _fresh(drafter, sequence, prompt)))
    hit = predrafts[1]  # one draft accepted, then the recovered token the drafter guessed
    committed = prompt + hit.assumed_ids
    [scratch] = [s.slot for s in drafter.slots.scratch(sequence.key) if s.cached[: len(committed)] == committed]
    reused = _reused(drafter.metrics)

    drafter.settle(sequence.key, committed)
    assert drafter.slots.own(sequence.key).slot == scratch
    assert _reused(drafter.metrics) - reused == len(hit.assumed_ids)  # d1 and the guessed token: no recompute
    sequence.tokens = list(committed)
    after_hit = _fresh(drafter, sequence, committed)
    recompute = _drafter(num_slots=1)
    recomputed = _fresh(recompute, _open(recompute, 1, committed), committed)
    assert after_hit.token_ids == hit.token_ids == recomputed.token_ids
    assert after_hit.token_ids == greedy_generate(tiny_draft_model(), committed, K)


def test_a_close_keeps_the_outcomes_slot_for_the_prefix_cache_without_counting_it_as_reused():
    """The sequence's last tokens, settled as it closes, hit a pre-drafted outcome: its slot, holding
    the most of them, is the one kept, but no KV of this sequence's is spared a recompute."""
    drafter, prompt = _drafter(), _prompt(11, 2)
    sequence = _open(drafter, 1, prompt)
    predrafts = drafter.draft(_all_outcomes(sequence, _fresh(drafter, sequence, prompt)))
    committed = prompt + predrafts[1].assumed_ids
    [scratch] = [s.slot for s in drafter.slots.scratch(sequence.key) if s.cached[: len(committed)] == committed]
    reused = _reused(drafter.metrics)
    drafter.settle(sequence.key, committed, closing=True)
    assert drafter.slots.own(sequence.key).slot == scratch
    assert _reused(drafter.metrics) == reused


def test_outcomes_without_a_free_slot_are_left_out_and_an_open_takes_a_scratch_slot():
    drafter, prompt = _drafter(num_slots=3), _prompt(9, 3)
    sequence = _open(drafter, 1, prompt)
    jobs = _all_outcomes(sequence, _fresh(drafter, sequence, prompt))
    predrafts = drafter.draft(jobs)
    assert [p.assumed_ids for p in predrafts] == [jobs[0].tokens[len(prompt):], jobs[1].tokens[len(prompt):]]
    assert drafter.model.kv_cache.num_free_slots == 0

    other = _open(drafter, 2, _prompt(7, 4))  # every slot holds a live pre-draft: the Open takes one
    assert len(drafter.slots.scratch(sequence.key)) == 1
    assert _fresh(drafter, other, other.tokens).token_ids == greedy_generate(tiny_draft_model(), other.tokens, K)


def test_the_next_predrafts_reuse_spare_slots_and_copy_only_what_changed():
    drafter, prompt = _drafter(num_slots=6), _prompt(20, 5)
    sequence = _open(drafter, 1, prompt)
    fresh = _fresh(drafter, sequence, prompt)
    drafter.draft(_all_outcomes(sequence, fresh))
    free = drafter.model.kv_cache.num_free_slots
    miss = prompt + [fresh.token_ids[0], (fresh.recovered_guesses[1][0].token + 1) % VOCAB]  # no outcome guessed it
    if miss[-1] == fresh.token_ids[1]:
        miss[-1] = (miss[-1] + 1) % VOCAB
    drafter.settle(sequence.key, miss)
    sequence.tokens = list(miss)
    copies: list[tuple[int, int]] = []
    copy = drafter.model.kv_cache.copy_positions
    drafter.model.kv_cache.copy_positions = lambda src, dst, start, end: (copies.append((start, end)),
                                                                          copy(src, dst, start, end))
    predrafts = drafter.draft(_all_outcomes(sequence, _fresh(drafter, sequence, miss)))
    assert len(predrafts) == K + 1 and drafter.model.kv_cache.num_free_slots == free
    assert copies and all(start >= len(prompt) for start, _ in copies)  # the shared prompt is not copied again
    for predraft in predrafts:
        assert predraft.token_ids == greedy_generate(tiny_draft_model(), miss + predraft.assumed_ids, K)


def test_the_ngram_drafter_covers_all_accepted_with_its_next_token_and_skips_what_it_cannot_guess():
    drafter = NgramDrafter(1, 4)
    tokens = [10, 11, 12, 13, 14, 30, 10, 11, 12, 13, 14, 31, 10, 11]
    sequence = DraftSequence((1, 1), tokens, Sampling(), K, accepts_assumed=True)
    [fresh] = drafter.draft([DraftJob(sequence, tokens)])
    assert (fresh.token_ids, fresh.recovered_guesses) == ([12, 13, 14], [])  # no distribution: no recovered guess
    [predraft] = drafter.draft(_all_outcomes(sequence, fresh))
    bonus = lookup(tokens + fresh.token_ids, 1, 1, 4)
    assert bonus == [31]
    assert predraft.assumed_ids == [12, 13, 14, 31] and predraft.base_len == len(tokens) + 4
    assert predraft.token_ids == lookup(tokens + [12, 13, 14, 31], K, 1, 4) == [10, 11, 12]
    unseen = DraftSequence((1, 2), [1, 2, 3], Sampling(), K, accepts_assumed=True)
    assert drafter.draft([DraftJob(unseen, [1, 2, 3, 4], num_assumed=1, guess_next=True)]) == []


def test_fanout_grows_with_spare_time_and_halves_when_an_extend_comes_first():
    fanout = Fanout(cap=4)
    assert fanout.limit == 4
    fanout.on_late()
    fanout.on_late()
    fanout.on_late()
    assert fanout.limit == 1
    fanout.on_spare(spare_s=0.010, round_s=0.020, outcomes=1)  # not a round's worth to spare
    assert fanout.limit == 1
    fanout.on_spare(spare_s=0.030, round_s=0.020, outcomes=1)
    fanout.on_spare(spare_s=0.011, round_s=0.020, outcomes=2)  # an outcome more costs 10 ms at most
    assert fanout.limit == 3
    for _ in range(3):
        fanout.on_spare(spare_s=1.0, round_s=0.020, outcomes=3)
    assert fanout.limit == 4
    off = Fanout(cap=0)
    off.on_late()
    off.on_spare(1.0, 0.01, 1)
    assert off.limit == 0


def test_each_draft_carries_its_likeliest_alternatives_and_each_is_an_outcome_by_gain():
    """--predraft-guesses 3: the drafter's three likeliest tokens other than each draft are three
    guesses at the recovered token, each an outcome pre-drafted in order of expected gain."""
    guesses = 3
    drafter = ModelDrafter(tiny_draft_model(num_slots=16), TOP_K, DraftMetrics("tiny"), guesses=guesses)
    prompt = _prompt(10, 2)
    sequence = _open(drafter, 1, prompt)
    fresh = _fresh(drafter, sequence, prompt)
    logits = _logits_after(tiny_draft_model(), prompt, fresh.token_ids)
    for j, alternatives in enumerate(fresh.recovered_guesses):
        likeliest = [t for t in logits[j].argsort(descending=True).tolist() if t != fresh.token_ids[j]][:guesses]
        assert [g.token for g in alternatives] == likeliest
        assert sorted((g.probability for g in alternatives), reverse=True) == [g.probability for g in alternatives]

    predrafter = Predrafter(K * guesses + 1, DraftMetrics("tiny"))
    predrafter.open(sequence)
    predrafter.on_drafted(DraftJob(sequence, list(prompt)), fresh)
    jobs = predrafter.take_jobs()
    alpha = 0.5  # the prior
    gains = {(j, g.token): alpha**j * (1 - alpha) * g.probability
             for j, alternatives in enumerate(fresh.recovered_guesses) for g in alternatives}
    gains[(K, None)] = alpha**K
    assert len(jobs) == len(gains) == K * guesses + 1
    assert [(job.num_assumed - (not job.guess_next), None if job.guess_next else job.tokens[-1]) for job in jobs] \
        == sorted(gains, key=lambda outcome: -gains[outcome])
    sent = drafter.draft(jobs)
    assert sorted(tuple(d.assumed_ids[:-1]) for d in sent if len(d.assumed_ids) <= K) == sorted(
        tuple(fresh.token_ids[:j]) for j in range(K) for _ in range(guesses))


def _predrafter_with_a_proposal(drafts: list[int], guesses: list[int], max_fanout: int = 4):
    metrics = DraftMetrics("tiny")
    predrafter = Predrafter(max_fanout, metrics, max_depth=4)
    sequence = DraftSequence((1, 1), [1, 2, 3], Sampling(), len(drafts), accepts_assumed=True)
    predrafter.open(sequence)
    job = DraftJob(sequence, list(sequence.tokens))
    predrafter.on_drafted(job, Drafted(sequence.key, 3, drafts, recovered_guesses=_certain(guesses)))
    return predrafter, sequence, metrics


def _extend(predrafter: Predrafter, sequence: DraftSequence, token_ids: list[int], now: float) -> None:
    """As the scheduler applies an Extend: the predrafter first, then the tokens."""
    predrafter.on_extend(sequence, len(sequence.tokens), token_ids, now)
    sequence.tokens += token_ids


def test_an_extend_cancels_pending_predrafts_and_shrinks_the_fanout():
    predrafter, sequence, metrics = _predrafter_with_a_proposal([7, 8, 9], [17, 18, 19])
    assert predrafter.has_pending()
    _extend(predrafter, sequence, [7, 40], now=1.0)  # before any pre-draft round
    assert not predrafter.has_pending() and predrafter.take_jobs() == []
    cancelled = metrics.registry.get_sample_value("tandem_draft_predraft_cancelled_total",
                                                  {**LABELS, "stage": "pending"})
    assert cancelled == 4 and predrafter.fanout.limit == 2
    assert not predrafter.covers(sequence)  # a fresh round follows


@pytest.mark.parametrize("extend_after_s, limit", [(0.005, 1), (0.05, 2)])
def test_spare_time_after_a_predraft_round_grows_the_fanout(extend_after_s, limit):
    predrafter, sequence, metrics = _predrafter_with_a_proposal([7, 8, 9], [17, 18, 19])
    _extend(predrafter, sequence, [40], now=0.0)  # late: 4 -> 2
    predrafter.covers(sequence)
    predrafter.fanout.on_late()  # 2 -> 1
    predrafter.on_drafted(DraftJob(sequence, list(sequence.tokens)),
                          Drafted(sequence.key, 4, [7, 8, 9], recovered_guesses=_certain([17, 18, 19])))
    [job] = predrafter.take_jobs()
    sent = predrafter.on_predrafted([Drafted(sequence.key, 5, [1, 2, 3], assumed_ids=job.tokens[4:], job=job)],
                                    now=1.0, round_s=0.01)
    assert len(sent) == 1
    _extend(predrafter, sequence, [7, 8, 9, 41], now=1.0 + extend_after_s)  # a round of 10 ms: one more fits?
    assert predrafter.fanout.limit == limit
    assert metrics.registry.get_sample_value("tandem_draft_fanout_limit", LABELS) == limit


def test_outcomes_are_ordered_by_expected_gain_from_the_measured_acceptance():
    predrafter, sequence, _ = _predrafter_with_a_proposal([7, 8, 9], [17, 18, 19])
    # alpha starts at 0.5, the hit rates at 1: P(j) = 0.5, 0.25, 0.125, then 0.125 for all three accepted.
    assert [(job.num_assumed, job.guess_next) for job in predrafter.take_jobs()] == [
        (1, False), (2, False), (3, False), (3, True)]
    for _ in range(30):  # the target keeps accepting every draft
        proposal_tokens = list(sequence.tokens)
        predrafter.on_predrafted([], now=0.0, round_s=0.0)
        _extend(predrafter, sequence, [7, 8, 9, 5], now=1.0)
        sequence.tokens = proposal_tokens  # the same prefix again, so the same proposal is the current one
        predrafter.on_drafted(DraftJob(sequence, list(sequence.tokens)),
                              Drafted(sequence.key, 3, [7, 8, 9], recovered_guesses=_certain([17, 18, 19])))
        predrafter.take_jobs()
    assert predrafter.model.acceptance.value > 0.9
    predrafter.on_drafted(DraftJob(sequence, list(sequence.tokens)),
                          Drafted(sequence.key, 3, [7, 8, 9], recovered_guesses=_certain([17, 18, 19])))
    first = predrafter.take_jobs()[0]
    assert (first.tokens[3:], first.guess_next) == ([7, 8, 9], True)  # all accepted is now the likeliest


def _deliver(predrafter: Predrafter, jobs: list[DraftJob], drafts: list[int], guesses: list[int]) -> list[Drafted]:
    """Each job drafted as `drafts` with `guesses` at the recovered tokens (a bonus outcome guesses 5)."""
    proposals = [make_drafted(job, drafts, None, _certain(guesses), guessed_next=5 if job.guess_next else None)
                 for job in jobs]
    return predrafter.on_predrafted(proposals, now=1.0, round_s=0.01)


@pytest.mark.parametrize("round_trip_s, step_s, depth", [
    (0.002, 0.040, 1), (0.050, 0.040, 2), (0.090, 0.040, 3), (1.0, 0.040, 3), (0.050, 0.0, 1)])
def test_the_predraft_depth_is_the_steps_a_round_trip_spans(round_trip_s, step_s, depth):
    metrics = DraftMetrics("tiny")
    predrafter = Predrafter(4, metrics, max_depth=3)
    predrafter.on_timing(1, round_trip_s, step_s)
    assert metrics.registry.get_sample_value("tandem_draft_predraft_depth", LABELS) == depth


def test_over_a_long_link_the_best_predrafts_outcomes_are_drafted_a_verification_further():
    predrafter, sequence, metrics = _predrafter_with_a_proposal([7, 8, 9], [17, 18, 19], max_fanout=2)
    predrafter.on_timing(1, round_trip_s=0.05, step_s=0.03)  # a pre-draft arrives a step and more later
    first = predrafter.take_jobs()  # alpha = 0.5: d1 rejected for 17 (0.5), d1 accepted, d2 for 18 (0.25)
    assert [job.tokens for job in first] == [[1, 2, 3, 17], [1, 2, 3, 7, 18]]
    assert len(_deliver(predrafter, first, [30, 31, 32], [40, 41, 42])) == 2
    second = predrafter.take_jobs()  # the next level, by P(both outcomes): 0.5 * 0.5, then 0.5 * 0.25
    assert [(job.tokens, job.num_assumed) for job in second] == [([1, 2, 3, 17, 40], 2),
                                                                  ([1, 2, 3, 17, 30, 41], 3)]
    assert len(_deliver(predrafter, second, [50, 51, 52], [60, 61, 62])) == 2
    assert not predrafter.has_pending()  # two verifications ahead is as deep as the round trip asks

    _extend(predrafter, sequence, [17], now=1.02)  # the target rejected d1 for 17, as first guessed
    assert predrafter.fanout.limit == 2  # in time: nothing for this verification was left to draft
    assert predrafter.covers(sequence)
    third = predrafter.take_jobs()  # its outcomes are sent already: their outcomes come next
    assert [job.tokens for job in third] == [[1, 2, 3, 17, 40, 60], [1, 2, 3, 17, 30, 41, 60]]
    assert all(job.num_assumed == len(job.tokens) - 4 for job in third)
    assert metrics.registry.get_sample_value("tandem_draft_predraft_hits_total", LABELS) == 1


def test_a_hit_drafts_the_outcomes_its_proposal_still_lacks_and_none_twice():
    predrafter = Predrafter(4, DraftMetrics("tiny"), max_depth=4)
    predrafter.on_timing(1, round_trip_s=0.05, step_s=0.03)
    predrafter.fanout.limit = 1  # one outcome a round: the tree is one path
    sequence = DraftSequence((1, 1), [1, 2, 3], Sampling(), 3, accepts_assumed=True)
    predrafter.open(sequence)
    predrafter.on_drafted(DraftJob(sequence, [1, 2, 3]),
                          Drafted(sequence.key, 3, [7, 8, 9], recovered_guesses=_certain([17, 18, 19])))
    [first] = predrafter.take_jobs()
    _deliver(predrafter, [first], [30, 31, 32], [40, 41, 42])
    [second] = predrafter.take_jobs()
    _deliver(predrafter, [second], [50, 51, 52], [60, 61, 62])
    assert (first.tokens, second.tokens) == ([1, 2, 3, 17], [1, 2, 3, 17, 40])
    predrafter.fanout.limit = 4
    _extend(predrafter, sequence, [17], now=1.02)
    assert predrafter.covers(sequence)
    jobs = [(job.tokens, job.guess_next) for job in predrafter.take_jobs()]
    assert ([1, 2, 3, 17, 30, 41], False) in jobs  # an outcome of the committed proposal, never drafted
    assert ([1, 2, 3, 17, 40], False) not in jobs  # drafted already: its pre-draft is held


def test_the_tree_of_sent_predrafts_stays_within_what_the_target_holds():
    predrafter, sequence, _ = _predrafter_with_a_proposal([7, 8, 9], [17, 18, 19], max_fanout=25)
    predrafter.on_timing(1, round_trip_s=1.0, step_s=0.03)  # as deep as allowed: 4 levels
    levels = []
    while jobs := predrafter.take_jobs():
        levels.append(len(_deliver(predrafter, jobs, [30, 31, 32], [40, 41, 42])))
    # 4 outcomes per proposal: 4, then 16, then 25 of 64, then only what leaves room for the
    # current proposal and a fresh one
    assert levels == [4, 16, 25, MAX_HELD_PROPOSALS - 2 - 45]


def test_an_extend_before_the_deeper_level_is_drafted_plans_it_from_the_committed_proposal():
    predrafter, sequence, _ = _predrafter_with_a_proposal([7, 8, 9], [17, 18, 19], max_fanout=2)
    predrafter.on_timing(1, round_trip_s=0.05, step_s=0.03)
    _deliver(predrafter, predrafter.take_jobs(), [30, 31, 32], [40, 41, 42])
    assert predrafter.has_pending()  # the next level waits for a round
    _extend(predrafter, sequence, [7, 18], now=1.02)
    assert predrafter.fanout.limit == 2  # this verification's outcomes were all sent: not late
    assert predrafter.covers(sequence)
    assert [job.tokens for job in predrafter.take_jobs()] == [[1, 2, 3, 7, 18, 40], [1, 2, 3, 7, 18, 30, 41]]


def test_a_predraft_is_sent_while_the_target_has_committed_a_prefix_of_its_tokens():
    """The target ran a step without it (it came late) and committed the first of its assumed tokens:
    the pre-draft may still be verified once the rest are committed."""
    predrafter, sequence, metrics = _predrafter_with_a_proposal([7, 8, 9], [17, 18, 19], max_fanout=4)
    jobs = predrafter.take_jobs()
    _extend(predrafter, sequence, [7], now=0.5)  # while the round runs
    sent = _deliver(predrafter, jobs, [30, 31, 32], [40, 41, 42])
    assert sorted(p.assumed_ids for p in sent) == [[7, 8, 9, 5], [7, 8, 19], [7, 18]]
    assert metrics.registry.get_sample_value("tandem_draft_predraft_cancelled_total",
                                             {**LABELS, "stage": "drafted"}) == 1  # it assumed 17


class GatedDrafter(ModelDrafter):
    """A model drafter whose rounds each wait for the test to let them run, and which records them."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.gate = threading.Semaphore(0)
        self.waiting = threading.Semaphore(0)  # released as each round reaches the gate
        self.rounds: list[list[tuple[int, bool]]] = []  # (seq id, is a pre-draft) of each job

    async def round_waits(self) -> None:
        assert await asyncio.to_thread(self.waiting.acquire, timeout=WAIT_S), "no round started"

    def draft(self, jobs, stop=never):
        self.waiting.release()
        assert self.gate.acquire(timeout=WAIT_S), "the test never let this round run"
        self.rounds.append([(job.sequence.key[1], job.is_predraft) for job in jobs])
        return super().draft(jobs, stop)


LIMITS = Limits(vocab_size=VOCAB, max_model_len=MAX_LEN, max_k=4, num_slots=12)


def _running(drafter: ModelDrafter, max_fanout: int = -1):
    return running_scheduler(drafter, drafter.metrics, LIMITS, max_fanout=max_fanout)


@pytest.fixture
async def gated():
    drafter = GatedDrafter(tiny_draft_model(num_slots=12), TOP_K, DraftMetrics("tiny"))
    async with _running(drafter) as scheduler:
        yield scheduler, drafter
        for _ in range(10):  # let any round still waiting finish, so that the scheduler can stop
            drafter.gate.release()


def _opens(*seq_ids: int, accepts_assumed: bool = True) -> pb.TargetUpdate:
    return pb.TargetUpdate(opens=[pb.SequenceOpen(seq_id=i, prompt_ids=_prompt(8, i), k=K,
                                                  accepts_assumed=accepts_assumed) for i in seq_ids])


def _extend_update(seq_id: int, start: int, token_ids: list[int]) -> pb.TargetUpdate:
    return pb.TargetUpdate(extends=[pb.SequenceExtend(seq_id=seq_id, start=start, token_ids=token_ids)])


async def _next(stream) -> list[pb.DraftProposal]:
    return list((await asyncio.wait_for(stream.outbox.get(), WAIT_S)).proposals)


async def test_fresh_prefixes_come_first_and_an_extend_cancels_the_pending_predrafts(gated):
    scheduler, drafter = gated
    stream = scheduler.open_stream()
    scheduler.apply(stream, _opens(1))
    await drafter.round_waits()
    scheduler.apply(stream, _opens(2))  # while sequence 1's fresh round runs
    drafter.gate.release()
    [first] = await _next(stream)
    await drafter.round_waits()
    assert (first.seq_id, list(first.assumed_ids)) == (1, [])
    # Sequence 2's fresh round now runs ahead of sequence 1's pre-drafts; an Extend makes those moot.
    miss = [(first.token_ids[0] + 1) % VOCAB]
    scheduler.apply(stream, _extend_update(1, 8, miss))
    for _ in range(3):
        drafter.gate.release()
    proposals = await _next(stream) + await _next(stream) + await _next(stream)
    assert drafter.rounds[:3] == [[(1, False)], [(2, False)], [(1, False)]]
    assert [(p.seq_id, p.base_len, list(p.assumed_ids)) for p in proposals[:2]] == [(2, 8, []), (1, 9, [])]
    assert {p.seq_id for p in proposals[2:]} == {1, 2} and all(p.assumed_ids for p in proposals[2:])
    assert all(p.base_len - len(p.assumed_ids) == 9 for p in proposals[2:] if p.seq_id == 1)  # none for 8 tokens
    registry = drafter.metrics.registry
    assert registry.get_sample_value("tandem_draft_predraft_cancelled_total", {**LABELS, "stage": "pending"}) == K + 1
    assert drafter.rounds[3] and all(predraft for round in drafter.rounds[3:] for _, predraft in round)
    assert registry.get_sample_value("tandem_draft_fanout_limit", LABELS) == 2  # max_k + 1 = 5, halved


class ForwardGatedDrafter(ModelDrafter):
    """A model drafter whose pre-draft rounds wait for the test before each forward after the first."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.gate = threading.Semaphore(0)
        self.at_gate = threading.Semaphore(0)  # released as a pre-draft forward reaches the gate
        self.predrafting = False
        self.round_kinds: list[bool] = []  # is a pre-draft, per round

    def draft(self, jobs, stop=never):
        self.predrafting = any(job.is_predraft for job in jobs)
        self.round_kinds.append(self.predrafting)
        return super().draft(jobs, stop)

    def _feed(self, rows):
        if self.predrafting:
            self.at_gate.release()
            assert self.gate.acquire(timeout=WAIT_S), "the test never let this forward run"
        return super()._feed(rows)


async def test_an_extend_stops_a_running_predraft_round_at_its_next_forward():
    """Fresh work must not wait for a whole pre-draft round: the round ends after the forward it is
    in, and the fresh round runs next. Its pre-drafts, made moot by the Extend, are not sent."""
    drafter = ForwardGatedDrafter(tiny_draft_model(num_slots=12), TOP_K, DraftMetrics("tiny"))
    async with _running(drafter) as scheduler:
        stream = scheduler.open_stream()
        scheduler.apply(stream, _opens(1))
        [fresh] = await _next(stream)
        assert await asyncio.to_thread(drafter.at_gate.acquire, timeout=WAIT_S), "no pre-draft round started"
        miss = [(fresh.token_ids[0] + 1) % VOCAB]
        scheduler.apply(stream, _extend_update(1, 8, miss))  # while the round's second forward waits
        drafter.gate.release()  # that forward only: a round that went on would wait at the next one
        [refreshed] = await _next(stream)
        assert (refreshed.base_len, list(refreshed.assumed_ids)) == (9, [])
        assert drafter.round_kinds[:3] == [False, True, False]
        assert _metric(drafter, "tandem_draft_predraft_proposals_total") == 0  # moot, so not sent
        for _ in range(2 * K):  # let the refreshed proposal's pre-draft round finish
            drafter.gate.release()


@pytest.fixture
async def predrafting():
    drafter = ModelDrafter(tiny_draft_model(num_slots=12), TOP_K, DraftMetrics("tiny"))
    async with _running(drafter) as scheduler:
        yield scheduler, drafter


def _metric(drafter: ModelDrafter, name: str, **labels: str) -> float:
    return drafter.metrics.registry.get_sample_value(name, {**LABELS, **labels})


async def test_a_hit_is_answered_by_the_predraft_already_sent_and_its_outcomes_follow(predrafting):
    scheduler, drafter = predrafting
    stream = scheduler.open_stream()
    prompt = _prompt(8, 1)
    scheduler.apply(stream, _opens(1))
    [fresh] = await _next(stream)
    predrafts = await _next(stream)
    guesses = _fresh(reference := _drafter(1), _open(reference, 1, prompt), prompt).recovered_guesses
    bonus = greedy_generate(tiny_draft_model(), prompt + list(fresh.token_ids), 1)
    drafts = list(fresh.token_ids)
    assert sorted(list(p.assumed_ids) for p in predrafts) == sorted(
        [drafts[:j] + [guesses[j][0].token] for j in range(K)] + [drafts + bonus])

    hit = next(p for p in predrafts if len(p.assumed_ids) == 1)  # d1 rejected, the recovered token guessed
    scheduler.apply(stream, _extend_update(1, 8, list(hit.assumed_ids)))
    after_hit = await _next(stream)
    assert all(p.assumed_ids and p.base_len - len(p.assumed_ids) == 9 for p in after_hit)  # no fresh round for 9
    assert [p.assumed_ids[: len(p.assumed_ids) - 1] for p in after_hit if len(p.assumed_ids) > K] == [
        list(hit.token_ids)]

    guessed = {hit.token_ids[0]} | {p.assumed_ids[0] for p in after_hit}
    miss = min(set(range(VOCAB)) - guessed)  # neither e1 nor the recovered token the drafter guessed
    scheduler.apply(stream, _extend_update(1, 9, [miss]))
    [refreshed] = await _next(stream)
    assert (refreshed.base_len, list(refreshed.assumed_ids)) == (10, [])
    sent = len(predrafts) + len(after_hit) + len(await _next(stream))  # and the refreshed proposal's pre-drafts

    assert _metric(drafter, "tandem_draft_predraft_proposals_total") == sent
    assert _metric(drafter, "tandem_draft_proposals_total") == sent + 2
    assert _metric(drafter, "tandem_draft_predraft_hits_total") == 1
    assert _metric(drafter, "tandem_draft_fanout_count") == 3  # one pre-draft round per proposal
    assert _metric(drafter, "tandem_draft_fanout_sum") == sent
    assert _metric(drafter, "tandem_draft_predraft_outcomes_total", guess="recovered") == 2
    assert _metric(drafter, "tandem_draft_predraft_guess_hits_total", guess="recovered") == 1
    await asyncio.sleep(0.1)  # nothing left to draft: idle
    assert _metric(drafter, "tandem_draft_idle_seconds_total") > 0.05


async def test_a_target_whose_round_trip_spans_a_step_gets_the_outcomes_of_the_predrafts_too():
    """Each level's pre-drafts continue its prefix as the drafter alone would (greedy)."""
    drafter = ModelDrafter(tiny_draft_model(num_slots=24), TOP_K, DraftMetrics("tiny"))
    async with running_scheduler(drafter, drafter.metrics, LIMITS, max_fanout=-1, max_predraft_depth=3) as scheduler:
        stream = scheduler.open_stream()
        timing = dict(draft_round_trip_us=50_000, step_interval_us=30_000)  # pre-drafts two verifications ahead
        scheduler.apply(stream, pb.TargetUpdate(opens=_opens(1).opens, **timing))
        [fresh] = await _next(stream)
        first, second = await _next(stream), await _next(stream)
        assert _metric(drafter, "tandem_draft_predraft_depth") == 2
        await asyncio.sleep(0.2)
        assert stream.outbox.empty()  # no third level
    prompt = _prompt(8, 1)
    assert all(len(p.assumed_ids) <= len(fresh.token_ids) + 1 for p in first)
    parents = {tuple(p.assumed_ids): list(p.token_ids) for p in first}
    for p in second:  # each assumes one of the first level's outcomes, then one of its own
        parent = max((a for a in parents if tuple(p.assumed_ids[: len(a)]) == a), key=len)
        accepted = p.assumed_ids[len(parent):]
        assert accepted[:-1] == parents[parent][: len(accepted) - 1]
    for p in [*first, *second]:
        assert p.base_len == len(prompt) + len(p.assumed_ids)
        assert list(p.token_ids) == greedy_generate(tiny_draft_model(), prompt + list(p.assumed_ids), len(p.token_ids))
    assert max(len(p.assumed_ids) for p in second) > K + 1  # past what one verification commits
    assert len(first) == K + 1  # every outcome of the fresh proposal
    assert len(second) == LIMITS.max_k + 1  # max_fanout -1: max_k x 1 guess + 1 a round, the best of 16


@pytest.mark.parametrize("max_fanout, accepts_assumed", [(0, True), (-1, False)], ids=["fanout-0", "old-target"])
async def test_without_fanout_or_a_target_that_keeps_them_there_are_no_predrafts(max_fanout, accepts_assumed):
    drafter = ModelDrafter(tiny_draft_model(num_slots=12), TOP_K, DraftMetrics("tiny"))
    async with _running(drafter, max_fanout) as scheduler:
        stream = scheduler.open_stream()
        scheduler.apply(stream, _opens(1, accepts_assumed=accepts_assumed))
        [fresh] = await _next(stream)
        scheduler.apply(stream, _extend_update(1, 8, list(fresh.token_ids[:1])))
        [second] = await _next(stream)
        assert (second.base_len, list(second.assumed_ids)) == (9, [])
        await asyncio.sleep(0.2)
        assert stream.outbox.empty()
        assert drafter.model.kv_cache.num_free_slots == 12 - 1  # no scratch slot was ever taken
        assert _metric(drafter, "tandem_draft_predraft_proposals_total") == 0
