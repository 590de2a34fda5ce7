"""min_tokens under speculation: the synchronous model pair verifies a draft at every step, so the
positions before min_tokens are verified with drafts, EOS banned, and the output stays the target's."""
from __future__ import annotations

import pytest

from tests.support.service_fixtures import greedy_request, run_requests
from tandem.runtime import load_tokenizer

SHORT = "Answer with one word: is water wet?"  # the target alone answers in a few tokens, then EOS


@pytest.fixture(scope="module")
def eos_ids(smollm2_path) -> frozenset[int]:
    return load_tokenizer(smollm2_path).eos_token_ids


def test_min_tokens_holds_off_eos_and_speculation_keeps_the_output(model_pair, eos_ids):
    [free] = run_requests(model_pair[1].address, [greedy_request(SHORT, 64, speculate=False)])
    assert free.finish_reason == "stop" and free.token_ids[-1] in eos_ids and len(free.token_ids) < 24
    floor = len(free.token_ids) + 8
    alone, speculative = run_requests(model_pair[1].address, [
        greedy_request(SHORT, 64, speculate=speculate, min_tokens=floor) for speculate in (False, True)])
    assert speculative.token_ids == alone.token_ids and speculative.text == alone.text
    assert speculative.draft_tokens > 0, "no draft was verified: the banned positions were not exercised"
    assert len(alone.token_ids) >= floor and not set(alone.token_ids[:floor]) & eos_ids
    assert alone.token_ids[: len(free.token_ids) - 1] == free.token_ids[:-1], "the same answer, then more"
