"""Plain TCP connections served from one epoll set per worker, without a loop transport each.

uvloop gives every connection a transport object of 680 bytes, a libuv handle of 248,
an entry in a weak-value dictionary, a socket wrapper and an empty list: about 1.2 KB
of the 1.8 KB an idle subscribed connection cost (tracemalloc, bench/million.md). A
million connections on one host is a memory problem first, so plain listeners
(``ws://``, ``http://``) accept their clients here instead: the event loop watches one
epoll descriptor per worker, and a connection is a file descriptor, a small transport
with ``__slots__`` and a dict entry.

Writes go straight to the socket and only what the kernel did not take is kept (and
watched with EPOLLOUT); reads are level-triggered into one buffer shared by the
worker. While what is kept is over the high-water mark (the protocol is paused for
writing) the connection is not read either, as ``openssl s_server`` does: a peer that
sends requests and never reads their answers stops being read once its answers pile
up, instead of making the server keep them all (review of issue 31, D5). The protocol
side is asyncio's (``connection_made``, ``data_received``, ``eof_received``,
``connection_lost``, ``pause_writing``, ``resume_writing``), so a
:class:`~migratory.server.sessions.connection.Connection` does not know which transport it
has; ``LeanTransport = false`` gives it the event loop's again (whose reading does not
wait for its writing).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import select
import socket
from collections.abc import Callable
from typing import Any

__all__ = ["Poller", "RawServer", "RawTransport", "available"]

log = logging.getLogger("migratory.server")

_IN = select.EPOLLIN if hasattr(select, "EPOLLIN") else 1
_OUT = select.EPOLLOUT if hasattr(select, "EPOLLOUT") else 4
_HUP = ~(_IN | _OUT)  # EPOLLHUP, EPOLLERR: reported whether watched or not
_READ_SIZE = 65536
_MAX_EVENTS = 1024  # per loop turn: the rest stay ready (level-triggered) for the next
_ACCEPTS_PER_TURN = 128
_HIGH_WATER = 64 * 1024  # asyncio's default write-buffer limits
_LOW_WATER = 16 * 1024
_FD_LIMIT_PAUSE = 0.5  # seconds without accepting after EMFILE/ENFILE


def available() -> bool:
    """Linux's epoll is what this module is built on."""
    return hasattr(select, "epoll")


class Poller:
    """One epoll set per worker, read from a single event-loop reader callback."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.epoll = select.epoll()
        self.transports: dict[int, RawTransport] = {}
        self.buffer = bytearray(_READ_SIZE)
        self.view = memoryview(self.buffer)
        loop.add_reader(self.epoll.fileno(), self._events)

    def _events(self) -> None:
        transports = self.transports
        for fd, mask in self.epoll.poll(0, _MAX_EVENTS):
            transport = transports.get(fd)
            if transport is None:  # closed by an earlier callback of this turn
                continue
            try:
                if mask & _OUT:
                    transport._write_ready()
                # not read if an earlier callback of this turn paused its reading (unless hung up or failed)
                if mask & ~_OUT and transports.get(fd) is transport and (transport._mask & _IN or mask & _HUP):
                    transport._read_ready()
            except Exception as exc:  # a protocol's bug costs its connection, never the others of this turn
                log.error("connection dropped: its protocol failed (%s: %s)", type(exc).__name__, exc)
                transport.abort()

    def close(self) -> None:
        """Abort what is still open and stop watching."""
        for transport in list(self.transports.values()):
            transport.abort()
        self.loop.remove_reader(self.epoll.fileno())
        self.epoll.close()


class RawTransport:
    """One accepted TCP connection: an ``asyncio.Transport`` for what a Connection uses."""

    __slots__ = ("_buffer", "_closing", "_mask", "_paused_protocol", "_reading", "fd", "peer", "poller", "protocol")

    def __init__(self, poller: Poller, fd: int, peer: Any, protocol: asyncio.Protocol) -> None:
        self.poller = poller
        self.fd = fd
        self.peer = peer
        self.protocol = protocol
        self._buffer: bytearray | None = None  # what the kernel has not taken yet
        self._closing = False
        self._paused_protocol = False
        self._reading: bool | None = True  # the protocol's wish (pause_reading); None after end of file
        self._mask = _IN
        poller.transports[fd] = self
        poller.epoll.register(fd, _IN)

    # --- asyncio.Transport --------------------------------------------------------------

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        """``peername`` only (kept while the protocol starts, asked of the kernel afterwards)."""
        if name != "peername" or self.fd < 0:
            return default
        if self.peer is not None:
            return self.peer
        sock = socket.socket(fileno=self.fd)  # the kernel tells the family
        try:
            return sock.getpeername()
        except OSError:
            return default
        finally:
            sock.detach()

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        """A WebSocket upgrade hands the connection to another session protocol (MQTT over WebSocket)."""
        assert isinstance(protocol, asyncio.Protocol)
        self.protocol = protocol

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self.protocol

    def is_closing(self) -> bool:
        return self._closing

    def is_reading(self) -> bool:
        return bool(self._mask & _IN)

    def pause_reading(self) -> None:
        if self._reading:
            self._reading = False
            if not self._closing:
                self._watch(self._mask & ~_IN)

    def resume_reading(self) -> None:
        """Read again, unless the peer is not reading what we wrote (then once it has: see :meth:`_write_ready`)."""
        if self._reading is False:
            self._reading = True
            if not self._closing and not self._paused_protocol:
                self._watch(self._mask | _IN)

    def get_write_buffer_size(self) -> int:
        return len(self._buffer) if self._buffer is not None else 0

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return _LOW_WATER, _HIGH_WATER

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Send now; keep only what the kernel did not take."""
        if self._closing:
            return
        buffer = self._buffer
        if buffer is not None:
            buffer += data
            self._pause_if_full(buffer)
            return
        try:
            sent = os.write(self.fd, data)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError as exc:
            self._fail(exc)
            return
        if sent != len(data):
            self._keep(memoryview(data)[sent:])

    def _keep(self, rest: bytes | bytearray | memoryview) -> None:
        """What the kernel did not take of a write made while nothing was queued: kept, and watched.

        Also for a TLS transport that writes its sealed record to :attr:`fd` itself (``Sealer.send``
        in migratory/server/transport/tls/records.py) when nothing is queued and the transport is not closing.
        """
        self._buffer = buffer = bytearray(rest)
        self._watch(self._mask | _OUT)
        self._pause_if_full(buffer)

    def _pause_if_full(self, buffer: bytearray) -> None:
        """Past the high-water mark, ask the protocol to stop writing (once, until drained), and stop reading.

        Reading waits as long as writing does: whatever the peer sends next may ask for more
        output (a request, a TLS ``KeyUpdate``), and a peer that does not read ours must not make
        the server keep it.
        """
        if len(buffer) > _HIGH_WATER and not self._paused_protocol:
            self._paused_protocol = True
            self._watch(self._mask & ~_IN)
            self.protocol.pause_writing()

    def writelines(self, chunks: list[bytes]) -> None:
        self.write(b"".join(chunks))

    def can_write_eof(self) -> bool:
        return False

    def close(self) -> None:
        """Stop reading, send what is buffered, then close."""
        if self._closing:
            return
        self._closing = True
        if self._buffer is None:
            self._finish(None)
        else:
            self._watch(_OUT)

    def abort(self) -> None:
        """Close now, dropping what is buffered."""
        self._closing = True
        self._buffer = None
        self._finish(None)

    # --- the poller's side ----------------------------------------------------------------

    def _watch(self, mask: int) -> None:
        if mask != self._mask and self.fd >= 0:
            self._mask = mask
            self.poller.epoll.modify(self.fd, mask)

    def _read_ready(self) -> None:
        poller = self.poller
        try:
            count = os.readv(self.fd, (poller.buffer,))
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._fail(exc)
            return
        if count:
            self.protocol.data_received(bytes(poller.view[:count]))
            return
        self._reading = None
        self._watch(self._mask & ~_IN)  # at end of file the socket stays readable
        keep_open = self.protocol.eof_received()
        if not keep_open:
            self.close()

    def _write_ready(self) -> None:
        buffer = self._buffer
        if buffer is None:
            self._watch(self._mask & ~_OUT)
            return
        try:
            sent = os.write(self.fd, buffer)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._fail(exc)
            return
        del buffer[:sent]
        if not buffer:
            self._buffer = None
            if self._closing:
                self._finish(None)
                return
            self._watch(self._mask & ~_OUT)
        if self._paused_protocol and len(buffer) <= _LOW_WATER:
            self._paused_protocol = False
            if self._reading and not self._closing:
                self._watch(self._mask | _IN)  # the peer reads again: so do we
            self.protocol.resume_writing()

    def _fail(self, exc: OSError) -> None:
        self._closing = True
        self._buffer = None
        self._finish(exc)

    def _finish(self, exc: Exception | None) -> None:
        fd = self.fd
        if fd < 0:
            return
        self.fd = -1
        poller = self.poller
        poller.transports.pop(fd, None)
        with contextlib.suppress(OSError):
            poller.epoll.unregister(fd)
        os.close(fd)
        poller.loop.call_soon(self.protocol.connection_lost, exc)


class RawServer:
    """Accepts on one listening socket; its connections live on the worker's :class:`Poller`."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        sock: socket.socket,
        factory: Callable[[], asyncio.Protocol],
        poller: Poller,
        backlog: int,
    ) -> None:
        self.loop = loop
        self.sock = sock
        self.factory = factory
        self.poller = poller
        self.family = sock.family
        self.serving = False
        sock.setblocking(False)
        sock.listen(backlog)
        self._accept: Callable[[], tuple[int, Any]] = sock._accept  # type: ignore[attr-defined]
        self._resume: asyncio.TimerHandle | None = None
        self._start()

    def _start(self) -> None:
        self._resume = None
        if not self.serving and self.sock.fileno() >= 0:
            self.serving = True
            self.loop.add_reader(self.sock.fileno(), self._on_accept)

    def _on_accept(self) -> None:
        for _ in range(_ACCEPTS_PER_TURN):
            try:
                fd, peer = self._accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    # out of descriptors: clients wait in the backlog instead of spinning this loop
                    log.warning("accept: %s; not accepting for %.1f s", exc.strerror, _FD_LIMIT_PAUSE)
                    self.loop.remove_reader(self.sock.fileno())
                    self.serving = False
                    self._resume = self.loop.call_later(_FD_LIMIT_PAUSE, self._start)
                    return
                continue  # ECONNABORTED and the like: that client is gone, the next may not be
            try:
                sock = socket.socket(self.family, socket.SOCK_STREAM, 0, fd)
                sock.setblocking(False)
                if self.family != socket.AF_UNIX:
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sock.detach()
            except OSError:
                os.close(fd)
                continue
            protocol = self.factory()
            transport = RawTransport(self.poller, fd, peer, protocol)
            protocol.connection_made(transport)  # type: ignore[arg-type]
            transport.peer = None  # 110 bytes a connection: the protocol has what it needs of it

    # --- what asyncio.Server offers and app.serve uses ---------------------------------

    def close(self) -> None:
        """Stop accepting (open connections stay)."""
        if self._resume is not None:
            self._resume.cancel()
            self._resume = None
        if self.serving:
            self.loop.remove_reader(self.sock.fileno())
            self.serving = False
        self.sock.close()

    async def wait_closed(self) -> None:
        return None
