"""Unix-socket links between the worker processes of one node (see migratory/bus.py).

Each worker listens on the abstract Unix socket ``@migratory-<node>-w<N>`` (Linux's
abstract namespace: nothing on disk to clean up, even after a SIGKILL) and opens
one outbound link to every
other worker; a link carries frames one way (outbound = what this worker sends).
Writes are coalesced once per loop turn. While a peer is down (being restarted by
the supervisor), forwarded publications wait in a bounded queue and everything
else is dropped: when the link comes back up the peer first receives a full state
sync (sequence numbers, snapshots, subscriber counts), so it misses nothing that
matters.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Callable
from typing import cast

from migratory import bus as b

__all__ = ["Bus"]

log = logging.getLogger("migratory.server")

MAX_QUEUED_FORWARDS = 100_000


class _Inbound(asyncio.Protocol):
    """Receiving side of a peer's outbound link."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.decoder = b.BusDecoder()
        self.peer = -1

    def data_received(self, data: bytes) -> None:
        try:
            frames = self.decoder.feed(data)
        except (b.BusError, UnicodeDecodeError) as exc:
            log.error("corrupt bus frame from worker %d: %s", self.peer, exc)
            return
        for frame in frames:
            if isinstance(frame, b.Hello):
                self.peer = frame.worker
                self.bus.inbound_up(frame.worker)
            else:
                self.bus.on_frame(frame, self.peer)


class _Outbound(asyncio.Protocol):
    __slots__ = ("lost", "transport")

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.lost: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.lost.done():
            self.lost.set_result(None)


class _Peer:
    __slots__ = ("index", "pending", "queued", "up", "writer")

    def __init__(self, index: int) -> None:
        self.index = index
        self.up = False
        self.writer: _Outbound | None = None
        self.pending: list[bytes] = []
        self.queued: list[bytes] = []


class Bus:
    """This worker's links to its peers."""

    def __init__(
        self,
        worker: int,
        workers: int,
        namespace: str,
        on_frame: Callable[[b.BusFrame, int], None],
        on_link_up: Callable[[int], None],
    ) -> None:
        self.worker = worker
        self.workers = workers
        self.namespace = namespace
        self.on_frame = on_frame
        self.on_link_up = on_link_up
        self.peers = {j: _Peer(j) for j in range(workers) if j != worker}
        self._server: asyncio.AbstractServer | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._flush_armed = False
        self._dirty: list[_Peer] = []
        self._closed = False
        self._inbound: set[int] = set()
        self._ready = asyncio.Event()

    def inbound_up(self, worker: int) -> None:
        self._inbound.add(worker)
        self._check_ready()

    def _check_ready(self) -> None:
        if len(self._inbound) == len(self.peers) and all(p.up for p in self.peers.values()):
            self._ready.set()

    async def wait_ready(self, timeout: float) -> bool:
        """Wait until every peer is linked both ways (so no broadcast is missed)."""
        try:
            await asyncio.wait_for(self._ready.wait(), timeout)
        except TimeoutError:
            return False
        return True

    def path(self, worker: int) -> str:
        return f"\0migratory-{self.namespace}-w{worker}"

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(self.path(self.worker))  # sockets passed in: uvloop takes no abstract paths
        listener.listen(64)
        listener.setblocking(False)
        self._server = await loop.create_unix_server(lambda: _Inbound(self), sock=listener)
        for peer in self.peers.values():
            self._tasks.append(asyncio.create_task(self._link(peer), name=f"bus-link-{peer.index}"))

    async def close(self) -> None:
        self._closed = True
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._server is not None:
            self._server.close()

    async def _link(self, peer: _Peer) -> None:
        loop = asyncio.get_running_loop()
        while not self._closed:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.setblocking(False)
                await loop.sock_connect(sock, self.path(peer.index))
                _, writer = await loop.create_unix_connection(_Outbound, sock=sock)
            except OSError:
                sock.close()
                await asyncio.sleep(0.05)
                continue
            peer.writer = writer
            peer.up = True
            self._write(peer, b.encode(b.Hello(self.worker)))
            self.on_link_up(peer.index)  # full state first ...
            queued, peer.queued = peer.queued, []
            for frame in queued:  # ... then the publications that waited for this peer
                self._write(peer, frame)
            log.info("bus link to worker %d up", peer.index)
            self._check_ready()
            await writer.lost
            peer.up = False
            peer.writer = None
            peer.pending.clear()
            if not self._closed:
                log.warning("bus link to worker %d lost", peer.index)

    def _write(self, peer: _Peer, frame: bytes) -> None:
        if not peer.pending:
            self._dirty.append(peer)
            if not self._flush_armed:
                self._flush_armed = True
                asyncio.get_running_loop().call_soon(self._flush)
        peer.pending.append(frame)

    def _flush(self) -> None:
        self._flush_armed = False
        dirty, self._dirty = self._dirty, []
        for peer in dirty:
            if peer.writer is not None and peer.writer.transport is not None and peer.pending:
                peer.writer.transport.write(b"".join(peer.pending))
            peer.pending.clear()

    def send(self, worker: int, frame: b.BusFrame, *, queue_if_down: bool = False) -> bool:
        """Send to one peer; returns False when it is down and the frame was not kept."""
        peer = self.peers[worker]
        data = b.encode(frame)
        if peer.up:
            self._write(peer, data)
            return True
        if queue_if_down and len(peer.queued) < MAX_QUEUED_FORWARDS:
            peer.queued.append(data)
            return True
        return False

    def broadcast(self, frame: b.BusFrame) -> None:
        data = b.encode(frame)
        for peer in self.peers.values():
            if peer.up:
                self._write(peer, data)
