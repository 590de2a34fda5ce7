"""The one request path every front door shares: a GenerateRequest in, the engine's outputs out.

The gRPC Generation service, the OpenAI HTTP server and the VllmEngine service only translate
into a `generation_pb2.GenerateRequest` and out of the `Output`s of its sequence; validation,
grammar compiling, admission and abort live here, once.
"""
from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

from target_service.config import TargetConfig
from target_service.engine import Engine
from target_service.request_grammars import RequestGrammars
from target_service.sequence import Output, Sequence
from target_service.validation import validate_request
from tandem.runtime import LoadedModel
from tandem.v1 import generation_pb2

SERVER_ABORTED = "the server aborted this request (it is shutting down, or a step failed); retry it"


@dataclass(slots=True)
class Serving:
    engine: Engine
    loaded: LoadedModel
    config: TargetConfig
    grammars: RequestGrammars

    @contextlib.asynccontextmanager
    async def session(self, request: generation_pb2.GenerateRequest) -> AsyncIterator[Sequence]:
        """The request's sequence, queued in the engine, for the length of the block; RequestError
        when it is refused. Leaving the block aborts the sequence (a no-op once it finished), so a
        door that stops early for any reason (its client left, a write failed, its call was
        cancelled) frees the slot at once."""
        seq = await self._submit(request)
        try:
            yield seq
        finally:
            self.engine.abort(seq)

    async def _submit(self, request: generation_pb2.GenerateRequest) -> Sequence:
        prompt_ids, options = validate_request(
            request, self.loaded.tokenizer, self.config, self.loaded.name, self.loaded.config.vocab_size
        )
        grammar = await self.grammars.matcher_for(options.constraint) if options.constraint else None
        seq = self.engine.new_sequence(request.request_id, prompt_ids, options, grammar)
        self.engine.submit(seq)
        return seq

    @staticmethod
    async def outputs(seq: Sequence) -> AsyncIterator[Output]:
        """The sequence's outputs up to the one that finishes it."""
        while True:
            output = await seq.outbox.get()
            yield output
            if output.finish is not None:
                return

    @property
    def drafter_model(self) -> str | None:
        """The connected drafter's model; None when no drafter is connected."""
        return self.engine.speculator.drafter_model

    @property
    def dtype(self) -> str:
        return str(self.loaded.model.dtype).removeprefix("torch.")
