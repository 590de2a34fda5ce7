"""A GenerateRequest, checked field by field: prompt ids and RequestOptions, or INVALID_ARGUMENT."""
from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import grpc
from google.protobuf.message import DecodeError, Message

from tandem_kernels.logprobs import MAX_LOGPROBS
from tandem_kernels.random import fresh_seed
from tandem_kernels.sampling import Sampling
from target_service.config import TargetConfig
from target_service.errors import RequestError, invalid
from target_service.front_doors.tool_calls import ToolChoice, tool_choice_of
from target_service.front_doors.tool_parsers import TOOL_PARSERS
from target_service.sequence import RequestOptions
from tandem.structured import Constraint, ConstraintError
from tandem.tokenizer import Tokenizer, TokenizerError
from tandem.v1 import generation_pb2

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_SPECULATIVE_TOKENS = 16
MAX_BAD_WORDS = 128
_SEED_MASK = (1 << 63) - 1  # seeds travel as uint64; the kernels key on non-negative int64
UINT64_MASK = 2**64 - 1  # a front door's signed seed (int32, int64) as the uint64 a request carries
_CHAT_ROLES = ("system", "user", "assistant", "tool")


def prompt_ids_of(request: generation_pb2.GenerateRequest, tokenizer: Tokenizer, vocab_size: int) -> list[int]:
    kind = request.WhichOneof("input")
    if kind == "prompt":
        if not request.prompt:
            raise invalid("prompt", "must not be empty")
        ids = tokenizer.encode(request.prompt)
    elif kind == "prompt_token_ids":
        ids = list(request.prompt_token_ids.ids)
        bad = [i for i in ids if i >= vocab_size]
        if bad:
            raise invalid("prompt_token_ids", f"id {bad[0]} is outside the vocabulary of {vocab_size}")
    elif kind == "chat":
        ids = _chat_ids(request.chat, tokenizer)
    else:
        raise invalid("input", "set one of prompt, prompt_token_ids or chat")
    if not ids:
        raise invalid(kind, "encodes to no tokens")
    return ids


def _template_message(message: generation_pb2.ChatMessage) -> dict[str, Any]:
    """A message as chat templates read it (transformers' shape): a call's arguments as an object."""
    rendered: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.tool_calls:
        rendered["tool_calls"] = [{"id": call.id, "type": "function",
                                   "function": {"name": call.name, "arguments": _json_or_text(call.arguments)}}
                                  for call in message.tool_calls]
    if message.tool_call_id:
        rendered["tool_call_id"] = message.tool_call_id
    return rendered


def _template_tool(tool: generation_pb2.Tool, index: int) -> dict[str, Any]:
    function: dict[str, Any] = {"name": tool.name}
    if tool.description:
        function["description"] = tool.description
    if tool.parameters:
        try:
            function["parameters"] = json.loads(tool.parameters)
        except json.JSONDecodeError as err:
            raise invalid(f"chat.tools[{index}].parameters", f"is not JSON: {err}") from None
    return {"type": "function", "function": function}


def _json_or_text(text: str) -> Any:
    """JSON text as its value; text that is not JSON as it is (a model may have written anything)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _chat_ids(chat: generation_pb2.ChatMessages, tokenizer: Tokenizer) -> list[int]:
    if not chat.messages:
        raise invalid("chat.messages", "must not be empty")
    for index, message in enumerate(chat.messages):
        if message.role not in _CHAT_ROLES:
            raise invalid(f"chat.messages[{index}].role", f"{message.role!r} is not one of {', '.join(_CHAT_ROLES)}")
    messages = [_template_message(m) for m in chat.messages]
    tools = [_template_tool(tool, index) for index, tool in enumerate(chat.tools)]
    try:
        return tokenizer.encode_chat(messages, tools=tools or None)
    except TokenizerError as err:
        raise invalid("chat", str(err)) from err


def sampling_options(
    params: generation_pb2.SamplingParams, prompt_len: int, config: TargetConfig, tokenizer: Tokenizer,
    vocab_size: int, input_field: str = "prompt",
) -> RequestOptions:
    """input_field: the request's input (prompt, prompt_token_ids or chat), named when it leaves no room."""
    room = config.max_model_len - prompt_len
    if room < 1:
        raise invalid(input_field, f"has {prompt_len} tokens; max_model_len is {config.max_model_len}, "
                                "which leaves no room to generate")
    sampling = _sampling(params, tokenizer, vocab_size)
    max_tokens = params.max_tokens if params.HasField("max_tokens") else room
    if max_tokens < 1:
        raise invalid("max_tokens", "must be at least 1")
    if max_tokens > room:
        raise invalid("max_tokens", f"{max_tokens} plus the prompt's {prompt_len} tokens exceed "
                                    f"max_model_len {config.max_model_len}")
    _check_stops(params, vocab_size)
    constraint = _constraint(params)
    _check_min_tokens(params, max_tokens, constraint)
    _check_rules_with_constraint(sampling, constraint)
    _check_something_allowed(sampling, params, tokenizer)
    logprobs, prompt_logprobs = _top_count(params, "logprobs"), _top_count(params, "prompt_logprobs")
    n = params.n if params.HasField("n") else 1
    if not 1 <= n <= config.max_num_seqs:
        raise invalid("n", f"must be in [1, {config.max_num_seqs}] (--max-num-seqs: the samples run at once), got {n}")
    k = params.num_speculative_tokens if params.HasField("num_speculative_tokens") else config.num_speculative_tokens
    if k > MAX_SPECULATIVE_TOKENS:
        raise invalid("num_speculative_tokens", f"must be at most {MAX_SPECULATIVE_TOKENS}, got {k}")
    return RequestOptions(
        sampling=sampling,
        constraint=constraint,
        max_tokens=max_tokens,
        stop=tuple(params.stop),
        stop_token_ids=frozenset(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
        skip_special_tokens=params.skip_special_tokens if params.HasField("skip_special_tokens") else True,
        speculate=params.speculate if params.HasField("speculate") else True,
        num_speculative_tokens=k,
        min_tokens=params.min_tokens,
        include_stop_str_in_output=params.include_stop_str_in_output,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        n=n,
    )


def _top_count(params: generation_pb2.SamplingParams, name: str) -> int | None:
    """logprobs or prompt_logprobs: the top alternatives asked for per token; None when unset."""
    if not params.HasField(name):
        return None
    count = getattr(params, name)
    if count > MAX_LOGPROBS:
        raise invalid(name, f"at most {MAX_LOGPROBS} top log-probabilities per token, got {count}")
    return count


def _check_min_tokens(params: generation_pb2.SamplingParams, max_tokens: int, constraint: Constraint | None) -> None:
    if params.min_tokens > max_tokens:
        raise invalid("min_tokens", f"{params.min_tokens} exceeds max_tokens {max_tokens}")
    if params.min_tokens and constraint is not None:
        raise invalid("min_tokens", "is not supported with a structured-output constraint (structured_outputs "
                                    "or response_format) yet: the grammar may end the output first; leave it 0")


def _check_something_allowed(sampling: Sampling, params: generation_pb2.SamplingParams, tokenizer: Tokenizer) -> None:
    """An allow list whose every token another rule bans (a one-token bad word always; a stop token
    while min_tokens holds) would leave a position with nothing to sample."""
    if not sampling.allowed_token_ids:
        return
    left = set(sampling.allowed_token_ids) - {word[0] for word in sampling.bad_words if len(word) == 1}
    if params.min_tokens:
        left -= set(params.stop_token_ids) | (set() if params.ignore_eos else set(tokenizer.eos_token_ids))
    if not left:
        raise invalid("allowed_token_ids", "every allowed token is banned: by a one-token bad word, or as a stop "
                                           "or end-of-sequence token while min_tokens holds; allow another token")


def _check_rules_with_constraint(sampling: Sampling, constraint: Constraint | None) -> None:
    """An allow list or bad words could forbid every token the grammar allows, and leave nothing to sample."""
    if constraint is None:
        return
    for name in ("allowed_token_ids", "bad_words"):
        if getattr(sampling, name):
            raise invalid(name, "is not supported with a structured-output constraint (structured_outputs or "
                                "response_format): together they may allow no token; leave it empty")


def _sampling(params: generation_pb2.SamplingParams, tokenizer: Tokenizer, vocab_size: int) -> Sampling:
    """Unset fields take vLLM's defaults; a top_k past the vocabulary is off; no seed draws a fresh one."""
    sampling = Sampling(
        temperature=params.temperature if params.HasField("temperature") else 1.0,
        top_k=params.top_k if params.top_k < vocab_size else 0,
        top_p=params.top_p if params.HasField("top_p") else 1.0,
        min_p=params.min_p if params.HasField("min_p") else 0.0,
        seed=(params.seed & _SEED_MASK) if params.HasField("seed") else fresh_seed(),
        drafter_invariant=params.drafter_invariant,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty if params.HasField("repetition_penalty") else 1.0,
        logit_bias=tuple(sorted(params.logit_bias.items())),
        allowed_token_ids=tuple(params.allowed_token_ids),
        bad_words=_bad_words(params.bad_words, tokenizer),
    )
    if (problem := sampling.problem(vocab_size)) is not None:
        raise invalid(problem.field, problem.message)
    return sampling


def _bad_words(words: Iterable[str], tokenizer: Tokenizer) -> tuple[tuple[int, ...], ...]:
    """Each word's token ids as vLLM finds them: the word without leading spaces, and after a space when
    that spelling starts with another token but has as many tokens."""
    words = list(words)
    if len(words) > MAX_BAD_WORDS:
        raise invalid("bad_words", f"at most {MAX_BAD_WORDS} words, got {len(words)}")
    found: list[tuple[int, ...]] = []
    for index, word in enumerate(words):
        if len(word) > MAX_STOP_STRING_CHARS:
            raise invalid(f"bad_words[{index}]", f"must have at most {MAX_STOP_STRING_CHARS} characters")
        bare = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        if not bare:
            raise invalid(f"bad_words[{index}]", "encodes to no tokens")
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        found.append(bare)
        if spaced[0] != bare[0] and len(spaced) == len(bare):
            found.append(spaced)
    return tuple(found)


def _constraint(params: generation_pb2.SamplingParams) -> Constraint | None:
    try:
        return Constraint.from_proto(params.structured_outputs)
    except ConstraintError as err:
        raise invalid(err.field, err.problem) from err


def _check_stops(params: generation_pb2.SamplingParams, vocab_size: int) -> None:
    if len(params.stop) > MAX_STOP_STRINGS:
        raise invalid("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(params.stop)}")
    for index, stop in enumerate(params.stop):
        if not stop or len(stop) > MAX_STOP_STRING_CHARS:
            raise invalid(f"stop[{index}]", f"must have 1 to {MAX_STOP_STRING_CHARS} characters")
    bad = [t for t in params.stop_token_ids if t >= vocab_size]
    if bad:
        raise invalid("stop_token_ids", f"id {bad[0]} is outside the vocabulary of {vocab_size}")


def validate_request(
    request: generation_pb2.GenerateRequest,
    tokenizer: Tokenizer,
    config: TargetConfig,
    model_name: str,
    vocab_size: int,
) -> tuple[list[int], RequestOptions, ToolChoice | None]:
    """The prompt's ids, the options, and what the answer may call (a chat's tool_choice; None: nothing)."""
    if request.model and request.model != model_name:
        raise invalid("model", f"{request.model!r} is not served here; this server serves {model_name!r}")
    ids = prompt_ids_of(request, tokenizer, vocab_size)
    params, choice = request.sampling_params, None
    if request.WhichOneof("input") == "chat":
        parser = TOOL_PARSERS[config.tool_call_parser] if config.tool_call_parser else None
        choice, constraint = tool_choice_of(request.chat, parser, params.HasField("structured_outputs"))
        if constraint is not None:  # a required or named call: its schema constrains the answer
            params = generation_pb2.SamplingParams()
            params.CopyFrom(request.sampling_params)
            params.structured_outputs.CopyFrom(constraint)
    return ids, sampling_options(params, len(ids), config, tokenizer, vocab_size, request.WhichOneof("input")), choice


GENERATE_METHOD = "/tandem.v1.Generation/Generate"


def decode_request(wire: bytes, message: type[Message] = generation_pb2.GenerateRequest) -> Message | RequestError:
    """The request, or the INVALID_ARGUMENT it earns (bad UTF-8 in a string, a truncated field)."""
    try:
        return message.FromString(wire)
    except DecodeError as err:
        return invalid("request", f"cannot be decoded: {err}")


class UndecodableRequests(grpc.aio.ServerInterceptor):
    """A streaming call's request that does not parse gets INVALID_ARGUMENT; grpc itself would answer UNKNOWN.

    methods: each unary-stream method's full name, with its request message."""

    def __init__(self, methods: dict[str, type[Message]]):
        self.methods = methods

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        message = self.methods.get(details.method)
        if handler is None or message is None:
            return handler
        generate = handler.unary_stream

        async def checked(request, context: grpc.aio.ServicerContext):
            if isinstance(request, RequestError):
                await context.abort(request.code, request.message)
            async for response in generate(request, context):
                yield response

        return grpc.unary_stream_rpc_method_handler(
            checked, request_deserializer=lambda wire: decode_request(wire, message),
            response_serializer=handler.response_serializer)
