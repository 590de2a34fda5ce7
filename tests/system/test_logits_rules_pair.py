"""Penalties, logit_bias, allowed_token_ids and bad_words under speculation: the synchronous model pair
verifies drafts at every step, each position processed with the drafts before it, and the greedy
output stays the target alone's, token for token."""
from __future__ import annotations

import pytest

from tests.support.service_fixtures import greedy_request, run_requests

PROMPT = "Write a short poem about the sea and the sky."


@pytest.mark.parametrize("rules", [
    dict(frequency_penalty=1.0, presence_penalty=0.5),
    dict(repetition_penalty=1.5),
    dict(logit_bias={378: 3.0, 260: -4.0}, bad_words=["sea", "waves"]),  # " The" up, " the" down
    dict(allowed_token_ids=list(range(200, 2000)), min_tokens=12),
])
def test_greedy_output_with_rules_is_the_target_alones(model_pair, rules):
    alone, speculative, free = run_requests(model_pair[1].address, [
        greedy_request(PROMPT, 40, speculate=False, **rules), greedy_request(PROMPT, 40, **rules),
        greedy_request(PROMPT, 40, speculate=False)])
    assert speculative.token_ids == alone.token_ids and speculative.text == alone.text
    assert alone.token_ids != free.token_ids, "the rules change the output"
    assert speculative.draft_tokens > 0 and speculative.accepted_tokens > 0, "no draft was verified and kept"


def _seeded(speculate: bool, temperature: float = 0.8, **rules):
    request = greedy_request(PROMPT, 32, speculate=speculate, seed=7, drafter_invariant=True, **rules)
    request.sampling_params.temperature = temperature
    return request


def test_drafter_invariant_output_with_rules_is_the_target_alones_in_any_batch(model_pair):
    """Seeded drafter-invariant sampling with penalties, a bias and bad words gives the target alone's
    tokens bit for bit, with or without drafts, alone or batched with rows whose rules differ."""
    rules = dict(frequency_penalty=0.8, presence_penalty=0.3, logit_bias={378: 2.0}, bad_words=["sea"])
    [alone] = run_requests(model_pair[1].address, [_seeded(False, **rules)])
    neighbours = [_seeded(True, 1.0, repetition_penalty=1.3), _seeded(True, 1.0), greedy_request(PROMPT, 24),
                  greedy_request(PROMPT, 24, presence_penalty=-1.0)]
    speculative, batched, *_ = run_requests(model_pair[1].address, [_seeded(True, **rules), _seeded(False, **rules),
                                                                     *neighbours])
    assert speculative.token_ids == alone.token_ids and batched.token_ids == alone.token_ids
    assert speculative.draft_tokens > 0, "no draft was verified"
    [free] = run_requests(model_pair[1].address, [_seeded(False)])
    assert free.token_ids != alone.token_ids, "the rules change the output"
