"""TCP links between cluster members' agents: authentication, optional TLS, framing.

Each pair of members shares one TCP connection, dialled by the member listed first
in ``ClusterMembers`` (so two members never race to connect to each other) and
redialled whenever it drops. Before any other frame, the two prove to each other that
they know ``ClusterPassword`` without sending it: the acceptor sends a fresh nonce,
the dialer answers with its own nonce and an HMAC over both nonces and both member
indexes, and the acceptor answers with its own HMAC (mutual challenge-response; MACs
compared in constant time). A stranger or a member with the wrong password is logged
and cut off; it never reaches the member state machine. With ``ClusterTLS`` the
connection is TLS with certificates on both sides, verified against ``ClusterTLSCA``,
and the challenge-response still runs inside it.

Frames are those of migratory/bus.py. Writes are coalesced once per loop turn; a peer
that stops reading is dropped once its backlog passes :data:`MAX_BACKLOG` (it
resynchronises when it comes back), so a hung member cannot grow our memory.

A whole state (a rejoining peer's, a claimant's) goes as a stream, encoded only while
the link holds less than :data:`HIGH_WATER` unread bytes; what is sent after it follows
it. Encoded in one turn and written at once, a Guaranteed member's full cache (a million
cached messages: seconds of CPU, hundreds of MB) held its agent past the peers'
heartbeat timeout, and a state over MAX_BACKLOG dropped the link it was sent on, at
every rejoin, for good.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import secrets
import socket
import ssl
import struct
from collections import deque
from collections.abc import Callable, Iterator
from typing import cast

from migratory import bus as b
from migratory.config import Config, Endpoint
from migratory.server.node.bus import cancel_all, write_some

__all__ = ["MemberLinks", "client_context", "server_context"]

log = logging.getLogger("migratory.cluster")

HANDSHAKE_TIMEOUT = 5.0
MAX_BACKLOG = 256 * 1024 * 1024  # frames (not streams) waiting for a peer, written or not, before it is dropped
HIGH_WATER = 1 << 20  # unread bytes a link may hold before a stream waits for room (resume_writing)
FRAMES_PER_TURN = 256  # frames of a peer handed on per loop turn: heartbeats (ours, and theirs read) never wait long
BYTES_PER_TURN = 256 * 1024  # and at most about this many bytes of them (a state's frame is up to 1 MB of cache)
_IDS = struct.Struct("!QQQ")


def _key(password: str) -> bytes:
    return hashlib.sha256(b"migratory-cluster\0" + password.encode("utf-8")).digest()


def _mac(key: bytes, role: bytes, first: bytes, second: bytes, a: int, c: int, incarnation: int) -> bytes:
    return hmac.new(key, role + first + second + _IDS.pack(a, c, incarnation), hashlib.sha256).digest()


def server_context(config: Config) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=config.cluster_tls_ca)
    context.minimum_version = ssl.TLSVersion.TLSv1_3 if config.tls_min_version == "TLSv1.3" else ssl.TLSVersion.TLSv1_2
    context.verify_mode = ssl.CERT_REQUIRED
    context.load_cert_chain(
        config.cluster_tls_certificate or config.tls_certificate,
        config.cluster_tls_key or config.tls_key,
        password=config.tls_key_password or None,
    )
    return context


def client_context(config: Config) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=config.cluster_tls_ca)
    context.minimum_version = ssl.TLSVersion.TLSv1_3 if config.tls_min_version == "TLSv1.3" else ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(
        config.cluster_tls_certificate or config.tls_certificate,
        config.cluster_tls_key or config.tls_key,
        password=config.tls_key_password or None,
    )
    return context


class _Link(asyncio.Protocol):
    """One member-to-member connection, from TCP accept/connect to close."""

    def __init__(self, links: MemberLinks, expected: int = -1) -> None:
        self.links = links
        self.expected = expected  # dialer: the member we called; acceptor: -1
        self.peer = -1
        self.up = False
        self.established_once = False
        self.decoder = b.BusDecoder(max_frame=b.PREAUTH_MAX_FRAME)
        self.transport: asyncio.Transport | None = None
        self.nonce = secrets.token_bytes(32)
        self.their_nonce = b""
        self.their_incarnation = 0
        self.addr = "?"
        # what waits for the end of this turn, or for room behind a stream, in order: encoded frames and
        # streams encoded as they leave; queued counts the bytes of the frames among them
        self.pending: deque[bytes | Iterator[bytes]] = deque()
        self.queued = 0
        self.paused = False  # over HIGH_WATER: resume_writing will come
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._timer: asyncio.TimerHandle | None = None
        self._backlog: deque[bytes] = deque()  # frames' bodies, decoded and handed on a few a turn (_drain)
        self._draining: asyncio.Handle | None = None

    # --- asyncio.Protocol -----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self.transport.set_write_buffer_limits(high=HIGH_WATER, low=HIGH_WATER // 4)
        peer = transport.get_extra_info("peername")
        self.addr = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(HANDSHAKE_TIMEOUT, self._handshake_timeout)
        if self.expected < 0:
            links = self.links
            self._send(b.Challenge(links.me, links.incarnation, self.nonce))

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        if self.pending:
            self.links.dirty(self)  # at the end of this turn: not from inside the transport's callback

    def _handshake_timeout(self) -> None:
        if not self.up:
            self.refuse("no authentication within 5 s")

    def data_received(self, data: bytes) -> None:
        if self.transport is None:
            return
        try:
            if not self.up:
                # handshake frames one at a time under the pre-authentication limit: what follows the
                # last of them in the same read (the peer's state sync) is decoded once we trust it
                self.decoder.push(data)
                while not self.up:
                    frame = self.decoder.next_frame()
                    if frame is None:
                        return
                    self._handshake(frame)
                    if self.transport is None:
                        return
                data = b""
            bodies = self.decoder.bodies(data)
        except b.BusError as exc:
            if self.up:
                self.fail(f"corrupt frame: {exc}")
            else:
                self.refuse(f"corrupt frame: {exc}")
            return
        self._backlog.extend(bodies)
        if self._draining is None and self._backlog:
            # after this turn's reads (one callback may read several times): one budget a turn, not one a read
            self._draining = asyncio.get_running_loop().call_soon(self._drain)

    def _drain(self) -> None:
        """Decode and hand on at most FRAMES_PER_TURN frames or about BYTES_PER_TURN bytes of them, then let
        the loop turn (and reading wait) before the rest: a peer's whole state (10,000 subjects, each
        relayed to every worker; or 200,000 cached messages) handed on in one turn held a rejoining
        member's agent for seconds on a saturated host, its heartbeats went out late, the peers dropped
        the link and sent their state again on the next (bench/million.md, the failover; bench/failover.md)."""
        self._draining = None
        transport = self.transport
        handed = size = 0
        while self._backlog and transport is not None and self.transport is transport:
            if handed >= FRAMES_PER_TURN or size >= BYTES_PER_TURN:
                transport.pause_reading()
                self._draining = asyncio.get_running_loop().call_soon(self._drain)
                return
            body = self._backlog.popleft()
            try:
                frame = b.decode(body)
            except b.BusError as exc:
                self.fail(f"corrupt frame: {exc}")
                return
            try:
                self.links.received(self.peer, frame)
            except Exception as exc:  # as an exception in data_received would: the link goes, not stays paused
                self.fail(f"handling its frame failed: {type(exc).__name__}: {exc}")
                return
            handed += 1
            size += len(body)
        if transport is not None and self.transport is transport and not transport.is_reading():
            transport.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self._draining is not None:
            self._draining.cancel()
            self._draining = None
        backlog, self._backlog = self._backlog, deque()
        if self.up and exc is None and self.transport is not None:
            # the peer closed after sending these (our own abort cleared them): they count, as before the turns
            for body in backlog:
                try:
                    frame = b.decode(body)
                except b.BusError as error:
                    log.error("cluster link to member %d: corrupt frame after it closed: %s", self.peer, error)
                    break
                self.links.received(self.peer, frame)
        self.transport = None
        if self.up:
            self.up = False
            self.links.lost(self.peer, self)
        if not self.closed.done():
            self.closed.set_result(None)

    # --- authentication ---------------------------------------------------------------------

    def _handshake(self, frame: b.BusFrame) -> None:
        links = self.links
        key = links.key
        if self.expected >= 0:  # we dialled
            if isinstance(frame, b.Challenge):
                if frame.member != self.expected:
                    self.refuse(f"{self.addr} says it is member {frame.member}, we called member {self.expected}")
                    return
                self.their_nonce, self.their_incarnation = frame.nonce, frame.incarnation
                mac = _mac(key, b"dial", frame.nonce, self.nonce, links.me, frame.member, links.incarnation)
                self._send(b.Proof(links.me, links.incarnation, self.nonce, mac))
                return
            if isinstance(frame, b.Welcome) and self.their_nonce:
                expected = _mac(
                    key, b"accept", self.nonce, self.their_nonce, self.expected, links.me, self.their_incarnation
                )
                if hmac.compare_digest(frame.mac, expected):
                    self._established(self.expected, self.their_incarnation)
                    return
                self.refuse("it does not know ClusterPassword (wrong password on one side)")
                return
        elif isinstance(frame, b.Proof):
            member = frame.member
            expected = _mac(key, b"dial", self.nonce, frame.nonce, member, links.me, frame.incarnation)
            if not 0 <= member < links.size or member >= links.me:
                self.refuse(f"member index {member} may not dial member {links.me}")
                return
            if not hmac.compare_digest(frame.mac, expected):
                self.refuse(f"member {member}: wrong ClusterPassword")
                return
            mac = _mac(key, b"accept", frame.nonce, self.nonce, links.me, member, links.incarnation)
            self._send(b.Welcome(mac))
            self._established(member, frame.incarnation)
            return
        self.refuse(f"unexpected {type(frame).__name__} before authentication")

    def _established(self, member: int, incarnation: int) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self.peer = member
        self.up = True
        self.established_once = True
        self.decoder.max_frame = b.MAX_BUS_FRAME
        self.links.established(member, incarnation, self)

    def refuse(self, why: str) -> None:
        self.links.refuse(self.addr, why)
        self.abort()

    def fail(self, why: str) -> None:
        log.error("cluster link to member %d dropped: %s", self.peer, why)
        self.abort()

    def abort(self) -> None:
        """Cut the connection now; nothing more is read from it, handed on from it, or written to it."""
        self._backlog.clear()
        self.pending.clear()  # a stream holds a state: let it go with the link
        self.queued = 0
        if self.transport is not None:
            self.transport.abort()
            self.transport = None

    # --- output ---------------------------------------------------------------------------

    def _send(self, frame: b.BusFrame) -> None:
        if self.transport is not None:
            self.transport.write(b.encode(frame))

    def queue(self, data: bytes | Iterator[bytes]) -> None:
        """Send ``data`` after what is queued: encoded frames, or a stream of them (a whole state)."""
        if self.transport is None:
            return
        if not self.pending:
            self.links.dirty(self)
        self.pending.append(data)
        if isinstance(data, bytes):
            self.queued += len(data)
            self._backlog_full()  # here too: behind a stream the peer does not read, no flush would see it

    def _backlog_full(self) -> bool:
        """Whether the frames waiting for the peer, written or not, pass MAX_BACKLOG (a stream is our own
        state and does not count); if they do, the link is dropped."""
        transport = self.transport
        if transport is None or transport.get_write_buffer_size() + self.queued <= MAX_BACKLOG:
            return False
        self.fail(f"it stopped reading ({MAX_BACKLOG >> 20} MB waiting)")
        return True

    def flush(self) -> None:
        """Write what waits until the link holds HIGH_WATER unread bytes (a stream encoded only now); the
        rest goes on when the peer has read (resume_writing), or next turn."""
        transport = self.transport
        if transport is None or transport.is_closing():
            self.pending.clear()  # a link closing in this turn takes nothing more (uvloop raises on a closed handle)
            self.queued = 0
            return
        try:
            self.queued -= write_some(self.pending, transport, HIGH_WATER)
        except Exception as exc:  # a bug encoding a state: this link starts over (handshake, state), not the others
            self.fail(f"cannot encode a state for it: {type(exc).__name__}: {exc}")
            return
        if self._backlog_full():
            return
        if self.pending and not self.paused:
            self.links.dirty(self)  # the socket took it all and paused nothing: no resume_writing will come


class MemberLinks:
    """This member's links to every other member: listen, dial, authenticate, route frames."""

    def __init__(
        self,
        config: Config,
        incarnation: int,
        on_up: Callable[[int, int], None],
        on_down: Callable[[int], None],
        on_frame: Callable[[int, b.BusFrame], None],
    ) -> None:
        self.config = config
        self.me = config.member_index
        self.size = len(config.cluster_members)
        self.incarnation = incarnation
        self.key = _key(config.cluster_password)
        self.on_up = on_up
        self.on_down = on_down
        self.on_frame = on_frame
        self.links: dict[int, _Link] = {}
        self.refused = 0
        self._logged: dict[tuple[str, str], float] = {}
        self._server: asyncio.AbstractServer | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._dirty: list[_Link] = []
        self._armed = False
        self._closed = False
        self._leaving: set[int] = set()  # peers that announced they stop (bus.Leaving)
        self._server_ssl = server_context(config) if config.cluster_tls else None
        self._client_ssl = client_context(config) if config.cluster_tls else None

    async def start(self, sock: socket.socket | None = None) -> None:
        """Listen (on ``sock`` if the supervisor bound it) and dial every member listed after us."""
        loop = asyncio.get_running_loop()
        me = self.config.cluster_member_listen
        assert me is not None
        if sock is not None:
            self._server = await loop.create_server(
                lambda: _Link(self),
                sock=sock,
                ssl=self._server_ssl,
                backlog=64,
            )
        else:
            self._server = await loop.create_server(
                lambda: _Link(self), me.host, me.port, ssl=self._server_ssl, backlog=64, reuse_address=True
            )
        for index, endpoint in enumerate(self.config.cluster_members):
            if index > self.me:
                self._tasks.append(asyncio.create_task(self._dial(index, endpoint), name=f"member-{index}"))

    async def _dial(self, index: int, endpoint: Endpoint) -> None:
        loop = asyncio.get_running_loop()
        delay = 0.1
        warned = False
        while not self._closed:
            try:
                _, link = await asyncio.wait_for(
                    loop.create_connection(
                        lambda: _Link(self, index),
                        endpoint.host,
                        endpoint.port,
                        ssl=self._client_ssl,
                        server_hostname=endpoint.host if self._client_ssl else None,
                    ),
                    HANDSHAKE_TIMEOUT,
                )
            except (OSError, TimeoutError, ssl.SSLError) as exc:
                if not warned:
                    log.info("member %d (%s) not reachable yet: %s", index, endpoint, exc)
                    warned = True
                await asyncio.sleep(delay)
                delay = min(1.0, delay * 2)
                continue
            await link.closed
            if link.established_once:
                warned, delay = False, 0.1
                if not self._closed:
                    await asyncio.sleep(0.05)
            else:  # refused (wrong password, not a member): do not hammer it
                await asyncio.sleep(delay)
                delay = min(5.0, delay * 2)

    async def close(self) -> None:
        self._closed = True
        await cancel_all(self._tasks)
        for link in list(self.links.values()):
            link.abort()
        if self._server is not None:
            self._server.close()

    # --- called by links -----------------------------------------------------------------

    def established(self, member: int, incarnation: int, link: _Link) -> None:
        old = self.links.get(member)
        if old is not None and old is not link:
            old.up = False  # its loss must not be reported after the new link's arrival
            old.abort()
            self.on_down(member)
        self.links[member] = link
        self._leaving.discard(member)  # back
        log.info("cluster link with member %d (%s) up", member, link.addr)
        self.on_up(member, incarnation)

    def lost(self, member: int, link: _Link) -> None:
        if self.links.get(member) is link:
            del self.links[member]
            if not self._closed:
                if member in self._leaving:
                    log.info("cluster link with member %d closed: the member stopped, as it announced", member)
                else:
                    log.warning("cluster link with member %d lost", member)
                self.on_down(member)

    def refuse(self, addr: str, why: str) -> None:
        """Count every refused link; log it, but at most once a minute per host and reason."""
        self.refused += 1
        now = asyncio.get_running_loop().time()
        key = (addr.rpartition(":")[0], why)
        if now - self._logged.get(key, -1e9) >= 60.0:
            self._logged[key] = now
            log.error("cluster link with %s refused: %s (%d refused so far)", addr, why, self.refused)

    def received(self, member: int, frame: b.BusFrame) -> None:
        if isinstance(frame, b.Leaving):
            self._leaving.add(member)
            log.info("member %d is leaving the cluster: %s", member, frame.reason or "stopping")
            return
        self.on_frame(member, frame)

    async def announce_leaving(self, me: int, reason: str) -> None:
        """Tell every peer this member stops on purpose, and give the frames a moment to leave (the links are
        aborted next, which would drop what is still buffered)."""
        for link in list(self.links.values()):
            link.queue(b.encode(b.Leaving(me, reason)))
            link.flush()
        await asyncio.sleep(0.05)

    def dirty(self, link: _Link) -> None:
        self._dirty.append(link)
        if not self._armed:
            self._armed = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._armed = False
        dirty, self._dirty = self._dirty, []
        for link in dirty:
            link.flush()

    # --- used by the agent ---------------------------------------------------------------

    def send(self, member: int, frame: b.BusFrame) -> None:
        link = self.links.get(member)
        if link is not None:
            link.queue(b.encode(frame))

    def send_stream(self, member: int, frames: Iterator[b.BusFrame]) -> None:
        """Send ``frames`` encoded only when the link has room for them (module docstring); what is sent
        to ``member`` after them follows them."""
        link = self.links.get(member)
        if link is not None:
            link.queue(map(b.encode, frames))

    def drop(self, member: int, reason: str) -> None:
        link = self.links.pop(member, None)
        if link is not None:
            log.warning("cluster link with member %d dropped: %s", member, reason)
            link.up = False
            link.abort()
