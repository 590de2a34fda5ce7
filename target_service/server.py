"""The Generation gRPC service, and the target process: model, engine, drafter link, and the front doors
(Generation and VllmEngine on the gRPC port, the OpenAI API on --http-port)."""
from __future__ import annotations

import asyncio
import logging
import time

import grpc
from smg_grpc_proto import vllm_engine_pb2, vllm_engine_pb2_grpc

from target_service.config import TargetConfig
from target_service.drafter_link import DrafterLink
from target_service.engine import Engine
from target_service.errors import RequestError
from target_service.grammars import RequestGrammars
from target_service.metrics import TargetMetrics
from target_service.openai_api.server import OpenAIServer
from target_service.sequence import FinishReason, Output, Sequence
from target_service.step import StepRunner
from target_service.serving import Serving
from target_service.validation import GENERATE_METHOD, UndecodableRequests
from target_service.vllm_grpc.servicer import GENERATE_METHOD as VLLM_GENERATE
from target_service.vllm_grpc.servicer import SERVICE_NAME as VLLM_SERVICE
from target_service.vllm_grpc.servicer import VllmEngineServicer
from tandem.grpc_server import ServerOptions, serve_until_signal, start_server
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
            seq = await self.serving.submit(request)
        except RequestError as err:
            await context.abort(err.code, err.message)
        async for output in self.serving.outputs(seq):
            yield self._response(seq, output)

    def _response(self, seq: Sequence, output: Output) -> generation_pb2.GenerateResponse:
        response = generation_pb2.GenerateResponse(
            token_ids=output.token_ids,
            text=output.text,
            num_accepted=output.num_accepted,
            server_elapsed_ns=int((time.perf_counter() - seq.arrival) * 1e9),
        )
        if output.finish is not None:
            response.finish_reason = _FINISH[output.finish]
            response.usage.CopyFrom(generation_pb2.Usage(
                prompt_tokens=len(seq.prompt_ids),
                completion_tokens=seq.num_generated,
                draft_tokens=seq.draft_tokens,
                accepted_tokens=seq.accepted_tokens,
                draft_steps=seq.draft_steps,
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
            dtype=str(model.dtype).removeprefix("torch."),
            device=str(model.device),
            draft_model=draft_model or "",
            drafter_connected=draft_model is not None,
        )


GENERATION_SERVICE = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name


def _register(server: grpc.aio.Server, generation: GenerationServicer, vllm: VllmEngineServicer) -> None:
    """Both front doors on one port: Tandem's own, and vLLM's engine protocol for gateways."""
    generation_pb2_grpc.add_GenerationServicer_to_server(generation, server)
    vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(vllm, server)


async def serve(config: TargetConfig) -> None:
    loaded = await asyncio.to_thread(
        load_model, config.model, dtype=config.dtype, device=config.device,
        num_slots=config.max_num_seqs, max_model_len=config.max_model_len,
    )
    metrics = TargetMetrics(loaded.name)
    engine = Engine(StepRunner(loaded.model, metrics), loaded.model.kv_cache, loaded.tokenizer,
                    loaded.config.vocab_size, config, metrics)
    compiler = await asyncio.to_thread(
        GrammarCompiler, loaded.tokenizer, loaded.config.vocab_size,
        GrammarLimits(compile_seconds=config.grammar_compile_timeout, cache_size=config.grammar_cache_size))
    await asyncio.to_thread(engine.runner.warm_up)
    link = None
    if config.drafter:
        link = DrafterLink(
            config.drafter, engine.tracker, metrics, vocab_size=loaded.config.vocab_size,
            tokenizer_fingerprint=loaded.tokenizer.fingerprint,
            reconnect_max_seconds=config.reconnect_max_seconds, max_message_bytes=config.max_message_bytes,
            tls=config.drafter_link_tls(), num_layers=loaded.config.num_layers,
            hidden_size=loaded.config.hidden_size,
        )
        engine.tracker.link = link
        link.start()
    engine.start()
    serving = Serving(engine, loaded, config, RequestGrammars(compiler, metrics))
    servicer = GenerationServicer(serving)
    vllm_servicer = VllmEngineServicer(serving)
    options = ServerOptions(host=config.host, port=config.port, metrics_port=config.metrics_port,
                            max_message_bytes=config.max_message_bytes, grace_seconds=config.grace_seconds,
                            tls=config.server_tls())
    token = config.read_auth_token()
    running = await start_server(
        options,
        lambda server: _register(server, servicer, vllm_servicer),
        [GENERATION_SERVICE, VLLM_SERVICE],
        metrics.registry,
        # The token is checked first: an unauthenticated caller learns nothing about its request.
        interceptors=[*([BearerTokenInterceptor(token)] if token else []), UndecodableRequests({
            GENERATE_METHOD: generation_pb2.GenerateRequest, VLLM_GENERATE: vllm_engine_pb2.GenerateRequest})],
    )
    http = None
    if config.http_port:
        http = OpenAIServer(serving, metrics.registry, token, config.max_message_bytes)
        await http.start(config.host, config.http_port, config.server_tls())
    try:
        await serve_until_signal(running, config.grace_seconds, engine.drain)
    finally:
        if http is not None:
            await http.stop()
        if link is not None:
            await link.stop()
        await engine.stop()
