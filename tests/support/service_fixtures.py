"""Helpers for tests that run the services as real processes on loopback."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager
from pathlib import Path

import grpc

from tandem.client import GenerationResult, generate, open_channel
from tandem.launch import ServiceProcess, free_port
from tandem.metrics_scrape import metric, scrape  # noqa: F401 (re-exported to tests)
from tandem.tls import ClientTls, bearer_metadata
from tandem.v1 import drafter_pb2_grpc, generation_pb2, generation_pb2_grpc

PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "List three fruits that are red.",
    "Explain photosynthesis in one sentence.",
    "Repeat after me: the quick brown fox jumps over the lazy dog. The quick brown fox",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 12?",
    "Summarize: Tandem splits speculative decoding into a target service and a draft service.",
]


SLOWING_FLAGS = ("--min-step-ms", "--delay-ms")


def service_process(module: str, args: list[str], **options) -> ServiceProcess:
    """A ServiceProcess of `module`; one given a slowing flag runs through tests.support.slowed."""
    if any(flag in args for flag in SLOWING_FLAGS):
        return ServiceProcess("tests.support.slowed", ["--service", module, *args], **options)
    return ServiceProcess(module, args, **options)


def protobuf_field(number: int, payload: bytes) -> bytes:
    """A length-delimited field in protobuf's wire format (a string, bytes or sub-message): appended
    to a serialized message, it puts raw bytes where a string belongs."""
    def varint(n: int) -> bytes:
        out = bytearray()
        while True:
            byte, n = n & 0x7F, n >> 7
            out.append(byte | (0x80 if n else 0))
            if not n:
                return bytes(out)

    return varint(number << 3 | 2) + varint(len(payload)) + payload


def greedy_request(prompt: str, max_tokens: int, **extra) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(
        chat=generation_pb2.ChatMessages(messages=[generation_pb2.ChatMessage(role="user", content=prompt)]),
        sampling_params=generation_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, **extra),
    )


def run_requests(address: str, requests: list[generation_pb2.GenerateRequest], timeout: float = 300.0,
                 concurrency: int = 64, tls: ClientTls | None = None, token: str = "") -> list[GenerationResult]:
    """Sends the requests over one channel, at most `concurrency` at a time, and waits for all."""

    async def main() -> list[GenerationResult]:
        limit = asyncio.Semaphore(concurrency)
        async with open_channel(address, tls, token) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)

            async def one(request: generation_pb2.GenerateRequest) -> GenerationResult:
                async with limit:
                    return await generate(stub, request, timeout=timeout)

            return await asyncio.gather(*(one(r) for r in requests))

    return asyncio.run(main())


def call_error(address: str, request: generation_pb2.GenerateRequest, tls: ClientTls | None = None,
               token: str = "") -> grpc.RpcError:
    """The error a request ends with (the test fails if it succeeds)."""
    channel = grpc.insecure_channel(address) if tls is None else grpc.secure_channel(address, tls.credentials())
    with channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        try:
            list(stub.Generate(request, timeout=60, metadata=bearer_metadata(token)))
        except grpc.RpcError as err:
            return err
    raise AssertionError("the request succeeded; an error was expected")


async def timed_responses(stub: generation_pb2_grpc.GenerationStub, request: generation_pb2.GenerateRequest,
                          timeout: float = 300.0) -> list[tuple[float, generation_pb2.GenerateResponse]]:
    """Every response of one Generate call, each with its arrival time on time.monotonic's clock."""
    return [(time.monotonic(), response) async for response in stub.Generate(request, timeout=timeout)]

@contextmanager
def target_with_drafter(drafter: drafter_pb2_grpc.DrafterServicer, log_dir: Path,
                        *target_args: str) -> Iterator[ServiceProcess]:
    """A healthy target process whose drafter is a test's own servicer, served from this process."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    drafter_pb2_grpc.add_DrafterServicer_to_server(drafter, server)
    port = free_port()
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    target = ServiceProcess("target_service", ["--threads", "1", "--max-model-len", "512", *target_args,
                                               "--drafter", f"127.0.0.1:{port}"], log_path=log_dir / "target.log")
    try:
        yield target.start().wait_healthy()
    finally:
        target.kill()
        server.stop(0)
