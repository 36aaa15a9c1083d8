"""Plain-WebSocket broadcast servers that the kit compares against.

``ws-broadcast``: a bare ``asyncio.Protocol`` on uvloop: frame built once, one write
per message and subscriber (the floor for a Python server). ``websockets``: the
websockets library's ``broadcast()`` with its task-per-connection server. In both,
every binary message a client sends is delivered to every other client.
Run as ``python -m migratory.bench.peers KIND HOST PORT``.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import struct
import sys
from typing import cast

__all__ = ["main"]

GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"


def _frame(payload: bytes) -> bytes:
    n = len(payload)
    if n < 126:
        return bytes((0x82, n)) + payload
    if n < 65536:
        return struct.pack("!BBH", 0x82, 126, n) + payload
    return struct.pack("!BBQ", 0x82, 127, n) + payload


class _Bare(asyncio.Protocol):
    __slots__ = ("buf", "clients", "transport", "up")

    def __init__(self, clients: set[_Bare]) -> None:
        self.clients = clients
        self.buf = b""
        self.up = False
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.clients.discard(self)

    def data_received(self, data: bytes) -> None:
        buf = self.buf + data
        assert self.transport is not None
        if not self.up:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                self.buf = buf
                return
            key = b""
            for line in buf[:end].split(b"\r\n"):
                if line.lower().startswith(b"sec-websocket-key:"):
                    key = line.split(b":", 1)[1].strip()
            accept = base64.b64encode(hashlib.sha1(key + GUID).digest())
            self.transport.write(
                b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                b"Sec-WebSocket-Accept: " + accept + b"\r\n\r\n"
            )
            self.up = True
            self.clients.add(self)
            buf = buf[end + 4 :]
        pos = 0
        while len(buf) - pos >= 6:
            length = buf[pos + 1] & 0x7F
            head = 2
            if length == 126:
                (length,) = struct.unpack_from("!H", buf, pos + 2)
                head = 4
            elif length == 127:
                (length,) = struct.unpack_from("!Q", buf, pos + 2)
                head = 10
            if len(buf) - pos < head + 4 + length:
                break
            mask = buf[pos + head : pos + head + 4]
            raw = buf[pos + head + 4 : pos + head + 4 + length]
            opcode = buf[pos] & 0x0F
            pos += head + 4 + length
            if opcode != 0x2:
                continue
            repeated = (mask * (length // 4 + 1))[:length]
            payload = (int.from_bytes(raw, "little") ^ int.from_bytes(repeated, "little")).to_bytes(length, "little")
            frame = _frame(payload)  # built once, written to every client
            for client in self.clients:
                if client is not self and client.transport is not None:
                    client.transport.write(frame)
        self.buf = buf[pos:]


async def _serve_bare(host: str, port: int) -> None:
    clients: set[_Bare] = set()
    server = await asyncio.get_running_loop().create_server(lambda: _Bare(clients), host, port, backlog=4096)
    async with server:
        await server.serve_forever()


async def _serve_websockets(host: str, port: int) -> None:
    from websockets.asyncio.server import ServerConnection, broadcast, serve

    clients: set[ServerConnection] = set()

    async def handler(ws: ServerConnection) -> None:
        clients.add(ws)
        try:
            async for message in ws:
                broadcast([c for c in clients if c is not ws], message)
        finally:
            clients.discard(ws)

    async with serve(handler, host, port, compression=None, max_size=None, backlog=4096) as server:
        await server.serve_forever()


def main() -> None:
    kind, host, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    import uvloop

    uvloop.run(_serve_bare(host, port) if kind == "ws-broadcast" else _serve_websockets(host, port))


if __name__ == "__main__":
    main()
