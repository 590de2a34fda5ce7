"""What both services' gRPC servers share: uvloop, health, reflection, metrics, limits, SIGTERM,
and a garbage collector that leaves what startup built alone."""
from __future__ import annotations

import asyncio
import gc
import logging
import signal
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry, start_http_server

from tandem.tls import ServerTls

log = logging.getLogger(__name__)

DEFAULT_MAX_MESSAGE_BYTES = 16 * 1024 * 1024


@dataclass(slots=True)
class ServerOptions:
    host: str = "127.0.0.1"
    port: int = 50051
    metrics_port: int = 9090  # 0 turns the /metrics endpoint off
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    grace_seconds: float = 30.0
    tls: ServerTls | None = None  # None serves plaintext (loopback, or behind a TLS-terminating proxy)


def channel_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    """Explicit message limits, and keepalives so that a dead peer is noticed."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", 10_000),
        ("grpc.keepalive_timeout_ms", 5_000),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.keepalive_permit_without_calls", 1),
    ]


MAX_PENDING_CALLS = 20_000


def server_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    """The channel options, and acceptance of the clients' keepalive pings: gRPC servers answer
    pings more often than every 5 minutes with GOAWAY "too_many_pings" by default."""
    return channel_options(max_message_bytes) + [
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
        ("grpc.http2.max_ping_strikes", 0),
        # Calls that arrived but that no handler has taken yet. Past gRPC's default (1,000) it
        # cancels them (CANCELLED, "too many pending requests"): a burst of 2,000 streams lost
        # about 180. The services answer a burst themselves, with RESOURCE_EXHAUSTED past --max-queue.
        ("grpc.server.max_pending_requests", MAX_PENDING_CALLS),
        ("grpc.server.max_pending_requests_hard_limit", MAX_PENDING_CALLS),
    ]


def set_torch_threads(threads: int) -> None:
    """One service per core by default: two busy services on two cores must not oversubscribe."""
    torch.set_num_threads(max(1, threads))


def install_event_loop() -> None:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency except on Windows
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


@dataclass(slots=True)
class RunningServer:
    server: grpc.aio.Server
    health: health_aio.HealthServicer
    service_names: list[str]
    port: int

    async def set_serving(self, serving: bool) -> None:
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for name in ["", *self.service_names]:
            await self.health.set(name, status)


async def start_server(
    options: ServerOptions,
    register: Callable[[grpc.aio.Server], None],
    service_names: list[str],
    registry: CollectorRegistry | None,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
) -> RunningServer:
    """Starts gRPC (with health and reflection) and the /metrics HTTP endpoint."""
    server = grpc.aio.server(options=server_options(options.max_message_bytes), interceptors=list(interceptors))
    register(server)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection(
        [*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
        server,
    )
    address = f"{options.host}:{options.port}"
    if options.tls is not None:
        port = server.add_secure_port(address, options.tls.credentials())
    else:
        port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"cannot bind gRPC to {options.host}:{options.port}")
    await server.start()
    if options.metrics_port and registry is not None:
        start_http_server(options.metrics_port, addr=options.host, registry=registry)
    running = RunningServer(server=server, health=health, service_names=service_names, port=port)
    await running.set_serving(True)
    security = ("plaintext" if options.tls is None else
                "mTLS" if options.tls.client_ca_file else "TLS")
    log.info("serving %s on %s:%d (%s)", ", ".join(service_names), options.host, port, security)
    return running


def freeze_startup_heap() -> None:
    """Collect once, then move every object startup made (model, tokenizer, modules: about 220,000
    on a target) out of the collector's reach. A full collection scanned them for 90-100 ms (a
    SmolLM2 target, measured), a pause for every stream; after the freeze it scans only what
    serving made. vLLM and SGLang freeze their heaps after warm-up too."""
    gc.collect()
    gc.freeze()
    log.info("froze %d objects made at startup out of the garbage collector's scans", gc.get_freeze_count())


async def serve_until_signal(
    running: RunningServer,
    grace_seconds: float,
    drain: Callable[[float], Awaitable[None]],
    also: Sequence[RunningServer] = (),
) -> None:
    """Runs until SIGTERM/SIGINT, then: health NOT_SERVING, drain within the grace period, stop.

    also: more servers of the same process (another port), stopped alike."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("shutting down: draining for up to %.1f s", grace_seconds)
    servers = [running, *also]
    for server in servers:
        await server.set_serving(False)
    await drain(grace_seconds)
    await asyncio.gather(*(server.server.stop(grace_seconds) for server in servers))
