"""vLLM's gRPC engine protocol (`vllm.grpc.engine.VllmEngine`) on the target's gRPC port.

What the Shepherd Model Gateway (smg) and llm-d speak to a vLLM worker. The gateway tokenizes and
detokenizes itself, so this service streams token ids: delta chunks, then one complete message
with why the request finished. Requests go the same way as every other front door's (Serving).
"""
from __future__ import annotations

import asyncio
import datetime
import hashlib
import importlib.metadata
import io
import json
import math
import time
import uuid
import zipfile
from dataclasses import dataclass, field

import grpc
from smg_grpc_proto import vllm_engine_pb2, vllm_engine_pb2_grpc
from smg_grpc_proto.generated import common_pb2

from tandem_kernels.logprobs import TokenLogprob
from target_service.errors import RequestError
from target_service.front_doors.serving import SERVER_ABORTED, Serving
from target_service.front_doors.vllm_engine.request import FIELD_NAMES, engine_request
from target_service.sequence import FinishReason, Output, Sequence

SERVICE_NAME = vllm_engine_pb2.DESCRIPTOR.services_by_name["VllmEngine"].full_name
VLLM_GENERATE_METHOD = f"/{SERVICE_NAME}/Generate"
TOKENIZER_CHUNK_BYTES = 64 * 1024
VERSION = importlib.metadata.version("tandem")


class VllmEngineDoor(vllm_engine_pb2_grpc.VllmEngineServicer):
    def __init__(self, serving: Serving):
        self.serving = serving
        self.started = time.time()
        self._running: dict[str, list[Sequence]] = {}  # a request's samples, by the gateway's request_id, for Abort
        self._cancelled: set[str] = set()  # running request ids an Abort call ended
        self._bundle: bytes | None = None  # GetTokenizer's zip

    # ---- generation ---------------------------------------------------------------------------

    async def Generate(self, request: vllm_engine_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        """Per sample (`index`), delta chunks of new token ids when streaming, then one complete
        message. A request the server aborts ends with UNAVAILABLE, which the gateway retries
        elsewhere when nothing was sent; one that an Abort call ended, with CANCELLED."""
        if request.request_id in self._running:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request_id: {request.request_id!r} is running "
                                                                 "already; give each request its own id")
        try:
            ours = engine_request(request)  # its refusals name their fields in this protocol's terms already
        except RequestError as err:
            await context.abort(err.code, err.message)
        key = request.request_id or uuid.uuid4().hex  # held before any await: a second one is ALREADY_EXISTS
        self._running[key] = []
        aborted = False
        try:
            async with self.serving.session(ours) as session:
                samples = session.samples
                self._running[key] = samples
                unsent = _Unsent(samples)
                async for output in self.serving.outputs(samples):
                    if output.finish is FinishReason.ABORT:
                        aborted = True
                        break
                    if output.finish is not None:
                        yield vllm_engine_pb2.GenerateResponse(complete=unsent.complete(output.index, request.stream))
                        continue
                    unsent.add(output)
                    if request.stream and output.token_ids:
                        yield vllm_engine_pb2.GenerateResponse(chunk=unsent.chunk(output))
        except RequestError as err:  # only the session's start raises it: nothing was sent yet
            err = err.renamed(FIELD_NAMES, "sampling_params.")
            await context.abort(err.code, err.message)
        finally:
            del self._running[key]
        if not aborted:
            return
        if key in self._cancelled:
            self._cancelled.discard(key)
            await context.abort(grpc.StatusCode.CANCELLED, "aborted by an Abort call")
        await context.abort(grpc.StatusCode.UNAVAILABLE, SERVER_ABORTED)

    async def Abort(self, request: vllm_engine_pb2.AbortRequest, context) -> vllm_engine_pb2.AbortResponse:
        """Unknown and finished ids are no error: the gateway aborts whatever stream it dropped."""
        for request_id in request.request_ids:
            live = [seq for seq in self._running.get(request_id, ()) if seq.finish is None]
            if live:
                self._cancelled.add(request_id)
            for seq in live:
                self.serving.engine.abort(seq)
        return vllm_engine_pb2.AbortResponse()

    # ---- what the gateway reads of the worker -------------------------------------------------

    async def HealthCheck(self, request, context) -> vllm_engine_pb2.HealthCheckResponse:
        if self.serving.engine.accepting:
            return vllm_engine_pb2.HealthCheckResponse(healthy=True, message="serving")
        return vllm_engine_pb2.HealthCheckResponse(healthy=False, message="shutting down: draining requests")

    async def GetModelInfo(self, request, context) -> vllm_engine_pb2.GetModelInfoResponse:
        """tokenizer_path is the model as --model named it. A name, or a path the gateway's machine
        does not have (a .gguf file is no tokenizer folder), sends the gateway to GetTokenizer; an
        HF folder the gateway can read too (a shared /models) it loads itself."""
        loaded, config = self.serving.loaded, self.serving.config
        tokenizer = loaded.tokenizer
        return vllm_engine_pb2.GetModelInfoResponse(
            model_path=loaded.name, served_model_name=loaded.name, tokenizer_path=loaded.name,
            is_generation=True, supports_vision=False, max_context_length=config.max_model_len,
            max_req_input_len=config.max_model_len - 1, vocab_size=loaded.config.vocab_size,
            model_type=loaded.config.architecture, architectures=loaded.config.to_hf()["architectures"],
            eos_token_ids=sorted(tokenizer.eos_token_ids),
            pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else -1,
            bos_token_id=tokenizer.bos_token_id if tokenizer.bos_token_id is not None else -1)

    async def GetServerInfo(self, request, context) -> vllm_engine_pb2.GetServerInfoResponse:
        engine, scheduler = self.serving.engine, self.serving.engine.scheduler
        return vllm_engine_pb2.GetServerInfoResponse(
            active_requests=len(scheduler.running) + len(scheduler.waiting), is_paused=not engine.accepting,
            uptime_seconds=time.time() - self.started, server_type="vllm-grpc", data_parallel_size=1,
            max_num_seqs=self.serving.config.max_num_seqs,
            model_dtype=self.serving.dtype,
            kv_cache_dtype=self.serving.kv_cache_dtype,
            block_size=scheduler.kv_cache.block_size)

    async def GetLoads(self, request, context) -> vllm_engine_pb2.GetLoadsResponse:
        scheduler, config = self.serving.engine.scheduler, self.serving.config
        if request.HasField("dp_rank") and request.dp_rank != 0:
            return vllm_engine_pb2.GetLoadsResponse(timestamp=_now(), version=VERSION, dp_rank_count=1)
        load = vllm_engine_pb2.SchedulerLoad(
            dp_rank=0, num_running_reqs=len(scheduler.running), num_waiting_reqs=len(scheduler.waiting),
            num_total_reqs=len(scheduler.running) + len(scheduler.waiting),
            num_used_tokens=sum(len(seq.token_ids) for seq in scheduler.running),
            max_total_num_tokens=scheduler.kv_cache.num_blocks * scheduler.kv_cache.block_size, token_usage=scheduler.kv_usage,
            max_running_requests=config.max_num_seqs,
            num_waiting_uncached_tokens=sum(len(seq.prompt_ids) for seq in scheduler.waiting))
        return vllm_engine_pb2.GetLoadsResponse(timestamp=_now(), version=VERSION, dp_rank_count=1,
                                                loads=[load])

    async def GetTokenizer(self, request, context):
        """A flat zip of the tokenizer's HF files, in 64 KiB chunks; the last one carries its sha256."""
        if self._bundle is None:  # built once, off the event loop: it deflates the whole vocabulary
            self._bundle = await asyncio.to_thread(self._tokenizer_bundle)
        bundle = self._bundle
        digest = hashlib.sha256(bundle).hexdigest()
        chunks = [bundle[i:i + TOKENIZER_CHUNK_BYTES] for i in range(0, len(bundle), TOKENIZER_CHUNK_BYTES)]
        for index, chunk in enumerate(chunks):
            yield common_pb2.GetTokenizerChunk(data=chunk, sha256=digest if index == len(chunks) - 1 else "")

    def _tokenizer_bundle(self) -> bytes:
        loaded = self.serving.loaded
        tokenizer = loaded.tokenizer
        files = tokenizer.hf_files()
        files["config.json"] = json.dumps({**loaded.config.to_hf(), "eos_token_id": sorted(tokenizer.eos_token_ids),
                                           "bos_token_id": tokenizer.bos_token_id}, indent=2)
        buffer = io.BytesIO()
        with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as bundle:
            for name, text in sorted(files.items()):
                bundle.writestr(name, text)
        return buffer.getvalue()

    # ---- the prefix cache -------------------------------------------------------------------

    async def SubscribeKvEvents(self, request, context):
        """The prefix cache's blocks stored and removed, one batch per step (target_service/kv_event_stream.py)."""
        if not self.serving.config.prefix_caching:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "no KV events: prefix caching is off "
                                                                "(--no-prefix-caching)")
        try:
            batches = self.serving.engine.kv_events.subscribe(request.start_sequence_number)
        except RequestError as err:
            await context.abort(err.code, err.message)
        async for batch in batches:
            yield batch

    async def FlushCache(self, request, context) -> common_pb2.FlushCacheResponse:
        """Forget every cached prefix block once no request is in flight, waiting up to timeout_s for that."""
        if not 0 <= request.timeout_s < math.inf:  # NaN fails both comparisons
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"timeout_s must be a finite number of seconds, 0 or more; got {request.timeout_s}")
        engine = self.serving.engine
        deadline = time.monotonic() + request.timeout_s
        while not engine.scheduler.idle and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if not engine.scheduler.idle:
            in_flight = len(engine.scheduler.running) + len(engine.scheduler.waiting)
            return common_pb2.FlushCacheResponse(
                success=False, message=f"{in_flight} request(s) in flight; flush when idle, or give timeout_s")
        engine.scheduler.prefix_cache.clear()
        engine.publish_kv_events()
        return common_pb2.FlushCacheResponse(success=True, message="prefix cache flushed")

    # ---- what this engine does not serve ------------------------------------------------------

    async def Embed(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "embeddings are not served: this is a generation model")

    async def StartProfile(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "profiling is not served over gRPC")

    async def StopProfile(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "profiling is not served over gRPC")


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat()


@dataclass(slots=True)
class _Unsent:
    """What a request's samples have not sent yet. Each sample's logprobs go with its next chunk, or in
    its complete message; the prompt's, as vLLM sends them, with each sample's first chunk and in
    every complete message."""

    samples: list[Sequence]
    logprobs: dict[int, list[TokenLogprob]] = field(default_factory=dict)  # by index
    prompt: vllm_engine_pb2.InputLogProbs | None = None
    streamed: set[int] = field(default_factory=set)  # the samples whose first chunk went out

    def add(self, output: Output) -> None:
        self.logprobs.setdefault(output.index, []).extend(output.logprobs or ())
        if output.prompt_logprobs is not None:
            self.prompt = _input_logprobs(self.samples[0].prompt_ids, output.prompt_logprobs)

    def chunk(self, output: Output) -> vllm_engine_pb2.GenerateStreamChunk:
        """The output's tokens and what waited to be sent with them."""
        seq = self.samples[output.index]
        first = seq.index not in self.streamed
        self.streamed.add(seq.index)
        return vllm_engine_pb2.GenerateStreamChunk(
            token_ids=output.token_ids, prompt_tokens=len(seq.prompt_ids), completion_tokens=len(output.token_ids),
            cached_tokens=seq.cached_tokens, output_logprobs=_logprobs(self.logprobs.pop(seq.index, [])),
            input_logprobs=self.prompt if first else None, index=seq.index)

    def complete(self, index: int, streamed: bool) -> vllm_engine_pb2.GenerateComplete:
        """output_ids and their logprobs, unless they were streamed already; the prompt's logprobs."""
        seq = self.samples[index]
        generated = seq.token_ids[len(seq.prompt_ids):]
        complete = vllm_engine_pb2.GenerateComplete(
            output_ids=[] if streamed else generated, finish_reason=seq.finish.value,
            prompt_tokens=len(seq.prompt_ids), completion_tokens=len(generated), cached_tokens=seq.cached_tokens,
            spec_accepted_tokens=seq.accepted_tokens, spec_draft_tokens=seq.draft_tokens,
            output_logprobs=_logprobs(self.logprobs.pop(index, [])), input_logprobs=self.prompt, index=index)
        stop = seq.stop_reason
        if isinstance(stop, str):
            complete.matched_stop_str = stop
        elif stop is not None:
            complete.matched_token_id = stop
        return complete


def _logprobs(logprobs: list[TokenLogprob]) -> vllm_engine_pb2.OutputLogProbs | None:
    """The protocol's shape of the tokens' log-probabilities; None (unset) when there are none."""
    if not logprobs:
        return None
    return vllm_engine_pb2.OutputLogProbs(
        token_logprobs=[lp.logprob for lp in logprobs], token_ids=[lp.token for lp in logprobs],
        top_logprobs=[_top(lp) for lp in logprobs] if any(lp.top for lp in logprobs) else [])  # none for logprobs=0


def _input_logprobs(prompt_ids: list[int], logprobs: list[TokenLogprob]) -> vllm_engine_pb2.InputLogProbs:
    """One entry per prompt token; the first, with nothing before it, has no value and no top."""
    return vllm_engine_pb2.InputLogProbs(
        token_logprobs=[vllm_engine_pb2.InputTokenLogProb(),
                        *(vllm_engine_pb2.InputTokenLogProb(value=lp.logprob) for lp in logprobs)],
        token_ids=prompt_ids, top_logprobs=[vllm_engine_pb2.TopLogProbs(), *(_top(lp) for lp in logprobs)])


def _top(logprob: TokenLogprob) -> vllm_engine_pb2.TopLogProbs:
    return vllm_engine_pb2.TopLogProbs(values=[v for _, v in logprob.top], token_ids=[t for t, _ in logprob.top])
