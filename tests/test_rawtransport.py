"""The epoll transport of plain listeners (migratory/server/transport/raw.py), over real sockets."""

from __future__ import annotations

import asyncio
import errno
import functools
import socket
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from typing import Any

import pytest

from migratory.server.transport import raw as rt

pytestmark = pytest.mark.skipif(not rt.available(), reason="epoll is Linux's")


def sync(test: Callable[..., Coroutine[Any, Any, None]]) -> Callable[..., None]:
    """Run an async test on a fresh event loop."""

    @functools.wraps(test)
    def run(*args: Any, **kwargs: Any) -> None:
        asyncio.run(test(*args, **kwargs))

    return run


class Recorder(asyncio.Protocol):
    """Keeps what happens to it; echoes when asked."""

    instances: list[Recorder] = []

    def __init__(self, echo: bool = False) -> None:
        self.echo = echo
        self.transport: Any = None
        self.data = bytearray()
        self.events: list[str] = []
        self.lost: asyncio.Future[Exception | None] = asyncio.get_running_loop().create_future()
        Recorder.instances.append(self)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.events.append("made")

    def data_received(self, data: bytes) -> None:
        self.data += data
        if self.echo:
            self.transport.write(data)

    def eof_received(self) -> bool | None:
        self.events.append("eof")
        return None

    def pause_writing(self) -> None:
        self.events.append("pause")

    def resume_writing(self) -> None:
        self.events.append("resume")

    def connection_lost(self, exc: Exception | None) -> None:
        self.events.append("lost")
        if not self.lost.done():
            self.lost.set_result(exc)


@asynccontextmanager
async def serving(echo: bool = False) -> AsyncIterator[tuple[rt.RawServer, rt.Poller, int]]:
    loop = asyncio.get_running_loop()
    Recorder.instances = []
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    poller = rt.Poller(loop)
    server = rt.RawServer(loop, sock, lambda: Recorder(echo), poller, 128)
    try:
        yield server, poller, port
    finally:
        server.close()
        poller.close()


async def accepted(port: int) -> tuple[socket.socket, Recorder]:
    """A plain client socket and the server's protocol of its connection."""
    client = socket.create_connection(("127.0.0.1", port))
    await until(lambda: Recorder.instances)
    return client, Recorder.instances[0]


async def receive(client: socket.socket, size: int | None = None) -> bytes:
    """``size`` bytes from the server, or (no size) everything until it closes."""
    client.setblocking(False)
    loop = asyncio.get_running_loop()
    received = bytearray()
    while size is None or len(received) < size:
        data = await asyncio.wait_for(loop.sock_recv(client, 1 << 20), 10)
        if not data:
            break
        received += data
    return bytes(received)


async def until(predicate: Any, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


@sync
async def test_echo_peer_address_and_eof() -> None:
    async with serving(echo=True) as (_, poller, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"hello")
        assert await asyncio.wait_for(reader.readexactly(5), 10) == b"hello"
        server_side = Recorder.instances[0]
        assert server_side.transport.get_extra_info("peername") == writer.get_extra_info("sockname")
        assert server_side.transport.get_extra_info("socket") is None
        assert server_side.transport.peer is None  # not kept: asked of the kernel
        writer.write_eof()
        assert await asyncio.wait_for(server_side.lost, 10) is None
        assert server_side.events == ["made", "eof", "lost"]
        assert await reader.read() == b""  # the server closed after the client's end of file
        assert not poller.transports
        writer.close()


@sync
async def test_backpressure_pauses_and_resumes_and_loses_nothing() -> None:
    async with serving() as (_, _, port):
        client, server_side = await accepted(port)
        chunk = bytes(range(256)) * 256  # 64 KiB
        for _ in range(400):  # far more than the kernel buffers of a reader that does not read
            server_side.transport.write(chunk)
        assert "pause" in server_side.events
        assert server_side.transport.get_write_buffer_size() > 0
        assert await receive(client, 400 * len(chunk)) == chunk * 400
        await until(lambda: "resume" in server_side.events)
        assert server_side.transport.get_write_buffer_size() == 0
        client.close()


@sync
async def test_close_sends_what_is_buffered_first() -> None:
    async with serving() as (_, poller, port):
        client, server_side = await accepted(port)
        payload = b"z" * (3 << 20)
        server_side.transport.write(payload)
        server_side.transport.close()
        assert server_side.transport.is_closing()
        server_side.transport.write(b"after close")  # ignored, as asyncio's transports do
        assert await receive(client) == payload
        assert await asyncio.wait_for(server_side.lost, 10) is None
        assert not poller.transports
        client.close()


@sync
async def test_abort_drops_buffer_and_peer_reset_is_reported() -> None:
    async with serving() as (_, _, port):
        first = socket.create_connection(("127.0.0.1", port))
        second = socket.create_connection(("127.0.0.1", port))
        await until(lambda: len(Recorder.instances) == 2)
        one, two = Recorder.instances
        one.transport.abort()
        assert await asyncio.wait_for(one.lost, 10) is None
        second.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        second.close()  # linger 0: a reset
        await asyncio.wait_for(two.lost, 10)
        assert two.events[-1] == "lost"
        first.close()


@sync
async def test_pause_reading_holds_input_until_resumed() -> None:
    async with serving() as (_, _, port):
        client, server_side = await accepted(port)
        server_side.transport.pause_reading()
        assert not server_side.transport.is_reading()
        client.sendall(b"held")
        await asyncio.sleep(0.2)
        assert server_side.data == b""
        server_side.transport.resume_reading()
        await until(lambda: server_side.data == b"held")
        client.close()


@sync
async def test_out_of_descriptors_pauses_accepting_then_resumes(monkeypatch: pytest.MonkeyPatch) -> None:
    async with serving(echo=True) as (server, _, port):
        real = server._accept
        failures = [OSError(errno.EMFILE, "Too many open files")]

        def accept() -> tuple[int, Any]:
            if failures:
                raise failures.pop()
            return real()

        server._accept = accept
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        await asyncio.sleep(0.1)
        assert not server.serving  # waiting out the shortage, the client in the backlog
        writer.write(b"still served")
        assert await asyncio.wait_for(reader.readexactly(12), 10) == b"still served"
        assert server.serving
        writer.close()


@sync
async def test_a_failing_protocol_costs_only_its_own_connection(caplog: pytest.LogCaptureFixture) -> None:
    async with serving(echo=True) as (_, poller, port):
        bad_reader, bad_writer = await asyncio.open_connection("127.0.0.1", port)
        good_reader, good_writer = await asyncio.open_connection("127.0.0.1", port)
        await until(lambda: len(Recorder.instances) == 2)
        bad = Recorder.instances[0]

        def explode(data: bytes) -> None:
            raise RuntimeError("bug")

        bad.data_received = explode  # type: ignore[method-assign]
        bad_writer.write(b"boom")
        assert await asyncio.wait_for(bad.lost, 10) is None
        assert "protocol failed (RuntimeError: bug)" in caplog.text
        good_writer.write(b"fine")
        assert await asyncio.wait_for(good_reader.readexactly(4), 10) == b"fine"
        assert len(poller.transports) == 1
        for writer in (bad_writer, good_writer):
            writer.close()
        del bad_reader
