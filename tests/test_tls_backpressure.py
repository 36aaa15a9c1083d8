"""Backpressure for everything a connection sends (review of issue 31, D5).

The review: "TLS-level answers ignore write backpressure and MaxPendingOutput, and reading never
pauses: a wss client that sends KeyUpdate requests (update_requested) and never reads grew a real
server by 7.5 MB (OpenSSL mode 6.7 MB); openssl s_server stops reading instead." So here:

* over real sockets (a listener of the worker's epoll transport, or of the event loop's), a client
  that floods ``KeyUpdate(update_requested)`` records sealed with its own traffic secret (from its
  key log) and never reads: what the server keeps for it stays small, in the lean record layer and
  on OpenSSL's, and reading resumes (the flood is served to its end) once the client reads;
* the same while the application streams to that client: the server stops reading it;
* a plain (non-TLS) connection whose answers pile up stops being read too;
* in process: one KeyUpdate answer for many requests (RFC 8446 4.6.3), held while TCP is paused,
  TLS-level output counted against the output limit, and the record allowance (RECORD_RATE) and
  the empty-record limit that bound a peer flooding tiny records.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from migratory.server.transport import raw as rawtransport
from migratory.server.transport.tls import SUITES, TLSServer, TLSTransport
from migratory.server.transport.tls import keyupdate as tls_keyupdate
from migratory.server.transport.tls import records as tls_records
from tests.conftest import ServerProcess
from tests.test_tls_review import UNEXPECTED_MESSAGE, assert_fatal_alert, lean_pair
from tests.test_tlstransport import App, FakeTCP, Pair, client_context, pki, server_context, tls_server_process

__all__ = ["pki"]  # the module-scoped certificate fixture, shared with test_tlstransport

pytestmark = pytest.mark.skipif(not rawtransport.available(), reason="epoll is Linux's")

SMALL_BUFFER = 8192  # kernel socket buffers on both sides: the kernel hides little of what piles up
BOUND = 512 * 1024  # what the server may keep for one flooding client (the review saw 7.5 MB)
FLOOD = 50_000  # KeyUpdate requests: answered one by one, 1.35 MB of answers
KEY_UPDATE = 27  # bytes of one KeyUpdate record


# --- a client that seals its own records -----------------------------------------------------


class Flooder:
    """A TLS 1.3 client on a real socket: OpenSSL (``ssl.SSLObject``) for the handshake, then records
    sealed here from the client's traffic secret, read from its own key log."""

    def __init__(self, sock: socket.socket, context: ssl.SSLContext) -> None:
        self.sock = sock
        self.into, self.out = ssl.MemoryBIO(), ssl.MemoryBIO()
        self.tls = context.wrap_bio(self.into, self.out, server_hostname="localhost")
        self.secret = b""
        self.server_secret = b""
        self.suite = SUITES["TLS_AES_128_GCM_SHA256"]
        self.received = 0
        self.records = bytearray()  # the server's records not yet opened (open_server_records)
        self.server_seq = 0
        self.plain = bytearray()  # the application data the server sent
        self.alerts: list[bytes] = []

    async def handshake(self, keylog: Path) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                self.tls.do_handshake()
                done = True
            except ssl.SSLWantReadError:
                done = False
            flight = self.out.read()
            if flight:
                await asyncio.wait_for(loop.sock_sendall(self.sock, flight), 10)
            if done:
                break
            data = await asyncio.wait_for(loop.sock_recv(self.sock, 65536), 10)
            assert data, "the server closed during the handshake"
            self.into.write(data)
        cipher = self.tls.cipher()
        assert cipher is not None and self.tls.version() == "TLSv1.3"
        self.suite = SUITES[cipher[0]]
        lines = [line.split() for line in keylog.read_text().splitlines()]
        self.secret = bytes.fromhex([line for line in lines if line[0] == "CLIENT_TRAFFIC_SECRET_0"][-1][2])
        self.server_secret = bytes.fromhex([line for line in lines if line[0] == "SERVER_TRAFFIC_SECRET_0"][-1][2])
        self.records += self.into.read()  # anything of the server's after its Finished

    def open_server_records(self, data: bytes) -> None:
        """Open what the server sent: its data into ``plain``, following its KeyUpdates (as OpenSSL would)."""
        self.records += data
        while len(self.records) >= 5:
            end = 5 + int.from_bytes(self.records[3:5], "big")
            if len(self.records) < end:
                return
            header, body = bytes(self.records[:5]), bytes(self.records[5:end])
            del self.records[:end]
            key, iv = self.suite.keys(self.server_secret)
            nonce = (iv ^ self.server_seq).to_bytes(12, "big")
            inner = self.suite.aead(key).decrypt(nonce, body, header).rstrip(b"\x00")
            self.server_seq += 1
            if inner[-1] == 22 and inner[0] == 0x18:  # the server's KeyUpdate: its next key, from 0
                self.server_secret = self.suite.next_secret(self.server_secret)
                self.server_seq = 0
            elif inner[-1] == 23:
                self.plain += inner[:-1]
            elif inner[-1] == 21:
                self.alerts.append(inner[:-1])

    def record(self, secret: bytes, content: bytes) -> bytes:
        """The first record (sequence number 0) under ``secret``: ``content`` with its content type."""
        key, iv = self.suite.keys(secret)
        header = bytes((23, 3, 3)) + (len(content) + 16).to_bytes(2, "big")
        return header + self.suite.aead(key).encrypt(iv.to_bytes(12, "big"), content, header)

    def key_updates(self, count: int) -> bytes:
        """``count`` KeyUpdate(update_requested) records, each under the key the previous one moved to."""
        out = bytearray()
        secret = self.secret
        for _ in range(count):
            out += self.record(secret, b"\x18\x00\x00\x01\x01\x16")
            secret = self.suite.next_secret(secret)
        return bytes(out)

    def data_after(self, updates: int, payload: bytes) -> bytes:
        """Application data under the key after ``updates`` KeyUpdates."""
        secret = self.secret
        for _ in range(updates):
            secret = self.suite.next_secret(secret)
        return self.record(secret, payload + b"\x17")

    async def push(self, data: bytes, pos: int, *, idle: float, limit: float) -> int:
        return await push(self.sock, data, pos, idle=idle, limit=limit)

    async def read_all(self, *, open_records: bool = False) -> None:
        """Read what the server sends (and open it, or drop it), until it closes or the task is cancelled."""
        loop = asyncio.get_running_loop()
        while data := await loop.sock_recv(self.sock, 1 << 20):
            self.received += len(data)
            if open_records:
                self.open_server_records(data)


async def push(sock: socket.socket, data: bytes, pos: int, *, idle: float, limit: float) -> int:
    """Send from ``pos`` until all is sent, nothing went for ``idle`` s or ``limit`` s passed; where it got."""
    loop = asyncio.get_running_loop()
    view = memoryview(data)
    last = started = loop.time()
    while pos < len(data):
        try:
            sent = sock.send(view[pos : pos + 65536])
        except BlockingIOError:
            sent = 0
        now = loop.time()
        if sent:
            pos += sent
            last = now
        elif now - last > idle:
            break
        if now - started > limit:
            break
        await asyncio.sleep(0 if sent else 0.002)  # the server runs on this loop too
    return pos


def small_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SMALL_BUFFER)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SMALL_BUFFER)
    sock.setblocking(False)
    return sock


class Served(App):
    """The server's application; with ``stream``, it writes that many bytes, pausing as asked (as Connection does)."""

    instances: list[Served] = []

    def __init__(self, stream: int = 0) -> None:
        super().__init__()
        self.left = stream
        self.paused = False
        self.paused_ever = False
        Served.instances.append(self)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._stream()

    def pause_writing(self) -> None:
        self.paused = self.paused_ever = True

    def resume_writing(self) -> None:
        self.paused = False
        self._stream()

    def _stream(self) -> None:
        while self.left > 0 and not self.paused and self.transport is not None:
            chunk = min(self.left, 4096)
            self.left -= chunk
            self.transport.write(b"s" * chunk)


@contextlib.asynccontextmanager
async def listening(
    pki: dict[str, Path], kind: str, mode: str, factory: Callable[[], asyncio.Protocol]
) -> AsyncIterator[int]:
    """A TLS listener in this process: ``kind`` epoll (RawServer) or asyncio; ``mode`` lean-c, lean-python, openssl."""
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SMALL_BUFFER)  # accepted sockets inherit both
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SMALL_BUFFER)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    tls = TLSServer(server_context(pki), factory, 10.0, loop, lean=mode != "openssl")
    assert tls.lean == (mode != "openssl")
    if mode == "lean-python":
        tls.sealer = None
    poller: rawtransport.Poller | None = None
    server: rawtransport.RawServer | asyncio.Server
    if kind == "epoll":
        poller = rawtransport.Poller(loop)
        server = rawtransport.RawServer(loop, sock, tls, poller, 16)
    else:
        sock.listen(16)
        server = await loop.create_server(tls, sock=sock)
    try:
        yield port
    finally:
        server.close()
        if poller is not None:
            poller.close()


def held(transport: TLSTransport) -> int:
    """What the server keeps to send on this connection: TCP's buffer, and what OpenSSL holds back."""
    size = transport.get_write_buffer_size()
    outgoing = transport._outgoing
    return size + (outgoing.pending if outgoing is not None else 0)


async def until(predicate: Callable[[], Any], timeout: float = 20.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        assert loop.time() < deadline, "timed out"
        await asyncio.sleep(0.005)


@contextlib.asynccontextmanager
async def sampling(transport: TLSTransport) -> AsyncIterator[list[int]]:
    """The server's :func:`held` for this connection, every few milliseconds."""
    samples: list[int] = []

    async def sample() -> None:
        while True:
            samples.append(held(transport))
            await asyncio.sleep(0.002)

    task = asyncio.ensure_future(sample())
    try:
        yield samples
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        samples.append(held(transport))


async def flood_client(pki: dict[str, Path], port: int, keylog: Path) -> Flooder:
    context = client_context(pki)
    context.keylog_filename = str(keylog)
    sock = small_socket()
    await asyncio.wait_for(asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port)), 10)
    client = Flooder(sock, context)
    await client.handshake(keylog)
    await until(lambda: Served.instances and Served.instances[0].transport is not None)
    return client


SERVERS = [
    pytest.param("epoll", "lean-c", id="epoll-lean-c"),
    pytest.param("epoll", "lean-python", id="epoll-lean-python"),
    pytest.param("epoll", "openssl", id="epoll-openssl"),
    pytest.param("asyncio", "lean-c", id="asyncio-lean-c"),
    pytest.param("asyncio", "openssl", id="asyncio-openssl"),
]


# --- over real sockets ----------------------------------------------------------------------


@pytest.mark.parametrize(("kind", "mode"), SERVERS)
def test_a_key_update_flood_that_is_never_read_stays_small(
    pki: dict[str, Path], tmp_path: Path, kind: str, mode: str
) -> None:
    """The review's client: KeyUpdate requests, nothing read. Both answer each request (the lean layer up to
    MAX_OWED_KEY_UPDATES waiting while TCP is full, then they share one), and then the server stops reading.
    Either way the server keeps little, and once the client reads, the rest of its flood is served."""

    async def scenario() -> None:
        Served.instances = []
        async with listening(pki, kind, mode, Served) as port:
            client = await flood_client(pki, port, tmp_path / "keys.log")
            transport = Served.instances[0].transport
            assert isinstance(transport, TLSTransport) and transport.lean == (mode != "openssl")
            flood = client.key_updates(FLOOD)
            async with sampling(transport) as samples:
                sent = await client.push(flood, 0, idle=1.0, limit=3.0)
                most = max(samples)
                assert most < BOUND, f"the server kept {most} bytes for a client that does not read"
                # the client reads now: the rest of its last record and its data after it are served
                reader = asyncio.ensure_future(client.read_all())
                updates = -(-sent // KEY_UPDATE)
                done = client.data_after(updates, b"done")
                assert await client.push(flood[: updates * KEY_UPDATE] + done, sent, idle=20, limit=30) == (
                    updates * KEY_UPDATE + len(done)
                )
                await until(lambda: Served.instances[0].received == b"done")
                assert transport.is_reading()
            assert max(samples) < BOUND
            if mode != "openssl":
                # never more than one answer per request (issue 52, N2), whatever TCP did meanwhile
                await until(lambda: held(transport) == 0)
                await asyncio.sleep(0.05)
                # (and the few records the session's own start left on the wire: tickets)
                assert client.received <= updates * KEY_UPDATE + 1024, (client.received, updates)
            reader.cancel()
            client.sock.close()

    asyncio.run(asyncio.wait_for(scenario(), 60))


@pytest.mark.parametrize(("kind", "mode"), [SERVERS[0], SERVERS[2], SERVERS[3]])
def test_a_subscriber_that_does_not_read_is_not_read_either(
    pki: dict[str, Path], tmp_path: Path, kind: str, mode: str
) -> None:
    """The application streams to a client that floods KeyUpdate requests and does not read: once TCP
    is full (the application paused), the server stops reading the client, so its requests stop
    adding answers. When the client reads, the stream completes and the requests are served."""
    stream = 1 << 20

    async def scenario() -> None:
        Served.instances = []
        async with listening(pki, kind, mode, lambda: Served(stream)) as port:
            client = await flood_client(pki, port, tmp_path / "keys.log")
            served = Served.instances[0]
            transport = served.transport
            assert isinstance(transport, TLSTransport)
            flood = client.key_updates(FLOOD)
            async with sampling(transport) as samples:
                await until(lambda: served.paused)
                sent = await client.push(flood, 0, idle=1.0, limit=3.0)
                assert served.paused and not transport.is_reading()
                assert sent < len(flood)  # the server stopped taking them
                most = max(samples)
                assert most < BOUND, f"the server kept {most} bytes for a client that does not read"
                reader = asyncio.ensure_future(client.read_all())
                updates = -(-sent // KEY_UPDATE)
                done = client.data_after(updates, b"done")
                await client.push(flood[: updates * KEY_UPDATE] + done, sent, idle=20, limit=30)
                await until(lambda: served.received == b"done")
                await until(lambda: served.left == 0 and held(transport) == 0)
                assert transport.is_reading() and not served.paused
                await until(lambda: client.received >= stream)
            assert max(samples) < BOUND
            reader.cancel()
            client.sock.close()

    asyncio.run(asyncio.wait_for(scenario(), 60))


def rss(group: int) -> int:
    """The resident memory (bytes) of the processes of one process group: a server and its workers."""
    total = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            if int((entry / "stat").read_text().rpartition(")")[2].split()[2]) != group:
                continue
            for line in (entry / "status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
    return total


@pytest.mark.parametrize("lean", ["true", "false"], ids=["lean", "openssl"])
def test_a_real_server_does_not_grow_for_a_key_update_flood(
    server_factory: Callable[..., ServerProcess], pki: dict[str, Path], tmp_path: Path, lean: str
) -> None:
    """``migratory serve`` (wss://, Workers = 1) and the review's client: its resident memory stays put,
    then the client reads, the rest of its flood is served and its HTTP request is answered."""
    server, port = tls_server_process(server_factory, pki, TLSLeanTransport=lean, HandshakeTimeout="60000")
    request = b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        keylog = tmp_path / "keys.log"
        context = client_context(pki)
        context.keylog_filename = str(keylog)
        sock = small_socket()
        await asyncio.wait_for(loop.sock_connect(sock, ("127.0.0.1", port)), 10)
        client = Flooder(sock, context)
        await client.handshake(keylog)
        # 8.1 MB of answers, one each: more than the kernel takes into the server's socket (tcp_wmem, 4 MB)
        flood = client.key_updates(6 * FLOOD)
        await asyncio.sleep(0.5)
        before = rss(server.proc.pid)
        sent = await client.push(flood, 0, idle=1.0, limit=6.0)
        await asyncio.sleep(0.5)
        grown = rss(server.proc.pid) - before
        assert grown < 1 << 20, f"the server grew by {grown} bytes for a client that does not read"
        reader = asyncio.ensure_future(client.read_all(open_records=True))
        updates = -(-sent // KEY_UPDATE)
        last = client.data_after(updates, request)
        await client.push(flood[: updates * KEY_UPDATE] + last, sent, idle=30, limit=40)
        await asyncio.wait_for(reader, 40)  # the server answers, then closes (Connection: close)
        assert b'"status":"ok"' in client.plain, (bytes(client.plain[:300]), client.alerts)
        sock.close()

    asyncio.run(asyncio.wait_for(scenario(), 90))
    assert server.proc.poll() is None


class Echo(asyncio.Protocol):
    """A plain protocol that answers everything it reads (as pipelined requests are answered)."""

    instances: list[Echo] = []

    def __init__(self) -> None:
        self.transport: Any = None
        self.paused = False
        Echo.instances.append(self)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.transport.write(data)

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False


def test_a_plain_connection_whose_answers_pile_up_is_not_read() -> None:
    """LeanTransport (the worker's epoll): reading waits while writing does, for ws:// and http:// too."""
    payload = bytes(range(256)) * (16 << 10)  # 4 MB of "requests", each answered in full

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        Echo.instances = []
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SMALL_BUFFER)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SMALL_BUFFER)
        sock.bind(("127.0.0.1", 0))
        poller = rawtransport.Poller(loop)
        server = rawtransport.RawServer(loop, sock, Echo, poller, 16)
        client = small_socket()
        try:
            await asyncio.wait_for(loop.sock_connect(client, sock.getsockname()), 10)
            await until(lambda: Echo.instances)
            echo = Echo.instances[0]
            samples: list[int] = []
            pos = 0
            view = memoryview(payload)
            last = loop.time()
            while pos < len(payload) and loop.time() - last < 1.0:
                with contextlib.suppress(BlockingIOError):
                    pos += client.send(view[pos : pos + 65536])
                    last = loop.time()
                samples.append(echo.transport.get_write_buffer_size())
                await asyncio.sleep(0.002)
            assert echo.paused and not echo.transport.is_reading()
            assert pos < len(payload)
            assert max(samples) < BOUND, f"the server kept {max(samples)} bytes for a client that does not read"
            received = bytearray()

            async def read() -> None:
                while data := await loop.sock_recv(client, 1 << 20):
                    received.extend(data)

            reader = asyncio.ensure_future(read())
            assert await push(client, payload, pos, idle=20, limit=30) == len(payload)
            await until(lambda: len(received) == len(payload))
            assert received == payload  # everything, in order
            assert echo.transport.is_reading() and not echo.paused
            reader.cancel()
        finally:
            client.close()
            server.close()
            poller.close()

    asyncio.run(asyncio.wait_for(scenario(), 60))


# --- in process: a fake TCP transport, a real OpenSSL client -----------------------------------


class PausingTCP(FakeTCP):
    """FakeTCP that also records whether it is asked to read."""

    def __init__(self) -> None:
        super().__init__()
        self.reading = True

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def is_reading(self) -> bool:
        return self.reading


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(params=["c-sealer", "python-sealer"])
def tls_server(pki: dict[str, Path], loop: asyncio.AbstractEventLoop, request: pytest.FixtureRequest) -> TLSServer:
    server = TLSServer(server_context(pki), App, 5.0, loop)
    assert server.lean
    if request.param == "python-sealer":
        server.sealer = None
    return server


def pausing(pair: Pair) -> PausingTCP:
    """The pair's TCP transport, replaced (after the handshake) by one that can pause reading."""
    tcp = PausingTCP()
    tcp.out = pair.tcp.out
    pair.transport._tcp = tcp  # type: ignore[assignment]
    pair.tcp = tcp
    return tcp


def records_of(wire: bytes) -> list[bytes]:
    out = []
    pos = 0
    while pos < len(wire):
        length = int.from_bytes(wire[pos + 3 : pos + 5], "big")
        out.append(wire[pos : pos + 5 + length])
        pos += 5 + length
    return out


def test_many_key_update_requests_get_one_answer_each(tls_server: TLSServer, pki: dict[str, Path]) -> None:
    """As OpenSSL (issue 52, N2): a hundred requests in one read, a hundred answers, each under the key the one
    before it installed; the real client follows all of them."""
    pair, records = lean_pair(tls_server, pki)
    wire = b""
    for _ in range(100):
        wire += records.handshake(b"\x18\x00\x00\x01\x01")
        records.next_key()
    wire += records.data(b"after a hundred")
    wsecret = pair.transport._wsecret
    pair.transport.data_received(wire)
    assert pair.app.received == b"after a hundred"
    answers = records_of(bytes(pair.tcp.out))
    assert len(answers) == 100 and all(len(a) == tls_keyupdate._KEY_UPDATE_SIZE for a in answers)
    assert pair.transport._wsecret != wsecret and not pair.transport._owed
    pair.transport.write(b"under our next key")  # the real client followed our hundred updates
    assert pair.receive() == b"under our next key"


def test_the_answer_waits_while_tcp_is_paused_and_goes_before_our_next_record(
    tls_server: TLSServer, pki: dict[str, Path]
) -> None:
    pair, records = lean_pair(tls_server, pki)
    tcp = pausing(pair)
    pair.transport.pause_writing()  # as TCP does past its high-water mark
    assert not tcp.reading  # and reading waits too
    wire = b""
    for _ in range(3):
        wire += records.handshake(b"\x18\x00\x00\x01\x01")
        records.next_key()
    pair.transport.data_received(wire)
    assert tcp.out == b"" and pair.transport._owed  # held back, not written
    pair.transport.write(b"first")  # the application writes anyway: our KeyUpdate goes first
    assert not pair.transport._owed and pair.receive() == b"first"
    pair.transport.data_received(records.handshake(b"\x18\x00\x00\x01\x01"))
    records.next_key()
    assert pair.transport._owed and tcp.out == b""
    pair.transport.resume_writing()  # TCP drained: the answer goes, and reading resumes
    assert not pair.transport._owed and tcp.reading and len(records_of(bytes(tcp.out))) == 1
    pair.transport.write(b"second")
    assert pair.receive() == b"second"
    pair.transport.data_received(records.data(b"and we follow the client"))
    assert pair.app.received == b"and we follow the client"


def test_reading_waits_for_the_application_and_for_tcp(tls_server: TLSServer, pki: dict[str, Path]) -> None:
    pair, _ = lean_pair(tls_server, pki)
    tcp = pausing(pair)
    pair.transport.pause_reading()
    assert not tcp.reading
    pair.transport.pause_writing()
    pair.transport.resume_writing()
    assert not tcp.reading  # the application still does not want to read
    pair.transport.pause_writing()
    pair.transport.resume_reading()
    assert not tcp.reading  # TCP still cannot write
    pair.transport.resume_writing()
    assert tcp.reading


class Limited(App):
    """An application with a Connection's output accounting: ``engine.max_pending`` and ``pending_bytes``."""

    def __init__(self, limit: int, pending: int) -> None:
        super().__init__()
        self.engine = SimpleNamespace(max_pending=limit)
        self.pending_bytes = pending


def test_an_owed_answer_counts_against_the_applications_output_limit(
    tls_server: TLSServer, pki: dict[str, Path]
) -> None:
    pair, records = lean_pair(tls_server, pki)
    app = Limited(1000, 990)  # the application's own queue is nearly at MaxPendingOutput
    pair.transport.set_protocol(app)
    tcp = pausing(pair)
    pair.transport.pause_writing()
    pair.transport.data_received(records.handshake(b"\x18\x00\x00\x01\x01"))
    assert tcp.aborted  # 990 + the 27 bytes of our answer: over the limit, dropped as a slow consumer
    # within the limit it just waits
    pair, records = lean_pair(tls_server, pki)
    pair.transport.set_protocol(Limited(1000, 900))
    tcp = pausing(pair)
    pair.transport.pause_writing()
    pair.transport.data_received(records.handshake(b"\x18\x00\x00\x01\x01"))
    assert not tcp.aborted and pair.transport._owed


def client_secret(keylog: Path) -> bytes:
    lines = [line.split() for line in keylog.read_text().splitlines()]
    return bytes.fromhex([line for line in lines if line[0] == "CLIENT_TRAFFIC_SECRET_0"][-1][2])


def test_openssl_records_wait_while_tcp_is_paused_and_count_against_the_limit(
    pki: dict[str, Path], loop: asyncio.AbstractEventLoop, tmp_path: Path
) -> None:
    """On OpenSSL's record layer its KeyUpdate answers stay in its outgoing BIO while TCP is paused,
    counted against the output limit (here the listener's); past it the connection is dropped."""
    for limit, requests in ((4 << 20, 50), (1000, 50)):
        keylog = tmp_path / f"keys-{limit}.log"
        context = client_context(pki)
        context.keylog_filename = str(keylog)
        server = TLSServer(server_context(pki), App, 5.0, loop, lean=False, max_pending=limit)
        pair = Pair(server, context)
        pair.handshake()
        assert not pair.transport.lean
        tcp = pausing(pair)
        pair.receive()  # the session tickets
        pair.transport.pause_writing()
        suite = SUITES[pair.client.cipher()[0]]  # type: ignore[index]
        secret = client_secret(keylog)
        wire = b""
        for _ in range(requests):
            key, iv = suite.keys(secret)
            header = bytes((23, 3, 3, 0, 22))
            wire += header + suite.aead(key).encrypt(iv.to_bytes(12, "big"), b"\x18\x00\x00\x01\x01\x16", header)
            secret = suite.next_secret(secret)
        pair.transport.data_received(wire)
        assert tcp.out == b""  # nothing written while paused
        if limit < requests * KEY_UPDATE:
            assert tcp.aborted
            continue
        assert not tcp.aborted and pair.transport._outgoing is not None
        assert pair.transport._outgoing.pending >= requests * 20  # OpenSSL answered each, held back
        pair.transport.resume_writing()
        assert pair.transport._outgoing.pending == 0 and len(tcp.out) >= requests * 20
        pair.transport.write(b"after the answers")
        assert pair.receive() == b"after the answers"


def test_a_flood_of_one_byte_records_is_opened_at_record_rate(
    tls_server: TLSServer, pki: dict[str, Path], loop: asyncio.AbstractEventLoop
) -> None:
    pair, records = lean_pair(tls_server, pki)
    tcp = pausing(pair)
    count = 10_000
    wire = b"".join(records.data(b"%c" % (48 + n % 10)) for n in range(count))
    pair.transport.data_received(wire)
    # a burst is opened at once; the rest waits, unread, and so does TCP
    assert len(pair.app.received) == tls_records.RECORD_BURST
    assert not tcp.reading and len(pair.transport._rbuf) < len(wire)
    started = loop.time()
    loop.run_until_complete(asyncio.wait_for(wait_for(lambda: len(pair.app.received) == count), 10))
    elapsed = loop.time() - started
    assert pair.app.received == b"".join(b"%c" % (48 + n % 10) for n in range(count))
    assert elapsed >= (count - tls_records.RECORD_BURST * 1.5) / tls_records.RECORD_RATE
    assert tcp.reading and pair.transport._rbuf == b""
    pair.transport.write(b"still fine")
    assert pair.receive() == b"still fine"


def test_what_waits_past_the_record_rate_waits_for_an_application_that_paused_reading(
    tls_server: TLSServer, pki: dict[str, Path], loop: asyncio.AbstractEventLoop
) -> None:
    pair, records = lean_pair(tls_server, pki)
    tcp = pausing(pair)
    count = tls_records.RECORD_BURST + 100
    pair.transport.data_received(b"".join(records.data(b"x") for _ in range(count)))
    assert len(pair.app.received) == tls_records.RECORD_BURST and not tcp.reading
    pair.transport.pause_reading()
    loop.run_until_complete(asyncio.sleep(0.2))  # the allowance has grown, but the application does not read
    assert len(pair.app.received) == tls_records.RECORD_BURST and not tcp.reading
    pair.transport.resume_reading()
    assert pair.app.received == b"x" * count and tcp.reading


def test_key_updates_count_more_against_the_record_rate(tls_server: TLSServer, pki: dict[str, Path]) -> None:
    pair, records = lean_pair(tls_server, pki)
    wire = b""
    for _ in range(1000):
        wire += records.handshake(b"\x18\x00\x00\x01\x00")
        records.next_key()
    wire += records.data(b"after")
    tcp = pausing(pair)
    pair.transport.data_received(wire)
    assert pair.app.received == b""  # 1000 KeyUpdates are more than a burst
    assert pair.transport._timer is not None and not tcp.reading


async def wait_for(predicate: Callable[[], bool]) -> None:
    while not predicate():
        await asyncio.sleep(0.005)


def test_empty_records_are_limited_as_openssl_limits_them(tls_server: TLSServer, pki: dict[str, Path]) -> None:
    pair, records = lean_pair(tls_server, pki)
    limit = tls_records.MAX_EMPTY_RECORDS
    # as many as OpenSSL allows, then data (which starts the count again), then as many again
    pair.transport.data_received(b"".join(records.data(b"") for _ in range(limit)) + records.data(b"a"))
    pair.transport.data_received(b"".join(records.data(b"") for _ in range(limit)) + records.data(b"b"))
    assert pair.app.received == b"ab" and not pair.tcp.closed
    # one more in a row is fatal
    pair.transport.data_received(b"".join(records.data(b"") for _ in range(limit + 1)) + records.data(b"never"))
    assert pair.app.received == b"ab"
    assert_fatal_alert(pair, UNEXPECTED_MESSAGE)


def test_openssl_mode_opens_data_records_at_record_rate(pki: dict[str, Path], loop: asyncio.AbstractEventLoop) -> None:
    server = TLSServer(server_context(pki), App, 5.0, loop, lean=False)
    pair = Pair(server, client_context(pki))
    pair.handshake()
    tcp = pausing(pair)
    count = 6000
    for n in range(count):
        pair.client.write(b"%c" % (48 + n % 10))
    pair.transport.data_received(pair.c_out.read())
    assert len(pair.app.received) == tls_records.RECORD_BURST and not tcp.reading
    loop.run_until_complete(asyncio.wait_for(wait_for(lambda: len(pair.app.received) == count), 10))
    assert pair.app.received == b"".join(b"%c" % (48 + n % 10) for n in range(count)) and tcp.reading
