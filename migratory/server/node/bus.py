"""Unix-socket links between the processes of one node (see migratory/bus.py).

Each process listens on the abstract Unix socket ``@migratory-<node>-w<N>`` (Linux's
abstract namespace: nothing on disk to clean up, even after a SIGKILL) and opens one
outbound link to each of its peers; a link carries frames one way (outbound = what
this process sends). Without a cluster every worker is a peer of every other; in a
cluster member the workers and the member agent form a star around the agent.

Only the node's own processes may speak on the bus. Abstract sockets can be reached
by any local user, so both ends check the other with ``SO_PEERCRED`` (same uid as
this server) and the first frame must carry a proof of the secret the supervisor
generated before forking (an HMAC over the node's namespace and the sender's
index). Anything else is logged and cut off before a single frame is acted upon.

Writes are coalesced once per loop turn. While a peer is down (being restarted by
the supervisor), forwarded publications wait in a bounded queue and everything else
is dropped: when the link comes back up the peer first receives a full state sync.

Writes are flow-controlled: a link's socket buffer holds at most :data:`HIGH_WATER` bytes
that its peer has not read; the rest waits here, as the frames were handed over (a broadcast's
bytes shared by every peer, a whole state as a lazy stream rendered when there is room). A member
agent that restarts hands its peers' whole state to dozens of starting workers at once: written
eagerly, every worker's copy sat in its socket's buffer (gigabytes at a million clients, until
the kernel's OOM killer ended the agent).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import hmac
import logging
import os
import socket
import struct
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import cast

from migratory import bus as b

__all__ = ["Bus", "fan_out", "peer_uid", "proof", "write_some"]

log = logging.getLogger("migratory.server")

MAX_QUEUED_FORWARDS = 100_000
HIGH_WATER = 256 << 10  # bytes a link's transport may hold unread by its peer; the rest waits in _Peer.pending
LINK_RETRY_FIRST = 0.05  # s before the first redial of a peer that is down (being restarted)
LINK_RETRY_MAX = 1.0  # s at most between redials
LINK_STABLE = 1.0  # s a link must stay up for the next loss to be redialled at once
_CRED = struct.Struct("3i")


def proof(secret: bytes, namespace: str, index: int) -> bytes:
    """What process ``index`` of this node presents in its Hello."""
    return hmac.new(secret, f"{namespace}/{index}".encode(), hashlib.sha256).digest()


def peer_uid(sock: socket.socket | None) -> int | None:
    """The uid of the process at the other end of a Unix socket (None if unknown)."""
    if sock is None:
        return None
    try:
        _pid, uid, _gid = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
    except OSError:
        return None
    return int(uid)


async def cancel_all(tasks: list[asyncio.Task[None]]) -> None:
    """Cancel the link tasks and wait until each has unwound (bus and member links alike)."""
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await task


class _Shared:
    """One lazy stream read by several links, each at its own pace: every frame is rendered once, when the
    first reader reaches it, and kept until the last has passed it. A member agent that becomes ready
    hands its whole state to every worker at once; rendered for each worker apart, 56 workers cost its
    agent 56 renderings of 10,000 subjects (7 s of CPU at a million clients, bench/million.md), and the
    heartbeats waited behind them."""

    __slots__ = ("_base", "_chunks", "_error", "_readers", "_source", "_trim_at")

    def __init__(self, source: Iterator[bytes]) -> None:
        self._source: Iterator[bytes] | None = source
        self._chunks: list[bytes] = []  # rendered, not yet passed by every reader
        self._base = 0  # the stream index of _chunks[0]
        self._readers: weakref.WeakSet[_Reader] = weakref.WeakSet()  # a link dropped drops its reader
        self._error = ""  # what failed the rendering, for every reader that reaches it
        self._trim_at = 256

    def reader(self) -> _Reader:
        if self._base or self._chunks:
            raise RuntimeError("every reader of a shared stream is made before the first read")
        reader = _Reader(self)
        self._readers.add(reader)
        return reader

    def at(self, index: int) -> bytes | None:
        """The frame at ``index`` (None past the end); a rendering failure fails every reader alike."""
        offset = index - self._base
        if offset < len(self._chunks):
            return self._chunks[offset]
        if self._error:
            # a new exception each time: the first one's traceback holds frames (and readers) alive
            raise RuntimeError(f"the shared stream failed earlier: {self._error}")
        if self._source is None:
            return None
        try:
            part = next(self._source, None)
        except Exception as exc:
            self._error, self._source = f"{type(exc).__name__}: {exc}", None
            raise
        if part is None:
            self._source = None
            return None
        self._chunks.append(part)
        if len(self._chunks) >= self._trim_at:
            self._trim()
        return part

    def _trim(self) -> None:
        """Forget what every reader has passed (checked as the kept part doubles: a reader that stalls costs
        memory up to the whole state, never a walk of the readers per frame)."""
        low = min((r.position for r in self._readers), default=self._base + len(self._chunks))
        if low > self._base:
            del self._chunks[: low - self._base]
            self._base = low
        self._trim_at = max(256, 2 * len(self._chunks))


class _Reader:
    """One link's place in a :class:`_Shared` stream."""

    __slots__ = ("__weakref__", "_shared", "position")

    def __init__(self, shared: _Shared) -> None:
        self._shared = shared
        self.position = 0

    def __iter__(self) -> _Reader:
        return self

    def __next__(self) -> bytes:
        part = self._shared.at(self.position)
        if part is None:
            raise StopIteration
        self.position += 1
        return part


def write_some(pending: deque[bytes | Iterator[bytes]], transport: asyncio.Transport, high_water: int) -> int:
    """Write what waits in ``pending``, in order, until ``transport`` holds more than ``high_water`` unread
    bytes (strictly: a transport pauses its protocol above the mark, not at it); a stream renders its
    next frame only now. Returns the bytes of encoded frames taken (a stream's are not counted)."""
    room = high_water - transport.get_write_buffer_size()
    chunk: list[bytes] = []
    frames = 0
    while pending and room >= 0:
        item = pending[0]
        if isinstance(item, bytes):
            pending.popleft()
            frames += len(item)
        else:
            part = next(item, None)
            if part is None:
                pending.popleft()
                continue
            item = part
        chunk.append(item)
        room -= len(item)
    if chunk:
        transport.write(b"".join(chunk))
    return frames


def fan_out(source: Iterator[bytes], count: int) -> list[Iterator[bytes]]:
    """``count`` readers of one stream of encoded frames, rendered once for all of them."""
    shared = _Shared(source)
    return [shared.reader() for _ in range(count)]


class _Inbound(asyncio.Protocol):
    """Receiving side of a peer's outbound link: authenticated before anything is acted upon."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.decoder = b.BusDecoder(max_frame=b.PREAUTH_MAX_FRAME)  # a stranger may not make us buffer much
        self.peer = -1
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        uid = peer_uid(transport.get_extra_info("socket"))
        if uid != os.getuid():
            self._refuse(f"a process of uid {uid} connected to the bus (this server runs as uid {os.getuid()})")

    def _refuse(self, why: str) -> None:
        self.bus.refuse(why)
        if self.transport is not None:
            self.transport.abort()
            self.transport = None

    def data_received(self, data: bytes) -> None:
        if self.transport is None:
            return
        try:
            if self.peer < 0:
                # the Hello alone is read under the pre-authentication limit; what follows it in the
                # same read (the peer's state sync) waits in the buffer until the Hello is checked
                self.decoder.push(data)
                hello = self.decoder.next_frame()
                if hello is None:
                    return
                if not isinstance(hello, b.Hello) or not self.bus.known(hello):
                    self._refuse("a peer without the node's secret")
                    return
                self.peer = hello.worker
                self.decoder.max_frame = b.MAX_BUS_FRAME
                self.bus.inbound_up(hello.worker)
                data = b""
            frames = self.decoder.feed(data)
        except b.BusError as exc:
            if self.peer < 0:
                self._refuse(f"a peer that did not say Hello properly: {exc}")
            else:
                log.error("corrupt bus frame from process %d: %s", self.peer, exc)
                self.transport.abort()
            return
        for frame in frames:
            if isinstance(frame, b.Leaving):
                self.bus.leaving.add(self.peer)  # its link's loss is a planned stop: said at INFO
                continue
            self.bus.on_frame(frame, self.peer)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.peer >= 0:
            self.bus.inbound_down(self.peer)


class _Outbound(asyncio.Protocol):
    __slots__ = ("lost", "on_resume", "paused", "transport")

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.lost: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.on_resume: Callable[[], None] | None = None
        self.paused = False  # over HIGH_WATER: resume_writing will come

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self.transport.set_write_buffer_limits(high=HIGH_WATER, low=HIGH_WATER // 4)

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        if self.on_resume is not None:
            self.on_resume()

    def data_received(self, data: bytes) -> None:
        pass  # outbound links carry nothing back

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.lost.done():
            self.lost.set_result(None)


class _Peer:
    __slots__ = ("dirty", "index", "pending", "queued", "up", "writer")

    def __init__(self, index: int) -> None:
        self.index = index
        self.up = False
        self.writer: _Outbound | None = None
        # what waits for room in the link, in order: encoded frames, and streams rendered as they leave
        self.pending: deque[bytes | Iterator[bytes]] = deque()
        self.dirty = False  # listed in Bus._dirty for the next flush
        self.queued: list[bytes] = []


class Bus:
    """This process's links to its peers on the node."""

    def __init__(
        self,
        worker: int,
        peers: Iterable[int],
        namespace: str,
        secret: bytes,
        on_frame: Callable[[b.BusFrame, int], None],
        on_link_up: Callable[[int], None],
        on_link_down: Callable[[int], None] | None = None,
        batching: float = 0.0,
    ) -> None:
        self.worker = worker
        self.batching = batching  # seconds frames wait for company before a write (BusBatchingTime)
        self.namespace = namespace
        self.secret = secret
        self.on_frame = on_frame
        self.on_link_up = on_link_up
        self.on_link_down = on_link_down
        self.peers = {j: _Peer(j) for j in peers if j != worker}
        self.refused = 0
        self._logged: dict[str, float] = {}
        self._server: asyncio.AbstractServer | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._flush_armed = False
        self._dirty: list[_Peer] = []
        self._closed = False
        self._inbound: set[int] = set()
        self._ready = asyncio.Event()
        self.leaving: set[int] = set()  # peers that said they stop (bus.Leaving)

    def refuse(self, why: str) -> None:
        """Count every refused link; log it at most once a minute per cause, with the count so far."""
        self.refused += 1
        now = time.monotonic()
        if now - self._logged.get(why, -1e9) >= 60.0:
            self._logged[why] = now
            log.error("bus: refused %s (%d refused so far)", why, self.refused)

    def known(self, hello: b.Hello) -> bool:
        """A Hello from one of our peers, proving the node's secret."""
        expected = proof(self.secret, self.namespace, hello.worker)
        return hello.worker in self.peers and hmac.compare_digest(hello.proof, expected)

    def inbound_up(self, worker: int) -> None:
        self._inbound.add(worker)
        self._check_ready()

    def inbound_down(self, worker: int) -> None:
        self._inbound.discard(worker)
        if self.on_link_down is not None and not self._closed:
            self.on_link_down(worker)

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
        for peer in self.peers.values():  # a planned stop: the peers log the links' loss as one
            if peer.up:
                self._write(peer, b.encode(b.Leaving(self.worker, "stopping")))
        self.flush()
        await cancel_all(self._tasks)
        if self._server is not None:
            self._server.close()

    async def _link(self, peer: _Peer) -> None:
        """Keep one outbound link to ``peer`` up; retried with backoff, never in a hot loop."""
        loop = asyncio.get_running_loop()
        delay = LINK_RETRY_FIRST
        while not self._closed:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.setblocking(False)
                await loop.sock_connect(sock, self.path(peer.index))
                uid = peer_uid(sock)
                if uid != os.getuid():
                    # someone else holds our peer's name (it is being restarted): never send it our secret
                    self.refuse(f"to link to {self.path(peer.index)[1:]}: it is held by a process of uid {uid}")
                    raise ConnectionRefusedError
                _, writer = await loop.create_unix_connection(_Outbound, sock=sock)
            except OSError:
                sock.close()
                await asyncio.sleep(delay)
                delay = min(LINK_RETRY_MAX, delay * 2)
                continue
            self.attach(peer, writer)
            since = loop.time()
            self._write(peer, b.encode(b.Hello(self.worker, proof(self.secret, self.namespace, self.worker))))
            self.on_link_up(peer.index)  # full state first ...
            queued, peer.queued = peer.queued, []
            for frame in queued:  # ... then the publications that waited for this peer
                self._write(peer, frame)
            self.leaving.discard(peer.index)
            log.info("bus link to process %d up", peer.index)
            self._check_ready()
            await writer.lost
            peer.up = False
            peer.writer = None
            peer.pending.clear()
            if self._closed:
                break
            if peer.index in self.leaving:
                log.info("bus link to process %d closed: the process stopped, as it announced", peer.index)
            else:
                log.warning("bus link to process %d lost", peer.index)
            if loop.time() - since < LINK_STABLE:
                # cut right after it came up (the peer refused us, or is crashing): back off before the next try
                await asyncio.sleep(delay)
                delay = min(LINK_RETRY_MAX, delay * 2)
            else:
                delay = LINK_RETRY_FIRST

    def attach(self, peer: _Peer, writer: _Outbound) -> None:
        """``writer`` is ``peer``'s link now: what waits for room goes on when it asks for more."""
        peer.writer = writer
        writer.on_resume = functools.partial(self._resume_soon, peer)
        peer.up = True

    def _write(self, peer: _Peer, frame: bytes | Iterator[bytes]) -> None:
        peer.pending.append(frame)
        self._schedule(peer)

    def _schedule(self, peer: _Peer) -> None:
        """List ``peer`` for the next flush (at the end of this loop turn, or after BusBatchingTime)."""
        if peer.dirty:
            return
        peer.dirty = True
        self._dirty.append(peer)
        if not self._flush_armed:
            self._flush_armed = True
            if self.batching:
                asyncio.get_running_loop().call_later(self.batching, self._flush)
            else:
                asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_armed = False
        self.flush()

    def flush(self) -> None:
        """Write what waits now, not at the end of the turn (or after BusBatchingTime): for frames that must
        reach the peers before what the caller writes next elsewhere."""
        dirty, self._dirty = self._dirty, []
        for peer in dirty:
            peer.dirty = False
        for peer in dirty:
            self._fill(peer)

    def _resume_soon(self, peer: _Peer) -> None:
        asyncio.get_running_loop().call_soon(self._resumed, peer)  # not from inside the transport's callback

    def _resumed(self, peer: _Peer) -> None:
        """The link has room again: go on at once (a flush already listed for it will do it instead)."""
        if not peer.dirty:
            self._fill(peer)

    def _fill(self, peer: _Peer) -> None:
        """Write what waits for ``peer`` until the link holds more than HIGH_WATER unread bytes."""
        writer = peer.writer
        transport = writer.transport if writer is not None else None
        # a link closed in this turn (its loss not handled yet) takes nothing more: uvloop raises on a
        # closed handle, and one raise here left every later peer's frames unsent, and unscheduled, forever
        if writer is None or transport is None or transport.is_closing():
            peer.pending.clear()
            return
        try:
            write_some(peer.pending, transport, HIGH_WATER)
        except Exception as exc:  # a bug rendering a state: this link starts over (Hello, full state), not the others
            log.error("bus link to process %d: cannot write (%s: %s); relinking", peer.index, type(exc).__name__, exc)
            peer.pending.clear()
            transport.abort()
            return
        if peer.pending and not writer.paused:
            # the socket took it all and did not pause us, so no resume_writing will come: go on next turn
            # (about HIGH_WATER bytes a link a turn: a whole state never holds the loop in one turn)
            self._resume_soon(peer)

    def linked(self, worker: int) -> bool:
        """Linked to ``worker`` both ways: our link to it is up and its link to us said Hello."""
        return self.is_up(worker) and worker in self._inbound

    def is_up(self, worker: int) -> bool:
        peer = self.peers.get(worker)
        return peer is not None and peer.up

    def send(self, worker: int, frame: b.BusFrame, *, queue_if_down: bool = False) -> bool:
        """Send to one peer; returns False when it is down and the frame was not kept."""
        return self.send_raw(worker, b.encode(frame), queue_if_down=queue_if_down)

    def send_stream(self, worker: int, frames: Iterator[bytes]) -> bool:
        """Send frames rendered only when the link has room for them (a whole state: see the module
        docstring); what is sent after it follows it. Returns False when the peer is down."""
        peer = self.peers[worker]
        if not peer.up:
            return False
        self._write(peer, frames)
        return True

    def send_stream_to(self, workers: Iterable[int], frames: Iterator[bytes]) -> None:
        """One stream to several peers (those up), rendered once for all of them (:class:`_Shared`): each
        reads it at its own pace, and what is sent to a peer after it follows it, as with send_stream."""
        peers = [self.peers[w] for w in workers if w in self.peers and self.peers[w].up]
        for peer, reader in zip(peers, fan_out(frames, len(peers)), strict=True):
            self._write(peer, reader)

    def send_raw(self, worker: int, data: bytes, *, queue_if_down: bool = False) -> bool:
        peer = self.peers[worker]
        if peer.up:
            self._write(peer, data)
            return True
        if queue_if_down and len(peer.queued) < MAX_QUEUED_FORWARDS:
            peer.queued.append(data)
            return True
        return False

    def broadcast(self, frame: b.BusFrame) -> None:
        self.broadcast_raw(b.encode(frame))

    def broadcast_raw(self, data: bytes) -> None:
        for peer in self.peers.values():
            if peer.up:
                self._write(peer, data)
