"""The target's own lookup (local_drafts.py): what it drafts from a sequence's own tokens, and when it stays silent."""
from __future__ import annotations

from target_service.sequence import RequestOptions, Sequence
from target_service.speculation.local_drafts import LocalDrafts
from tandem_kernels.compression import ONE
from tandem_kernels.sampling import Sampling

PASSAGE = [60, 61, 62, 63, 64, 65, 66]


def _sequence(prompt: list[int], temperature: float = 0.0) -> Sequence:
    """A sequence of this prompt; nothing here reads its text."""
    options = RequestOptions(sampling=Sampling(temperature=temperature, seed=1), max_tokens=32, stop=(),
                             stop_token_ids=frozenset(), ignore_eos=False, skip_special_tokens=True, speculate=True,
                             num_speculative_tokens=4)
    return Sequence(seq_id=1, request_id="r", prompt_ids=list(prompt), options=options, arrival=0.0,
                    detokenizer=None, stops=None)


def test_a_sequence_that_repeats_a_passage_is_drafted_its_continuation():
    seq = _sequence([1, *PASSAGE, 2, 60, 61])
    proposal = LocalDrafts().propose(seq, 4)
    assert (proposal.base_len, proposal.tokens, proposal.assumed, proposal.probs) == (len(seq.token_ids),
                                                                                    (62, 63, 64, 65), (), None)
    local = LocalDrafts()
    assert local.propose(seq, 2).tokens == (62, 63)
    assert local.propose(seq, 4).tokens == (62, 63, 64, 65)  # the same tokens, a larger cap: looked up again


def test_committed_tokens_join_the_index_as_they_come():
    local = LocalDrafts()
    seq = _sequence([1, *PASSAGE, 2])
    assert local.propose(seq, 4) is None  # 2 occurs nowhere before
    seq.token_ids += [60, 61, 62]
    assert local.propose(seq, 4).tokens == (63, 64, 65, 66)
    seq.token_ids += [63, 64, 65, 66, 3, 60]  # the output repeats itself too: its own tokens count
    assert local.propose(seq, 4).tokens == (61, 62, 63, 64)


def test_a_lookup_that_expects_less_than_one_accepted_token_drafts_nothing():
    # After 7 came 8, 9, 6 and 5 once each: the newest, 5 4 7, would be right one time in four (0.75 tokens).
    seq = _sequence([7, 8, 1, 7, 9, 2, 7, 6, 3, 7, 5, 4, 7])
    assert LocalDrafts().propose(seq, 4) is None
    # One time in three, and four tokens long: 4/3 tokens expected, enough.
    assert LocalDrafts().propose(_sequence([7, 8, 1, 7, 9, 2, 7, 5, 4, 3, 7]), 4).tokens == (5, 4, 3, 7)


def test_sampled_sequences_get_point_masses():
    seq = _sequence([1, *PASSAGE, 2, 60, 61], temperature=0.8)
    proposal = LocalDrafts().propose(seq, 3)
    assert proposal.tokens == (62, 63, 64) and proposal.probs.k == 1
    assert proposal.probs.ids[:, 0].tolist() == [62, 63, 64] and (proposal.probs.fixed == ONE).all()
