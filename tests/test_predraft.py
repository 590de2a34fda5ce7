"""Pre-drafting in-process: the wire field, the drafters' outcome rows and slots.

The model drafter runs on a tiny random model; every pre-draft is compared with what a fresh round
from the same prefix drafts, computed by a second drafter that saw only fresh rounds.
"""
from __future__ import annotations

import pytest
import torch

from draft_service.drafter import Draft, DraftJob, DraftSequence, Sampling
from draft_service.metrics import DraftMetrics
from draft_service.model_drafter import ModelDrafter
from draft_service.ngram_drafter import NgramDrafter, lookup
from kernels.compression import sample_compressed, unpack
from tandem.generate import greedy_generate
from tandem.model.batch import SequenceChunk
from tandem.v1 import drafter_pb2 as pb
from tiny_drafter import VOCAB, tiny_draft_model

TOP_K = 8
K = 3
LABELS = {"model": "tiny", "service": "draft"}
SAMPLED = Sampling(temperature=0.8, top_k=50, top_p=0.9, seed=1234)
MODES = {"greedy": Sampling(), "sampled": SAMPLED, "invariant": Sampling(temperature=1.0, seed=99, invariant=True)}


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _drafter(num_slots: int = 12) -> ModelDrafter:
    return ModelDrafter(tiny_draft_model(num_slots=num_slots), TOP_K, DraftMetrics("tiny"))


def _open(drafter, seq_id: int, prompt: list[int], sampling: Sampling = Sampling()) -> DraftSequence:
    sequence = DraftSequence((1, seq_id), list(prompt), sampling, K, accepts_assumed=True)
    drafter.open(sequence.key)
    return sequence


def _fresh(drafter, sequence: DraftSequence, tokens: list[int]) -> Draft:
    [draft] = drafter.draft([DraftJob(sequence, list(tokens))])
    return draft


def _all_outcomes(sequence: DraftSequence, fresh: Draft) -> list[DraftJob]:
    """A pre-draft job for every outcome of `fresh`: j drafts accepted, then the recovered token the drafter
    guessed (j < k); all k accepted, then a bonus token the drafter guesses as it drafts."""
    prefix, drafts = list(sequence.tokens), fresh.token_ids
    jobs = [DraftJob(sequence, prefix + drafts[:j] + [guess], num_assumed=j + 1)
            for j, guess in enumerate(fresh.recovered_guesses)]
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
    draft = Draft((1, 3), base_len=12, token_ids=[7, 8], assumed_ids=[5, 6], recovered_guesses=[9, 9])
    assert draft.to_proto() == proposal  # the recovered guesses stay with the drafter


@pytest.mark.parametrize("mode", MODES)
def test_each_outcome_is_predrafted_as_a_fresh_round_from_its_prefix_would_draft(mode):
    drafter, prompt = _drafter(), _prompt(10, 1)
    sequence = _open(drafter, 1, prompt, MODES[mode])
    fresh = _fresh(drafter, sequence, prompt)
    drafts = fresh.token_ids
    logits = _logits_after(tiny_draft_model(), prompt, drafts)  # [k + 1, V]: row j predicts position L + j
    runner_up = [int(row.index_fill(0, torch.tensor([d]), float("-inf")).argmax()) for row, d in zip(logits, drafts)]
    assert fresh.recovered_guesses == runner_up  # the most likely token other than each draft

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
        assert (predraft.token_ids, predraft.probs) == (reference.token_ids, reference.probs)
        if mode == "sampled":  # drawn from the q' it sends, keyed by the seed and the positions it guesses
            q_prime = unpack(predraft.probs, K, TOP_K, VOCAB)
            positions = torch.arange(predraft.base_len, predraft.base_len + K)
            assert sample_compressed(q_prime, torch.full((K,), SAMPLED.seed), positions).tolist() == predraft.token_ids


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
    miss = prompt + [fresh.token_ids[0], (fresh.recovered_guesses[1] + 1) % VOCAB]  # no outcome guessed it
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
