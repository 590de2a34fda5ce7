"""The target's end of the Speculate stream: connect, check, stream, and reconnect with backoff.

Sending never blocks a step: updates go into a queue that the stream drains. While the drafter
is down, updates are dropped; on reconnect every running sequence is opened afresh. A drafter
that stops reading would let that queue grow without end, so past a bound the link is dropped
and made again, like any other drafter failure.

With several drafters (addresses.py) the link holds one stream, to one of them: it starts
at a random one, so that targets spread over the drafters, and after a failure it moves on to the
next at once, reopening its sequences there; it waits out the backoff only once every drafter has
failed in a row.
"""
from __future__ import annotations

import asyncio
import logging
import random

import grpc

from target_service.metrics import TargetMetrics
from target_service.speculation.addresses import Candidate, DrafterAddresses
from target_service.speculation.speculator import DrafterPeer
from tandem.grpc_server import channel_options
from tandem.hidden_states import FeatureError, FeatureLayout
from tandem.tls import ClientTls
from tandem.v1 import drafter_pb2, drafter_pb2_grpc

log = logging.getLogger(__name__)

INITIAL_BACKOFF_SECONDS = 0.1
# One update per step: thousands are tens of seconds of steps that a live drafter would have read.
MAX_PENDING_UPDATES = 4096


class IncompatibleDrafter(Exception):
    """The drafter's vocabulary or tokenizer differs from the target's."""


class DrafterStalled(Exception):
    """The drafter stopped reading updates: the ones queued for it passed the bound."""


class DrafterLink:
    def __init__(self, drafters: str | DrafterAddresses, peer: DrafterPeer, metrics: TargetMetrics, *,
                 vocab_size: int, tokenizer_fingerprint: str, reconnect_max_seconds: float, max_message_bytes: int,
                 tls: ClientTls | None = None, max_pending_updates: int = MAX_PENDING_UPDATES,
                 num_layers: int = 0, hidden_size: int = 0):
        """num_layers, hidden_size: the target's, which a drafter that reads features must fit."""
        self.drafters = drafters if isinstance(drafters, DrafterAddresses) else DrafterAddresses.parse(drafters)
        self.address = ""  # the drafter tried or connected last
        self.peer = peer  # hears every proposal, and reopens the running sequences on each connect
        self.metrics = metrics
        self.vocab_size = vocab_size
        self.tokenizer_fingerprint = tokenizer_fingerprint
        self.reconnect_max_seconds = reconnect_max_seconds
        self.max_message_bytes = max_message_bytes
        self.tls = tls
        self.max_pending_updates = max_pending_updates
        self.num_layers = num_layers
        self.hidden_size = hidden_size
        self.feature_layout: FeatureLayout | None = None  # the connected drafter's, when it reads features
        self._call: grpc.aio.StreamStreamCall | None = None
        self._stalled = False
        self._went_up = False  # whether the current attempt connected
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
        if not self.connected:
            return
        if self._queue.qsize() >= self.max_pending_updates:
            self._stalled = True
            self._set_connected(False)
            if self._call is not None:
                self._call.cancel()  # _session turns the cancel into DrafterStalled; _run reconnects
            return
        self._queue.put_nowait(update)

    async def _run(self) -> None:
        backoff = INITIAL_BACKOFF_SECONDS
        turn = random.randrange(1 << 16)  # which drafter first: targets spread over them
        failed_in_a_row = 0
        while True:
            candidates = await self.drafters.resolve()
            self._went_up = False
            try:
                if not candidates:
                    raise LookupError("the drafter's DNS name resolved to no address")
                candidate = candidates[turn % len(candidates)]
                self.address = candidate.address
                await self._session(candidate)
            except asyncio.CancelledError:
                raise
            except DrafterStalled as err:
                log.warning("dropping the drafter link to %s: %s", self.address, err)
            except IncompatibleDrafter as err:
                log.error("refusing drafter at %s: %s", self.address, err)
                backoff = self.reconnect_max_seconds
            except grpc.aio.AioRpcError as err:
                log.warning("drafter at %s: %s (%s)", self.address, err.code().name, err.details())
            except LookupError as err:
                log.warning("drafter %s: %s", self.drafters.endpoints[0].address, err)
            except Exception:
                log.exception("drafter link failed")
            finally:
                self._set_connected(False)
            was_up = self._went_up
            turn += 1  # the next drafter: one that just failed is tried again last
            failed_in_a_row = 0 if was_up else failed_in_a_row + 1
            if was_up:
                backoff = INITIAL_BACKOFF_SECONDS  # it was up; a fresh failure starts the backoff over
            if was_up or failed_in_a_row < len(candidates):
                await asyncio.sleep(INITIAL_BACKOFF_SECONDS)
                continue
            failed_in_a_row = 0  # every drafter failed in a row: wait before the next round
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.reconnect_max_seconds)

    async def _session(self, candidate: Candidate) -> None:
        """One stream to one drafter, until it ends; raises on failures. Sets _went_up once connected."""
        async with self._channel(candidate) as channel:
            stub = drafter_pb2_grpc.DrafterStub(channel)
            info = await stub.Info(drafter_pb2.DrafterInfoRequest(), timeout=5.0)
            self.feature_layout = self._check(info)
            self.info = info
            self._queue = asyncio.Queue()
            self._stalled = False
            self._set_connected(True)
            self._went_up = True
            log.info("drafter connected: %s (%s, k <= %d) at %s", info.model, info.kind, info.max_k, self.address)
            self._queue.put_nowait(self.peer.reopen_all())
            self._call = call = stub.Speculate(self._updates())
            try:
                async for message in call:
                    self.peer.on_proposals(message, message.ByteSize())
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if not self._stalled or getattr(task, "cancelling", lambda: 0)():  # link.stop() wins
                    raise
                raise DrafterStalled(f"{self.max_pending_updates} updates queued unread") from None
            finally:
                self._call = None
            log.warning("drafter at %s closed the stream", self.address)

    def _channel(self, candidate: Candidate) -> grpc.aio.Channel:
        # Certificates are read at each connect, so that rotated files are picked up on reconnect.
        options = channel_options(self.max_message_bytes)
        if self.tls is None:
            return grpc.aio.insecure_channel(candidate.address, options=options)
        if candidate.server_name:  # an address from DNS: the certificate names the DNS name, not the IP
            options = [*options, ("grpc.ssl_target_name_override", candidate.server_name)]
        return grpc.aio.secure_channel(candidate.address, self.tls.credentials(), options=options)

    async def _updates(self):
        while True:
            yield await self._queue.get()

    def _check(self, info: drafter_pb2.DrafterInfo) -> FeatureLayout | None:
        """IncompatibleDrafter unless the target can serve this drafter; the features it reads, if any."""
        if info.vocab_size != self.vocab_size:
            raise IncompatibleDrafter(f"vocabulary of {info.vocab_size} tokens; the target has {self.vocab_size}")
        if info.tokenizer_fingerprint != self.tokenizer_fingerprint:
            raise IncompatibleDrafter("its tokenizer fingerprint differs from the target's")
        if info.max_k < 1:
            raise IncompatibleDrafter(f"max_k {info.max_k} must be at least 1")
        if not info.hidden_layers:
            return None
        if info.target_hidden_size != self.hidden_size:
            raise IncompatibleDrafter(f"it reads features of hidden size {info.target_hidden_size}; "
                                      f"the target's is {self.hidden_size}")
        layout = FeatureLayout(tuple(info.hidden_layers), info.target_hidden_size)
        try:
            layout.check_layers(self.num_layers)
        except FeatureError as err:
            raise IncompatibleDrafter(str(err)) from None
        return layout

    def _set_connected(self, connected: bool) -> None:
        self.connected = connected
        self.metrics.drafter_connected.set(1 if connected else 0)
