"""The one request path every front door shares: a GenerateRequest in, the engine's outputs out.

The gRPC Generation service, the OpenAI HTTP server and the VllmEngine service only translate
into a `generation_pb2.GenerateRequest` and out of the `Output`s of its sequence; validation,
grammar compiling, admission and abort live here, once.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator
from dataclasses import dataclass

from target_service.config import TargetConfig
from target_service.engine import Engine
from target_service.front_doors.request_grammars import RequestGrammars
from target_service.front_doors.tool_calls import ToolChoice
from target_service.front_doors.validation import validate_request
from target_service.sequence import Output, Sequence
from tandem.runtime import LoadedModel, dtype_name
from tandem.v1 import generation_pb2

SERVER_ABORTED = "the server aborted this request (it is shutting down, or a step failed); retry it"


@dataclass(frozen=True, slots=True)
class Session:
    """A request being served: its samples in the engine, and what its answer may call."""

    samples: list[Sequence]
    tool_choice: ToolChoice | None  # a chat's tool_choice that lets it call; the doors read the calls


@dataclass(slots=True)
class Serving:
    engine: Engine
    loaded: LoadedModel
    config: TargetConfig
    grammars: RequestGrammars

    @contextlib.asynccontextmanager
    async def session(self, request: generation_pb2.GenerateRequest) -> AsyncIterator[Session]:
        """The request's samples (one unless it asks for n), queued in the engine, for the length of
        the block; RequestError when it is refused. Leaving the block aborts them (a no-op for those
        that finished), so a door that stops early for any reason (its client left, a write failed,
        its call was cancelled) frees their slots at once."""
        session = await self._submit(request)
        try:
            yield session
        finally:
            for seq in session.samples:
                self.engine.abort(seq)

    async def _submit(self, request: generation_pb2.GenerateRequest) -> Session:
        prompt_ids, options, tool_choice = validate_request(
            request, self.loaded.tokenizer, self.config, self.loaded.name, self.loaded.config.vocab_size
        )
        grammars = await self.grammars.matchers_for(options.constraint, options.n) if options.constraint else None
        samples = self.engine.new_sequences(request.request_id, prompt_ids, options, grammars)
        self.engine.submit(samples)
        return Session(samples, tool_choice)

    @staticmethod
    async def outputs(samples: list[Sequence]) -> AsyncIterator[Output]:
        """The samples' outputs as they come (Output.index says whose), up to the last one that finishes."""
        outbox, running = samples[0].outbox, len(samples)
        while running:
            output = await outbox.get()
            yield output
            running -= output.finish is not None

    @staticmethod
    async def batch_outputs(groups: list[list[Sequence]]) -> AsyncIterator[tuple[int, Output]]:
        """The outputs of several requests' samples as they come, each with its sample's place in the
        groups laid end to end (a batch of prompts: prompt p's sample i is choice p * n + i)."""
        if len(groups) == 1:
            async for output in Serving.outputs(groups[0]):
                yield output.index, output
            return
        merged: asyncio.Queue[tuple[int, Output]] = asyncio.Queue()

        async def forward(first: int, samples: list[Sequence]) -> None:
            async for output in Serving.outputs(samples):
                merged.put_nowait((first + output.index, output))

        firsts = itertools.accumulate((len(samples) for samples in groups[:-1]), initial=0)
        forwarders = [asyncio.create_task(forward(first, samples)) for first, samples in zip(firsts, groups)]
        try:
            running = sum(len(samples) for samples in groups)
            while running:
                choice, output = await merged.get()
                yield choice, output
                running -= output.finish is not None
        finally:
            for task in forwarders:
                task.cancel()

    @property
    def drafter_model(self) -> str | None:
        """The connected drafter's model; None when no drafter is connected."""
        return self.engine.speculator.drafter_model

    @property
    def dtype(self) -> str:
        return dtype_name(self.loaded.model.dtype)

    @property
    def kv_cache_dtype(self) -> str:
        """As vLLM names it: auto for a cache in the model's dtype, else the cache's."""
        cache = dtype_name(self.loaded.model.kv_cache.dtype)
        return "auto" if cache == self.dtype else cache
