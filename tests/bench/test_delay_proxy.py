"""The delay proxy: every byte arrives, in order, no sooner than its delay; a partition holds bytes
without closing, and healing delivers them."""
from __future__ import annotations

import asyncio
import time

import pytest

from bench.delay_proxy import Delay, DelayProxy


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(65536):
        writer.write(data)
        await writer.drain()
    writer.close()


@pytest.fixture
async def echo_port():
    server = await asyncio.start_server(_echo, "127.0.0.1", 0)
    yield server.sockets[0].getsockname()[1]
    server.close()


async def _proxy(port: int, delay: Delay) -> DelayProxy:
    return await DelayProxy("127.0.0.1", port, delay, seed=1).start()


async def test_a_round_trip_takes_twice_the_one_way_delay(echo_port):
    proxy = await _proxy(echo_port, Delay(0.03))
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
    for _ in range(3):
        began = time.perf_counter()
        writer.write(b"ping")
        assert await reader.readexactly(4) == b"ping"
        assert time.perf_counter() - began >= 0.06
    writer.close()
    await proxy.close()


async def test_jitter_keeps_byte_order(echo_port):
    """Each chunk draws its own delay, yet none overtakes the one sent before it."""
    proxy = await _proxy(echo_port, Delay(0.001, jitter=0.01))
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
    sent = b"".join(f"{i:05d}".encode() for i in range(300))
    for i in range(0, len(sent), 5):
        writer.write(sent[i:i + 5])
        await writer.drain()
        await asyncio.sleep(0)
    got = await asyncio.wait_for(reader.readexactly(len(sent)), 10)
    assert got == sent
    writer.close()
    await proxy.close()


async def test_a_partition_holds_bytes_without_closing_and_healing_delivers_them(echo_port):
    proxy = await _proxy(echo_port, Delay(0.0))
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
    writer.write(b"before")
    assert await reader.readexactly(6) == b"before"
    proxy.partition()
    writer.write(b"during")
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(reader.readexactly(6), 0.3)
    assert not reader.at_eof()
    proxy.heal()
    assert await asyncio.wait_for(reader.readexactly(6), 5) == b"during"
    writer.close()
    await proxy.close()


async def test_closing_one_side_closes_the_other(echo_port):
    proxy = await _proxy(echo_port, Delay(0.005))
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
    writer.write(b"last words")
    writer.write_eof()
    assert await asyncio.wait_for(reader.read(), 5) == b"last words"
    writer.close()
    await proxy.close()


def test_negative_delays_are_refused():
    with pytest.raises(ValueError, match="delays must be >= 0"):
        Delay(-0.001)
