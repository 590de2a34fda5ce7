"""The target process: model, engine, Speculator and drafter link, and the front doors (Generation and
VllmEngine on the gRPC port, the OpenAI API on --http-port), put together."""
from __future__ import annotations

import asyncio
import functools
import logging

from target_service.config import TargetConfig, chat_template_source
from target_service.engine import Engine
from target_service.front_doors.request_grammars import RequestGrammars
from target_service.front_doors.servers import FrontDoors
from target_service.front_doors.serving import Serving
from target_service.metrics import TargetMetrics
from target_service.model_runner import ModelRunner
from target_service.scheduler import Scheduler
from target_service.speculation.link import DrafterLink
from target_service.speculation.policy import speculation_policy
from target_service.speculation.local_drafts import LocalDrafts
from target_service.speculation.speculator import Speculator
from tandem.grpc_server import freeze_startup_heap, serve_until_signal
from tandem.runtime import dtype_name, load_model
from tandem.structured import GrammarCompiler, GrammarLimits

log = logging.getLogger(__name__)


async def serve(config: TargetConfig) -> None:
    loaded = await asyncio.to_thread(
        load_model, config.model, dtype=config.dtype, device=config.device,
        num_slots=config.max_num_seqs, max_model_len=config.max_model_len, kv_cache_tokens=config.kv_cache_tokens or None,
        block_size=config.block_size, quantization=config.quantization, kv_cache_dtype=config.kv_cache_dtype,
        block_activations=config.block_activations,
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
    local_drafts = LocalDrafts() if config.local_drafts and not config.sync_speculation else None
    speculator = Speculator(speculation_policy(config), metrics, vocab_size=loaded.config.vocab_size,
                            max_len=kv_cache.max_len, connect=connect, local_drafts=local_drafts)
    scheduler = Scheduler(kv_cache, config.max_num_seqs, config.max_queue, metrics, config.prefix_caching,
                          config.max_num_batched_tokens)
    metrics.describe_cache(kv_cache.block_size, kv_cache.num_blocks, dtype_name(kv_cache.dtype),
                           config.prefix_caching)
    engine = Engine(ModelRunner(loaded.model, metrics), scheduler, speculator, loaded.tokenizer, config, metrics)
    compiler = await asyncio.to_thread(
        GrammarCompiler, loaded.tokenizer, loaded.config.vocab_size,
        GrammarLimits(compile_seconds=config.grammar_compile_timeout, cache_size=config.grammar_cache_size))
    await asyncio.to_thread(engine.runner.warm_up)
    freeze_startup_heap()
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
