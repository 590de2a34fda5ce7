"""tandem.v1's Generation service: a GenerateRequest in, the stream of its samples' responses out."""
from __future__ import annotations

import time

import grpc

from tandem_kernels.logprobs import TokenLogprob
from target_service.errors import RequestError
from target_service.front_doors.serving import Serving
from target_service.front_doors.tool_calls import ToolChoice, call_id, parsed_answer
from target_service.sequence import FinishReason, Output, Sequence
from tandem.v1 import generation_pb2, generation_pb2_grpc

_FINISH = {
    FinishReason.STOP: generation_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: generation_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: generation_pb2.FINISH_REASON_ABORT,
}


class GenerationDoor(generation_pb2_grpc.GenerationServicer):
    """tandem.v1's Generation service."""

    def __init__(self, serving: Serving):
        self.serving = serving

    async def Generate(self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        try:
            async with self.serving.session(request) as session:
                samples, choice = session.samples, session.tool_choice
                answers: list[list[str]] = [[] for _ in samples]  # each sample's text deltas, read for calls at its end
                async for output in self.serving.outputs(samples):
                    response = self._response(samples[output.index], output)
                    if choice is not None:
                        answers[output.index].append(output.text)
                        if output.finish in (FinishReason.STOP, FinishReason.LENGTH):
                            _add_calls(response, choice, "".join(answers[output.index]))
                    yield response
        except RequestError as err:  # only the session's start raises it: nothing was sent yet
            await context.abort(err.code, err.message)

    def _response(self, seq: Sequence, output: Output) -> generation_pb2.GenerateResponse:
        response = generation_pb2.GenerateResponse(
            token_ids=output.token_ids,
            text=output.text,
            num_accepted=output.num_accepted,
            server_elapsed_ns=int((time.perf_counter() - seq.arrival) * 1e9),
            logprobs=_token_logprobs(output.logprobs),
            prompt_logprobs=_token_logprobs(output.prompt_logprobs),
            index=output.index,
        )
        if output.finish is not None:
            response.finish_reason = _FINISH[output.finish]
            response.usage.CopyFrom(generation_pb2.Usage(
                prompt_tokens=len(seq.prompt_ids),
                completion_tokens=seq.num_generated,
                draft_tokens=seq.draft_tokens,
                accepted_tokens=seq.accepted_tokens,
                draft_steps=seq.draft_steps,
                cached_tokens=seq.cached_tokens,
            ))
        return response

    async def GetModelInfo(self, request, context) -> generation_pb2.ModelInfo:
        loaded, model = self.serving.loaded, self.serving.loaded.model
        draft_model = self.serving.drafter_model
        return generation_pb2.ModelInfo(
            model=loaded.name,
            vocab_size=loaded.config.vocab_size,
            max_model_len=self.serving.config.max_model_len,
            tokenizer_fingerprint=loaded.tokenizer.fingerprint,
            eos_token_ids=sorted(loaded.tokenizer.eos_token_ids),
            dtype=self.serving.dtype,
            device=str(model.device),
            draft_model=draft_model or "",
            drafter_connected=draft_model is not None,
        )


def _add_calls(response: generation_pb2.GenerateResponse, choice: ToolChoice, answer: str) -> None:
    """The calls a whole answer made, and its text outside them; none when it made none."""
    parsed = parsed_answer(choice, answer)
    if parsed is not None and parsed[1]:
        content, calls = parsed
        response.tool_calls.extend(generation_pb2.ToolCall(id=call_id(), name=name, arguments=arguments)
                                   for name, arguments in calls)
        response.content = content or ""


def _token_logprobs(logprobs: list[TokenLogprob] | None) -> list[generation_pb2.TokenLogprob]:
    return [generation_pb2.TokenLogprob(token_id=lp.token, logprob=lp.logprob, rank=lp.rank,
                                        top_token_ids=[t for t, _ in lp.top], top_logprobs=[v for _, v in lp.top])
            for lp in logprobs or ()]


GENERATION_SERVICE = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
