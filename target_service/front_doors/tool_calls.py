"""Function tools on a chat, for every front door: what `chat.tool_choice` lets the answer be, the
constraint that makes a required or named call always parse, and the calls read back from an answer.

The tools go to the chat template (`ChatMessages.tools`), which shows them to the model. The choice:
- unset or `none`: text, as without tools;
- a named function: that function's arguments, constrained to its parameters' JSON schema;
- `required`: a JSON array of calls, `[{"name": ..., "parameters": {...}}, ...]`, constrained to a
  schema that allows only the tools given (one call when parallel_tool_calls is false);
- `auto`: the model writes text or calls in its own format, which the target's --tool-call-parser
  reads back (tool_parsers.py); without one, `auto` is refused.
The constraints are the structured output the engine already enforces, with speculation on, so a
required or named answer always parses (unless max_tokens cuts it short: then it stays text).
"""
from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jsonschema

from target_service.errors import invalid
from target_service.front_doors.tool_parsers import ParsedCall, ToolParser
from tandem.v1 import generation_pb2, structured_pb2

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a function's name
_MODES = ("none", "auto", "required")


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


def tool_choice_of(chat: generation_pb2.ChatMessages, parser: ToolParser | None,
                   other_constraint: bool) -> tuple[ToolChoice | None, structured_pb2.StructuredOutputs | None]:
    """What the chat's tools and tool_choice ask for (None: text), and the constraint of a required or
    named call; INVALID_ARGUMENT naming the field. other_constraint: the request has structured outputs."""
    _check_tools(chat.tools)
    which = chat.tool_choice.WhichOneof("choice")
    mode = chat.tool_choice.mode if which == "mode" else "function" if which else "none"
    if mode not in _MODES and which == "mode":
        raise invalid("chat.tool_choice.mode", f"{mode!r} is not one of {', '.join(_MODES)}")
    if mode == "none":
        return None, None
    if not chat.tools:
        raise invalid("chat.tool_choice", f"{_shown(chat.tool_choice)} needs tools; give tools or leave tool_choice "
                                          "unset")
    if mode == "auto":
        if parser is None:
            raise invalid("chat.tool_choice", '"auto" (OpenAI\'s default when tools are given) needs the server '
                                              'started with --tool-call-parser; set "required", name a function, '
                                              'or "none"')
        return ToolChoice(parser=parser), None
    if other_constraint:
        raise invalid("chat.tool_choice", f"{_shown(chat.tool_choice)} constrains the output as a structured output "
                                          "(response_format, structured_outputs) would; give one of them, not both")
    if mode == "required":
        parallel = chat.tool_choice.parallel_tool_calls if chat.tool_choice.HasField("parallel_tool_calls") else True
        return ToolChoice(), _required(chat.tools, parallel)
    named = [tool for tool in chat.tools if tool.name == chat.tool_choice.function]
    if not named:
        raise invalid("chat.tool_choice", f"function {chat.tool_choice.function!r} is not among the tools "
                                          f"({', '.join(tool.name for tool in chat.tools)})")
    return ToolChoice(function=named[0].name), structured_pb2.StructuredOutputs(json=json.dumps(_parameters(named[0])))


def _shown(choice: generation_pb2.ToolChoice) -> str:
    """The choice as OpenAI's JSON writes it, for a message."""
    if choice.WhichOneof("choice") == "function":
        return json.dumps({"type": "function", "function": {"name": choice.function}})
    return json.dumps(choice.mode)


def _check_tools(tools: Sequence[generation_pb2.Tool]) -> None:
    seen = set()
    for index, tool in enumerate(tools):
        if not _NAME.fullmatch(tool.name):
            raise invalid(f"chat.tools[{index}].name", f"{tool.name!r} must be 1 to 64 letters, digits, underscores "
                                                       "or dashes")
        if tool.name in seen:
            raise invalid(f"chat.tools[{index}].name", f"{tool.name!r} is given twice")
        seen.add(tool.name)
        _check_schema(tool, f"chat.tools[{index}].parameters")


def _check_schema(tool: generation_pb2.Tool, field: str) -> None:
    try:
        schema = json.loads(tool.parameters) if tool.parameters else {}
    except json.JSONDecodeError as err:
        raise invalid(field, f"is not JSON: {err}") from None
    if not isinstance(schema, dict):
        raise invalid(field, "must be a JSON schema object")
    if not isinstance(schema.get("$schema", ""), str):
        raise invalid(f"{field}.$schema", "must be the URI of a JSON schema dialect")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as err:
        raise invalid(field, f"is not a valid JSON schema: {err.message}") from None


def _parameters(tool: generation_pb2.Tool) -> dict[str, Any]:
    return json.loads(tool.parameters) if tool.parameters else {"type": "object", "properties": {}}


def _required(tools: Sequence[generation_pb2.Tool], parallel: bool) -> structured_pb2.StructuredOutputs:
    """The JSON schema of an array of calls of the tools."""
    calls = {"anyOf": [{"type": "object", "properties": {"name": {"const": tool.name}, "parameters": _parameters(tool)},
                        "required": ["name", "parameters"], "additionalProperties": False}
                       for tool in tools]}
    schema = {"type": "array", "items": calls, "minItems": 1, **({} if parallel else {"maxItems": 1})}
    return structured_pb2.StructuredOutputs(json=json.dumps(schema))


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parsed_answer(choice: ToolChoice, text: str) -> tuple[str | None, list[ParsedCall]] | None:
    """A whole answer's content (None: none) and calls; None when it does not parse (cut short by
    max_tokens, or calls the parser cannot read): then it is text."""
    if choice.parser is not None:
        return choice.parser.parse(text)
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    if choice.function is not None:
        return None, [(choice.function, text)]
    return None, [(call["name"], json.dumps(call["parameters"], ensure_ascii=False)) for call in value]
