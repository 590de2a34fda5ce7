"""Tandem behind the real Shepherd Model Gateway: smg launch --backend vllm --worker-urls grpc://A grpc://B.

Two targets share one drafter (conftest.py's `shared_drafter`; target A is `front_doors`). The
gateway (smg 1.13.0 from PyPI, a Rust binary) loads the tokenizer from a worker with GetTokenizer,
renders the chat template and speaks VllmEngine to both. Through it the OpenAI SDK streams chat
completions, structured JSON validates, a named tool call parses, the Responses API answers, greedy text equals `tandem generate`'s, and requests go
to both targets. Last, target B is killed with streams in flight: they end with an error, and
requests keep succeeding on A.
"""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import httpx
import jsonschema
import openai
import pytest

from tests.support.service_fixtures import PROMPTS, metric, scrape
from tandem.launch import GatewayProcess, ServiceProcess

MODEL = "smollm2-135m"
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def target_b(shared_drafter, tmp_path_factory):
    logs = tmp_path_factory.mktemp("gateway-b")
    target = ServiceProcess("target_service", ["--threads", "1", "--max-model-len", "512",
                                               "--drafter", shared_drafter.address], log_path=logs / "target.log")
    try:
        yield target.start().wait_healthy().wait_metric("tandem_drafter_connected", 1)
    finally:
        target.kill()


@pytest.fixture(scope="module")
def gateway(front_doors, target_b, tmp_path_factory):
    process = GatewayProcess([front_doors.address, target_b.address], tmp_path_factory.mktemp("gateway") / "smg.log")
    try:
        yield process.start().wait_ready(MODEL).url
    finally:
        process.kill()


def _client(gateway: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway}/v1", api_key="unused", max_retries=0)


def _chat(prompt: str) -> list[dict]:
    return [{"role": "user", "content": prompt}]


def test_the_openai_sdk_streams_greedy_text_equal_to_tandem_generate(gateway, front_doors):
    client = _client(gateway)
    for prompt in PROMPTS[:3]:
        cli = subprocess.run([sys.executable, "-m", "tandem.cli", "generate", prompt, "--chat", "--target",
                              front_doors.address, "--max-tokens", str(MAX_TOKENS)],
                             capture_output=True, text=True, timeout=120)
        assert cli.returncode == 0, cli.stderr
        stream = client.chat.completions.create(model=MODEL, messages=_chat(prompt), temperature=0,
                                                max_tokens=MAX_TOKENS, stream=True)
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert text == cli.stdout.removesuffix("\n")


def test_structured_json_through_the_gateway_validates(gateway):
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    reply = _client(gateway).chat.completions.create(
        model=MODEL, messages=_chat("Invent a person and give their name and age as JSON."), temperature=0,
        max_tokens=64, response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}})
    jsonschema.validate(json.loads(reply.choices[0].message.content), schema)


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather now in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"], "additionalProperties": False}}}


@pytest.mark.parametrize("tool_choice", [{"type": "function", "function": {"name": "get_weather"}}, "required"])
def test_a_tool_call_through_the_gateway_closes_and_parses(gateway, tool_choice):
    """The gateway parses tools itself and constrains the answer through VllmEngine's structured output.
    Its `required` schema lists each call's keys without closing the object: the target closes it, as
    vLLM's default backend does, so the 135M model cannot add keys until max_tokens."""
    reply = _client(gateway).chat.completions.create(
        model=MODEL, messages=_chat("What is the weather in Paris?"), tools=[WEATHER], tool_choice=tool_choice,
        temperature=0, max_tokens=64)
    [call, *more] = reply.choices[0].message.tool_calls
    for made in (call, *more):
        assert made.function.name == "get_weather"
        jsonschema.validate(json.loads(made.function.arguments), WEATHER["function"]["parameters"])


def test_the_responses_api_through_the_gateway_answers(gateway):
    response = _client(gateway).responses.create(model=MODEL, input="Name a color.", temperature=0,
                                                 max_output_tokens=MAX_TOKENS)
    assert response.output_text and response.status in ("completed", "incomplete")


def test_requests_reach_both_targets(gateway, front_doors, target_b):
    def served(target: ServiceProcess) -> float:
        return metric(scrape(target.metrics_url), "tandem_request_success_total", finish_reason="stop") + \
            metric(scrape(target.metrics_url), "tandem_request_success_total", finish_reason="length")

    before = served(front_doors), served(target_b)
    client = _client(gateway)
    for prompt in PROMPTS[:4]:
        client.chat.completions.create(model=MODEL, messages=_chat(prompt), max_tokens=4)
    after = served(front_doors), served(target_b)
    assert httpx.get(f"{gateway}/readiness", timeout=10).status_code == 200  # what the deploy probes read
    assert after[0] - before[0] >= 1 and after[1] - before[1] >= 1
    assert (after[0] - before[0]) + (after[1] - before[1]) == 4


def test_a_killed_target_ends_its_streams_with_an_error_and_the_other_serves_on(gateway, target_b):
    """Last in this file: it kills target B."""
    body = {"model": MODEL, "messages": _chat(PROMPTS[1]), "max_tokens": 300, "ignore_eos": True, "stream": True}

    async def stream_one(http: httpx.AsyncClient, first_chunk: asyncio.Event) -> list[dict]:
        events = []
        async with http.stream("POST", f"{gateway}/v1/chat/completions", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line.removeprefix("data: ")))
                    first_chunk.set()
        return events

    async def kill_midway() -> list[list[dict]]:
        async with httpx.AsyncClient(timeout=120) as http:
            started = [asyncio.Event() for _ in range(4)]
            streams = [asyncio.create_task(stream_one(http, event)) for event in started]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
            target_b.kill()
            return await asyncio.wait_for(asyncio.gather(*streams), 90)  # none may hang

    outcomes = asyncio.run(kill_midway())
    failed = [events for events in outcomes if "error" in events[-1]]
    finished = [events for events in outcomes if events[-1].get("choices") and
                events[-1]["choices"][0].get("finish_reason") == "length"]
    assert len(failed) == 2 and len(finished) == 2, [e[-1] for e in outcomes]
    client = _client(gateway)
    deadline = time.monotonic() + 60
    while True:  # once the gateway has noticed, every request succeeds on A
        try:
            client.chat.completions.create(model=MODEL, messages=_chat("hi"), max_tokens=2)
            break
        except openai.APIError:
            assert time.monotonic() < deadline, "the gateway never routed around the killed target"
            time.sleep(0.5)
    for prompt in PROMPTS[:6]:
        reply = client.chat.completions.create(model=MODEL, messages=_chat(prompt), max_tokens=4)
        assert reply.choices[0].finish_reason in ("stop", "length")
