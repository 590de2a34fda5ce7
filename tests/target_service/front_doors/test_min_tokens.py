"""min_tokens and include_stop_str_in_output through the real target's front doors (the lossless
check under speculation is tests/system/test_min_tokens_pair.py)."""
from __future__ import annotations

import grpc
import httpx
import pytest

from tests.support.service_fixtures import call_error, greedy_request, run_requests

SHORT = "Answer with one word: is water wet?"  # the target alone answers in a few tokens, then EOS


def test_stop_strings_wait_for_min_tokens_and_can_stay_in_the_text(front_doors):
    [free] = run_requests(front_doors.address, [greedy_request(SHORT, 64, speculate=False)])
    stop = free.text[:2]  # found at once without min_tokens
    cut, kept, held = run_requests(front_doors.address, [
        greedy_request(SHORT, 64, stop=[stop]),
        greedy_request(SHORT, 64, stop=[stop], include_stop_str_in_output=True),
        greedy_request(SHORT, 64, stop=[stop], min_tokens=len(free.token_ids) + 4)])
    assert cut.text == "" and cut.finish_reason == "stop"
    assert kept.text == stop
    assert len(held.token_ids) > len(free.token_ids) + 4 or held.finish_reason == "length"


@pytest.mark.parametrize("params, field", [
    (dict(min_tokens=10), "min_tokens"),  # past max_tokens 8
    (dict(min_tokens=2, structured_outputs={"regex": "[0-9]+"}), "min_tokens"),
])
def test_min_tokens_it_cannot_honour_is_invalid_argument(front_doors, params, field):
    from tandem.v1 import structured_pb2

    if "structured_outputs" in params:
        params["structured_outputs"] = structured_pb2.StructuredOutputs(**params["structured_outputs"])
    err = call_error(front_doors.address, greedy_request(SHORT, 8, **params))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and err.details().startswith(field), err.details()


def test_the_openai_api_takes_both_fields(front_doors):
    [free] = run_requests(front_doors.address, [greedy_request(SHORT, 64, speculate=False)])
    floor = len(free.token_ids) + 8
    [held] = run_requests(front_doors.address, [greedy_request(SHORT, 64, min_tokens=floor)])
    body = {"messages": [{"role": "user", "content": SHORT}], "temperature": 0, "max_tokens": 64,
            "min_tokens": floor}
    url = front_doors.http_url + "/chat/completions"
    answer = httpx.post(url, json=body, timeout=120).json()
    assert answer["choices"][0]["message"]["content"] == held.text
    stop = free.text[:2]
    kept = httpx.post(url, json={**body, "min_tokens": 0, "stop": [stop], "include_stop_str_in_output": True},
                      timeout=120).json()
    assert kept["choices"][0]["message"]["content"] == stop
    bad = httpx.post(url, json={**body, "min_tokens": -1}, timeout=120)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "min_tokens"
