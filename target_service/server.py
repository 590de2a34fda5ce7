"""The Generation gRPC service, and the target process: model, engine, drafter link, and the front doors
(Generation and VllmEngine on the gRPC port, the OpenAI API on --http-port)."""
from __future__ import annotations

import asyncio
import functools
import logging
import time

import grpc
from smg_grpc_proto import vllm_engine_pb2, vllm_engine_pb2_grpc

from tandem_kernels.logprobs import TokenLogprob
from target_service.config import TargetConfig, chat_template_source
from target_service.drafter_link import DrafterLink
from target_service.engine import Engine
from target_service.errors import RequestError
from target_service.request_grammars import RequestGrammars
from target_service.metrics import TargetMetrics
from target_service.openai_api.server import OpenAIServer
from target_service.scheduler import Scheduler
from target_service.sequence import FinishReason, Output, Sequence
from target_service.model_runner import ModelRunner
from target_service.serving import Serving
from target_service.speculation import speculation_policy
from target_service.speculator import Speculator
from target_service.tool_calls import ToolChoice, call_id, parsed_answer
from target_service.validation import GENERATE_METHOD, UndecodableRequests
from target_service.vllm_grpc.servicer import SERVICE_NAME as VLLM_SERVICE
from target_service.vllm_grpc.servicer import VLLM_GENERATE_METHOD, VllmEngineServicer
from tandem.grpc_server import RunningServer, ServerOptions, serve_until_signal, start_server
from tandem.runtime import load_model
from tandem.structured import GrammarCompiler, GrammarLimits
from tandem.tls import BearerTokenInterceptor
from tandem.v1 import generation_pb2, generation_pb2_grpc

log = logging.getLogger(__name__)

_FINISH = {
    FinishReason.STOP: generation_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: generation_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: generation_pb2.FINISH_REASON_ABORT,
}


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, serving: Serving):
        self.serving = serving

    async def Generate(self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        try:
            async with self.serving.session(request) as samples:
                answers = [""] * len(samples)  # each sample's text so far, read for calls at its end
                async for output in self.serving.outputs(samples):
                    seq = samples[output.index]
                    response = self._response(seq, output)
                    if seq.options.tool_choice is not None:
                        answers[output.index] += output.text
                        if output.finish in (FinishReason.STOP, FinishReason.LENGTH):
                            _add_calls(response, seq.options.tool_choice, answers[output.index])
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


def _register(server: grpc.aio.Server, generation: GenerationServicer, vllm: VllmEngineServicer) -> None:
    """Both front doors on one port: Tandem's own, and vLLM's engine protocol for gateways."""
    generation_pb2_grpc.add_GenerationServicer_to_server(generation, server)
    vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(vllm, server)


async def serve(config: TargetConfig) -> None:
    loaded = await asyncio.to_thread(
        load_model, config.model, dtype=config.dtype, device=config.device,
        num_slots=config.max_num_seqs, max_model_len=config.max_model_len, kv_cache_tokens=config.kv_cache_tokens or None,
        block_size=config.block_size,
    )
    if config.chat_template:
        loaded.tokenizer = loaded.tokenizer.with_chat_template(chat_template_source(config.chat_template))
    metrics = TargetMetrics(loaded.name)
    connect = None
    if config.drafter:
        connect = functools.partial(
            DrafterLink, config.drafter, metrics=metrics, vocab_size=loaded.config.vocab_size,
            tokenizer_fingerprint=loaded.tokenizer.fingerprint,
            reconnect_max_seconds=config.reconnect_max_seconds, max_message_bytes=config.max_message_bytes,
            tls=config.drafter_link_tls(), num_layers=loaded.config.num_layers,
            hidden_size=loaded.config.hidden_size,
        )
    kv_cache = loaded.model.kv_cache
    speculator = Speculator(speculation_policy(config), metrics, vocab_size=loaded.config.vocab_size,
                            max_len=kv_cache.max_len, connect=connect)
    scheduler = Scheduler(kv_cache, config.max_num_seqs, config.max_queue, metrics, config.prefix_caching,
                          config.max_num_batched_tokens)
    metrics.describe_cache(kv_cache.block_size, kv_cache.num_blocks, str(kv_cache.v[0].dtype).removeprefix("torch."),
                           config.prefix_caching)
    engine = Engine(ModelRunner(loaded.model, metrics), scheduler, speculator, loaded.tokenizer, config, metrics)
    compiler = await asyncio.to_thread(
        GrammarCompiler, loaded.tokenizer, loaded.config.vocab_size,
        GrammarLimits(compile_seconds=config.grammar_compile_timeout, cache_size=config.grammar_cache_size))
    await asyncio.to_thread(engine.runner.warm_up)
    link = speculator.link
    if link is not None:
        link.start()
    engine.start()
    serving = Serving(engine, loaded, config, RequestGrammars(compiler, metrics))
    doors = FrontDoors(serving, config, metrics)
    try:
        await doors.start()
        await serve_until_signal(doors.grpc[0], config.grace_seconds, engine.drain, also=doors.grpc[1:])
    finally:
        await doors.stop()
        if link is not None:
            await link.stop()
        await engine.stop()


class FrontDoors:
    """The servers clients reach: the gRPC port (Generation and VllmEngine), --vllm-grpc-port (VllmEngine
    alone, without the bearer token: for a gateway, which sends none) and --http-port (OpenAI)."""

    def __init__(self, serving: Serving, config: TargetConfig, metrics: TargetMetrics):
        self.serving, self.config, self.metrics = serving, config, metrics
        self.grpc: list[RunningServer] = []
        self.http: OpenAIServer | None = None

    async def start(self) -> None:
        """HTTP first: once the gRPC port reports SERVING, every door is open."""
        config, token = self.config, self.config.read_auth_token()
        generation, vllm = GenerationServicer(self.serving), VllmEngineServicer(self.serving)
        if config.http_port:
            self.http = OpenAIServer(self.serving, self.metrics.registry, token, config.max_message_bytes)
            await self.http.start(config.host, config.http_port, config.server_tls())
        undecodable = UndecodableRequests({GENERATE_METHOD: generation_pb2.GenerateRequest,
                                           VLLM_GENERATE_METHOD: vllm_engine_pb2.GenerateRequest})
        self.grpc.append(await start_server(
            self._options(config.port, config.metrics_port),
            lambda server: _register(server, generation, vllm),
            [GENERATION_SERVICE, VLLM_SERVICE],
            self.metrics.registry,
            # The token is checked first: an unauthenticated caller learns nothing about its request.
            interceptors=[*([BearerTokenInterceptor(token)] if token else []), undecodable],
        ))
        if config.vllm_grpc_port:
            self.grpc.append(await start_server(
                self._options(config.vllm_grpc_port, 0),
                lambda server: vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(vllm, server),
                [VLLM_SERVICE], None, interceptors=[undecodable]))

    def _options(self, port: int, metrics_port: int) -> ServerOptions:
        config = self.config
        return ServerOptions(host=config.host, port=port, metrics_port=metrics_port,
                             max_message_bytes=config.max_message_bytes, grace_seconds=config.grace_seconds,
                             tls=config.server_tls())

    async def stop(self) -> None:
        if self.http is not None:
            await self.http.stop()
