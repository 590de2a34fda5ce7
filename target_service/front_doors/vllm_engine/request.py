"""vLLM's gRPC GenerateRequest (`vllm.grpc.engine`, from smg-grpc-proto) as the engine's GenerateRequest.

Every SamplingParams field maps onto ours or, when it asks for what Tandem does not serve yet
(truncate_prompt_tokens, ...), is refused with INVALID_ARGUMENT naming it. Unset and zero values mean
what the gateway means by them: temperature unset is 1.0, top_p 0 is 1.0, top_k 0 is off,
repetition_penalty 0 is off, max_tokens unset fills the context.
"""
from __future__ import annotations

from smg_grpc_proto import vllm_engine_pb2

from tandem_kernels.logprobs import MAX_LOGPROBS
from target_service.errors import RequestError, invalid
from target_service.front_doors.validation import UINT64_MASK
from tandem.v1 import generation_pb2, structured_pb2

# Our fields by the names a VllmEngine request gives them, for messages that name the field to fix;
# the others are SamplingParams fields of the same name (RequestError.renamed).
FIELD_NAMES = {"prompt_token_ids": "tokenized.input_ids", "prompt": "text", "input": "tokenized",
               "structured_outputs.json": "sampling_params.json_schema", "structured_outputs": "sampling_params"}


def _refuse(field: str, problem: str = "is not supported yet") -> RequestError:
    """INVALID_ARGUMENT for a field this engine does not serve."""
    return invalid(field, problem)


def engine_request(request: vllm_engine_pb2.GenerateRequest) -> generation_pb2.GenerateRequest:
    """Our request for theirs; RequestError for a field we do not serve."""
    for name in ("kv_transfer_params", "mm_inputs", "media_refs"):
        if request.HasField(name):
            raise _refuse(name)
    if request.extra_mm_inputs:
        raise _refuse("extra_mm_inputs")
    if request.HasField("kv_transfer_params_json"):
        raise _refuse("kv_transfer_params_json", "is not supported: this engine does no KV transfer")
    if request.HasField("data_parallel_rank") and request.data_parallel_rank != 0:
        raise _refuse("data_parallel_rank", f"is {request.data_parallel_rank}; this engine has one rank, 0")
    ours = generation_pb2.GenerateRequest(request_id=request.request_id,
                                          sampling_params=sampling_params(request.sampling_params))
    kind = request.WhichOneof("input")
    if kind == "tokenized":
        ours.prompt_token_ids.ids.extend(request.tokenized.input_ids)
    elif kind == "text":
        ours.prompt = request.text
    return ours


def sampling_params(params: vllm_engine_pb2.SamplingParams) -> generation_pb2.SamplingParams:
    _refuse_unserved(params)
    ours = generation_pb2.SamplingParams(
        top_k=params.top_k,
        stop=list(params.stop),
        stop_token_ids=list(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
        skip_special_tokens=params.skip_special_tokens,
        min_tokens=params.min_tokens,
        include_stop_str_in_output=params.include_stop_str_in_output,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        logit_bias=_logit_bias(params),
    )
    if params.repetition_penalty:
        ours.repetition_penalty = params.repetition_penalty
    if params.HasField("temperature"):
        ours.temperature = params.temperature
    if params.top_p:
        ours.top_p = params.top_p
    if params.min_p:
        ours.min_p = params.min_p
    if params.n:  # 0: unset, one sample
        ours.n = params.n
    if params.HasField("max_tokens"):
        ours.max_tokens = params.max_tokens
    if params.HasField("seed"):
        ours.seed = params.seed & UINT64_MASK
    for name in ("logprobs", "prompt_logprobs"):
        if params.HasField(name):
            count = getattr(params, name)
            if count < 0:  # vLLM's -1, every token's, is not served
                raise invalid(f"sampling_params.{name}", f"must be in [0, {MAX_LOGPROBS}], got {count}")
            setattr(ours, name, count)
    constraint = _constraint(params)
    if constraint is not None:
        ours.structured_outputs.CopyFrom(constraint)
    return ours


def _refuse_unserved(params: vllm_engine_pb2.SamplingParams) -> None:
    """spaces_between_special_tokens and grammar_from_first_token are taken as they come: the
    first shapes only text, which this protocol does not carry (the gateway detokenizes); the
    second asks for what this engine always does, a constraint from the first generated token."""
    field = "sampling_params."
    if params.HasField("truncate_prompt_tokens"):
        raise _refuse(field + "truncate_prompt_tokens")


def _logit_bias(params: vllm_engine_pb2.SamplingParams) -> dict[int, float]:
    """Their int32 keys as our token ids; a negative one names no token."""
    negative = [token for token in params.logit_bias if token < 0]
    if negative:
        raise invalid("sampling_params.logit_bias", f"key {negative[0]} is not a token id")
    return dict(params.logit_bias)


def _constraint(params: vllm_engine_pb2.SamplingParams) -> structured_pb2.StructuredOutputs | None:
    kind = params.WhichOneof("constraint")
    if kind is None:
        return None
    if kind == "json_schema":
        return structured_pb2.StructuredOutputs(json=params.json_schema)
    if kind == "json_object":
        return structured_pb2.StructuredOutputs(json_object=params.json_object)
    if kind == "choice":
        return structured_pb2.StructuredOutputs(choice=structured_pb2.Choices(choices=params.choice.choices))
    if kind in ("regex", "grammar"):
        return structured_pb2.StructuredOutputs(**{kind: getattr(params, kind)})
    raise _refuse(f"sampling_params.{kind}")
