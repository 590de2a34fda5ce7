"""OpenAI request bodies, as vLLM takes them, translated into the engine's GenerateRequest.

The models declare every field a request may carry: OpenAI's names and vLLM's extensions side by
side, and Tandem's own (`speculate`, `num_speculative_tokens`, `drafter_invariant`), the way vLLM
takes its extensions. A field nobody declared is refused (OpenAI's own API does the same); a field
declared but not served yet (functions, best_of) is taken only at the
value that turns it off. Value ranges are the engine's to check (validation.py), once for every
front door.
"""
from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tandem_kernels.logprobs import MAX_LOGPROBS
from target_service.front_doors.validation import UINT64_MASK
from tandem.v1 import generation_pb2, structured_pb2

UINT32_MAX = 2**32 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's and vLLM's default for /v1/completions


class ProtocolError(ValueError):
    """A request body we cannot translate; `param` names the field to fix (None: the body itself)."""

    def __init__(self, param: str | None, problem: str, code: str = "invalid_value"):
        super().__init__(f"{param}: {problem}" if param else problem)
        self.param = param
        self.code = code


class StrictBody(BaseModel):
    # strict: "0.5" is not a number and 1 is not a boolean, as in OpenAI's API.
    model_config = ConfigDict(extra="forbid", strict=True)


class TextPart(StrictBody):
    model_config = ConfigDict(extra="allow", strict=True)  # another part type carries other fields
    type: str
    text: str | None = None


class FunctionCall(StrictBody):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCall(StrictBody):
    """A call an assistant message in the history made."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(StrictBody):
    role: str
    content: str | list[TextPart] | None = None
    name: Any = None  # a participant's name: refused (chat_messages), the chat template has no place for it
    tool_calls: list[ToolCall] | None = None  # an assistant message's
    tool_call_id: str | None = None  # a tool message's: the call it answers


class FunctionDefinition(StrictBody):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None  # taken: a call that tool_choice asks for always follows the schema


class ToolDefinition(StrictBody):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(StrictBody):
    name: str


class NamedToolChoice(StrictBody):
    type: Literal["function"]
    function: FunctionName


class StreamOptions(StrictBody):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(StrictBody):
    name: str
    schema_: dict[str, Any] | bool = Field(default=True, alias="schema")  # `schema` would shadow BaseModel's
    description: str | None = None
    strict: bool | None = None


class ResponseFormat(StrictBody):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsParams(StrictBody):
    """vLLM's `structured_outputs`: one constraint. Its other options are refused (see UNSERVED)."""

    json_: str | dict[str, Any] | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    structural_tag: Any = None
    whitespace_pattern: Any = None
    disable_additional_properties: Any = None
    disable_fallback: Any = None


class _Request(StrictBody):
    """What both endpoints take."""

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1, le=UINT32_MAX)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = Field(default=None, ge=-1, le=UINT32_MAX)
    min_p: float | None = None
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    min_tokens: int = Field(default=0, ge=0, le=UINT32_MAX)
    include_stop_str_in_output: bool = False
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # token ids as strings, OpenAI's JSON shape
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = None
    request_id: str | None = None
    user: str | None = None  # OpenAI's end-user id, for abuse tracking; it changes no output
    # Tandem's extensions
    speculate: bool | None = None
    num_speculative_tokens: int | None = Field(default=None, ge=0, le=UINT32_MAX)
    drafter_invariant: bool = False
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)  # vLLM's; not with stream
    n: int | None = Field(default=None, ge=1, le=UINT32_MAX)  # samples, each its own choice


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=UINT32_MAX)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    functions: Any = None
    function_call: Any = None
    add_generation_prompt: Any = None
    continue_final_message: Any = None
    add_special_tokens: Any = None
    chat_template: Any = None
    chat_template_kwargs: Any = None


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=None, ge=0, le=UINT32_MAX)  # 0 only with echo: score the prompt
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False  # the prompt before the completion, with its tokens' logprobs when logprobs is set
    best_of: Any = None
    suffix: Any = None


class TokenizeRequest(StrictBody):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # prompts: true unless false, as vLLM; messages: false only
    add_generation_prompt: Literal[True] = True  # messages are tokenized as chat completions take them
    return_token_strs: bool = False


class DetokenizeRequest(StrictBody):
    model: str | None = None
    tokens: list[int]


# The value of each unserved field that asks for nothing; `None` (unset) always does too.
UNSERVED: dict[str, tuple[Any, ...]] = {
    "functions": (), "function_call": ("none",), "add_generation_prompt": (True,),
    "continue_final_message": (False,), "add_special_tokens": (False,), "chat_template": (),
    "chat_template_kwargs": ({},), "best_of": (1,), "suffix": (),
    "structural_tag": (), "whitespace_pattern": (), "disable_additional_properties": (False,),
    "disable_fallback": (False,),
    # the Responses API's (responses/protocol.py)
    "reasoning": ({}, {"effort": None, "summary": None}), "background": (False,), "max_tool_calls": (),
    "verbosity": ("medium",),
    "include_obfuscation": (False,), "truncation": ("disabled",),
}


def check_unserved(body: BaseModel, prefix: str = "") -> None:
    """A ProtocolError for the first field of UNSERVED that asks for something."""
    for name, neutral in UNSERVED.items():
        if name not in type(body).model_fields:
            continue
        value = getattr(body, name)
        if value is None or any(type(value) is type(n) and value == n for n in neutral):
            continue
        shown = json.dumps(value) if _jsonable(value) else repr(value)
        raise ProtocolError(f"{prefix}{name}", f"{shown} is not supported yet"
                            + (f"; leave it unset or {json.dumps(neutral[0])}" if neutral else "; leave it unset"),
                            code="unsupported_parameter")


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
        return True
    except (TypeError, ValueError):
        return False


def parse_body(model: type[BaseModel], body: bytes) -> Any:
    """The body as `model`, or a ProtocolError naming the first field at fault."""
    try:
        parsed = model.model_validate_json(body)
    except ValidationError as err:
        raise _protocol_error(err) from None
    if not isinstance(parsed, _Request):  # /tokenize and /detokenize declare only what they serve
        return parsed
    check_unserved(parsed)
    if parsed.structured_outputs is not None:
        check_unserved(parsed.structured_outputs, "structured_outputs.")
    if parsed.stream_options is not None and not parsed.stream:
        raise ProtocolError("stream_options", "is only allowed when stream is true")
    if parsed.stream and parsed.prompt_logprobs:  # vLLM's rule: a chunk has no place for them
        raise ProtocolError("prompt_logprobs", "is not available when stream is true; leave it unset or 0")
    return parsed


def parse_value(model: type[BaseModel], value: Any, where: str) -> Any:
    """A part of a body (already JSON) as `model`, or a ProtocolError naming the field under `where`."""
    try:
        return model.model_validate(value)
    except ValidationError as err:
        raise _protocol_error(err, where) from None


def _protocol_error(err: ValidationError, where: str = "") -> ProtocolError:
    first = err.errors(include_url=False)[0]
    if first["type"] == "json_invalid":
        return ProtocolError(None, f"the body is not valid JSON: {first['msg'].removeprefix('Invalid JSON: ')}")
    param = _param_of(first["loc"])
    param = f"{where}.{param}" if where and param else where or param
    if first["type"] == "extra_forbidden":
        return ProtocolError(param, "is not a parameter this server takes", code="unknown_parameter")
    if not param:
        return ProtocolError(None, f"the body must be a JSON object: {first['msg']}")
    return ProtocolError(param, first["msg"])


def _param_of(loc: tuple[Any, ...]) -> str:
    """`messages[0].content` from pydantic's ('messages', 0, 'content'), union branch names dropped."""
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        elif "[" in item or item in ("str", "int", "bool", "float", "dict", "list"):
            continue  # pydantic names the union member it tried: `list[int]`, `str`
        else:
            parts.append(("." if parts else "") + item)
    return "".join(parts)


# ---- translation into the engine's request ------------------------------------------------------

def sampling_params(body: _Request, max_tokens: int | None) -> generation_pb2.SamplingParams:
    params = generation_pb2.SamplingParams(
        top_k=0 if body.top_k in (None, -1) else body.top_k,
        stop=[body.stop] if isinstance(body.stop, str) else list(body.stop or []),
        stop_token_ids=_token_ids("stop_token_ids", body.stop_token_ids or []),
        ignore_eos=body.ignore_eos,
        skip_special_tokens=body.skip_special_tokens,
        drafter_invariant=body.drafter_invariant,
        min_tokens=body.min_tokens,
        include_stop_str_in_output=body.include_stop_str_in_output,
        logit_bias=_logit_bias(body.logit_bias or {}),
        allowed_token_ids=_token_ids("allowed_token_ids", body.allowed_token_ids or []),
        bad_words=body.bad_words or [],
    )
    for name in ("temperature", "top_p", "min_p", "speculate", "num_speculative_tokens", "presence_penalty",
                 "frequency_penalty", "repetition_penalty"):
        value = getattr(body, name)
        if value is not None:
            setattr(params, name, value)
    if body.seed is not None:
        params.seed = body.seed & UINT64_MASK
    if body.n is not None:
        params.n = body.n
    if body.prompt_logprobs is not None and not body.stream:
        params.prompt_logprobs = body.prompt_logprobs
    if max_tokens is not None:
        params.max_tokens = max_tokens
    constraint = _constraint(body)
    if constraint is not None:
        params.structured_outputs.CopyFrom(constraint)
    return params


def _logit_bias(bias: dict[str, float]) -> dict[int, float]:
    """OpenAI's {"token id": bias} with the ids as numbers."""
    ids = {}
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit()) or int(key) > UINT32_MAX:
            raise ProtocolError("logit_bias", f"key {key!r} is not a token id")
        ids[int(key)] = value
    return ids


def _token_ids(param: str, ids: list[int]) -> list[int]:
    bad = [i for i in ids if not 0 <= i <= UINT32_MAX]
    if bad:
        raise ProtocolError(param, f"id {bad[0]} is not a token id")
    return ids


def _constraint(body: _Request) -> structured_pb2.StructuredOutputs | None:
    if body.response_format is not None and body.structured_outputs is not None:
        raise ProtocolError("response_format", "give response_format or structured_outputs, not both")
    if body.response_format is not None:
        return _response_format(body.response_format)
    if body.structured_outputs is not None:
        return _structured_outputs(body.structured_outputs)
    return None


def _response_format(fmt: ResponseFormat) -> structured_pb2.StructuredOutputs | None:
    if fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return structured_pb2.StructuredOutputs(json_object=True)
    if fmt.json_schema is None:
        raise ProtocolError("response_format.json_schema", "is required when type is json_schema")
    schema = fmt.json_schema.schema_
    return structured_pb2.StructuredOutputs(json=json.dumps(schema if schema is not True else {}))


def _structured_outputs(so: StructuredOutputsParams) -> structured_pb2.StructuredOutputs:
    kinds = {"json": so.json_, "regex": so.regex, "choice": so.choice, "grammar": so.grammar,
             "json_object": so.json_object or None}
    given = [kind for kind, value in kinds.items() if value is not None]
    if len(given) != 1:
        raise ProtocolError("structured_outputs", f"set exactly one of {', '.join(kinds)}; got "
                            + (", ".join(given) if given else "none"))
    kind = given[0]
    compact = so.disable_any_whitespace
    if kind == "json":
        spec = so.json_ if isinstance(so.json_, str) else json.dumps(so.json_)
        return structured_pb2.StructuredOutputs(json=spec, disable_any_whitespace=compact)
    if kind == "choice":
        return structured_pb2.StructuredOutputs(choice=structured_pb2.Choices(choices=so.choice),
                                                disable_any_whitespace=compact)
    if kind == "json_object":
        return structured_pb2.StructuredOutputs(json_object=True, disable_any_whitespace=compact)
    return structured_pb2.StructuredOutputs(**{kind: kinds[kind]}, disable_any_whitespace=compact)


def chat_messages(messages: list[ChatMessage], param: str = "messages") -> generation_pb2.ChatMessages:
    """Text content as the chat template takes it: a list of text parts joined by newlines."""
    out = []
    for index, message in enumerate(messages):
        if message.name is not None:
            raise ProtocolError(f"{param}[{index}].name", "is not supported yet: the chat template has no place "
                                                         "for a participant's name; leave it unset",
                                code="unsupported_parameter")
        content = message.content
        if isinstance(content, list):
            texts = []
            for part_index, part in enumerate(content):
                where = f"{param}[{index}].content[{part_index}]"
                if part.type != "text":
                    raise ProtocolError(f"{where}.type", f"{part.type!r} parts are not supported; this model "
                                                        "takes text parts only")
                if part.text is None:
                    raise ProtocolError(f"{where}.text", "is required in a text part")
                texts.append(part.text)
            content = "\n".join(texts)
        out.append(generation_pb2.ChatMessage(role=message.role, content=content or "",
                                              tool_calls=_tool_calls(message, f"{param}[{index}]"),
                                              tool_call_id=_tool_call_id(message, f"{param}[{index}]")))
    return generation_pb2.ChatMessages(messages=out)


def _tool_calls(message: ChatMessage, where: str) -> list[generation_pb2.ToolCall]:
    if message.tool_calls and message.role != "assistant":
        raise ProtocolError(f"{where}.tool_calls", f"only an assistant message makes calls, not a {message.role!r} one")
    return [generation_pb2.ToolCall(id=call.id, name=call.function.name, arguments=call.function.arguments)
            for call in message.tool_calls or ()]


def _tool_call_id(message: ChatMessage, where: str) -> str:
    if message.role == "tool" and not message.tool_call_id:
        raise ProtocolError(f"{where}.tool_call_id", "is required in a tool message: the id of the call it answers")
    return message.tool_call_id or "" if message.role == "tool" else ""


def chat_request(body: ChatCompletionRequest, request_id: str) -> generation_pb2.GenerateRequest:
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    request = generation_pb2.GenerateRequest(
        request_id=request_id,
        chat=chat_messages(body.messages),
        sampling_params=sampling_params(body, max_tokens),
    )

    if body.top_logprobs and not body.logprobs:
        raise ProtocolError("top_logprobs", "needs logprobs: true")
    if body.logprobs:
        request.sampling_params.logprobs = body.top_logprobs or 0
    return request


def completion_requests(body: CompletionRequest, request_id: str) -> list[generation_pb2.GenerateRequest]:
    """One engine request per prompt of the body, as vLLM serves a batch: prompt p's request is the one
    that prompt alone would make, its id suffixed -p when the batch has more than one."""
    max_tokens = body.max_tokens if body.max_tokens is not None else COMPLETION_DEFAULT_MAX_TOKENS
    if max_tokens == 0 and not body.echo:
        raise ProtocolError("max_tokens", "must be at least 1; 0 is only allowed with echo: true, which returns "
                                          "the prompt alone (to score it, with logprobs)")
    # echo with max_tokens 0: the engine samples one token, which the response leaves out (as vLLM does)
    params = sampling_params(body, max(max_tokens, 1))
    if body.logprobs is not None:
        params.logprobs = body.logprobs
        if body.echo and not params.HasField("prompt_logprobs"):
            params.prompt_logprobs = body.logprobs  # an echoed prompt shows its tokens' logprobs too
    prompts = completion_prompts(body)
    requests = []
    for p, prompt in enumerate(prompts):
        request = generation_pb2.GenerateRequest(request_id=request_id if len(prompts) == 1 else f"{request_id}-{p}",
                                                 sampling_params=params)
        if isinstance(prompt, str):
            request.prompt = prompt
        else:
            request.prompt_token_ids.ids.extend(_token_ids(f"prompt[{p}]" if len(prompts) > 1 else "prompt", prompt))
        requests.append(request)
    return requests


def completion_prompts(body: CompletionRequest) -> list[str | list[int]]:
    """The prompts of a body: a text or a list of token ids is one; a list of them is a batch."""
    prompt = body.prompt
    if isinstance(prompt, list) and not prompt:
        raise ProtocolError("prompt", "is empty; give a text, a list of token ids, or a list of either (a batch)")
    if isinstance(prompt, list) and isinstance(prompt[0], (str, list)):
        return prompt
    return [prompt]
