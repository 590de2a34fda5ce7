"""n > 1 through the front doors, from real clients: OpenAI choices (streamed or not, chat and
completions) and VllmEngine's indexed chunks and complete messages. Seeded drafter-invariant
sampling makes sample i the output of one sample seeded seed + i."""
from __future__ import annotations

import grpc
import openai
import pytest
from smg_grpc_proto import vllm_engine_pb2, vllm_engine_pb2_grpc

from tandem.runtime import load_tokenizer
from tests.support.service_fixtures import greedy_request, run_requests

PROMPT = "Name three colours."
TOKENS = 10
SEED = 21
SEEDED = dict(temperature=1.0, seed=SEED, extra_body={"drafter_invariant": True})


@pytest.fixture(scope="module")
def client(front_doors):
    return openai.OpenAI(base_url=front_doors.http_url, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def singles(front_doors):
    """The one-sample outputs seeded SEED, SEED + 1, SEED + 2 (drafter-invariant), over tandem.v1."""
    requests = []
    for i in range(3):
        request = greedy_request(PROMPT, TOKENS, seed=SEED + i, drafter_invariant=True, logprobs=0)
        request.sampling_params.temperature = 1.0
        requests.append(request)
    results = run_requests(front_doors.address, requests)
    assert len({tuple(r.token_ids) for r in results}) == 3
    return results


def test_chat_choices_are_the_samples_streamed_or_not(client, singles):
    messages = [{"role": "user", "content": PROMPT}]
    whole = client.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=TOKENS, n=3,
                                           logprobs=True, **SEEDED)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert [c.message.content for c in whole.choices] == [s.text for s in singles]
    assert [[e.logprob for e in c.logprobs.content] for c in whole.choices] == \
        [[lp.logprob for lp in s.logprobs] for s in singles]
    assert whole.usage.completion_tokens == sum(len(s.token_ids) for s in singles)
    assert whole.usage.prompt_tokens == singles[0].prompt_tokens
    texts, finished, role_chunks = ["", "", ""], [], 0
    for chunk in client.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=TOKENS, n=3,
                                                stream=True, stream_options={"include_usage": True}, **SEEDED):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            role_chunks += choice.delta.role == "assistant"
            if choice.finish_reason:
                finished.append(choice.index)
        if chunk.usage:
            assert chunk.usage.completion_tokens == whole.usage.completion_tokens
    assert texts == [s.text for s in singles]
    assert sorted(finished) == [0, 1, 2] and role_chunks == 3


def test_completion_choices_each_carry_their_index(client, front_doors, smollm2_path):
    ids = load_tokenizer(smollm2_path).encode_chat([{"role": "user", "content": PROMPT}])
    whole = client.completions.create(model="smollm2-135m", prompt=ids, max_tokens=TOKENS, n=2, **SEEDED)
    singles = [client.completions.create(model="smollm2-135m", prompt=ids, max_tokens=TOKENS, temperature=1.0,
                                         seed=SEED + i, extra_body={"drafter_invariant": True}) for i in range(2)]
    assert [(c.index, c.text) for c in whole.choices] == [(i, s.choices[0].text) for i, s in enumerate(singles)]


def test_vllm_engine_sends_each_samples_chunks_and_complete_with_its_index(front_doors, smollm2_path):
    """VllmEngine has no drafter-invariant switch: greedy samples, each the greedy output."""
    ids = load_tokenizer(smollm2_path).encode_chat([{"role": "user", "content": PROMPT}])
    with grpc.insecure_channel(front_doors.address) as channel:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)

        def generate(request_id: str, stream: bool, n: int) -> list:
            request = vllm_engine_pb2.GenerateRequest(
                request_id=request_id, stream=stream, tokenized=vllm_engine_pb2.TokenizedInput(input_ids=ids),
                sampling_params=vllm_engine_pb2.SamplingParams(temperature=0.0, max_tokens=TOKENS, n=n))
            return list(stub.Generate(request, timeout=60))

        [single] = [r.complete for r in generate("one", False, 1)]
        whole = [r.complete for r in generate("n-whole", False, 2)]
        assert sorted((c.index, tuple(c.output_ids)) for c in whole) == [(i, tuple(single.output_ids)) for i in (0, 1)]
        streamed = generate("n-stream", True, 2)
        tokens: dict[int, list[int]] = {0: [], 1: []}
        for response in streamed:
            if response.HasField("chunk"):
                tokens[response.chunk.index] += response.chunk.token_ids
        assert sorted(r.complete.index for r in streamed if r.HasField("complete")) == [0, 1]
        assert tokens == {0: list(single.output_ids), 1: list(single.output_ids)}
