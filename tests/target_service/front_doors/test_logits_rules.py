"""Penalties, logit_bias, allowed_token_ids and bad_words through the real target's three front doors
(the lossless check under speculation is tests/system/test_logits_rules_pair.py)."""
from __future__ import annotations

import grpc
import httpx
import pytest
from smg_grpc_proto import vllm_engine_pb2, vllm_engine_pb2_grpc

from tests.support.service_fixtures import greedy_request, run_requests
from tandem.runtime import load_tokenizer

PROMPT = "List the colours of the rainbow, separated by commas."


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    return load_tokenizer(smollm2_path)


def _id(tokenizer, text: str) -> int:
    [token] = tokenizer.encode(text, add_special_tokens=False)
    return token


def test_each_rule_changes_the_output_as_it_says(front_doors, tokenizer):
    free, penalized, biased, allowed, banned = run_requests(front_doors.address, [
        greedy_request(PROMPT, 24),
        greedy_request(PROMPT, 24, frequency_penalty=2.0, presence_penalty=2.0),
        greedy_request(PROMPT, 6, logit_bias={_id(tokenizer, "!"): 100.0}),
        greedy_request(PROMPT, 6, allowed_token_ids=[_id(tokenizer, " yes"), _id(tokenizer, " no")]),
        greedy_request(PROMPT, 24, bad_words=["sight", "colors"]),  # one token, bare and after a space
    ])
    assert free.text.count(" rainbow") >= 2 and " sight" in free.text and " colors" in free.text, free.text
    assert penalized.text != free.text and penalized.token_ids[:4] == free.token_ids[:4]
    assert biased.text == "!" * 6
    assert set(allowed.text.split()) <= {"yes", "no"} and len(allowed.token_ids) == 6
    assert " sight" not in banned.text and " colors" not in banned.text
    assert banned.token_ids[0] == free.token_ids[0]


def test_the_openai_api_and_vllm_engine_give_what_generation_gives(front_doors, tokenizer):
    bias = {_id(tokenizer, " colors"): -100.0, _id(tokenizer, " light"): 5.0}
    [expected] = run_requests(front_doors.address, [greedy_request(
        PROMPT, 24, frequency_penalty=0.5, presence_penalty=0.25, repetition_penalty=1.3, logit_bias=bias)])
    body = {"messages": [{"role": "user", "content": PROMPT}], "temperature": 0, "max_tokens": 24,
            "frequency_penalty": 0.5, "presence_penalty": 0.25, "repetition_penalty": 1.3,
            "logit_bias": {str(token): value for token, value in bias.items()}}
    answer = httpx.post(front_doors.http_url + "/chat/completions", json=body, timeout=120).json()
    assert answer["choices"][0]["message"]["content"] == expected.text
    ids = tokenizer.encode_chat([{"role": "user", "content": PROMPT}])
    params = vllm_engine_pb2.SamplingParams(temperature=0.0, max_tokens=24, frequency_penalty=0.5,
                                            presence_penalty=0.25, repetition_penalty=1.3, logit_bias=bias)
    with grpc.insecure_channel(front_doors.address) as channel:
        [complete] = [r.complete for r in vllm_engine_pb2_grpc.VllmEngineStub(channel).Generate(
            vllm_engine_pb2.GenerateRequest(request_id="rules", stream=False, sampling_params=params,
                                            tokenized=vllm_engine_pb2.TokenizedInput(input_ids=ids)), timeout=120)]
    assert list(complete.output_ids) == expected.token_ids


def test_bad_words_are_refused_when_they_encode_to_nothing_and_limited_in_number(front_doors):
    url = front_doors.http_url + "/completions"
    empty = httpx.post(url, json={"prompt": "hi", "bad_words": ["ok", "  "]}, timeout=60)
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "bad_words[1]"
    many = httpx.post(url, json={"prompt": "hi", "bad_words": ["x"] * 129}, timeout=60)
    assert many.status_code == 400 and many.json()["error"]["param"] == "bad_words"


def test_bad_words_are_tokenized_as_vllm_does(tokenizer):
    """A word and its spelling after a space are both banned only when they have as many tokens."""
    from target_service.front_doors.validation import _bad_words

    assert _bad_words(["sight"], tokenizer) == ((35076,), (6968,))
    assert _bad_words(["  rainbow"], tokenizer) == ((1155, 10314),)  # " rainbow" is one token: not added


def test_an_allow_list_the_other_rules_empty_is_refused(front_doors, tokenizer):
    """Nothing would be left to sample: refused by name, rather than sampling a banned token."""
    url = front_doors.http_url + "/completions"
    eos, yes = sorted(tokenizer.eos_token_ids)[0], _id(tokenizer, " yes")
    for body in ({"allowed_token_ids": [eos], "min_tokens": 2}, {"allowed_token_ids": [yes], "bad_words": ["yes"]}):
        response = httpx.post(url, json={"prompt": "hi", "max_tokens": 4, **body}, timeout=60)
        assert response.status_code == 400 and response.json()["error"]["param"] == "allowed_token_ids", response.text
    served = httpx.post(url, json={"prompt": "hi", "max_tokens": 4, "allowed_token_ids": [eos, yes], "min_tokens": 2},
                        timeout=60)
    assert served.status_code == 200 and served.json()["choices"][0]["text"].startswith(" yes yes")
