"""The Open the target sends: the drafter reads back the very sampling, rules and min_tokens ban the target applies.

Values are exact in float32, as the front doors' protos make them before the target reads them."""
from __future__ import annotations

from draft_service.drafter import DraftSequence, sampling_of
from tandem_kernels.sampling import Sampling
from target_service.sequence import RequestOptions, Sequence
from target_service.speculation.messages import open_message
from target_service.stops import StopChecker

RULES = Sampling(temperature=0.75, top_k=40, top_p=0.875, min_p=0.0625, seed=2**63 - 5, presence_penalty=0.5,
                 frequency_penalty=-1.25, repetition_penalty=1.5, logit_bias=((3, -2.5), (17, 4.0)),
                 allowed_token_ids=(3, 9, 17, 40), bad_words=((9,), (17, 3)))


def _sequence(sampling: Sampling, min_tokens: int) -> Sequence:
    options = RequestOptions(sampling=sampling, max_tokens=50, stop=(), stop_token_ids=frozenset({40}),
                             ignore_eos=False, skip_special_tokens=True, speculate=True, num_speculative_tokens=4,
                             min_tokens=min_tokens)
    seq = Sequence(seq_id=1, request_id="r", prompt_ids=[5, 6, 7], options=options, arrival=0.0,
                   detokenizer=None, stops=StopChecker((), frozenset({2, 40})))
    seq.token_ids += [9, 17]  # generated before a reconnect: the Open sends them, and says where the prompt ends
    return seq


def test_the_drafter_reads_back_the_targets_sampling_and_ban():
    seq = _sequence(RULES, min_tokens=4)
    message = open_message(seq, k=4, accepts_assumed=True)
    assert sampling_of(message.sampling) == RULES
    drafted = DraftSequence((1, 1), list(message.prompt_ids), sampling_of(message.sampling), 4,
                            prompt_len=message.prompt_len, min_tokens=message.sampling.min_tokens,
                            min_tokens_banned=tuple(message.sampling.min_tokens_banned_ids))
    for drafts in ((), (3,), (3, 9)):
        mine = drafted.logits_context(list(seq.token_ids) + list(drafts))
        banned = ((2, 40), 1) if len(drafts) < 2 else ((), 0)  # 2 generated, then the drafts, min_tokens 4
        assert (mine.banned, mine.banned_rows, mine.prompt_len) == (*banned, 3)
    target = seq.logits_context((3, 9))
    assert (target.banned, target.banned_rows, target.prompt_len) == ((2, 40), 2, 3)


def test_without_rules_or_min_tokens_nothing_is_processed():
    seq = _sequence(Sampling(temperature=0.75), min_tokens=0)
    assert seq.logits_context() is None
    assert sampling_of(open_message(seq, 4, False).sampling) == Sampling(temperature=0.75)
