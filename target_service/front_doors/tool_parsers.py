"""Tool-call parsers for tool_choice `auto` (the target's --tool-call-parser, vLLM's names): how a
model writes calls among its text, read back into calls (tool_calls.py).

- `hermes`: each call a JSON object {"name": ..., "arguments": {...}} between <tool_call> and
  </tool_call> (Hermes, Qwen, and the shipped smollm2_tool_use template); text before the first
  call, less trailing blanks, is the message's content.
- `llama3_json`: the whole answer one JSON object {"name": ..., "parameters": {...}} (or several,
  separated by `;`), as Llama 3.1's JSON tool calling writes it; an answer that does not start with
  `{` is content.

A parser also says where calls start in a partial answer, and how much of its tail could still be
the start of a call, so that a stream sends content at once and holds back only what may be a call.
"""
from __future__ import annotations

import json
import re
from typing import Any, Protocol

ParsedCall = tuple[str, str]  # (function name, arguments as JSON text)


class ToolParser(Protocol):
    name: str

    def start(self, text: str) -> int:
        """Where the first call starts in `text` (a partial answer); -1 while none has."""

    def pending(self, text: str) -> int:
        """How many characters at the end of `text`, which has no call yet, could begin one (the blank
        before a call, which its answer drops, is held back besides)."""

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]] | None:
        """A whole answer's content (None: none) and calls; None when what looks like calls does not parse."""


class HermesParser:
    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    _BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def start(self, text: str) -> int:
        return text.find(self.OPEN)

    def pending(self, text: str) -> int:
        return next((n for n in range(min(len(text), len(self.OPEN) - 1), 0, -1) if self.OPEN.startswith(text[-n:])),
                    0)

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]] | None:
        at = self.start(text)
        if at < 0:
            return text, []
        calls = []
        for block in self._BLOCK.findall(text[at:]):
            call = _json_call(block, "arguments")
            if call is None:
                return None
            calls.append(call)
        return text[:at].rstrip() or None, calls


class Llama3JsonParser:
    name = "llama3_json"

    def start(self, text: str) -> int:
        stripped = text.lstrip()
        return len(text) - len(stripped) if stripped.startswith("{") else -1

    def pending(self, text: str) -> int:
        return 0  # the first character that is not blank decides

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]] | None:
        if self.start(text) < 0:
            return text, []
        calls = [_json_call(part, "parameters", "arguments") for part in text.split(";") if part.strip()]
        return None if any(call is None for call in calls) else (None, calls)


def _json_call(text: str, *argument_keys: str) -> ParsedCall | None:
    """{"name": ..., key: {...}} as (name, arguments JSON); None when it is not one."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments: Any = next((value[key] for key in argument_keys if key in value), {})
    return value["name"], arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


TOOL_PARSERS: dict[str, ToolParser] = {parser.name: parser for parser in (HermesParser(), Llama3JsonParser())}
