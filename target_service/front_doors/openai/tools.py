"""Function tools on chat completions, as vLLM serves them: the body's tools and tool_choice as
tandem.v1 carries them (what they mean, and the constraint: target_service/front_doors/tool_calls.py), and the
calls an answer makes in OpenAI's shape, whole or streamed."""
from __future__ import annotations

import json
from typing import Any

from target_service.front_doors.openai import protocol
from target_service.front_doors.openai.protocol import ChatCompletionRequest, NamedToolChoice, ToolDefinition
from target_service.front_doors.tool_calls import ToolChoice, call_id, parsed_answer
from tandem.v1 import generation_pb2

_DECODER = json.JSONDecoder()


def chat_request(body: ChatCompletionRequest, request_id: str) -> generation_pb2.GenerateRequest:
    """protocol.chat_request, with the tools for the chat template and tool_choice (OpenAI's default:
    `auto` when tools are given)."""
    request = protocol.chat_request(body, request_id)
    request.chat.tools.extend(template_tools(body.tools or []))
    choice = body.tool_choice if body.tool_choice is not None else ("auto" if body.tools else "none")
    if isinstance(choice, NamedToolChoice):
        request.chat.tool_choice.function = choice.function.name
    else:
        request.chat.tool_choice.mode = choice
    request.chat.tool_choice.parallel_tool_calls = body.parallel_tool_calls
    return request


def tool_fields(body: ChatCompletionRequest) -> dict[str, str]:
    """The body's names of the tool fields of tandem.v1's chat, for its errors."""
    return {"chat.tool_choice": "tool_choice",
            **{f"chat.tools[{index}]": f"tools[{index}].function" for index in range(len(body.tools or ()))}}


def template_tools(tools: list[ToolDefinition]) -> list[generation_pb2.Tool]:
    """The tools as tandem.v1 sends them to the chat template."""
    return [generation_pb2.Tool(name=tool.function.name, description=tool.function.description or "",
                                parameters=json.dumps(tool.function.parameters) if tool.function.parameters else "")
            for tool in tools]


def answer_of(choice: ToolChoice, text: str) -> tuple[str | None, list[dict[str, Any]] | None]:
    """A whole answer as the message's content and OpenAI's tool_calls (None: it made none). An answer
    that does not parse (cut short by max_tokens, or calls the parser cannot read) stays content."""
    calls = parsed_answer(choice, text)
    if calls is None:
        return text, None
    content, parsed = calls
    return content, [_call(name, arguments) for name, arguments in parsed] or None


def _call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def _entry(index: int, name: str, arguments: str) -> dict[str, Any]:
    return {"index": index, **_call(name, arguments)}


class CallStream:
    """One streamed choice's answer as OpenAI streams it: content deltas, and tool_calls deltas with a
    call's id, type and name in its first and its arguments after.
    - A named function's arguments stream as they are generated.
    - `required` sends each call once the array holds all of it.
    - `auto` streams content while no call has started, holding back only a tail that may begin one;
      from the first call on it holds the rest, and parses it when the answer ends."""

    def __init__(self, choice: ToolChoice):
        self.choice = choice
        self.text = ""
        self.shown = 0  # auto: the characters sent as content
        self.sent = 0  # calls whose first delta went out

    def feed(self, text: str, last: bool) -> tuple[str, list[dict[str, Any]]]:
        """The content and tool_calls entries of the delta for this much more of the answer; `last`: it ended."""
        self.text += text
        if self.choice.function is not None:
            return self._named(text)
        if self.choice.parser is None:
            return self._required(last)
        return self._auto(last)

    def _named(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        if self.sent == 0:
            self.sent = 1
            return "", [_entry(0, self.choice.function, text)]
        return "", [{"index": 0, "function": {"arguments": text}}] if text else []

    def _required(self, last: bool) -> tuple[str, list[dict[str, Any]]]:
        calls = _complete_calls(self.text)
        new = [_entry(self.sent + i, call["name"], json.dumps(call["parameters"], ensure_ascii=False))
               for i, call in enumerate(calls[self.sent:])]
        self.sent = len(calls)
        return (self.text if last and not self.sent else ""), new  # cut short before a whole call: text

    def _auto(self, last: bool) -> tuple[str, list[dict[str, Any]]]:
        parser = self.choice.parser
        start = parser.start(self.text)
        if start < 0 and last:
            upto = len(self.text)
        else:  # hold back what may begin a call, and the blank before it, which a call's answer drops
            upto = start if start >= 0 else len(self.text) - parser.pending(self.text)
            upto = max(self.shown, len(self.text[:upto].rstrip()))
        content = self.text[self.shown:upto]
        self.shown = start if start >= 0 else upto
        if not last or self.shown == len(self.text):
            return content, []
        parsed = parser.parse(self.text[self.shown:])
        if parsed is None:  # what looked like calls does not parse: it was text
            content += self.text[upto:]
            self.shown = len(self.text)
            return content, []
        self.shown = len(self.text)
        self.sent = len(parsed[1])
        return content, [_entry(i, name, arguments) for i, (name, arguments) in enumerate(parsed[1])]


def _complete_calls(text: str) -> list[dict[str, Any]]:
    """The calls of a JSON array's text so far that are complete."""
    start = text.find("[")
    if start < 0:
        return []
    calls, position = [], start + 1
    while True:
        while position < len(text) and text[position] in " \t\r\n,":
            position += 1
        try:
            call, position = _DECODER.raw_decode(text, position)
        except json.JSONDecodeError:
            return calls
        calls.append(call)
