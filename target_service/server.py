"""The Generation gRPC service, and the target process: model, engine, drafter link, server."""
from __future__ import annotations

import asyncio
import logging
import time

import grpc

from target_service.config import TargetConfig
from target_service.drafter_link import DrafterLink
from target_service.engine import Engine
from target_service.errors import RequestError
from target_service.grammars import RequestGrammars
from target_service.metrics import TargetMetrics
from target_service.sequence import FinishReason, Output, Sequence
from target_service.step import StepRunner
from target_service.validation import UndecodableRequests, validate_request
from tandem.grpc_server import ServerOptions, serve_until_signal, start_server
from tandem.runtime import LoadedModel, load_model
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
    def __init__(self, engine: Engine, loaded: LoadedModel, config: TargetConfig, grammars: RequestGrammars):
        self.engine = engine
        self.loaded = loaded
        self.config = config
        self.grammars = grammars

    async def Generate(self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        try:
            prompt_ids, options = validate_request(
                request, self.loaded.tokenizer, self.config, self.loaded.name, self.loaded.config.vocab_size
            )
            grammar = await self.grammars.matcher_for(options.constraint) if options.constraint else None
            seq = self.engine.new_sequence(request.request_id, prompt_ids, options, grammar)
            self.engine.submit(seq)
        except RequestError as err:
            await context.abort(err.code, err.message)
        try:
            while True:
                output = await seq.outbox.get()
                yield self._response(seq, output)
                if output.finish is not None:
                    return
        finally:
            self.engine.abort(seq)  # a no-op once finished; frees the sequence when the client left

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
        link = self.engine.tracker.link
        connected = link is not None and link.connected
        model = self.loaded.model
        return generation_pb2.ModelInfo(
            model=self.loaded.name,
            vocab_size=self.loaded.config.vocab_size,
            max_model_len=self.config.max_model_len,
            tokenizer_fingerprint=self.loaded.tokenizer.fingerprint,
            eos_token_ids=sorted(self.loaded.tokenizer.eos_token_ids),
            dtype=str(model.dtype).removeprefix("torch."),
            device=str(model.device),
            draft_model=link.info.model if connected else "",
            drafter_connected=connected,
        )


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
    servicer = GenerationServicer(engine, loaded, config, RequestGrammars(compiler, metrics))
    options = ServerOptions(host=config.host, port=config.port, metrics_port=config.metrics_port,
                            max_message_bytes=config.max_message_bytes, grace_seconds=config.grace_seconds,
                            tls=config.server_tls())
    token = config.read_auth_token()
    running = await start_server(
        options,
        lambda server: generation_pb2_grpc.add_GenerationServicer_to_server(servicer, server),
        [generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name],
        metrics.registry,
        # The token is checked first: an unauthenticated caller learns nothing about its request.
        interceptors=[*([BearerTokenInterceptor(token)] if token else []), UndecodableRequests()],
    )
    try:
        await serve_until_signal(running, config.grace_seconds, engine.drain)
    finally:
        if link is not None:
            await link.stop()
        await engine.stop()
