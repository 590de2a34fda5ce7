"""Held proposals on their own: what validate_proposal refuses, how match_proposal meets the committed
tokens, and how a sequence's DrafterState keeps, matches and evicts them (the engine drives them
end to end in tests/target_service/test_engine_steps.py)."""
from __future__ import annotations

import pytest
import torch

from tandem_kernels.compression import encode, pack
from tandem_kernels.sampling import Sampling
from target_service.sequence import RequestOptions, Sequence
from target_service.speculation.drafter_state import DrafterState, Evicted
from target_service.speculation.proposals import (EXHAUSTED, NO_MATCH, HeldProposal, InvalidProposal,
                                                  match_proposal, validate_proposal)
from tandem.protos import MAX_HELD_PROPOSALS
from tandem.v1 import drafter_pb2

VOCAB = 100
PROMPT = [1, 2, 3]


def _seq(committed: list[int] = (), temperature: float = 0.0) -> Sequence:
    """A sequence with these tokens committed after the prompt; nothing here reads its text."""
    options = RequestOptions(sampling=Sampling(temperature=temperature, seed=1), max_tokens=32, stop=(),
                             stop_token_ids=frozenset(), ignore_eos=False, skip_special_tokens=True, speculate=True,
                             num_speculative_tokens=4)
    seq = Sequence(seq_id=1, request_id="r", prompt_ids=list(PROMPT), options=options, arrival=0.0,
                   detokenizer=None, stops=None)
    seq.token_ids += list(committed)
    return seq


def _held(base_len: int, tokens: tuple[int, ...], assumed: tuple[int, ...] = ()) -> HeldProposal:
    return HeldProposal(base_len=base_len, tokens=tokens, probs=None, assumed=assumed)


# ---- validate_proposal ---------------------------------------------------------------------------

@pytest.mark.parametrize("message, accepts_assumed, reason", [
    (drafter_pb2.DraftProposal(base_len=4, token_ids=[]), False, "length"),
    (drafter_pb2.DraftProposal(base_len=4, token_ids=[5] * 5), False, "length"),
    (drafter_pb2.DraftProposal(base_len=4, token_ids=[VOCAB]), False, "token_id"),
    (drafter_pb2.DraftProposal(base_len=5, token_ids=[5], assumed_ids=[6]), False, "assumed"),
    (drafter_pb2.DraftProposal(base_len=2, token_ids=[5]), False, "base_len"),
    (drafter_pb2.DraftProposal(base_len=6, token_ids=[5]), False, "base_len"),
    (drafter_pb2.DraftProposal(base_len=7, token_ids=[5], assumed_ids=[6, 7]), True, "base_len"),
])
def test_a_proposal_the_target_cannot_use_is_refused_with_its_reason(message, accepts_assumed, reason):
    with pytest.raises(InvalidProposal) as err:
        validate_proposal(message, _seq([4]), VOCAB, max_k=4, probs_top_k=8, accepts_assumed=accepts_assumed)
    assert err.value.reason == reason


def test_a_valid_proposal_is_held_as_sent_with_its_q_prime_when_sampling_needs_it():
    message = drafter_pb2.DraftProposal(base_len=5, token_ids=[7, 8], assumed_ids=[9])
    held = validate_proposal(message, _seq([4]), VOCAB, max_k=4, probs_top_k=8, accepts_assumed=True)
    assert (held.base_len, held.tokens, held.assumed, held.known_len, held.probs) == (5, (7, 8), (9,), 4, None)
    probs = torch.softmax(torch.randn(2, VOCAB), dim=-1)
    q_prime = encode(probs, 4)
    message = drafter_pb2.DraftProposal(base_len=4, token_ids=[7, 8], probs=pack(q_prime), probs_top_k=4)
    sampled = validate_proposal(message, _seq([4], temperature=0.8), VOCAB, max_k=4, probs_top_k=8)
    assert sampled.probs is not None and torch.equal(sampled.probs.ids, q_prime.ids)
    with pytest.raises(InvalidProposal, match="probs_top_k"):
        validate_proposal(drafter_pb2.DraftProposal(base_len=4, token_ids=[7], probs_top_k=9),
                          _seq([4], temperature=0.8), VOCAB, max_k=4, probs_top_k=8)


# ---- match_proposal ------------------------------------------------------------------------------

@pytest.mark.parametrize("held, committed, limit, tokens, salvaged", [
    (_held(4, (7, 8, 9)), [4], 4, (7, 8, 9), False),  # drafted for the committed prefix
    (_held(4, (7, 8, 9)), [4], 2, (7, 8), False),  # cut to the limit
    (_held(4, (7, 8, 9)), [4, 7], 4, (8, 9), True),  # from an older prefix, whose first draft was committed
    (_held(5, (8, 9), assumed=(7,)), [4, 7], 4, (8, 9), False),  # a pre-draft whose assumed token was committed
    (_held(4, (7, 8, 9, 10, 11, 12, 13, 14)), [4, 7, 8], 4, (9, 10, 11, 12), True),  # a lookahead: k left past 2
])
def test_the_drafts_that_continue_the_committed_tokens_are_usable(held, committed, limit, tokens, salvaged):
    match = match_proposal(held, PROMPT + committed, limit)
    assert not match.contradicted and match.drafts is not None
    assert (match.drafts.tokens, match.drafts.salvaged) == (tokens, salvaged)


@pytest.mark.parametrize("held, committed, expected_contradicted, expected", [
    (_held(4, (7, 8)), [4, 6], True, None),  # the committed token is not its first draft
    (_held(5, (8,), assumed=(7,)), [4, 6], True, None),  # nor its assumed token
    (_held(5, (8,), assumed=(7,)), [4], False, NO_MATCH),  # its assumed token is not committed yet
    (_held(4, (7, 8)), [4, 7, 8], False, EXHAUSTED),  # all its drafts were committed
])
def test_a_proposal_the_committed_tokens_contradict_or_have_not_reached_has_no_drafts(held, committed,
                                                                                     expected_contradicted, expected):
    match = match_proposal(held, PROMPT + committed, 4)
    assert match.drafts is None and match.contradicted is expected_contradicted
    if expected is not None:
        assert match == expected


# ---- DrafterState --------------------------------------------------------------------------------

def test_the_held_proposal_with_most_drafts_left_is_matched_the_newest_on_ties():
    state = DrafterState(_seq([4, 7]))
    older, longer, newer = _held(4, (7, 8)), _held(5, (8, 9, 10)), _held(5, (8, 9, 11))
    for held in (older, longer):
        state.keep(held)
    match, source = state.match(limit=4)
    assert source is longer and match.drafts.tokens == (8, 9, 10)
    state.keep(newer)
    assert state.match(limit=4)[1] is newer


def test_eviction_drops_contradicted_and_used_up_proposals_and_counts_those_never_verified():
    state = DrafterState(_seq([4, 7, 8]))
    used = _held(4, (9,))
    used.used = True
    live, exhausted = _held(6, (9, 10)), _held(5, (8,))
    for held in (_held(4, (5,)), _held(6, (9,), assumed=(6, 8)), used, live, exhausted):
        state.keep(held)
    assert state.evict() == Evicted(stale=1, predrafts=1)
    assert state.held == [live]


def test_a_sequence_holds_the_newest_proposals_only():
    state = DrafterState(_seq([4]))
    kept = [_held(4, (i,)) for i in range(MAX_HELD_PROPOSALS + 2)]
    for held in kept:
        state.keep(held)
    assert state.held == kept[2:]


def test_an_answer_is_timed_from_the_update_that_asked_for_it_once():
    state = DrafterState(_seq([4]))
    state.tell(now=10.0)
    state.seq.token_ids.append(7)
    state.tell(now=10.5)
    assert state.answered_after(4, now=11.0) == pytest.approx(1.0)
    assert state.answered_after(4, now=11.2) is None, "answered already"
    assert state.answered_after(5, now=11.0) == pytest.approx(0.5)


def test_feature_rows_are_sent_only_when_they_reach_the_position_asked():
    state = DrafterState(_seq([4]))
    state.keep_features(3, torch.ones(2, 1, 4))
    state.keep_features(5, torch.ones(1, 1, 4))
    first, rows = state.take_features(6)
    assert first == 3 and rows.shape == (3, 1, 4)
    state.keep_features(7, torch.ones(1, 1, 4))
    assert state.take_features(9) == (0, None), "a step ran without capturing: rows short of the position"
