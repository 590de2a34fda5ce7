"""The OpenAI-compatible HTTP API (--http-port), driven by the OpenAI SDK and httpx over loopback.

Three targets: the shared `front_doors` one with an n-gram drafter (conftest.py), for outputs,
streaming and structured output; one with synchronous speculation, for the speculation figures;
one guarded (TLS, a bearer token, one slot,
no queue, a small body limit) for the errors a front door owes its clients: 401, 413, 429 and,
while it drains, 503.
"""
from __future__ import annotations

import asyncio
import json
import socket
import ssl
import subprocess
import sys
import time
from dataclasses import dataclass

import grpc
import httpx
import jsonschema
import openai
import pytest
from smg_grpc_proto import vllm_engine_pb2, vllm_engine_pb2_grpc

from tests.support.cert_factory import TestCA
from tests.support.service_fixtures import PROMPTS, greedy_request, metric, run_requests, scrape
from tandem.launch import ServiceProcess, free_port
from tandem.tls import ClientTls
from tandem.v1 import generation_pb2, generation_pb2_grpc

BASE = ["--threads", "1", "--max-model-len", "512"]
MAX_TOKENS = 24
TOKEN = "http-s3cret"


@pytest.fixture(scope="module")
def client(front_doors):
    return openai.OpenAI(base_url=front_doors.http_url, api_key="unused", max_retries=0)


def _post(target: ServiceProcess, path: str, body, **kwargs) -> httpx.Response:
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(target.http_url.removesuffix("/v1") + path, content=content, timeout=120, **kwargs)


def _chat(prompt: str) -> list[dict]:
    return [{"role": "user", "content": prompt}]


def test_greedy_text_is_the_same_through_http_grpc_and_tandem_generate(front_doors, client):
    prompts = PROMPTS[:3]
    grpc_texts = [r.text for r in run_requests(front_doors.address, [greedy_request(p, MAX_TOKENS) for p in prompts])]
    for prompt, expected in zip(prompts, grpc_texts):
        whole = client.chat.completions.create(model="smollm2-135m", messages=_chat(prompt), temperature=0,
                                               max_completion_tokens=MAX_TOKENS)
        assert whole.choices[0].message.content == expected
        stream = client.chat.completions.create(messages=_chat(prompt), model="smollm2-135m", temperature=0,
                                                max_tokens=MAX_TOKENS, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected
    cli = subprocess.run([sys.executable, "-m", "tandem.cli", "generate", prompts[0], "--chat", "--target",
                          front_doors.address, "--max-tokens", str(MAX_TOKENS)],
                         capture_output=True, text=True, timeout=120)
    assert cli.returncode == 0, cli.stderr
    assert cli.stdout.removesuffix("\n") == grpc_texts[0]


def test_completions_take_a_string_a_list_of_one_or_token_ids(front_doors, client):
    prompt = "The three primary colors are"
    [expected] = run_requests(front_doors.address, [generation_pb2.GenerateRequest(
        prompt=prompt, sampling_params=generation_pb2.SamplingParams(temperature=0, max_tokens=MAX_TOKENS))])
    ids = _post(front_doors, "/tokenize", {"prompt": prompt}).json()["tokens"]
    assert len(ids) == expected.prompt_tokens
    for sent in (prompt, [prompt], ids):
        done = client.completions.create(model="smollm2-135m", prompt=sent, temperature=0, max_tokens=MAX_TOKENS)
        assert done.choices[0].text == expected.text
        assert done.usage.completion_tokens == len(expected.token_ids)
    streamed = client.completions.create(model="smollm2-135m", prompt=prompt, temperature=0, max_tokens=MAX_TOKENS,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == expected.text
    default = client.completions.create(model="smollm2-135m", prompt=prompt, temperature=0)
    assert default.usage.completion_tokens == 16 and default.choices[0].finish_reason == "length"


def _choices_by_index(chunks: list) -> list[tuple[int, str, str]]:
    """A completion's choices, from its body or its chunks, as (index, text, finish_reason) in index order."""
    texts: dict[int, list[str]] = {}
    reasons: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts.setdefault(choice.index, []).append(choice.text)
            if choice.finish_reason is not None:
                reasons[choice.index] = choice.finish_reason
    return [(index, "".join(texts[index]), reasons[index]) for index in sorted(texts)]


def test_a_batch_of_prompts_answers_each_as_it_would_alone(front_doors, client):
    """vLLM's batch: prompt p's sample i is choice p * n + i, sampled as that prompt alone samples it (its
    seeds too), the usage summed over the prompts; as text or as token ids, streamed or not."""
    prompts = ["The three primary colors are", "Once upon a time, a fox", "def add(a, b):"]
    ids = [_post(front_doors, "/tokenize", {"prompt": p}).json()["tokens"] for p in prompts]
    params = {"model": "smollm2-135m", "temperature": 0.8, "seed": 11, "n": 2, "max_tokens": 8}
    alone = [client.completions.create(prompt=p, **params) for p in prompts]
    expected = [(p * 2 + c.index, c.text, c.finish_reason) for p, a in enumerate(alone) for c in a.choices]
    assert len({text for _, text, _ in expected}) > 3, "the samples differ, so a mixed-up order would show"
    for sent in (prompts, ids):
        whole = client.completions.create(prompt=sent, **params)
        assert _choices_by_index([whole]) == sorted(expected)
        assert whole.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone) == sum(map(len, ids))
        assert whole.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
        streamed = list(client.completions.create(prompt=sent, stream=True, stream_options={"include_usage": True},
                                                  **params))
        assert _choices_by_index(streamed) == sorted(expected)
        assert streamed[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_a_stream_starts_with_the_role_ends_with_why_then_usage_and_done(front_doors):
    body = {"messages": _chat(PROMPTS[4]), "temperature": 0, "max_tokens": 40, "stream": True,
            "stream_options": {"include_usage": True}, "stop": ["lazy"]}
    with httpx.stream("POST", front_doors.http_url + "/chat/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    last_choice = chunks[-2]["choices"][0]
    assert last_choice["finish_reason"] == "stop" and last_choice["stop_reason"] == "lazy"
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == []
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1])
    assert "lazy" not in text and text
    usage = usage_chunk["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_continuous_usage_stats_count_the_tokens_of_every_chunk(front_doors):
    body = {"messages": _chat(PROMPTS[0]), "temperature": 0, "max_tokens": 12, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with httpx.stream("POST", front_doors.http_url + "/chat/completions", json=body, timeout=120) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts) and 1 <= counts[0] and counts[-1] <= 12  # running counts, never backwards
    assert chunks[-1]["choices"] == [] and counts[-1] == counts[-2]  # the usage chunk repeats the total
    assert all(c["usage"]["total_tokens"] == c["usage"]["prompt_tokens"] + c["usage"]["completion_tokens"]
               for c in chunks)


@pytest.fixture(scope="module")
def sync_target(shared_drafter, tmp_path_factory):
    """A target that waits for the drafter's drafts every step: whether drafts are verified then
    does not depend on how busy the machine is."""
    folder = tmp_path_factory.mktemp("openai-sync")
    target = ServiceProcess("target_service", [*BASE, "--sync-speculation", "--drafter", shared_drafter.address],
                            log_path=folder / "target.log", http_port=free_port())
    try:
        yield target.start().wait_healthy().wait_metric("tandem_drafter_connected", 1)
    finally:
        target.kill()


def test_speculation_figures_are_reported_where_vllm_puts_them(sync_target):
    """The model continues this prompt by repeating itself ("beta beta beta ..."), which the n-gram
    drafter copies: its drafts are verified and the figures add up. (On the shared asynchronous
    target a loaded box could leave a request with no draft verified in time.)"""
    body = {"prompt": " ".join(["alpha beta gamma delta"] * 6), "temperature": 0, "max_tokens": 48}
    reply = _post(sync_target, "/v1/completions", body).json()
    spec = reply["metrics"]["speculative_decoding"]
    histogram = spec["acceptance_histogram"]
    assert len(histogram) == spec["num_spec_tokens"] + 1 == 5
    assert sum(histogram) == spec["num_spec_steps"] > 0
    assert sum(a * n for a, n in enumerate(histogram)) == spec["num_accepted_draft_tokens"] > 0
    assert spec["num_draft_tokens"] >= spec["num_accepted_draft_tokens"]
    mean = 1 + spec["num_accepted_draft_tokens"] / spec["num_spec_steps"]
    assert spec["mean_acceptance_length"] == pytest.approx(mean)


def test_structured_json_follows_the_schema(front_doors, client):
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
              "required": ["city", "population"], "additionalProperties": False}
    reply = client.chat.completions.create(
        model="smollm2-135m", messages=_chat("Give the largest city of France and its population as JSON."),
        temperature=0, max_tokens=64,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}})
    jsonschema.validate(json.loads(reply.choices[0].message.content), schema)
    choice = client.chat.completions.create(model="smollm2-135m", messages=_chat("Is the sky blue?"), max_tokens=8,
                                            extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert choice.choices[0].message.content in ("yes", "no")


@pytest.mark.parametrize("body, status, param", [
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, 400, "temperature"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": 7e3}, 400, "temperature"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_p": 0}, 400, "top_p"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_k": -2}, 400, "top_k"),
    ({"messages": [{"role": "user", "content": "hi"}], "seed": 2**70}, 400, "seed"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 10**6}, 400, "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400, "max_tokens"),
    ({"messages": [{"role": "bot", "content": "hi"}]}, 400, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
     "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": "hi"}], "stop": [""]}, 400, "stop[0]"),
    ({"messages": [{"role": "user", "content": "hi"}], "stop_token_ids": [10**9]}, 400, "stop_token_ids"),
    ({"messages": [{"role": "user", "content": "hi"}], "frobnicate": 1}, 400, "frobnicate"),
    ({"messages": [{"role": "user", "content": "hi"}], "n": 0}, 400, "n"),
    ({"messages": [{"role": "user", "content": "hi"}], "n": 999}, 400, "n"),
    ({"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 3}, 400, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "logprobs": 1}, 400, "logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 21}, 400, "prompt_logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": -1}, 400, "prompt_logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 1, "stream": True}, 400, "prompt_logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "presence_penalty": 2.5}, 400, "presence_penalty"),
    ({"messages": [{"role": "user", "content": "hi"}], "frequency_penalty": -9}, 400, "frequency_penalty"),
    ({"messages": [{"role": "user", "content": "hi"}], "repetition_penalty": 0}, 400, "repetition_penalty"),
    ({"messages": [{"role": "user", "content": "hi"}], "presence_penalty": "high"}, 400, "presence_penalty"),
    ({"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ({"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"the": 10}}, 400, "logit_bias"),
    ({"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"\u00b2": 10}}, 400, "logit_bias"),
    ({"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"99999999": 1}}, 400, "logit_bias"),
    ({"messages": [{"role": "user", "content": "hi"}], "allowed_token_ids": [10**9]}, 400, "allowed_token_ids"),
    ({"messages": [{"role": "user", "content": "hi"}], "allowed_token_ids": [5], "response_format":
      {"type": "json_object"}}, 400, "allowed_token_ids"),
    ({"messages": [{"role": "user", "content": "hi"}], "bad_words": [" "]}, 400, "bad_words[0]"),
    ({"messages": [{"role": "user", "content": "hi"}], "bad_words": "cat"}, 400, "bad_words"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, 400, "tools[0].function"),
    ({"messages": [{"role": "user", "content": "hi"}], "stream_options": {"include_usage": True}}, 400,
     "stream_options"),
    ({"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_schema"}}, 400,
     "response_format.json_schema"),
    ({"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "xml"}}, 400,
     "response_format.type"),
    ({"messages": [{"role": "user", "content": "hi"}], "structured_outputs": {"regex": "(", "choice": ["a"]}}, 400,
     "structured_outputs"),
    ({"messages": [{"role": "user", "content": "hi"}], "structured_outputs": {"regex": "(unclosed"}}, 400,
     "structured_outputs.regex"),
    ({"messages": [{"role": "user", "content": "hi"}], "num_speculative_tokens": 99}, 400, "num_speculative_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "model": "gpt-4o"}, 404, "model"),
    ([1, 2], 400, None),
    ("{not json", 400, None),
    (b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', 400, None),
])
def test_bad_chat_bodies_get_an_openai_error_naming_the_parameter(front_doors, body, status, param):
    response = _post(front_doors, "/v1/chat/completions", body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"].startswith(param) if param and status == 400 else error["message"]


@pytest.mark.parametrize("body, param", [
    ({"prompt": ["a", [1]]}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [[1, 2], [10**9]]}, "prompt[1]"),
    ({"prompt": ["a", ""]}, "prompt[1]"),
    ({"prompt": [10**9]}, "prompt"),
    ({"prompt": "hi", "echo": "yes"}, "echo"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": -1, "echo": True}, "max_tokens"),
    ({"prompt": "hi", "best_of": 3}, "best_of"),
    ({"prompt": "hi", "logprobs": 21}, "logprobs"),
    ({"prompt": "hi", "logprobs": True}, "logprobs"),
    ({}, "prompt"),
])
def test_bad_completion_bodies_name_the_parameter(front_doors, body, param):
    response = _post(front_doors, "/v1/completions", body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_the_sdk_raises_its_own_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=_chat("hi"))
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model="smollm2-135m", messages=_chat("hi"), temperature=-1)


def _wait_idle(target: ServiceProcess, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while metric(scrape(target.metrics_url), "tandem_num_requests_running") and time.monotonic() < deadline:
        time.sleep(0.1)


def test_a_client_that_leaves_mid_stream_frees_its_slot(front_doors):
    before = metric(scrape(front_doors.metrics_url), "tandem_request_success_total", finish_reason="abort")
    body = {"messages": _chat(PROMPTS[1]), "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", front_doors.http_url + "/chat/completions", json=body, timeout=120) as response:
        lines = response.iter_lines()
        while not next(lines).startswith("data: "):
            pass
    _wait_idle(front_doors)
    samples = scrape(front_doors.metrics_url)
    assert metric(samples, "tandem_request_success_total", finish_reason="abort") == before + 1
    assert metric(samples, "tandem_num_requests_running") == 0


def test_models_health_tokenize_detokenize_and_metrics(front_doors, client):
    [card] = client.models.list().data
    assert card.id == "smollm2-135m" and card.model_extra["max_model_len"] == 512
    base = front_doors.http_url.removesuffix("/v1")
    assert httpx.get(base + "/health").status_code == 200
    tokens = _post(front_doors, "/tokenize", {"prompt": "Hello world", "return_token_strs": True}).json()
    assert tokens["count"] == len(tokens["tokens"]) == len(tokens["token_strs"]) and tokens["max_model_len"] == 512
    assert _post(front_doors, "/detokenize", {"tokens": tokens["tokens"]}).json() == {"prompt": "Hello world"}
    for flag in (True, False):  # SmolLM2's tokenizer adds no special tokens to a plain prompt either way
        assert _post(front_doors, "/tokenize", {"prompt": "Hello world", "add_special_tokens": flag}).json()[
            "tokens"] == tokens["tokens"]
    chat_ids = _post(front_doors, "/tokenize", {"messages": _chat("Hello")}).json()["tokens"]
    [via_grpc] = run_requests(front_doors.address, [greedy_request("Hello", 1)])
    assert len(chat_ids) == via_grpc.prompt_tokens
    assert _post(front_doors, "/detokenize", {"tokens": [10**9]}).status_code == 400
    assert "tandem_generation_tokens_total" in httpx.get(base + "/metrics").text


# ---- the guarded target: TLS, a bearer token, one slot and no queue, a small body limit ------------

@dataclass(frozen=True)
class Guarded:
    target: ServiceProcess
    ca_file: str
    vllm_port: int  # --vllm-grpc-port


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    folder = tmp_path_factory.mktemp("openai-guarded")
    ca = TestCA(folder, "http-ca")
    server = ca.issue("server")
    vllm_port = free_port()
    target = ServiceProcess("target_service", [*BASE, "--tls-cert", server.cert, "--tls-key", server.key,
                                               "--auth-token", TOKEN, "--max-num-seqs", "1", "--max-queue", "0",
                                               "--max-message-bytes", "65536", "--grace-seconds", "30",
                                               "--vllm-grpc-port", str(vllm_port)],
                            log_path=folder / "target.log", tls=ClientTls(ca.ca_file), http_port=free_port())
    try:
        yield Guarded(target.start().wait_healthy(), ca.ca_file, vllm_port)
    finally:
        target.kill()


def _guarded_client(guarded, token: str = TOKEN) -> httpx.Client:
    target, ca_file = guarded.target, guarded.ca_file
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.Client(base_url=target.http_url.removesuffix("/v1"), verify=ssl.create_default_context(cafile=ca_file),
                        headers=headers, timeout=120)


def test_tls_and_the_bearer_token(guarded):
    body = {"messages": _chat("hi"), "max_tokens": 2}
    with _guarded_client(guarded) as http:
        assert http.post("/v1/chat/completions", json=body).status_code == 200
        assert http.get("/health").status_code == 200
    for token in ("", "wrong"):
        with _guarded_client(guarded, token) as http:
            response = http.post("/v1/chat/completions", json=body)
            assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
            assert http.get("/health").status_code == 200  # probes need no token
    target, ca_file = guarded.target, guarded.ca_file
    sdk = openai.OpenAI(base_url=target.http_url, api_key=TOKEN, max_retries=0,
                        http_client=httpx.Client(verify=ssl.create_default_context(cafile=ca_file)))
    assert sdk.chat.completions.create(model="smollm2-135m", messages=_chat("hi"), max_tokens=2).choices
    # Plaintext to a TLS port: the server drops it; whether the client sees a bad reply, a refused
    # connection or a reset depends on whether the server closed with the request still unread.
    with pytest.raises((httpx.RemoteProtocolError, httpx.ConnectError, httpx.ReadError)):
        httpx.post(f"http://127.0.0.1:{target.http_port}/v1/chat/completions", json=body, timeout=10)


def test_a_malformed_authorization_header_is_401_not_500(guarded):
    target, ca_file = guarded.target, guarded.ca_file
    raw = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\xfe\r\n"
           b"Content-Length: 2\r\nConnection: close\r\n\r\n{}")
    context = ssl.create_default_context(cafile=ca_file)
    with socket.create_connection(("127.0.0.1", target.http_port), timeout=30) as plain, \
            context.wrap_socket(plain, server_hostname="127.0.0.1") as tls:
        tls.sendall(raw)
        reply = b""
        while chunk := tls.recv(65536):
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 401"), reply[:200]


def test_the_vllm_grpc_port_serves_a_gateway_without_the_token_and_nothing_else(guarded):
    """A gateway sends no bearer token: VllmEngine alone, on a port of its own, takes none."""
    target, ca_file = guarded.target, guarded.ca_file
    credentials = ClientTls(ca_file).credentials()
    health = vllm_engine_pb2.HealthCheckRequest()
    with grpc.secure_channel(target.address, credentials) as main:
        with pytest.raises(grpc.RpcError) as info:
            vllm_engine_pb2_grpc.VllmEngineStub(main).HealthCheck(health, timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with grpc.secure_channel(f"127.0.0.1:{guarded.vllm_port}", credentials) as engine_port:
        assert vllm_engine_pb2_grpc.VllmEngineStub(engine_port).HealthCheck(health, timeout=10).healthy
        params = vllm_engine_pb2.SamplingParams(temperature=0.0, max_tokens=2)
        request = vllm_engine_pb2.GenerateRequest(request_id="g", text="Hi", sampling_params=params)
        assert list(vllm_engine_pb2_grpc.VllmEngineStub(engine_port).Generate(request, timeout=60))[-1].HasField(
            "complete")
        with pytest.raises(grpc.RpcError) as info:
            list(generation_pb2_grpc.GenerationStub(engine_port).Generate(
                greedy_request("hi", 2), timeout=10))
        assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_a_body_over_the_limit_is_413(guarded):
    with _guarded_client(guarded) as http:
        response = http.post("/v1/chat/completions", json={"messages": _chat("x" * 70_000)})
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"


def test_a_full_queue_is_429_and_the_next_request_is_served(guarded):
    async def two_at_once():
        async with _async_guarded(guarded) as http:
            long = {"messages": _chat(PROMPTS[1]), "max_tokens": 200, "ignore_eos": True, "stream": True}
            async with http.stream("POST", "/v1/chat/completions", json=long) as running:
                lines = running.aiter_lines()
                while not (await anext(lines)).startswith("data: "):
                    pass
                refused = await http.post("/v1/chat/completions", json={"messages": _chat("hi"), "max_tokens": 2})
            return refused

    refused = asyncio.run(two_at_once())
    assert refused.status_code == 429 and "max-queue" in refused.json()["error"]["message"]
    _wait_idle(guarded.target)  # the stream's client left: its slot is freed after the step that runs it
    with _guarded_client(guarded) as http:
        assert http.post("/v1/chat/completions", json={"messages": _chat("hi"), "max_tokens": 2}).status_code == 200


def test_a_draining_server_is_503_and_finishes_what_runs(guarded):
    """Last in this file: it stops the guarded target."""
    target = guarded.target

    async def drain():
        async with _async_guarded(guarded) as http:
            body = {"messages": _chat(PROMPTS[1]), "max_tokens": 300, "ignore_eos": True}
            running = asyncio.create_task(http.post("/v1/chat/completions", json=body))
            await asyncio.sleep(1.0)
            target.process.terminate()
            await asyncio.sleep(0.5)
            refused = await http.post("/v1/chat/completions", json={"messages": _chat("hi"), "max_tokens": 2})
            health = await http.get("/health")
            return await running, refused, health

    finished, refused, health = asyncio.run(drain())
    assert finished.status_code == 200 and finished.json()["usage"]["completion_tokens"] == 300
    assert refused.status_code == 503 and health.status_code == 503
    assert target.process.wait(60) == 0


def test_a_stream_the_server_aborts_ends_with_an_error_event_then_done(tmp_path):
    """Past the grace period a drain aborts what still runs: a started stream cannot change its status."""
    target = ServiceProcess("target_service", [*BASE, "--grace-seconds", "0.5"], log_path=tmp_path / "target.log",
                            http_port=free_port()).start().wait_healthy()
    try:
        body = {"messages": _chat(PROMPTS[1]), "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", target.http_url + "/chat/completions", json=body, timeout=120) as response:
            lines = response.iter_lines()
            while not next(lines).startswith("data: "):
                pass
            target.process.terminate()
            events = [line[6:] for line in lines if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert "aborted" in error["message"] and error["type"] == "server_error"
        assert target.process.wait(30) == 0
    finally:
        target.kill()


def test_a_drafter_killed_mid_stream_costs_the_http_client_nothing(tmp_path):
    draft = ServiceProcess("draft_service", ["--drafter", "ngram", "--threads", "1"], log_path=tmp_path / "draft.log")
    target = ServiceProcess("target_service", [*BASE, "--drafter", draft.address], log_path=tmp_path / "target.log",
                            http_port=free_port())
    try:
        draft.start()
        target.start()
        draft.wait_healthy()
        target.wait_healthy().wait_metric("tandem_drafter_connected", 1)
        body = {"messages": _chat(PROMPTS[4]), "temperature": 0, "max_tokens": 120, "stream": True,
                "stream_options": {"include_usage": True}}
        with httpx.stream("POST", target.http_url + "/chat/completions", json=body, timeout=120) as response:
            lines = response.iter_lines()
            events = []
            while not events:
                line = next(lines)
                events += [line[6:]] if line.startswith("data: ") else []
            draft.kill()
            events += [line[6:] for line in lines if line.startswith("data: ")]
        chunks = [json.loads(e) for e in events[:-1]]
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
        alone = httpx.post(target.http_url + "/chat/completions", timeout=120, json={
            "messages": _chat(PROMPTS[4]), "temperature": 0, "max_tokens": 120, "speculate": False}).json()
        assert events[-1] == "[DONE]" and text == alone["choices"][0]["message"]["content"]
        assert chunks[-1]["usage"]["completion_tokens"] == alone["usage"]["completion_tokens"]
    finally:
        target.kill()
        draft.kill()


def _async_guarded(guarded) -> httpx.AsyncClient:
    target, ca_file = guarded.target, guarded.ca_file
    return httpx.AsyncClient(base_url=target.http_url.removesuffix("/v1"),
                             verify=ssl.create_default_context(cafile=ca_file), timeout=120,
                             headers={"Authorization": f"Bearer {TOKEN}"})
