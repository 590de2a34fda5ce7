"""The target's end of the Speculate stream: connect, check, stream, and reconnect with backoff.

Sending never blocks a step: updates go into a queue that the stream drains. While the drafter
is down, updates are dropped; on reconnect every running sequence is opened afresh.
"""
from __future__ import annotations

import asyncio
import logging

import grpc

from target_service.metrics import TargetMetrics
from tandem.grpc_server import channel_options
from tandem.v1 import drafter_pb2, drafter_pb2_grpc

log = logging.getLogger(__name__)

INITIAL_BACKOFF_SECONDS = 0.1


class IncompatibleDrafter(Exception):
    """The drafter's vocabulary or tokenizer differs from the target's."""


class DrafterLink:
    def __init__(self, address: str, engine, metrics: TargetMetrics, *, vocab_size: int,
                 tokenizer_fingerprint: str, reconnect_max_seconds: float, max_message_bytes: int):
        self.address = address
        self.engine = engine
        self.metrics = metrics
        self.vocab_size = vocab_size
        self.tokenizer_fingerprint = tokenizer_fingerprint
        self.reconnect_max_seconds = reconnect_max_seconds
        self.max_message_bytes = max_message_bytes
        self.info: drafter_pb2.DrafterInfo | None = None
        self.connected = False
        self._queue: asyncio.Queue[drafter_pb2.TargetUpdate] = asyncio.Queue()
        self._task: asyncio.Task | None = None

    @property
    def max_k(self) -> int:
        return self.info.max_k if self.info else 0

    @property
    def probs_top_k(self) -> int:
        return self.info.probs_top_k if self.info else 0

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="drafter-link")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def send(self, update: drafter_pb2.TargetUpdate) -> None:
        if self.connected:
            self._queue.put_nowait(update)

    async def _run(self) -> None:
        backoff = INITIAL_BACKOFF_SECONDS
        while True:
            try:
                await self._session()
                backoff = INITIAL_BACKOFF_SECONDS  # it was up; a fresh failure starts the backoff over
            except asyncio.CancelledError:
                raise
            except IncompatibleDrafter as err:
                log.error("refusing drafter at %s: %s", self.address, err)
                backoff = self.reconnect_max_seconds
            except grpc.aio.AioRpcError as err:
                log.warning("drafter at %s: %s (%s)", self.address, err.code().name, err.details())
            except Exception:
                log.exception("drafter link failed")
            finally:
                self._set_connected(False)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.reconnect_max_seconds)

    async def _session(self) -> None:
        async with grpc.aio.insecure_channel(self.address, options=channel_options(self.max_message_bytes)) as channel:
            stub = drafter_pb2_grpc.DrafterStub(channel)
            info = await stub.Info(drafter_pb2.DrafterInfoRequest(), timeout=5.0)
            self._check(info)
            self.info = info
            self._queue = asyncio.Queue()
            self._set_connected(True)
            log.info("drafter connected: %s (%s, k <= %d) at %s", info.model, info.kind, info.max_k, self.address)
            self._queue.put_nowait(self.engine.reopen_all())
            call = stub.Speculate(self._updates())
            async for message in call:
                self.engine.on_proposals(message, message.ByteSize())
            log.warning("drafter at %s closed the stream", self.address)

    async def _updates(self):
        while True:
            yield await self._queue.get()

    def _check(self, info: drafter_pb2.DrafterInfo) -> None:
        if info.vocab_size != self.vocab_size:
            raise IncompatibleDrafter(f"vocabulary of {info.vocab_size} tokens; the target has {self.vocab_size}")
        if info.tokenizer_fingerprint != self.tokenizer_fingerprint:
            raise IncompatibleDrafter("its tokenizer fingerprint differs from the target's")
        if info.max_k < 1:
            raise IncompatibleDrafter(f"max_k {info.max_k} must be at least 1")

    def _set_connected(self, connected: bool) -> None:
        self.connected = connected
        self.metrics.drafter_connected.set(1 if connected else 0)
