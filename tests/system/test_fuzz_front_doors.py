"""Generated requests on the new front doors, hostile ones included: OpenAI HTTP bodies on chat,
completions and responses (malformed
JSON, wrong types, unknown and unserved fields, bad UTF-8, bodies over the limit) and VllmEngine
requests (wild sampling fields, raw bytes where strings belong). Each ends with success or a
clear refusal in its protocol's shape, and the server lives and serves as before.
"""
from __future__ import annotations

import json

import grpc
import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st
from smg_grpc_proto import vllm_engine_pb2

from tests.support.fuzzing import fuzz_settings
from tests.support.service_fixtures import PROMPTS, metric, protobuf_field, scrape
from tandem.launch import ServiceProcess, free_port

MAX_MODEL_LEN = 64  # room for the good request (48 prompt tokens + 8); an example without max_tokens stays short
MAX_BODY = 16_384
CLEAR_HTTP = {200, 400, 404, 413, 429}
# No DEADLINE_EXCEEDED: every request here ends within its deadline, or it hung.
CLEAR_GRPC = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}
VLLM_METHOD = "/vllm.grpc.engine.VllmEngine/Generate"
TIMEOUT = 20.0
U32 = 2**32 - 1


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    logs = tmp_path_factory.mktemp("fuzz-front-doors")
    # Both cores: the client's work is light, and an example without max_tokens generates up to the limit.
    service = ServiceProcess("target_service", ["--threads", "2", "--max-model-len", str(MAX_MODEL_LEN),
                                                "--max-num-seqs", "4", "--max-message-bytes", str(MAX_BODY)],
                             log_path=logs / "target.log", http_port=free_port())
    try:
        yield service.start().wait_healthy(timeout=300)
    finally:
        service.kill()


texts = st.text(max_size=30) | st.text(st.characters(codec="utf-8"), max_size=200)
json_values = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | texts,
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(texts, inner, max_size=3),
                           max_leaves=6)

TOOL = {"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}
# Each field has a sane value and a wild one (any JSON value); an example makes a few fields wild.
SANE = {
    "model": st.sampled_from(["smollm2-135m", None]),
    "temperature": st.sampled_from([0, 0.7, 1.0]),
    "top_p": st.sampled_from([1.0, 0.9]),
    "top_k": st.sampled_from([-1, 0, 20]),
    "min_p": st.sampled_from([0.0, 0.05]),
    "seed": st.integers(-2**63, 2**63 - 1),
    "max_tokens": st.integers(1, 4),
    "stop": st.sampled_from([None, "x", ["a", "bc"]]),
    "stop_token_ids": st.lists(st.integers(0, 49_151), max_size=2),
    "ignore_eos": st.booleans(),
    "stream": st.booleans(),
    "n": st.sampled_from([None, 1, 2]),
    "logprobs": st.sampled_from([None, False, True]),  # chat's; completions' differs (SANE_COMPLETION)
    "top_logprobs": st.sampled_from([None, 0, 3]),
    "prompt_logprobs": st.sampled_from([None, 0, 2]),
    "presence_penalty": st.sampled_from([None, 0, 0.5, -1.5]),
    "frequency_penalty": st.sampled_from([None, 0, 0.3]),
    "repetition_penalty": st.sampled_from([None, 1.0, 1.3]),
    "logit_bias": st.sampled_from([None, {}, {"13": 5.0, "28": -100}]),
    "allowed_token_ids": st.sampled_from([None, [13, 28, 30, 2]]),
    "bad_words": st.sampled_from([None, ["the"], ["blue sky", " a"]]),
    "response_format": st.sampled_from([None, {"type": "text"}, {"type": "json_object"}]),
    "structured_outputs": st.sampled_from([None, {"choice": ["yes", "no"]}, {"regex": "[a-z]{1,4}"}]),
    "speculate": st.booleans(),
    "num_speculative_tokens": st.integers(0, 8),
    "tools": st.sampled_from([None, [], [TOOL]]),
    "tool_choice": st.sampled_from([None, "none", "auto", "required", {"type": "function", "function": {"name": "f"}},
                                    {"type": "function", "function": {"name": "g"}}]),
    "parallel_tool_calls": st.booleans(),
}
# Where the completions endpoint's sane value differs from chat's, and chat's fields it lacks.
SANE_COMPLETION = {"logprobs": st.sampled_from([None, 0, 2]), "echo": st.booleans(),
                   "max_tokens": st.integers(0, 4)}  # 0: with echo, the prompt alone; without, a 400
CHAT_ONLY = {"top_logprobs", "tools", "tool_choice", "parallel_tool_calls"}
ROLES = st.sampled_from(["system", "user", "assistant", "tool"])
SANE_INPUT = {
    "messages": st.lists(st.fixed_dictionaries({"role": ROLES, "content": texts}), min_size=1, max_size=2),
    "prompt": texts.filter(bool) | st.lists(st.integers(0, 49_151), min_size=1, max_size=8)
              | st.lists(texts.filter(bool), min_size=1, max_size=3)  # a batch
              | st.lists(st.lists(st.integers(0, 49_151), min_size=1, max_size=8), min_size=1, max_size=3),
}
WILD_INPUT = {
    "messages": st.lists(st.fixed_dictionaries({"role": ROLES | texts, "content": texts | json_values}),
                         max_size=3) | json_values,
    "prompt": st.lists(texts, max_size=3) | st.lists(st.integers(-5, 2**33), max_size=8)
              | st.lists(st.lists(st.integers(-5, 2**33), max_size=4), max_size=3) | json_values,
}
RESPONSES_TOOL = {"type": "function", "name": "f", "parameters": TOOL["function"]["parameters"]}
# The Responses API's fields: its own names, and the sampling fields it shares with chat.
SANE_RESPONSES = {name: SANE[name] for name in ("model", "temperature", "top_p", "top_k", "min_p", "seed", "stream",
                                               "top_logprobs", "repetition_penalty", "speculate")} | {
    "max_output_tokens": st.integers(1, 4),
    "instructions": st.none() | texts,
    "store": st.booleans(),
    "previous_response_id": st.sampled_from([None, "resp_unknown"]),
    "include": st.sampled_from([None, [], ["message.output_text.logprobs"], ["reasoning.encrypted_content"]]),
    "tools": st.sampled_from([None, [], [RESPONSES_TOOL], [{"type": "web_search"}]]),
    "tool_choice": st.sampled_from([None, "none", "auto", "required", {"type": "function", "name": "f"},
                                    {"type": "function", "name": "g"}]),
    "text": st.sampled_from([None, {"format": {"type": "text"}}, {"format": {"type": "json_object"}},
                             {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
                             {"format": {"type": "json_schema", "schema": {}}}]),
    "truncation": st.sampled_from([None, "disabled", "auto"]),
    "metadata": st.sampled_from([None, {}, {"k": "v"}]),
}
ITEMS = st.sampled_from([
    {"role": "user", "content": "Hi"},
    {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]},
    {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{\"x\": 1}"},
    {"type": "function_call_output", "call_id": "c1", "output": "2"},
    {"type": "reasoning", "summary": []},
])
SANE_INPUT["input"] = texts.filter(bool) | st.lists(ITEMS, min_size=1, max_size=3)
WILD_INPUT["input"] = st.lists(json_values | ITEMS, max_size=3) | json_values
WILD = {name: json_values for name in SANE | SANE_COMPLETION | SANE_RESPONSES} | {"frobnicate": json_values}
# Each endpoint: its sane fields, and the field that carries its input.
ENDPOINTS = {
    "/v1/chat/completions": (SANE, "messages"),
    "/v1/completions": ({name: value for name, value in (SANE | SANE_COMPLETION).items() if name not in CHAT_ONLY},
                        "prompt"),
    "/v1/responses": (SANE_RESPONSES, "input"),
}


@st.composite
def http_requests(draw) -> tuple[str, bytes]:
    wild = draw(st.sets(st.sampled_from(sorted(WILD)), max_size=2) | st.just(set()))
    path = draw(st.sampled_from(sorted(ENDPOINTS)))
    sane, field = ENDPOINTS[path]
    body = {name: draw((WILD if name in wild else sane)[name]) for name in sane | WILD
            if name in wild or (name in sane and draw(st.booleans()))}
    body[field] = draw((WILD_INPUT if draw(st.integers(0, 3)) == 0 else SANE_INPUT)[field])
    wire = json.dumps(body, ensure_ascii=draw(st.booleans())).encode()
    mutation = draw(st.sampled_from(["none"] * 6 + ["truncate", "bad-utf8", "not-json", "huge"]))
    if mutation == "truncate":
        wire = wire[:draw(st.integers(0, max(0, len(wire) - 1)))]
    elif mutation == "bad-utf8":
        at = draw(st.integers(0, len(wire)))
        wire = wire[:at] + draw(st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\x00"])) + wire[at:]
    elif mutation == "not-json":
        wire = draw(st.binary(max_size=64))
    elif mutation == "huge":
        wire = b'{"messages": [{"role": "user", "content": "' + b"x" * (MAX_BODY + 1) + b'"}]}'
    return path, wire


@pytest.mark.parametrize("examples", [60, pytest.param(10_000, marks=pytest.mark.slow)])
def test_generated_http_bodies_end_cleanly_and_leave_the_server_sound(target, examples):
    base = f"http://127.0.0.1:{target.http_port}"
    good = {"messages": [{"role": "user", "content": PROMPTS[4]}], "temperature": 0, "max_tokens": 8}
    seen: dict[int, int] = {}
    with httpx.Client(base_url=base, timeout=TIMEOUT) as http:
        reference = http.post("/v1/chat/completions", json=good).json()["choices"][0]["message"]["content"]

        @fuzz_settings(examples)
        @given(http_requests())
        def check(request: tuple[str, bytes]) -> None:
            path, wire = request
            response = http.post(path, content=wire, headers={"Content-Type": "application/json"})
            seen[response.status_code] = seen.get(response.status_code, 0) + 1
            assert response.status_code in CLEAR_HTTP, f"{response.status_code} {response.text:.500} for {wire!r:.1000}"
            if response.status_code == 200:
                _assert_whole(path, response)
            else:
                assert set(response.json()["error"]) == {"message", "type", "param", "code"}
            assert target.process.poll() is None, "the target died"

        check()
        again = http.post("/v1/chat/completions", json=good).json()["choices"][0]["message"]["content"]
        assert again == reference, "a fuzzed request changed a later greedy output"
    _assert_idle(target)
    assert seen.get(200, 0) > 0 and seen.get(400, 0) > 0, seen


def _assert_whole(path: str, response: httpx.Response) -> None:
    """A body with its choices or output; a stream that ended as its protocol ends one."""
    streamed = response.headers["content-type"].startswith("text/event-stream")
    if path != "/v1/responses":
        assert response.text.rstrip().endswith("data: [DONE]") if streamed else response.json()["choices"]
        return
    if streamed:
        last = json.loads(response.text.rstrip().rsplit("data: ", 1)[1])
        assert last["type"] in ("response.completed", "response.incomplete"), last
    else:
        assert response.json()["status"] in ("completed", "incomplete")


def _assert_idle(target: ServiceProcess) -> None:
    samples = scrape(target.metrics_url)
    assert metric(samples, "tandem_num_requests_running") == 0
    assert metric(samples, "tandem_num_requests_waiting") == 0


wild_floats = st.floats(width=32) | st.sampled_from([float("nan"), float("inf"), -1.0, 3e38])
VLLM_SANE = {
    "temperature": st.sampled_from([0.0, 0.7]),
    "top_p": st.sampled_from([0.0, 1.0, 0.9]),
    "top_k": st.integers(0, 50),
    "min_p": st.sampled_from([0.0, 0.05]),
    "repetition_penalty": st.sampled_from([0.0, 1.0, 1.2]),
    "presence_penalty": st.sampled_from([0.0, 0.5]),
    "frequency_penalty": st.sampled_from([0.0, -0.4]),
    "max_tokens": st.integers(1, 4),
    "n": st.sampled_from([0, 1, 2]),
    "stop": st.lists(st.text(min_size=1, max_size=8), max_size=2),
    "stop_token_ids": st.lists(st.integers(0, 49_151), max_size=2),
    "seed": st.integers(-2**31, 2**31 - 1),
}
VLLM_WILD = {
    "temperature": wild_floats, "top_p": wild_floats, "top_k": st.integers(0, U32), "min_p": wild_floats,
    "repetition_penalty": wild_floats, "max_tokens": st.integers(0, U32), "n": st.integers(0, U32),
    "stop": st.lists(texts, max_size=20), "stop_token_ids": st.lists(st.integers(0, U32), max_size=4),
    "seed": st.integers(-2**31, 2**31 - 1), "frequency_penalty": wild_floats, "presence_penalty": wild_floats,
    "min_tokens": st.integers(0, U32), "logprobs": st.integers(-2**31, 2**31 - 1),
    "prompt_logprobs": st.integers(-2**31, 2**31 - 1),
    "logit_bias": st.dictionaries(st.integers(-2**31, 2**31 - 1), wild_floats, max_size=3),
}


@st.composite
def vllm_requests(draw) -> bytes:
    wild = draw(st.sets(st.sampled_from(sorted(VLLM_WILD)), max_size=3) | st.just(set()))
    params = vllm_engine_pb2.SamplingParams(skip_special_tokens=True)
    for name in sorted(set(VLLM_SANE) | wild):
        value = draw((VLLM_WILD if name in wild else VLLM_SANE)[name])
        if isinstance(value, list):
            getattr(params, name).extend(value)
        elif isinstance(value, dict):
            getattr(params, name).update(value)
        else:
            setattr(params, name, value)
    constraint = draw(st.sampled_from([None] * 5 + ["regex", "json_schema", "choice", "json_object", "structural_tag"]))
    if constraint == "choice":
        params.choice.choices.extend(draw(st.lists(texts, max_size=3)))
    elif constraint == "json_object":
        params.json_object = draw(st.booleans())
    elif constraint is not None:
        setattr(params, constraint, draw(texts))
    request = vllm_engine_pb2.GenerateRequest(request_id=draw(texts), stream=draw(st.booleans()),
                                              sampling_params=params)
    kind = draw(st.sampled_from(["ids", "ids", "text", "wild-ids"]))
    if kind == "ids":
        request.tokenized.input_ids.extend(draw(st.lists(st.integers(0, 49_151), min_size=1, max_size=16)))
    elif kind == "wild-ids":
        request.tokenized.input_ids.extend(draw(st.lists(st.integers(0, U32), max_size=MAX_MODEL_LEN + 8)))
    else:
        request.text = draw(texts)
    wire = request.SerializeToString()
    for number in draw(st.lists(st.sampled_from([1, 3]), max_size=2)):  # request_id, text
        wire += protobuf_field(number, draw(st.binary(max_size=32)))
    return wire


def _without_cached_tokens(responses: list) -> list:
    """The responses with `complete.cached_tokens` cleared: whether the prompt's KV is still kept
    depends on how many requests came in between."""
    for response in responses:
        if response.HasField("complete"):
            response.complete.ClearField("cached_tokens")
    return responses


@pytest.mark.parametrize("examples", [60, pytest.param(10_000, marks=pytest.mark.slow)])
def test_generated_vllm_engine_requests_end_cleanly_and_leave_the_server_sound(target, examples):
    seen: dict[str, int] = {}
    good = vllm_engine_pb2.GenerateRequest(
        request_id="good", text=PROMPTS[4],
        sampling_params=vllm_engine_pb2.SamplingParams(temperature=0.0, max_tokens=8)).SerializeToString()
    with grpc.insecure_channel(target.address) as channel:
        generate = channel.unary_stream(VLLM_METHOD, request_serializer=lambda wire: wire,
                                        response_deserializer=vllm_engine_pb2.GenerateResponse.FromString)

        def outcome(wire: bytes) -> tuple[grpc.StatusCode, list]:
            try:
                return grpc.StatusCode.OK, list(generate(wire, timeout=TIMEOUT))
            except grpc.RpcError as err:
                return err.code(), []

        reference = _without_cached_tokens(outcome(good)[1])

        @fuzz_settings(examples)
        @given(vllm_requests())
        def check(wire: bytes) -> None:
            code, responses = outcome(wire)
            seen[code.name] = seen.get(code.name, 0) + 1
            assert code in CLEAR_GRPC, f"{code.name} for {wire!r:.1000}"
            if code == grpc.StatusCode.OK:
                completes = [r.complete.index for r in responses if r.HasField("complete")]
                assert responses[-1].HasField("complete") and sorted(completes) == list(range(len(completes)))
            assert target.process.poll() is None, "the target died"

        check()
        assert _without_cached_tokens(outcome(good)[1]) == reference, "a fuzzed request changed a later greedy output"
    _assert_idle(target)
    assert seen.get("OK", 0) > 0 and seen.get("INVALID_ARGUMENT", 0) > 0, seen
