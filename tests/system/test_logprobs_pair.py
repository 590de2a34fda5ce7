"""Logprobs under speculation: the synchronous model pair verifies drafts at every step, and every
emitted token's logprob and top alternatives (accepted drafts, recovered and bonus tokens alike)
equal the target alone's bit for bit: the native decoder is batch-invariant, and the raw logprobs
are taken before any processing."""
from __future__ import annotations

from tests.support.service_fixtures import greedy_request, run_requests

PROMPT = "Write a short poem about the sea and the sky."


def _logprobs(result) -> list[tuple]:
    return [(lp.token_id, lp.logprob, lp.rank, tuple(lp.top_token_ids), tuple(lp.top_logprobs))
            for lp in result.logprobs]


def test_logprobs_with_speculation_are_the_target_alones(model_pair):
    alone, speculative, penalized_alone, penalized = run_requests(model_pair[1].address, [
        greedy_request(PROMPT, 40, speculate=False, logprobs=5, prompt_logprobs=1),
        greedy_request(PROMPT, 40, logprobs=5, prompt_logprobs=1),
        greedy_request(PROMPT, 40, speculate=False, logprobs=2, frequency_penalty=1.0),
        greedy_request(PROMPT, 40, logprobs=2, frequency_penalty=1.0)])
    assert speculative.token_ids == alone.token_ids and speculative.accepted_tokens > 0
    assert _logprobs(speculative) == _logprobs(alone)
    assert speculative.prompt_logprobs == alone.prompt_logprobs and len(alone.prompt_logprobs) == alone.prompt_tokens - 1
    assert [lp.token_id for lp in alone.logprobs] == alone.token_ids
    assert all(len(lp.top_token_ids) == 5 and lp.rank == 1 for lp in alone.logprobs), "greedy: rank 1"
    assert _logprobs(penalized) == _logprobs(penalized_alone) and penalized.accepted_tokens > 0
    assert any(lp.rank > 1 for lp in penalized.logprobs), "raw logprobs: a penalty makes a token not the argmax"


def test_without_logprobs_none_are_sent(model_pair):
    [result] = run_requests(model_pair[1].address, [greedy_request(PROMPT, 8)])
    assert result.logprobs == [] and result.prompt_logprobs == []
