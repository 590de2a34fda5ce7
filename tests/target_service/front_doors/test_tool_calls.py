"""Function tools on the OpenAI door, driven by the OpenAI SDK: the tools and the history of calls
reach the chat template (the shipped smollm2_tool_use one), tool_choice `required` or a named
function makes the answer calls whose arguments follow the tools' schemas, and `auto` reads the
calls the model writes (the Hermes parser), streamed or not, with speculation on and off alike.
tandem.v1 takes the same tool_choice and returns the same calls."""
from __future__ import annotations

import json

import grpc
import httpx
import jsonschema
import openai
import pytest

from target_service.config import chat_template_source
from tandem.runtime import load_tokenizer
from tandem.v1 import generation_pb2, generation_pb2_grpc, structured_pb2

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather now in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris, and what time is it there?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def client(front_doors):
    return openai.OpenAI(base_url=front_doors.http_url, api_key="unused", max_retries=0)


def _create(client, **kwargs):
    return client.chat.completions.create(**{"model": "smollm2-135m", "messages": ASK, "tools": TOOLS,
                                             "temperature": 0, "max_tokens": 120, **kwargs})


def _streamed_calls(chunks, content_allowed: bool = False) -> tuple[list[dict], str]:
    """The calls a stream's deltas add up to, as OpenAI's clients assemble them, and why it finished."""
    calls: dict[int, dict] = {}
    reason = None
    for chunk in chunks:
        for choice in chunk.choices:
            assert content_allowed or not choice.delta.content, "a required or named answer sends no content"
            for delta in choice.delta.tool_calls or ():
                call = calls.setdefault(delta.index, {"id": delta.id, "name": delta.function.name, "arguments": ""})
                call["arguments"] += delta.function.arguments or ""
            reason = choice.finish_reason or reason
    return [calls[i] for i in sorted(calls)], reason


def _valid(name: str, arguments: str) -> dict:
    value = json.loads(arguments)
    jsonschema.validate(value, SCHEMAS[name])
    return value


def test_a_named_function_is_called_with_arguments_that_follow_its_schema(client):
    whole = _create(client, tool_choice=NAMED)
    choice = whole.choices[0]
    assert choice.finish_reason == "stop", "OpenAI's reason when the request named the function"
    assert choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    _valid("get_weather", call.function.arguments)
    [streamed], reason = _streamed_calls(_create(client, tool_choice=NAMED, stream=True))
    assert (streamed["name"], streamed["arguments"], reason) == ("get_weather", call.function.arguments, "stop")
    assert streamed["id"].startswith("call_")
    alone = _create(client, tool_choice=NAMED, extra_body={"speculate": False})
    assert alone.choices[0].message.tool_calls[0].function.arguments == call.function.arguments


@pytest.mark.parametrize("parallel", [True, False])
def test_required_makes_calls_of_the_tools_given(client, parallel):
    whole = _create(client, tool_choice="required", parallel_tool_calls=parallel)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls
    assert len(calls) >= 1 and (parallel or len(calls) == 1)
    for call in calls:
        _valid(call.function.name, call.function.arguments)
    assert len({call.id for call in calls}) == len(calls)
    streamed, reason = _streamed_calls(_create(client, tool_choice="required", parallel_tool_calls=parallel,
                                               stream=True))
    assert [(c["name"], c["arguments"]) for c in streamed] == [(c.function.name, c.function.arguments) for c in calls]
    assert reason == "tool_calls"


def test_none_answers_in_text_and_an_answer_cut_short_stays_text(client):
    text = _create(client, tool_choice="none")
    assert text.choices[0].message.tool_calls is None and text.choices[0].message.content
    short = _create(client, tool_choice=NAMED, max_tokens=2)
    assert short.choices[0].finish_reason == "length" and short.choices[0].message.tool_calls is None
    assert short.choices[0].message.content


# The embedded 135M model answers these prompts in text; a regex makes it write a Hermes call, so that
# the parser's path through the door runs on a real answer.
HERMES_CALL = {"regex": 'Checking\\.\n<tool_call>\n\\{"name": "get_time", "arguments": \\{"city": "(Paris|Rome)"\\}\\}\n</tool_call>'}


def test_auto_reads_the_calls_the_model_writes_streamed_or_not(client):
    text = _create(client)  # tool_choice unset: auto, as OpenAI's default with tools
    assert text.choices[0].message.tool_calls is None and text.choices[0].message.content
    assert text.choices[0].finish_reason in ("stop", "length")
    whole = _create(client, tool_choice="auto", extra_body={"structured_outputs": HERMES_CALL})
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
    [call] = choice.message.tool_calls
    assert call.function.name == "get_time" and json.loads(call.function.arguments)["city"] in ("Paris", "Rome")
    chunks = list(_create(client, tool_choice="auto", stream=True, extra_body={"structured_outputs": HERMES_CALL}))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == "Checking."
    streamed, reason = _streamed_calls(chunks, content_allowed=True)
    assert [(c["name"], c["arguments"]) for c in streamed] == [(call.function.name, call.function.arguments)]
    assert reason == "tool_calls"
    alone = _create(client, tool_choice="auto", extra_body={"structured_outputs": HERMES_CALL, "speculate": False})
    assert alone.choices[0].message.tool_calls[0].function.arguments == call.function.arguments


def test_the_tools_and_the_history_of_calls_reach_the_chat_template(client, smollm2_path):
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps({"city": "Paris", "unit": "celsius"})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": json.dumps({"temperature": 18})},
        {"role": "user", "content": "And in Rome?"}]
    tokenizer = load_tokenizer(smollm2_path).with_chat_template(chat_template_source("smollm2_tool_use"))
    rendered = [dict(m, tool_calls=[{**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                                    for c in m["tool_calls"]]) if m.get("tool_calls") else m for m in history]
    expected = tokenizer.encode_chat(rendered, tools=TOOLS)
    answer = client.chat.completions.create(model="smollm2-135m", messages=history, tools=TOOLS, tool_choice=NAMED,
                                            temperature=0, max_tokens=40)
    assert answer.usage.prompt_tokens == len(expected)
    plain = tokenizer.encode_chat(ASK)
    assert len(expected) > len(plain) + 100, "the tools' signatures are in the prompt"


@pytest.mark.parametrize("body, param", [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}],
      "tool_choice": "required"}, "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"$schema": []}}}],
      "tool_choice": "required"}, "tools[0].function.parameters.$schema"),
    ({"tools": [{"type": "function", "function": {"name": "two words"}}], "tool_choice": "required"},
     "tools[0].function.name"),
    ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools[1].function.name"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_news"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"messages": ASK + [{"role": "tool", "content": "18 degrees"}]}, "messages[1].tool_call_id"),
    ({"messages": [{"role": "user", "content": "hi", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages[0].tool_calls"),
])
def test_bad_tool_fields_get_a_400_naming_them_and_harm_nothing(front_doors, client, body, param):
    response = httpx.post(front_doors.http_url + "/chat/completions", json={"messages": ASK, **body}, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert _create(client, tool_choice=NAMED).choices[0].message.tool_calls


def _grpc_tools() -> list[generation_pb2.Tool]:
    return [generation_pb2.Tool(name=t["function"]["name"], description=t["function"]["description"],
                                parameters=json.dumps(t["function"]["parameters"])) for t in TOOLS]


def _grpc_answer(front_doors, choice: generation_pb2.ToolChoice, **params) -> list[generation_pb2.GenerateResponse]:
    request = generation_pb2.GenerateRequest(
        chat=generation_pb2.ChatMessages(messages=[generation_pb2.ChatMessage(**m) for m in ASK], tools=_grpc_tools(),
                                         tool_choice=choice),
        sampling_params=generation_pb2.SamplingParams(temperature=0, max_tokens=120, **params))
    with grpc.insecure_channel(front_doors.address) as channel:
        return list(generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=120))


def test_tandem_v1_takes_tool_choice_and_returns_the_calls_parsed(front_doors, client):
    """The same calls as the OpenAI door makes, in the last response; the text deltas are the answer
    as generated; a chat without tool_choice answers in text, its tools only shown."""
    cases = [(generation_pb2.ToolChoice(function="get_weather"), {"tool_choice": NAMED}, {}),
             (generation_pb2.ToolChoice(mode="required", parallel_tool_calls=False),
              {"tool_choice": "required", "parallel_tool_calls": False}, {}),
             (generation_pb2.ToolChoice(mode="auto"), {"tool_choice": "auto"},
              {"structured_outputs": structured_pb2.StructuredOutputs(regex=HERMES_CALL["regex"])})]
    for choice, openai_fields, params in cases:
        responses = _grpc_answer(front_doors, choice, **params)
        last = responses[-1]
        extra = {"structured_outputs": HERMES_CALL} if params else {}
        expected = _create(client, **openai_fields, extra_body=extra).choices[0].message
        assert [(c.name, c.arguments) for c in last.tool_calls] == \
            [(c.function.name, c.function.arguments) for c in expected.tool_calls]
        assert all(c.id.startswith("call_") for c in last.tool_calls)
        assert last.content == (expected.content or "")
        text = "".join(r.text for r in responses)
        assert text.startswith("Checking.\n<tool_call>" if params else ("[" if choice.mode else "{"))
    plain = _grpc_answer(front_doors, generation_pb2.ToolChoice())
    assert not plain[-1].tool_calls and "".join(r.text for r in plain)


@pytest.mark.parametrize("choice, params, field", [
    (generation_pb2.ToolChoice(function="get_news"), {}, "chat.tool_choice"),
    (generation_pb2.ToolChoice(mode="sometimes"), {}, "chat.tool_choice.mode"),
    (generation_pb2.ToolChoice(mode="required"),
     {"structured_outputs": structured_pb2.StructuredOutputs(json_object=True)}, "chat.tool_choice"),
])
def test_tandem_v1_refuses_a_bad_tool_choice_naming_the_field(front_doors, choice, params, field):
    with pytest.raises(grpc.RpcError) as caught:
        _grpc_answer(front_doors, choice, **params)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details().startswith(f"{field}: ")
