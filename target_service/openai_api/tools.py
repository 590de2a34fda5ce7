"""Function tools on chat completions, as vLLM serves them.

The tools go to the chat template (tandem.v1's `ChatMessages.tools`), which shows them to the model.
`tool_choice` decides what the answer is:
- `none`: text, as without tools;
- a named function: that function's arguments, constrained to its parameters' JSON schema;
- `required`: a JSON array of calls, `[{"name": ..., "parameters": {...}}, ...]`, constrained to a
  schema that allows only the tools given (one call when `parallel_tool_calls` is false).
- `auto` (the default with tools): the model writes text or calls in its own format, which the
  target's --tool-call-parser reads back (tool_parsers.py); without one, `auto` is refused.
The constraints are the structured output the engine already enforces, with speculation on, so a
required or named answer always parses (unless max_tokens cuts it short: then it stays text).
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

import jsonschema

from target_service.openai_api import protocol
from target_service.openai_api.protocol import ChatCompletionRequest, ProtocolError, ToolDefinition
from target_service.openai_api.tool_parsers import ParsedCall, ToolParser
from tandem.v1 import generation_pb2, structured_pb2

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a function's name
_DECODER = json.JSONDecoder()


@dataclass(frozen=True, slots=True)
class ToolChoice:
    """A chat whose answer may call: the one function named, any of the tools (`required`), or
    (`auto`) text or calls as the model writes them, which `parser` reads."""

    function: str | None = None  # the function named
    parser: ToolParser | None = None  # `auto`'s; neither: `required`

    @property
    def finish_reason(self) -> str:
        """OpenAI's for an answer that called: `stop` when the request named the function, else `tool_calls`."""
        return "stop" if self.function is not None else "tool_calls"

    @property
    def constrained(self) -> bool:
        return self.parser is None


def chat_request(body: ChatCompletionRequest, request_id: str,
                 choice: ToolChoice | None) -> generation_pb2.GenerateRequest:
    """protocol.chat_request, with the tools for the chat template and the constraint of `choice`
    (tool_choice(body), computed once per request)."""
    request = protocol.chat_request(body, request_id)
    request.chat.tools.extend(template_tools(body.tools or []))
    if choice is not None and choice.constrained:
        request.sampling_params.structured_outputs.CopyFrom(constraint(choice, body.tools, body.parallel_tool_calls))
    return request


def tool_choice(body: ChatCompletionRequest, parser: ToolParser | None = None) -> ToolChoice | None:
    """What the request's tools and tool_choice ask for; None for text. Raises ProtocolError naming the field."""
    tools = body.tools or []
    _check_tools(tools)
    choice = body.tool_choice if body.tool_choice is not None else ("auto" if tools else "none")
    if choice == "none":
        return None
    if not tools:
        raise ProtocolError("tool_choice", f"{json.dumps(_shown(choice))} needs tools; give tools or leave it unset")
    if choice == "auto":
        if parser is None:
            raise ProtocolError("tool_choice", '"auto" (the default when tools are given) needs the server started '
                                               'with --tool-call-parser; set "required", name a function, or "none"',
                                code="unsupported_parameter")
        return ToolChoice(parser=parser)
    if body.response_format is not None or body.structured_outputs is not None:
        raise ProtocolError("tool_choice", "constrains the output as response_format or structured_outputs would; "
                                           "give one of them, not both")
    if choice == "required":
        return ToolChoice()
    names = [tool.function.name for tool in tools]
    if choice.function.name not in names:
        raise ProtocolError("tool_choice", f"function {choice.function.name!r} is not among the tools "
                                           f"({', '.join(names)})")
    return ToolChoice(function=choice.function.name)


def _shown(choice: Any) -> Any:
    return choice if isinstance(choice, str) else choice.model_dump()


def _check_tools(tools: list[ToolDefinition]) -> None:
    seen = set()
    for index, tool in enumerate(tools):
        name = tool.function.name
        if not _NAME.fullmatch(name):
            raise ProtocolError(f"tools[{index}].function.name", f"{name!r} must be 1 to 64 letters, digits, "
                                                                 "underscores or dashes")
        if name in seen:
            raise ProtocolError(f"tools[{index}].function.name", f"{name!r} is given twice")
        seen.add(name)
        _check_schema(tool.function.parameters or {}, f"tools[{index}].function.parameters")


def _check_schema(schema: dict[str, Any], param: str) -> None:
    if not isinstance(schema.get("$schema", ""), str):
        raise ProtocolError(f"{param}.$schema", "must be the URI of a JSON schema dialect")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as err:
        raise ProtocolError(param, f"is not a valid JSON schema: {err.message}") from None


def template_tools(tools: list[ToolDefinition]) -> list[generation_pb2.Tool]:
    """The tools as tandem.v1 sends them to the chat template."""
    return [generation_pb2.Tool(name=tool.function.name, description=tool.function.description or "",
                                parameters=json.dumps(tool.function.parameters) if tool.function.parameters else "")
            for tool in tools]


def constraint(choice: ToolChoice, tools: list[ToolDefinition], parallel: bool) -> structured_pb2.StructuredOutputs:
    """The JSON schema the answer follows: the named function's parameters, or an array of calls of the tools."""
    if choice.function is not None:
        [tool] = [tool for tool in tools if tool.function.name == choice.function]
        return structured_pb2.StructuredOutputs(json=json.dumps(_parameters(tool)))
    calls = {"anyOf": [{"type": "object", "properties": {"name": {"const": tool.function.name},
                                                         "parameters": _parameters(tool)},
                        "required": ["name", "parameters"], "additionalProperties": False}
                       for tool in tools]}
    schema = {"type": "array", "items": calls, "minItems": 1, **({} if parallel else {"maxItems": 1})}
    return structured_pb2.StructuredOutputs(json=json.dumps(schema))


def _parameters(tool: ToolDefinition) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object", "properties": {}}


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def answer_of(choice: ToolChoice, text: str) -> tuple[str | None, list[dict[str, Any]] | None]:
    """A whole answer as the message's content and OpenAI's tool_calls (None: it made none). An answer
    that does not parse (cut short by max_tokens, or calls the parser cannot read) stays content."""
    calls = _calls(choice, text)
    if calls is None:
        return text, None
    content, parsed = calls
    return content, [_call(name, arguments) for name, arguments in parsed] or None


def _calls(choice: ToolChoice, text: str) -> tuple[str | None, list[ParsedCall]] | None:
    if choice.parser is not None:
        return choice.parser.parse(text)
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    if choice.function is not None:
        return None, [(choice.function, text)]
    return None, [(call["name"], json.dumps(call["parameters"], ensure_ascii=False)) for call in value]


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
