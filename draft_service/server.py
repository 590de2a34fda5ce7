"""The Drafter gRPC service: Info, and Speculate (one long-lived bidirectional stream per target)."""
from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc

from draft_service.config import DraftConfig
from draft_service.grammars import DraftGrammars
from draft_service.drafter import Drafter
from draft_service.drafters.eagle3 import Eagle3Drafter
from draft_service.metrics import DraftMetrics
from draft_service.drafters.model import ModelDrafter
from draft_service.drafters.ngram import NgramDrafter
from draft_service.drafters.suffix import SuffixDrafter, SuffixFrontDrafter
from tandem.suffix_index import SuffixParams
from draft_service.scheduler import DraftScheduler, Limits, Stream
from tandem.config import ModelConfig
from tandem.grpc_server import ServerOptions, freeze_startup_heap, serve_until_signal, start_server
from tandem.runtime import load_eagle3_head, load_model, load_tokenizer, tokenizer_path
from tandem.structured import GrammarCompiler, GrammarLimits
from tandem.tokenizer import Tokenizer
from tandem.v1 import drafter_pb2, drafter_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = drafter_pb2.DESCRIPTOR.services_by_name["Drafter"].full_name


@dataclass(slots=True)
class LoadedDrafter:
    drafter: Drafter
    info: drafter_pb2.DrafterInfo
    metrics: DraftMetrics
    grammars: DraftGrammars


def load_drafter(config: DraftConfig) -> LoadedDrafter:
    """The drafter the config names, its Info (vocabulary from the same model) and its metrics."""
    began = time.perf_counter()
    metrics = DraftMetrics(config.model)
    drafter: Drafter
    if config.drafter == "eagle3":
        head = load_eagle3_head(config.model, config.drafter_target, dtype=config.dtype, device=config.device,
                                num_slots=config.num_slots, max_model_len=config.max_model_len)
        drafter = Eagle3Drafter(head.model, config.probs_top_k, metrics, guesses=config.predraft_guesses,
                                prefix_caching=config.prefix_caching)
        vocab_size, tokenizer = head.model.config.vocab_size, head.tokenizer
    elif config.drafter in ("model", "suffix+model"):
        loaded = load_model(config.model, dtype=config.dtype, device=config.device, num_slots=config.num_slots,
                            max_model_len=config.max_model_len, drafter_target=config.drafter_target,
                            quantization=config.quantization, kv_cache_dtype=config.kv_cache_dtype,
                            block_activations=config.block_activations)
        drafter = ModelDrafter(loaded.model, config.probs_top_k, metrics, loaded.draft_vocab,
                               guesses=config.predraft_guesses, prefix_caching=config.prefix_caching,
                               max_num_batched_tokens=config.max_num_batched_tokens)
        if config.drafter == "suffix+model":
            drafter = SuffixFrontDrafter(suffix_drafter(config), drafter, config.suffix_confidence)
        # The model's logits width: every id it can draft.
        vocab_size, tokenizer = loaded.config.vocab_size, loaded.tokenizer
    else:
        drafter = suffix_drafter(config) if config.drafter == "suffix" else NgramDrafter(config.ngram_min_n,
                                                                                          config.ngram_max_n)
        path = tokenizer_path(config.model, config.drafter_target)
        tokenizer = load_tokenizer(path)
        vocab_size = model_vocab_size(path, tokenizer)
    info = drafter_pb2.DrafterInfo(model=config.model, vocab_size=vocab_size,
                                   tokenizer_fingerprint=tokenizer.fingerprint, max_k=config.max_k,
                                   kind=drafter.kind, probs_top_k=drafter.probs_top_k)
    if drafter.feature_layout is not None:
        info.hidden_layers.extend(drafter.feature_layout.layers)
        info.target_hidden_size = drafter.feature_layout.hidden_size
    log.info("loaded the %s drafter for %s (vocabulary %d) in %.1f s",
             drafter.kind, config.model, vocab_size, time.perf_counter() - began)
    grammars = DraftGrammars(GrammarCompiler(tokenizer, vocab_size, GrammarLimits(cache_size=config.grammar_cache_size)))
    return LoadedDrafter(drafter, info, metrics, grammars)


def suffix_drafter(config: DraftConfig) -> SuffixDrafter:
    params = SuffixParams(max_depth=config.suffix_max_depth, max_spec_factor=config.suffix_spec_factor,
                          min_token_prob=config.suffix_min_token_prob)
    return SuffixDrafter(params, config.suffix_cache_tokens)


def model_vocab_size(path: Path, tokenizer: Tokenizer) -> int:
    """The logits width of the model at path (what a target checks against), without loading its weights."""
    if path.is_dir():
        return ModelConfig.from_hf(json.loads((path / "config.json").read_text())).vocab_size
    return tokenizer.vocab_size  # a GGUF vocabulary is its token list


class DraftService(drafter_pb2_grpc.DrafterServicer):
    def __init__(self, info: drafter_pb2.DrafterInfo, scheduler: DraftScheduler):
        self._info = info
        self._scheduler = scheduler

    async def Info(self, request: drafter_pb2.DrafterInfoRequest, context) -> drafter_pb2.DrafterInfo:
        return self._info

    async def Speculate(
        self, request_iterator: AsyncIterator[drafter_pb2.TargetUpdate], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[drafter_pb2.DraftProposals]:
        stream = self._scheduler.open_stream()
        log.info("stream %d opened by %s", stream.id, context.peer())
        reader = asyncio.create_task(self._read_updates(request_iterator, stream))
        try:
            while (message := await stream.outbox.get()) is not None:
                yield message
        finally:
            reader.cancel()
            self._scheduler.close_stream(stream)
            log.info("stream %d closed", stream.id)

    async def _read_updates(self, updates: AsyncIterator[drafter_pb2.TargetUpdate], stream: Stream) -> None:
        """Applies updates until the target stops sending; then the response stream ends too."""
        try:
            async for update in updates:
                self._scheduler.apply(stream, update)
        except Exception:
            log.exception("stream %d: reading updates failed", stream.id)
        finally:
            stream.outbox.put_nowait(None)


async def serve(config: DraftConfig) -> None:
    """Loads the drafter, serves until SIGTERM/SIGINT, then ends the streams and stops."""
    loaded = load_drafter(config)
    limits = Limits(vocab_size=loaded.info.vocab_size, max_model_len=config.max_model_len,
                    max_k=config.max_k, num_slots=config.num_slots,
                    max_seqs_per_target=config.max_seqs_per_target, lookahead=config.lookahead)
    # Only a model has a distribution to guess recovered tokens from; the lookup drafters guess none.
    guesses = config.predraft_guesses if config.drafter in ("model", "suffix+model", "eagle3") else 1
    scheduler = DraftScheduler(loaded.drafter, loaded.metrics, limits,
                               max_fanout=config.max_fanout, guesses=guesses, grammars=loaded.grammars,
                               max_predraft_depth=config.max_predraft_depth)
    servicer = DraftService(loaded.info, scheduler)
    freeze_startup_heap()
    options = ServerOptions(host=config.host, port=config.port, metrics_port=config.metrics_port,
                            max_message_bytes=config.max_message_bytes, grace_seconds=config.grace_seconds,
                            tls=config.server_tls())
    scheduler.start()
    try:
        running = await start_server(
            options, lambda server: drafter_pb2_grpc.add_DrafterServicer_to_server(servicer, server),
            [SERVICE_NAME], loaded.metrics.registry)
        await serve_until_signal(running, config.grace_seconds, scheduler.drain)
    finally:
        await scheduler.stop()
