"""Responses API request bodies, and their translation into chat completion requests.

Input items are checked one by one, so that an error names the item (`input[2].call_id`):
- a message (`type` may be left out): `user`, `system`, `developer` (a system message to this
  model's template) or `assistant`, its content a string or `input_text` / `output_text` parts;
- `function_call`: a call an earlier answer made, joined to the assistant message before it;
- `function_call_output`: its result, a `tool` message.
`instructions` go first as a system message, and are not carried to a response that continues
this one (as OpenAI's API does).
"""
from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field, StringConstraints
from typing_extensions import Annotated

from tandem_kernels.logprobs import MAX_LOGPROBS
from target_service.errors import renamed_field
from target_service.front_doors.openai import protocol
from target_service.front_doors.openai.protocol import (INT64_MAX, INT64_MIN, UINT32_MAX, ChatCompletionRequest, ChatMessage,
                                                ProtocolError, StrictBody)

LOGPROBS_INCLUDE = "message.output_text.logprobs"  # the `include` entry that asks for the answer's logprobs
# Where a chat request's field names what a responses request calls otherwise.
RESPONSES_FIELDS = {"messages": "input", "input": "input", "chat.messages": "input", "chat": "input",
                    "chat.tools": "tools", "chat.tool_choice": "tool_choice",
                    "max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
                    "response_format": "text.format", "structured_outputs": "text.format"}

Item = dict[str, Any]  # an input or output item, as JSON


class ContentPart(StrictBody):
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None  # an output_text's, sent back as it came
    logprobs: list[Any] | None = None


class MessageItem(StrictBody):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]
    id: str | None = None
    status: str | None = None


CallId = Annotated[str, StringConstraints(min_length=1)]


class FunctionCallItem(StrictBody):
    type: Literal["function_call"]
    call_id: CallId
    name: str
    arguments: str  # JSON text
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(StrictBody):
    type: Literal["function_call_output"]
    call_id: CallId
    output: str | list[ContentPart]
    id: str | None = None
    status: str | None = None


_ITEMS = {"message": MessageItem, "function_call": FunctionCallItem, "function_call_output": FunctionCallOutputItem}
ParsedItem = MessageItem | FunctionCallItem | FunctionCallOutputItem


class FunctionTool(StrictBody):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(StrictBody):
    type: Literal["function"]
    name: str


class TextFormat(StrictBody):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(StrictBody):
    format: TextFormat | None = None
    verbosity: Any = None  # unserved: the model has one voice


class ResponsesStreamOptions(StrictBody):
    include_obfuscation: Any = None  # unserved: no padding of events


class ResponsesRequest(StrictBody):
    model: str | None = None
    input: str | list[Item]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    stream_options: ResponsesStreamOptions | None = None
    max_output_tokens: int | None = Field(default=None, ge=1, le=UINT32_MAX)
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    include: list[str] | None = None
    tools: list[Item] | None = None  # function tools, checked one by one
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    # OpenAI's bounds: 16 pairs, keys to 64 characters, values to 512
    metadata: dict[Annotated[str, StringConstraints(max_length=64)],
                   Annotated[str, StringConstraints(max_length=512)]] | None = Field(default=None, max_length=16)
    user: str | None = None  # these three change no output
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: Literal["auto", "default"] | None = None
    truncation: Literal["disabled", "auto"] | None = None
    reasoning: Any = None
    background: Any = None
    max_tool_calls: Any = None
    # vLLM's sampling extensions, and Tandem's
    top_k: int | None = Field(default=None, ge=-1, le=UINT32_MAX)
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    request_id: str | None = None
    speculate: bool | None = None
    num_speculative_tokens: int | None = Field(default=None, ge=0, le=UINT32_MAX)
    drafter_invariant: bool = False

    @property
    def logprobs(self) -> bool:
        return bool(self.top_logprobs) or LOGPROBS_INCLUDE in (self.include or ())


_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
             "seed", "speculate", "num_speculative_tokens", "drafter_invariant", "top_logprobs")


def check(body: ResponsesRequest) -> None:
    """What parsing leaves to check: fields not served, and what stream_options and include ask."""
    protocol.check_unserved(body)
    for where, part in (("text.", body.text), ("stream_options.", body.stream_options)):
        if part is not None:
            protocol.check_unserved(part, where)
    if body.stream_options is not None and not body.stream:
        raise ProtocolError("stream_options", "is only allowed when stream is true")
    for entry in body.include or ():
        if entry != LOGPROBS_INCLUDE:
            raise ProtocolError("include", f"{entry!r} is not served; this server includes only {LOGPROBS_INCLUDE!r}",
                                code="unsupported_parameter")


def input_items(body: ResponsesRequest) -> list[ParsedItem]:
    """The request's input as items, each checked: a string is one user message."""
    if isinstance(body.input, str):
        return [MessageItem(role="user", content=body.input)]
    return [_parse_item(item, f"input[{index}]") for index, item in enumerate(body.input)]


def kept(inputs: list[ParsedItem], output: list[Item]) -> list[ParsedItem]:
    """A response's input and output items as a later response's history takes them: their text alone."""
    return [_compact(item) for item in (*inputs, *(_parse_item(item, "output") for item in output))]


def _compact(item: ParsedItem) -> ParsedItem:
    """The item without what never reaches the prompt: ids, statuses, annotations, logprobs."""
    if isinstance(item, MessageItem):
        return MessageItem(role=item.role, content=_text(item.content))
    if isinstance(item, FunctionCallOutputItem):
        return FunctionCallOutputItem(type=item.type, call_id=item.call_id, output=_text(item.output))
    return FunctionCallItem(type=item.type, call_id=item.call_id, name=item.name, arguments=item.arguments)


def _parse_item(item: Item, where: str) -> ParsedItem:
    kind = item.get("type", "message")
    model = _ITEMS.get(kind) if isinstance(kind, str) else None
    if model is None:
        raise ProtocolError(f"{where}.type", f"{json.dumps(kind)} items are not supported; give "
                                             f"{', '.join(_ITEMS)} items", code="unsupported_parameter")
    return protocol.parse_value(model, item, where)


def chat_request(body: ResponsesRequest, history: list[ParsedItem], items: list[ParsedItem]) -> ChatCompletionRequest:
    """The chat completion that answers: instructions, the history of the response continued, the input."""
    if not history and not items:
        raise ProtocolError("input", "is empty: give a string, or at least one item")
    messages = [ChatMessage(role="system", content=body.instructions)] if body.instructions is not None else []
    messages += messages_of(history + items)
    fields: dict[str, Any] = {name: getattr(body, name) for name in _SAMPLING if getattr(body, name) is not None}
    fields.update(messages=messages, max_completion_tokens=body.max_output_tokens, logprobs=body.logprobs or None,
                  tools=[_chat_tool(tool, f"tools[{index}]") for index, tool in enumerate(body.tools or ())] or None,
                  tool_choice=_chat_tool_choice(body.tool_choice), parallel_tool_calls=body.parallel_tool_calls,
                  response_format=_response_format(body.text))
    if body.logprobs and body.tools and body.tool_choice != "none":
        raise ProtocolError("top_logprobs" if body.top_logprobs else "include", "logprobs are served for text "
                            "answers only; leave them unset when tools may be called, or set tool_choice none")
    given = {key: value for key, value in fields.items() if value is not None}
    return protocol.parse_value(ChatCompletionRequest, given, "")


def messages_of(items: list[ParsedItem]) -> list[ChatMessage]:
    """Items as chat messages: consecutive calls join the assistant message before them."""
    messages: list[ChatMessage] = []
    for item in items:
        if isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            messages.append(ChatMessage(role=role, content=_text(item.content)))
        elif isinstance(item, FunctionCallOutputItem):
            messages.append(ChatMessage(role="tool", content=_text(item.output), tool_call_id=item.call_id))
        else:
            call = protocol.ToolCall(id=item.call_id, function=protocol.FunctionCall(name=item.name,
                                                                                      arguments=item.arguments))
            if not messages or messages[-1].role != "assistant":
                messages.append(ChatMessage(role="assistant", content=None))
            messages[-1].tool_calls = [*(messages[-1].tool_calls or ()), call]
    return messages


def _text(content: str | list[ContentPart]) -> str:
    """Parts joined by newlines, as chat completions join text parts."""
    return content if isinstance(content, str) else "\n".join(part.text for part in content)


def _chat_tool(tool: Item, where: str) -> dict[str, Any]:
    kind = tool.get("type")
    if kind != "function":
        raise ProtocolError(f"{where}.type", f"{json.dumps(kind)} tools are not supported; this server calls "
                                             "function tools",
                            code="unsupported_parameter")
    function = protocol.parse_value(FunctionTool, tool, where).model_dump(exclude={"type"}, exclude_none=True)
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: str | NamedFunction | None) -> Any:
    if isinstance(choice, NamedFunction):
        return {"type": "function", "function": {"name": choice.name}}
    return choice


def _response_format(text: TextConfig | None) -> dict[str, Any] | None:
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.name is None:
        raise ProtocolError("text.format.name", "is required when type is json_schema")
    schema = {"name": fmt.name, "schema": fmt.schema_ if fmt.schema_ is not None else True,
              "description": fmt.description, "strict": fmt.strict}
    return {"type": "json_schema", "json_schema": {key: value for key, value in schema.items() if value is not None}}


def renamed_error(err: ProtocolError) -> ProtocolError:
    """A chat request's error named as the responses request names the field."""
    param = renamed_field(err.param or "", RESPONSES_FIELDS)
    if param.startswith("tools[") and ".function." in param:
        param = param.replace(".function.", ".", 1)
    if param == err.param:
        return err
    problem = str(err).removeprefix(f"{err.param}: ")
    return ProtocolError(param, problem, err.code)
