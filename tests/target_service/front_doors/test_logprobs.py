"""Logprobs through the three front doors, in each protocol's shape, from real clients: the OpenAI SDK
(chat and completions, streamed or not, and completions that echo their prompt), vLLM's VllmEngine
stub, and tandem.v1. Every door gives the same numbers (the pair's identity with the target alone:
tests/system/test_logprobs_pair.py)."""
from __future__ import annotations

import grpc
import httpx
import openai
import pytest
from smg_grpc_proto import vllm_engine_pb2, vllm_engine_pb2_grpc

from tests.support.service_fixtures import greedy_request, run_requests
from tandem.runtime import load_tokenizer
from tandem.v1 import generation_pb2

PROMPT = "Name three colours."
TOKENS = 12


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    return load_tokenizer(smollm2_path)


@pytest.fixture(scope="module")
def client(front_doors):
    return openai.OpenAI(base_url=front_doors.http_url, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def expected(front_doors):
    """tandem.v1's answer, with 3 top logprobs per token."""
    [result] = run_requests(front_doors.address, [greedy_request(PROMPT, TOKENS, logprobs=3)])
    assert len(result.logprobs) == len(result.token_ids) == TOKENS
    return result


def test_chat_logprobs_in_openais_shape_streamed_or_not(client, expected, tokenizer):
    messages = [{"role": "user", "content": PROMPT}]
    whole = client.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=TOKENS,
                                           temperature=0, logprobs=True, top_logprobs=3)
    content = whole.choices[0].logprobs.content
    streamed = [entry for chunk in client.chat.completions.create(
        model="smollm2-135m", messages=messages, max_tokens=TOKENS, temperature=0, logprobs=True, top_logprobs=3,
        stream=True) if chunk.choices and chunk.choices[0].logprobs for entry in chunk.choices[0].logprobs.content]
    for entries in (content, streamed):
        assert len(entries) == TOKENS
        for entry, lp in zip(entries, expected.logprobs):
            assert entry.token == tokenizer.decode([lp.token_id]) and entry.bytes == list(entry.token.encode())
            assert entry.logprob == lp.logprob  # the float32 value, exact as a JSON double
            assert [t.logprob for t in entry.top_logprobs] == list(lp.top_logprobs)
            assert [t.token for t in entry.top_logprobs] == [tokenizer.decode([t]) for t in lp.top_token_ids]
    plain = client.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=4, temperature=0)
    assert plain.choices[0].logprobs is None


def test_completion_logprobs_in_the_legacy_shape(client, front_doors, tokenizer):
    [grpc_result] = run_requests(front_doors.address, [greedy_request(PROMPT, TOKENS, logprobs=2)])
    prompt = tokenizer.decode(tokenizer.encode_chat([{"role": "user", "content": PROMPT}]))
    for stream in (False, True):
        response = client.completions.create(model="smollm2-135m", prompt=prompt, max_tokens=TOKENS, temperature=0,
                                             logprobs=2, stream=stream)
        chunks = list(response) if stream else [response]
        parts = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
        tokens = [t for p in parts for t in p.tokens]
        values = [v for p in parts for v in p.token_logprobs]
        tops = [top for p in parts for top in p.top_logprobs]
        offsets = [o for p in parts for o in p.text_offset]
        assert values == [lp.logprob for lp in grpc_result.logprobs]
        assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
        for token, top in zip(tokens, tops):
            assert token in top and 2 <= len(top) <= 3, "the top 2, and the sampled token among them"


def test_vllm_engine_sends_output_logprobs_streamed_or_not(front_doors, expected, tokenizer):
    ids = tokenizer.encode_chat([{"role": "user", "content": PROMPT}])
    with grpc.insecure_channel(front_doors.address) as channel:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
        for stream in (False, True):
            request = vllm_engine_pb2.GenerateRequest(
                request_id=f"lp-{stream}", stream=stream, tokenized=vllm_engine_pb2.TokenizedInput(input_ids=ids),
                sampling_params=vllm_engine_pb2.SamplingParams(temperature=0.0, max_tokens=TOKENS, logprobs=3))
            responses = list(stub.Generate(request, timeout=60))
            parts = [r.chunk.output_logprobs for r in responses if r.HasField("chunk")] if stream else \
                [responses[-1].complete.output_logprobs]
            assert [t for p in parts for t in p.token_ids] == expected.token_ids
            assert [v for p in parts for v in p.token_logprobs] == [lp.logprob for lp in expected.logprobs]
            assert [list(top.token_ids) for p in parts for top in p.top_logprobs] == \
                [list(lp.top_token_ids) for lp in expected.logprobs]


@pytest.fixture(scope="module")
def prompt_expected(front_doors, tokenizer):
    """tandem.v1's prompt logprobs (2 top per token) for PROMPT's chat ids, which it sends in its first response."""
    ids = tokenizer.encode_chat([{"role": "user", "content": PROMPT}])
    [result] = run_requests(front_doors.address, [greedy_request(PROMPT, 2, prompt_logprobs=2)])
    assert [lp.token_id for lp in result.prompt_logprobs] == ids[1:]
    assert all(len(lp.top_token_ids) == 2 and lp.rank >= 1 for lp in result.prompt_logprobs)
    return ids, result.prompt_logprobs


def _vllm_shape(entry: dict, lp, tokenizer) -> None:
    """One position of vLLM's OpenAI prompt_logprobs: the prompt token and the top 2, by token id."""
    assert entry[str(lp.token_id)]["logprob"] == lp.logprob and entry[str(lp.token_id)]["rank"] == lp.rank
    for rank, (token, value) in enumerate(zip(lp.top_token_ids, lp.top_logprobs), 1):
        assert entry[str(token)] == {"logprob": value, "rank": rank, "decoded_token": tokenizer.decode([token])}
    assert len(entry) == 3 - (lp.token_id in lp.top_token_ids)


def test_prompt_logprobs_on_openai_chat_and_completions_not_streamed(client, prompt_expected, tokenizer):
    ids, expected = prompt_expected
    messages = [{"role": "user", "content": PROMPT}]
    chat = client.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=2, temperature=0,
                                          extra_body={"prompt_logprobs": 2}).model_dump()
    text = client.completions.create(model="smollm2-135m", prompt=ids, max_tokens=2, temperature=0,
                                     extra_body={"prompt_logprobs": 2}).model_dump()
    for entries in (chat["prompt_logprobs"], text["choices"][0]["prompt_logprobs"]):
        assert entries[0] is None and len(entries) == len(ids)
        for entry, lp in zip(entries[1:], expected):
            _vllm_shape(entry, lp, tokenizer)
    assert client.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=1,
                                          temperature=0).model_dump()["prompt_logprobs"] is None
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=1, stream=True,
                                       extra_body={"prompt_logprobs": 1})
    assert info.value.body["param"] == "prompt_logprobs" and "stream" in info.value.body["message"]


def test_vllm_engine_sends_input_logprobs_with_each_samples_first_chunk_and_every_complete(front_doors,
                                                                                          prompt_expected):
    ids, expected = prompt_expected
    with grpc.insecure_channel(front_doors.address) as channel:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
        for stream in (False, True):
            request = vllm_engine_pb2.GenerateRequest(
                request_id=f"plp-{stream}", stream=stream, tokenized=vllm_engine_pb2.TokenizedInput(input_ids=ids),
                sampling_params=vllm_engine_pb2.SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=2, n=2))
            carriers = [r.chunk if r.HasField("chunk") else r.complete for r in stub.Generate(request, timeout=60)]
            firsts = {}
            for carrier in carriers:
                firsts.setdefault(carrier.index, carrier)
            completes = [c for c in carriers if isinstance(c, vllm_engine_pb2.GenerateComplete)]
            carrying = [c for c in carriers if c.HasField("input_logprobs")]
            assert sorted(c.index for c in completes) == [0, 1]
            assert set(map(id, carrying)) == {id(c) for c in [*firsts.values(), *completes]}
            for got in (c.input_logprobs for c in carrying):
                assert list(got.token_ids) == ids and not got.token_logprobs[0].HasField("value")
                assert [v.value for v in got.token_logprobs[1:]] == [lp.logprob for lp in expected]
                assert [list(top.token_ids) for top in got.top_logprobs[1:]] == \
                    [list(lp.top_token_ids) for lp in expected]


def _lm_eval_choice(response: dict, ctxlen: int) -> tuple[float, bool]:
    """What lm-evaluation-harness's local-completions takes from an echoed answer: the continuation's
    loglikelihood (the prompt's tokens past the context; the one generated token left out) and
    whether each of its tokens was the most likely."""
    logprobs = response["choices"][0]["logprobs"]
    values, tops = logprobs["token_logprobs"][ctxlen:-1], logprobs["top_logprobs"][ctxlen:-1]
    return sum(values), all(value == max(top.values()) for value, top in zip(values, tops))


@pytest.mark.parametrize("stream", [False, True])
def test_echo_puts_the_prompt_and_its_logprobs_before_the_completion(client, front_doors, prompt_expected, tokenizer,
                                                                     stream):
    ids, expected = prompt_expected
    [completion] = run_requests(front_doors.address, [generation_pb2.GenerateRequest(
        prompt_token_ids=generation_pb2.TokenIds(ids=ids),
        sampling_params=generation_pb2.SamplingParams(temperature=0, max_tokens=3, logprobs=2))])
    text = tokenizer.decode(ids)
    response = client.completions.create(model="smollm2-135m", prompt=ids, max_tokens=3, temperature=0, logprobs=2,
                                         echo=True, stream=stream)
    chunks = list(response) if stream else [response]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text + completion.text
    assert chunks[0].choices[0].text.startswith(text)
    parts = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    tokens = [t for p in parts for t in p.tokens]
    values = [v for p in parts for v in p.token_logprobs]
    tops = [top for p in parts for top in p.top_logprobs]
    assert tokens == [tokenizer.decode([t]) for t in ids + completion.token_ids]
    assert values == [None] + [lp.logprob for lp in expected] + [lp.logprob for lp in completion.logprobs]
    assert tops[0] is None
    for token, lp, top in zip(ids[1:], expected, tops[1:]):  # the prompt token and the top 2
        assert top == {tokenizer.decode([t]): v for t, v in (*zip(lp.top_token_ids, lp.top_logprobs),
                                                              (token, lp.logprob))}
    assert [o for p in parts for o in p.text_offset] == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]


def test_echo_with_max_tokens_0_returns_the_prompt_alone_as_vllm_does(client, prompt_expected, tokenizer):
    ids, expected = prompt_expected
    for prompt, text in ((ids, tokenizer.decode(ids)), ("The three primary colors are", None)):
        for stream in (False, True):
            response = client.completions.create(model="smollm2-135m", prompt=prompt, max_tokens=0, temperature=0,
                                                 logprobs=2, echo=True, stream=stream)
            chunks = list(response) if stream else [response]
            choices = [c.choices[0] for c in chunks if c.choices]
            assert "".join(c.text for c in choices) == (text if text is not None else prompt)
            assert choices[-1].finish_reason == "length"
            values = [v for c in choices if c.logprobs for v in c.logprobs.token_logprobs]
            if prompt is ids:
                assert values == [None] + [lp.logprob for lp in expected]
            else:
                assert values[0] is None and len(values) == len(tokenizer.encode(prompt))
    plain = client.completions.create(model="smollm2-135m", prompt=ids, max_tokens=0, echo=True)
    assert plain.choices[0].text == tokenizer.decode(ids) and plain.choices[0].logprobs is None
    assert plain.usage.completion_tokens == 1, "the one token the engine sampled, counted as vLLM counts it"


def test_echo_in_a_batch_starts_each_choice_with_its_own_prompt(client):
    """lm-evaluation-harness's local-completions with a batch size above 1 sends its contexts as one
    batch: each choice echoes its own prompt and scores it as that prompt alone does."""
    prompts = ["The sky is", "Two plus two is", "Paris is the capital of"]
    params = {"model": "smollm2-135m", "max_tokens": 0, "temperature": 0, "logprobs": 1, "echo": True}
    alone = [client.completions.create(prompt=p, **params).choices[0] for p in prompts]
    batch = client.completions.create(prompt=prompts, **params)
    assert [c.index for c in batch.choices] == [0, 1, 2]
    for got, expected, prompt in zip(batch.choices, alone, prompts):
        assert got.text == expected.text == prompt
        assert got.logprobs.token_logprobs == expected.logprobs.token_logprobs
        assert got.logprobs.text_offset == expected.logprobs.text_offset and got.logprobs.text_offset[0] == 0


def test_lm_evaluation_harness_loglikelihood_requests_score_the_continuation(front_doors, prompt_expected):
    """local-completions' request for a loglikelihood, and its reading of the answer, with speculation
    on (the n-gram drafter) and off: the same scores, equal to the prompt logprobs tandem.v1 sends."""
    ids, expected = prompt_expected
    ctxlen = len(ids) - 4  # the last 4 prompt tokens are the continuation scored
    body = {"model": "smollm2-135m", "prompt": [ids], "temperature": 0, "max_tokens": 1, "logprobs": 1,
            "seed": 1234, "echo": True}
    scores = []
    for speculate in (True, False):
        response = httpx.post(front_doors.http_url + "/completions", json={**body, "speculate": speculate},
                              timeout=120)
        assert response.status_code == 200, response.text
        scores.append(_lm_eval_choice(response.json(), ctxlen))
    assert scores[0] == scores[1]
    assert scores[0][0] == sum(lp.logprob for lp in expected[ctxlen - 1:])
    assert scores[0][1] == all(lp.rank == 1 for lp in expected[ctxlen - 1:])
