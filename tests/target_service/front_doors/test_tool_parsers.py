"""tool_choice auto's parsers, and the stream of an answer that may call: sent in any pieces, a
stream's content and calls add up to what the whole answer's parse gives, and no content carries
a call's text (a call that does not parse is text)."""
from __future__ import annotations

import json

import pytest

from target_service.errors import RequestError
from target_service.front_doors.openai.protocol import ChatCompletionRequest
from target_service.front_doors.openai.tools import CallStream, answer_of, chat_request
from target_service.front_doors.tool_calls import ToolChoice, tool_choice_of
from target_service.front_doors.tool_parsers import TOOL_PARSERS

HERMES, LLAMA = TOOL_PARSERS["hermes"], TOOL_PARSERS["llama3_json"]
WEATHER = json.dumps({"city": "Paris", "unit": "celsius"})


@pytest.mark.parametrize("text, content, calls", [
    ("It is sunny.", "It is sunny.", None),
    ('<tool_call>\n{"name": "get_weather", "arguments": ' + WEATHER + '}\n</tool_call>', None,
     [("get_weather", WEATHER)]),
    ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": ' + WEATHER + '}\n</tool_call>\n'
     '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>', "Let me look.",
     [("get_weather", WEATHER), ("get_time", "{}")]),
    ('<tool_call>\n{"name": "get_time", "arguments": {"city": "Rome"}}', None,  # max_tokens cut the close
     [("get_time", '{"city": "Rome"}')]),
    ('<tool_call>\n{"name": "get_time", "argum', '<tool_call>\n{"name": "get_time", "argum', None),  # stays text
    ("The tag <tool is not a call", "The tag <tool is not a call", None),
])
def test_hermes_reads_calls_between_tags_and_the_text_before_them(text, content, calls):
    choice = ToolChoice(parser=HERMES)
    got_content, got_calls = answer_of(choice, text)
    assert got_content == content
    assert ([(c["function"]["name"], c["function"]["arguments"]) for c in got_calls] if got_calls else None) == calls
    _streams_alike(choice, text)


@pytest.mark.parametrize("text, calls", [
    ('{"name": "get_weather", "parameters": ' + WEATHER + '}', [("get_weather", WEATHER)]),
    ('  {"name": "get_weather", "arguments": ' + WEATHER + '}; {"name": "get_time", "parameters": {}}',
     [("get_weather", WEATHER), ("get_time", "{}")]),
    ("Paris is sunny today.", None),
    ('{"name": "get_weather", "parameters": {"city"', None),
])
def test_llama3_json_reads_an_answer_that_is_json_calls(text, calls):
    choice = ToolChoice(parser=LLAMA)
    content, got = answer_of(choice, text)
    assert ([(c["function"]["name"], c["function"]["arguments"]) for c in got] if got else None) == calls
    assert content == (None if calls else text)
    _streams_alike(choice, text)


def _streams_alike(choice: ToolChoice, text: str) -> None:
    """Fed in pieces of every size up to 7, the stream gives the whole answer's content and calls."""
    content, calls = answer_of(choice, text)
    for size in range(1, 8):
        stream = CallStream(choice)
        pieces = [text[i:i + size] for i in range(0, len(text), size)]
        streamed, entries = "", []
        for n, piece in enumerate(pieces):
            got, new = stream.feed(piece, last=n == len(pieces) - 1)
            assert "<tool_call>" not in got or "<tool_call>" in (content or ""), "a call's text is not content"
            streamed += got
            entries += new
        assert streamed == (content or "")
        assert [(e["function"]["name"], e["function"]["arguments"]) for e in entries] == \
            [(c["function"]["name"], c["function"]["arguments"]) for c in calls or ()]
        assert [e["index"] for e in entries] == list(range(len(entries)))


def test_required_streams_each_call_once_whole_and_a_cut_answer_as_text():
    text = '[{"name": "get_weather", "parameters": ' + WEATHER + '}, {"name": "get_time", "parameters": {}}]'
    stream, sent = CallStream(ToolChoice()), []
    for i in range(len(text)):
        content, entries = stream.feed(text[i], last=i == len(text) - 1)
        assert content == ""
        sent += entries
    assert [(e["index"], e["function"]["name"], e["function"]["arguments"]) for e in sent] == \
        [(0, "get_weather", WEATHER), (1, "get_time", "{}")]
    cut = CallStream(ToolChoice())
    assert cut.feed('[{"name": "get_wea', last=True) == ('[{"name": "get_wea', [])


def test_auto_is_refused_without_a_parser_and_is_the_default_with_tools():
    tools = [{"type": "function", "function": {"name": "get_time"}}]
    for extra in ({"tool_choice": "auto"}, {}):
        body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], "tools": tools,
                                                     **extra})
        chat = chat_request(body, "r").chat
        with pytest.raises(RequestError, match="--tool-call-parser") as info:
            tool_choice_of(chat, None, other_constraint=False)
        assert info.value.field == "chat.tool_choice"
        assert tool_choice_of(chat, HERMES, other_constraint=False) == (ToolChoice(parser=HERMES), None)
