"""The Responses API on the OpenAI door, driven by the OpenAI SDK: an answer is the chat completion
of the same conversation (instructions, the stored history of previous_response_id, the input items),
streamed with OpenAI's events in OpenAI's order, equal streamed or not and with speculation on or off;
function tools and their results as items; text.format; logprobs; stored responses read back and
deleted; bad bodies refused by name."""
from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from target_service.front_doors.openai.responses.output import ResponseMeta, ResponseStream
from target_service.front_doors.openai.responses.protocol import ResponsesRequest
from target_service.front_doors.openai.responses.store import ResponseStore, StoredResponse

MODEL = "smollm2-135m"
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather now in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                           "unit": {"enum": ["celsius", "fahrenheit"]}},
                          "required": ["city", "unit"], "additionalProperties": False}}
ASK = "What is the weather in Paris?"
TEXT_EVENTS = ["response.output_item.added", "response.content_part.added", "response.output_text.delta",
               "response.output_text.done", "response.content_part.done", "response.output_item.done"]
CALL_EVENTS = ["response.output_item.added", "response.function_call_arguments.delta",
               "response.function_call_arguments.done", "response.output_item.done"]


@pytest.fixture(scope="module")
def client(front_doors):
    return openai.OpenAI(base_url=front_doors.http_url, api_key="unused", max_retries=0)


def _create(client, **kwargs):
    return client.responses.create(**{"model": MODEL, "temperature": 0, "max_output_tokens": 24, **kwargs})


def _events(client, **kwargs) -> list:
    return list(_create(client, stream=True, **kwargs))


def _shape(events: list) -> list[str]:
    """The event types, each run of deltas as one."""
    types = [event.type for event in events]
    return [kind for i, kind in enumerate(types) if not (kind.endswith(".delta") and i and types[i - 1] == kind)]


def test_a_text_answer_is_the_chat_answer_streamed_or_not_with_speculation_or_without(client):
    whole = _create(client, input="Name three colors.", instructions="Answer in one short sentence.")
    [message] = whole.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert whole.id.startswith("resp_") and whole.object == "response" and whole.model == MODEL
    chat = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=24, messages=[
        {"role": "system", "content": "Answer in one short sentence."}, {"role": "user", "content": "Name three colors."}])
    assert whole.output_text == chat.choices[0].message.content and whole.output_text
    assert whole.status == ("completed" if chat.choices[0].finish_reason == "stop" else "incomplete")
    usage = whole.usage
    assert (usage.input_tokens, usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    alone = _create(client, input="Name three colors.", instructions="Answer in one short sentence.",
                    extra_body={"speculate": False})
    assert alone.output_text == whole.output_text

    events = _events(client, input="Name three colors.", instructions="Answer in one short sentence.")
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert _shape(events) == ["response.created", "response.in_progress", *TEXT_EVENTS, f"response.{whole.status}"]
    assert "".join(event.delta for event in events if event.type == "response.output_text.delta") == whole.output_text
    final = events[-1].response
    assert final.output_text == whole.output_text and final.id == events[0].response.id
    assert final.output[0].id == events[2].item.id, "the items streamed are the final response's"


def test_an_answer_cut_by_max_output_tokens_is_incomplete(client):
    short = _create(client, input="Tell me a long story about a dragon.", max_output_tokens=3)
    assert short.status == "incomplete" and short.incomplete_details.reason == "max_output_tokens"
    assert short.output[0].status == "incomplete" and short.usage.output_tokens == 3
    events = _events(client, input="Tell me a long story about a dragon.", max_output_tokens=3)
    assert events[-1].type == "response.incomplete" and events[-1].response.output_text == short.output_text


def test_the_sdk_stream_helper_assembles_the_final_response(client):
    with client.responses.stream(model=MODEL, input="Say hi.", instructions="Reply with one word.",
                                 temperature=0, max_output_tokens=200) as stream:
        text = "".join(event.delta for event in stream if event.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert final.status == "completed" and final.output_text == text and text


def test_previous_response_id_continues_the_conversation_as_a_chat_would(client):
    first = _create(client, input="My name is Ada. Remember it.", instructions="Be brief.", max_output_tokens=12)
    second = _create(client, input="What is my name?", previous_response_id=first.id, max_output_tokens=12)
    assert second.previous_response_id == first.id
    # The history: the first input and answer; the first's instructions are not carried, as in OpenAI's API.
    chat = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=12, messages=[
        {"role": "user", "content": "My name is Ada. Remember it."},
        {"role": "assistant", "content": first.output_text}, {"role": "user", "content": "What is my name?"}])
    assert second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert second.usage.input_tokens_details.cached_tokens > 0, "the first turn's KV is reused"
    assert client.responses.retrieve(second.id).model_dump() == second.model_dump()

    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    third = _create(client, input="Spell it.", previous_response_id=second.id, max_output_tokens=4)
    assert third.usage.input_tokens > second.usage.input_tokens, "a forgotten ancestor leaves the history whole"


def test_a_response_not_stored_cannot_be_read_or_continued(client, front_doors):
    unstored = _create(client, input="Hello.", store=False, max_output_tokens=2)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    response = httpx.post(front_doors.http_url + "/responses", timeout=60,
                          json={"input": "Hi", "previous_response_id": unstored.id})
    assert response.status_code == 404 and response.json()["error"]["param"] == "previous_response_id"


def _valid_call(item) -> dict:
    assert item.type == "function_call" and item.id.startswith("fc_") and item.call_id.startswith("call_")
    arguments = json.loads(item.arguments)
    jsonschema.validate(arguments, WEATHER["parameters"])
    return arguments


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "name": "get_weather"}])
def test_a_required_or_named_call_follows_the_schema_streamed_or_not(client, tool_choice):
    whole = _create(client, input=ASK, tools=[WEATHER], tool_choice=tool_choice, parallel_tool_calls=False,
                    max_output_tokens=60)
    [call] = whole.output
    _valid_call(call)
    assert call.name == "get_weather" and whole.status == "completed" and whole.output_text == ""
    events = _events(client, input=ASK, tools=[WEATHER], tool_choice=tool_choice, parallel_tool_calls=False,
                     max_output_tokens=60)
    assert _shape(events) == ["response.created", "response.in_progress", *CALL_EVENTS, "response.completed"]
    arguments = "".join(event.delta for event in events if event.type == "response.function_call_arguments.delta")
    assert arguments == call.arguments == events[-1].response.output[0].arguments
    alone = _create(client, input=ASK, tools=[WEATHER], tool_choice=tool_choice, parallel_tool_calls=False,
                    max_output_tokens=60, extra_body={"speculate": False})
    assert alone.output[0].arguments == call.arguments


def test_a_tool_result_is_answered_as_the_chat_with_the_call_and_its_result(client):
    asked = _create(client, input=ASK, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
                    max_output_tokens=60)
    [call] = asked.output
    result = json.dumps({"temperature": 18, "sky": "clear"})
    output = {"type": "function_call_output", "call_id": call.call_id, "output": result}
    continued = _create(client, previous_response_id=asked.id, input=[output], tools=[WEATHER], tool_choice="none")
    items = [{"role": "user", "content": ASK}, call.model_dump(exclude_none=True), output]
    stateless = _create(client, input=items, tools=[WEATHER], tool_choice="none")
    chat = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=24, tools=[
        {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}], tool_choice="none",
        messages=[{"role": "user", "content": ASK},
                  {"role": "assistant", "content": None, "tool_calls": [{"id": call.call_id, "type": "function",
                   "function": {"name": call.name, "arguments": call.arguments}}]},
                  {"role": "tool", "tool_call_id": call.call_id, "content": result}])
    assert continued.output_text == stateless.output_text == chat.choices[0].message.content
    assert continued.usage.input_tokens == stateless.usage.input_tokens == chat.usage.prompt_tokens


def test_auto_answers_in_text_or_calls_the_same_streamed_or_not(client):
    whole = _create(client, input=ASK, tools=[WEATHER], max_output_tokens=40)
    assert whole.tool_choice == "auto" and whole.output
    events = _events(client, input=ASK, tools=[WEATHER], max_output_tokens=40)
    streamed = events[-1].response
    assert [item.type for item in streamed.output] == [item.type for item in whole.output]
    assert streamed.output_text == whole.output_text


def test_text_format_json_schema_constrains_the_answer(client):
    schema = {"type": "object", "properties": {"color": {"type": "string", "maxLength": 12}},
              "required": ["color"], "additionalProperties": False}
    fmt = {"format": {"type": "json_schema", "name": "color", "schema": schema, "strict": True}}
    whole = _create(client, input="Name a color, in JSON.", text=fmt, max_output_tokens=40)
    jsonschema.validate(json.loads(whole.output_text), schema)
    assert whole.text.format.type == "json_schema"
    events = _events(client, input="Name a color, in JSON.", text=fmt, max_output_tokens=40)
    assert events[-1].response.output_text == whole.output_text


def test_logprobs_come_with_the_text_when_included(client):
    kwargs = {"input": "Name a fruit.", "include": ["message.output_text.logprobs"], "top_logprobs": 2,
              "max_output_tokens": 8}
    whole = _create(client, **kwargs)
    part = whole.output[0].content[0]
    assert len(part.logprobs) == whole.usage.output_tokens
    assert "".join(lp.token for lp in part.logprobs) == part.text
    assert all(len(lp.top_logprobs) == 2 and lp.logprob <= 0 for lp in part.logprobs)
    events = _events(client, **kwargs)
    streamed = [lp for event in events if event.type == "response.output_text.delta" for lp in event.logprobs]
    assert [lp.model_dump() for lp in streamed] == [lp.model_dump() for lp in part.logprobs]


@pytest.mark.parametrize("body, status, param", [
    ({"input": []}, 400, "input"),
    ({"input": [{"type": "reasoning", "summary": []}]}, 400, "input[0].type"),
    ({"input": [{"type": [], "role": "user", "content": "hi"}]}, 400, "input[0].type"),
    ({"input": [{"type": "function_call_output", "call_id": "", "output": "18"}]}, 400, "input[0].call_id"),
    ({"input": "hi", "metadata": {f"k{i}": "v" for i in range(17)}}, 400, "metadata"),
    ({"input": [{"type": "function_call_output", "output": "18"}]}, 400, "input[0].call_id"),
    ({"input": [{"role": "robot", "content": "hi"}]}, 400, "input[0].role"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400, "input[0].content"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, 400, "tools[0].type"),
    ({"input": "hi", "tools": [{**WEATHER, "parameters": {"type": "objekt"}}], "tool_choice": "required"}, 400,
     "tools[0].parameters"),
    ({"input": "hi", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_news"}}, 400, "tool_choice"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "schema": {}}}}, 400, "text.format.name"),
    ({"input": "hi", "max_output_tokens": 0}, 400, "max_output_tokens"),
    ({"input": "hi", "temperature": -1}, 400, "temperature"),
    ({"input": "hi", "truncation": "auto"}, 400, "truncation"),
    ({"input": "hi", "background": True}, 400, "background"),
    ({"input": "hi", "include": ["reasoning.encrypted_content"]}, 400, "include"),
    ({"input": "hi", "previous_response_id": "resp_unknown"}, 404, "previous_response_id"),
    ({"input": "hi", "frobnicate": 1}, 400, "frobnicate"),
])
def test_bad_bodies_get_the_status_naming_the_field_and_harm_nothing(front_doors, client, body, status, param):
    response = httpx.post(front_doors.http_url + "/responses", json=body, timeout=60)
    assert response.status_code == status, response.text
    assert response.json()["error"]["param"] == param
    assert _create(client, input="Hi.", max_output_tokens=2).output_text


def test_what_a_response_echoes_may_be_sent_back(client):
    """A client that sends a response's own fields back (reasoning, top_logprobs 0) is served."""
    echoed = _create(client, input="Hi.", max_output_tokens=2, tools=[WEATHER], tool_choice="none", top_logprobs=0,
                     reasoning={"effort": None, "summary": None}, metadata={"k": "v"})
    assert echoed.output_text and echoed.metadata == {"k": "v"}


def test_unknown_ids_get_404_on_read_and_delete(front_doors):
    for method in ("GET", "DELETE"):
        response = httpx.request(method, front_doors.http_url + "/responses/resp_unknown", timeout=60)
        assert response.status_code == 404 and response.json()["error"]["param"] == "response_id"


def test_the_store_forgets_the_least_recently_used_past_its_capacity():
    store = ResponseStore(2)
    for name in ("a", "b"):
        store.put(name, StoredResponse({"id": name}, ()))
    assert store.get("a") is not None  # a is now the most recently used
    store.put("c", StoredResponse({"id": "c"}, ()))
    assert (store.get("b"), len(store)) == (None, 2)
    assert store.get("a") is not None and store.get("c") is not None
    assert store.delete("a") and not store.delete("a")


def test_a_stored_conversation_keeps_the_text_alone():
    """What never reaches the prompt (ids, statuses, annotations, logprobs) is not kept for later turns."""
    from target_service.front_doors.openai.responses import protocol

    output = [{"id": "msg_1", "type": "message", "status": "completed", "role": "assistant", "content": [
        {"type": "output_text", "text": "It is", "annotations": [], "logprobs": [{"token": "It", "logprob": -0.1}]},
        {"type": "output_text", "text": "sunny.", "annotations": [], "logprobs": []}]},
        {"id": "fc_1", "type": "function_call", "status": "completed", "call_id": "call_1", "name": "f",
         "arguments": "{}"}]
    inputs = protocol.input_items(protocol.ResponsesRequest(input="Weather?"))
    kept = protocol.kept(inputs, output)
    assert [item.model_dump(exclude_none=True) for item in kept] == [
        {"type": "message", "role": "user", "content": "Weather?"},
        {"type": "message", "role": "assistant", "content": "It is\nsunny."},
        {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"}]
    messages = protocol.messages_of(kept)
    assert [(m.role, m.content) for m in messages] == [("user", "Weather?"), ("assistant", "It is\nsunny.")]
    assert messages[1].tool_calls[0].id == "call_1", "the call joins the answer before it"


def test_events_built_but_never_sent_leave_no_gap_before_response_failed():
    """A stream numbers its events as they are sent: a step whose events were built, then failed,
    leaves the failed event right after the last one sent."""
    meta = ResponseMeta("resp_1", 0, "smollm2-135m", ResponsesRequest.model_validate({"input": "Hi."}), stored=False)
    stream = ResponseStream(meta, None)
    sent = [stream.numbered(event) for event in stream.start()]
    assert stream.feed("Hello", [], last=False), "the events of a step that never went out"
    failed = stream.numbered(stream.failed("internal error"))
    assert [event["sequence_number"] for event in [*sent, failed]] == [0, 1, 2]
    assert failed["type"] == "response.failed"

