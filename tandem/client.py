"""A client of the public Generation API: one streamed request, with what a user measures of it."""
from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from tandem.tls import ClientTls, bearer_metadata
from tandem.v1 import generation_pb2, generation_pb2_grpc

FINISH_NAMES = {
    generation_pb2.FINISH_REASON_STOP: "stop",
    generation_pb2.FINISH_REASON_LENGTH: "length",
    generation_pb2.FINISH_REASON_ABORT: "abort",
}


@dataclass(slots=True)
class GenerationResult:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""
    prompt_tokens: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    draft_steps: int = 0
    cached_tokens: int = 0  # prompt tokens the target's prefix cache held
    ttft: float = 0.0  # seconds from sending to the first token
    token_times: list[float] = field(default_factory=list)  # arrival of each token, from sending
    elapsed: float = 0.0
    logprobs: list[generation_pb2.TokenLogprob] = field(default_factory=list)  # one per token, when asked
    prompt_logprobs: list[generation_pb2.TokenLogprob] = field(default_factory=list)  # prompt tokens 1.., when asked

    @property
    def decode_tokens_per_second(self) -> float:
        """Tokens after the first, over the time after the first: what speculation speeds up."""
        span = self.elapsed - self.ttft
        return (len(self.token_ids) - 1) / span if span > 0 and len(self.token_ids) > 1 else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return 1 + self.accepted_tokens / self.draft_steps if self.draft_steps else 1.0

    def summary(self) -> str:
        return (f"TTFT {self.ttft * 1000:.0f} ms · {len(self.token_ids)} tokens · "
                f"{self.decode_tokens_per_second:.1f} tok/s · acceptance {self.acceptance_rate:.0%} · "
                f"mean acceptance length {self.mean_acceptance_length:.2f} · finish {self.finish_reason}")


async def generate(
    stub: generation_pb2_grpc.GenerationStub,
    request: generation_pb2.GenerateRequest,
    on_text: Callable[[str], None] | None = None,
    timeout: float | None = None,
) -> GenerationResult:
    """A request of one sample (n unset or 1); on_text gets each text delta as it arrives."""
    [result] = await generate_samples(stub, request, on_text, timeout)
    return result


async def generate_samples(
    stub: generation_pb2_grpc.GenerationStub,
    request: generation_pb2.GenerateRequest,
    on_text: Callable[[str], None] | None = None,
    timeout: float | None = None,
) -> list[GenerationResult]:
    """Each of the request's n samples, by index; times count from sending, for each sample."""
    results: dict[int, GenerationResult] = {}
    start = time.perf_counter()
    async for response in stub.Generate(request, timeout=timeout):
        now = time.perf_counter() - start
        result = results.setdefault(response.index, GenerationResult())
        if response.token_ids and not result.token_ids:
            result.ttft = now
        result.token_ids.extend(response.token_ids)
        result.token_times.extend([now] * len(response.token_ids))
        result.logprobs.extend(response.logprobs)
        result.prompt_logprobs.extend(response.prompt_logprobs)
        result.text += response.text
        if on_text is not None and response.text:
            on_text(response.text)
        if response.finish_reason:
            result.finish_reason = FINISH_NAMES[response.finish_reason]
            usage = response.usage
            result.prompt_tokens = usage.prompt_tokens
            result.draft_tokens = usage.draft_tokens
            result.accepted_tokens = usage.accepted_tokens
            result.draft_steps = usage.draft_steps
            result.cached_tokens = usage.cached_tokens
            result.elapsed = now
    return [results[index] for index in sorted(results)]


def chat_request(
    content: str, *, system: str = "", model: str = "", **sampling
) -> generation_pb2.GenerateRequest:
    messages = ([generation_pb2.ChatMessage(role="system", content=system)] if system else [])
    messages.append(generation_pb2.ChatMessage(role="user", content=content))
    return generation_pb2.GenerateRequest(
        chat=generation_pb2.ChatMessages(messages=messages),
        sampling_params=generation_pb2.SamplingParams(**sampling),
        model=model,
    )


class _BearerToken:
    """Adds `authorization: Bearer <token>` to every call (works on plaintext channels too, unlike call credentials)."""

    def __init__(self, token: str):
        self._metadata = bearer_metadata(token)

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()), *self._metadata)
        return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata,
                                          details.credentials, details.wait_for_ready)


# grpc.aio files an interceptor under its first matching kind only, so each kind gets its own class.
class _UnaryUnaryBearer(_BearerToken, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(self._details(details), request)


class _UnaryStreamBearer(_BearerToken, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(self._details(details), request)


# Client-side load balancing: where the target's name resolves to several replicas
# (dns:///targets.tandem.svc:50051, or ipv4:10.0.0.1:50051,10.0.0.2:50051), calls go round-robin
# over every one that is up, instead of all to the first (grpc's default, pick_first).
ROUND_ROBIN_SERVICE_CONFIG = json.dumps({"loadBalancingConfig": [{"round_robin": {}}]})


def open_channel(address: str, tls: ClientTls | None = None, token: str = "",
                 options: list[tuple[str, int | str]] | None = None) -> grpc.aio.Channel:
    """A channel to a target: plaintext, or TLS (mTLS with a client cert) when `tls` is given; calls
    spread round-robin over the addresses the target name resolves to."""
    options = [("grpc.service_config", ROUND_ROBIN_SERVICE_CONFIG), *(options or [])]
    interceptors = [_UnaryUnaryBearer(token), _UnaryStreamBearer(token)] if token else None
    if tls is None:
        return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
    return grpc.aio.secure_channel(address, tls.credentials(), options=options, interceptors=interceptors)
