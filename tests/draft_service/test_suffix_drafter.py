"""The suffix drafter in-process: matching against a brute-force reference, frequencies, the shared
cache and its bound, pre-draft jobs, and the suffix+model drafter's split."""
from __future__ import annotations

import random
from collections import Counter

import pytest

from draft_service.drafter import DraftJob, DraftSequence
from tandem_kernels.sampling import Sampling
from draft_service.metrics import DraftMetrics
from draft_service.drafters.model import ModelDrafter
from draft_service.drafters.suffix import SuffixDrafter, SuffixFrontDrafter
from tandem.suffix_index import ANCHORS, SuffixIndex, SuffixParams, speculate
from tandem_kernels.compression import ONE, unpack
from tests.support.tiny_drafter import tiny_draft_model

K = 4
UNBOUNDED = SuffixParams(max_occurrences=1_000_000)


def _job(tokens: list[int], seq_id: int = 1, k: int = K, sampling: Sampling = Sampling(),
         num_assumed: int = 0, guess_next: bool = False) -> DraftJob:
    sequence = DraftSequence((0, seq_id), list(tokens[: len(tokens) - num_assumed]), sampling, k)
    return DraftJob(sequence, list(tokens), num_assumed, guess_next)


def _draft(drafter, tokens: list[int], **job_args):
    drafts = drafter.draft([_job(tokens, **job_args)])
    return drafts[0] if drafts else None


def _reference_draft(docs: list[list[int]], context: list[int], k: int, params: SuffixParams):
    """Brute force over every position of every document, by the rules in suffix_index's docstring."""
    for n in ANCHORS:
        if len(context) < n:
            continue
        found = []
        for doc in docs:
            for end in range(n, len(doc)):  # end < len(doc): something follows
                if doc[end - n : end] == context[-n:]:
                    length = 0
                    while (length < min(params.max_depth, end, len(context))
                           and doc[end - length - 1] == context[-length - 1]):
                        length += 1
                    found.append((max(length, n), doc[end : end + k + 1]))
        if found:
            break
    else:
        return [], 0.0
    best_tokens, best_score = [], 0.0
    for m in sorted({length for length, _ in found}, reverse=True):
        alive = [c for length, c in found if length >= m]
        tokens, chance, score = [], 1.0, 0.0
        for step in range(min(k, max(1, int(params.max_spec_factor * m)))):
            counts = Counter(c[step] for c in alive if len(c) > step)
            if not counts:
                break
            top = max(counts.values())
            chance *= top / sum(counts.values())
            if chance < params.min_token_prob:
                break
            # Ties: the most recent occurrence's token, as the index scans newest first.
            token = next(c[step] for c in reversed(alive) if len(c) > step and counts[c[step]] == top)
            tokens.append(token)
            score += chance
            alive = [c for c in alive if len(c) > step and c[step] == token]
        if score > best_score:
            best_tokens, best_score = tokens, score
    return best_tokens, best_score


@pytest.mark.parametrize("seed", range(40))
def test_speculate_equals_a_brute_force_reference(seed):
    rng = random.Random(seed)
    vocab = rng.choice([2, 3, 5, 9])
    docs = [[rng.randrange(vocab) for _ in range(rng.randrange(1, 60))] for _ in range(rng.randrange(1, 4))]
    context = [rng.randrange(vocab) for _ in range(rng.randrange(1, 30))]
    params = SuffixParams(max_depth=rng.choice([3, 24]), max_spec_factor=rng.choice([0.5, 1.0, 4.0]),
                          min_token_prob=rng.choice([0.0, 0.1, 0.4]), max_occurrences=1_000_000)
    index = SuffixIndex()
    for doc in docs:
        index.add(doc)
    draft = speculate(index.occurrences(context, params, K + 1), K, params)
    tokens, score = _reference_draft(docs, context, K, params)
    assert (draft.tokens, draft.score) == (tokens, pytest.approx(score))


def test_a_repeated_passage_is_drafted_as_far_as_it_goes():
    passage = [11, 12, 13, 14, 15, 16, 17]
    tokens = [1, 2] + passage + [3] + passage[:3]
    draft = _draft(SuffixDrafter(UNBOUNDED), tokens)
    assert draft.token_ids == passage[3:7] and draft.base_len == len(tokens)
    assert draft.to_proto().probs == b"" and draft.assumed_ids == []  # greedy: ids only


def test_frequencies_decide_the_draft_and_where_it_stops():
    # After [5, 6] came 7 three times and 8 once: the draft is 7 with chance 3/4 ...
    tokens = [5, 6, 7, 1, 5, 6, 7, 2, 5, 6, 8, 3, 5, 6, 7, 4, 5, 6]
    drafter = SuffixDrafter(SuffixParams(max_spec_factor=1.0, min_token_prob=0.5))
    draft = drafter.propose(_job(tokens), K)
    # ... and stops there: after 7 came 1, 2 and 4 once each (chance 3/4 x 1/3 < 1/2).
    assert draft.tokens == [7] and draft.score == pytest.approx(0.75)
    strict = SuffixDrafter(SuffixParams(min_token_prob=0.8))
    assert strict.propose(_job(tokens), K).tokens == []


def test_speculation_length_follows_the_match_length():
    short = SuffixDrafter(SuffixParams(max_spec_factor=1.0))
    # A one-token match ([1]) drafts one token; a three-token one ([9, 1, 2]) three.
    assert short.propose(_job([9, 1, 2, 3, 4, 5, 6, 7, 8, 0, 1]), K).tokens == [2]
    assert short.propose(_job([9, 1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2], seq_id=2), K).tokens == [3, 4, 5]


def test_finished_outputs_are_drafted_from_but_not_their_prompts():
    drafter = SuffixDrafter(UNBOUNDED)
    prompt, output = [100, 101, 102, 103], [200, 201, 202, 203, 204]
    drafter.settle((0, 1), prompt)
    drafter.settle((0, 1), prompt + output)
    drafter.close((0, 1))
    assert _draft(drafter, [7, 200, 201], seq_id=2).token_ids == [202, 203, 204]
    assert _draft(drafter, [7, 100, 101], seq_id=3).token_ids == []  # an empty answer: prompts are not shared


def test_the_shared_cache_keeps_the_newest_tokens_within_its_bound():
    drafter = SuffixDrafter(UNBOUNDED, cache_tokens=10)
    for seq_id, output in enumerate(([300, 301, 302, 303, 304, 305], [400, 401, 402, 403, 404, 405],
                                     [500, 501, 502, 503])):
        drafter.settle((0, seq_id), [1])
        drafter.settle((0, seq_id), [1] + output)
        drafter.close((0, seq_id))
    assert drafter.shared.num_tokens == 10
    assert _draft(drafter, [9, 300, 301], seq_id=10).token_ids == []  # dropped: the oldest
    assert _draft(drafter, [9, 400, 401], seq_id=11).token_ids == [402, 403, 404, 405]
    for seq_id in range(20, 40):  # many drops: the index is rebuilt and still right
        drafter.settle((0, seq_id), [1])
        drafter.settle((0, seq_id), [1, 600 + seq_id, 700, 701])
        drafter.close((0, seq_id))
    assert sum(len(entries) for by_n in drafter.shared.ends.values() for entries in by_n.values()) \
        <= 2 * drafter.shared.num_tokens * len(ANCHORS)
    assert _draft(drafter, [9, 639, 700], seq_id=12).token_ids == [701]


def test_replaced_tokens_rebuild_the_sequences_own_index():
    drafter = SuffixDrafter(UNBOUNDED, cache_tokens=0)
    drafter.settle((0, 1), [1, 2, 3, 9, 1, 2])
    assert drafter.propose(_job([1, 2, 3, 9, 1, 2]), K).tokens == [3, 9, 1, 2]
    drafter.settle((0, 1), [4, 2, 5, 8, 4, 2])  # a reconnect reopened it with other tokens
    assert drafter.propose(_job([4, 2, 5, 8, 4, 2]), K).tokens == [5, 8, 4, 2]


def test_pre_draft_jobs_assume_tokens_without_indexing_them():
    drafter = SuffixDrafter(UNBOUNDED, cache_tokens=0)
    committed = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2]
    draft = _draft(drafter, committed + [3, 4], num_assumed=2)
    assert draft.assumed_ids == [3, 4] and draft.token_ids == [5, 6, 7, 8] and draft.base_len == 12
    assert drafter._local[(0, 1)].index.docs[0] == committed
    # "All drafts accepted": the first suffix token is the bonus guess, the drafts follow it.
    bonus = _draft(drafter, committed + [3, 4, 5, 6], num_assumed=4, guess_next=True)
    assert bonus.assumed_ids == [3, 4, 5, 6, 7] and bonus.token_ids == [8, 1, 2] and bonus.base_len == 15
    assert _draft(drafter, [50, 51], seq_id=2, num_assumed=1) is None  # nothing for an assumed prefix


def test_sampled_sequences_get_a_point_mass():
    draft = _draft(SuffixDrafter(UNBOUNDED), [1, 2, 3, 1, 2], sampling=Sampling(temperature=0.8, seed=3))
    assert draft.token_ids == [3, 1, 2] and draft.to_proto().probs_top_k == 1 and len(draft.to_proto().probs) > 0
    rows = unpack(draft.to_proto().probs, 3, 1, 1000)
    assert rows.ids[:, 0].tolist() == [3, 1, 2] and (rows.fixed == ONE).all()


def test_suffix_front_drafter_takes_confident_suffix_drafts_and_asks_the_model_for_the_rest():
    model = ModelDrafter(tiny_draft_model(), 8, DraftMetrics("tiny"))
    alone = ModelDrafter(tiny_draft_model(), 8, DraftMetrics("alone"))
    front = SuffixFrontDrafter(SuffixDrafter(UNBOUNDED, cache_tokens=0), model, confidence=0.75)
    repeated = [21, 22, 23, 24, 25, 26, 27, 28, 29, 20, 21, 22, 23]
    fresh = [31, 32, 33, 34, 35]
    jobs = [_job(repeated, seq_id=1), _job(fresh, seq_id=2)]
    for job in jobs:
        front.open(job.sequence.key)
        alone.open(job.sequence.key)
    by_seq = {d.key[1]: d for d in front.draft(jobs)}
    assert by_seq[1].token_ids == [24, 25, 26, 27]
    assert by_seq[2].token_ids == alone.draft([jobs[1]])[0].token_ids
    assert model.metrics.registry.get_sample_value(
        "tandem_draft_suffix_proposals_total", {"model": "tiny", "service": "draft"}) == 1
    assert front.probs_top_k == 8
