"""What tests/test_tls_interop.py needs: the real server in this process, and clients that are not Python's ``ssl``.

* :class:`LiveServer`: ``migratory.server.process.app.serve`` (the worker's own code: Engine, Connection,
  the TLS listener on the worker's epoll transport) on a thread with its own uvloop, on a
  context from ``migratory.server.transport.context.build_context``, as ``migratory serve`` runs it, so the test can see
  every :class:`~migratory.server.transport.tls.TLSTransport` it made (:class:`Seen`) and the
  process-wide ``tls_stats.fallbacks`` counters;
* :class:`TlsliteClient` (tlslite-ng, pure Python TLS 1.3) and :class:`SClient` (``openssl s_client``,
  driven through its stdin and stdout), both offering ``send``/``recv``;
* :class:`NativeSession`: a WebSocket upgrade then the native protocol (CONNECT, SUBSCRIBE, PUBLISH,
  the MESSAGE back) over either client, and :func:`health`, a ``GET /health``.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import os
import re
import socket
import ssl
import struct
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

import pytest

from migratory import protocol
from migratory.bench.wire import _mask
from migratory.config import Config
from migratory.server.transport.tls import TLSServer, TLSTransport
from migratory.server.transport.tls import stats as tls_stats

HRR_RANDOM = bytes.fromhex("cf21ad74e59a6111be1d8c021e65b891c2a211167abb8c5e079e09e2c8a8339c")
"""The ServerHello.random of a HelloRetryRequest (RFC 8446 4.1.3)."""

TIMEOUT = 30.0
"""Seconds any one step may take (a loaded 2-core machine; tlslite-ng is pure Python)."""


# --- the server ------------------------------------------------------------------------------


@dataclass
class Seen:
    """One TLS connection of the live server, as its transport saw it."""

    transport: TLSTransport
    peer: tuple[Any, ...] | None = None
    cipher: str = ""
    version: str = ""
    reused: bool | None = None
    client_key_updates: int = 0  # KeyUpdates received (and followed) by the lean record layer
    server_key_updates: int = 0  # KeyUpdates the lean record layer sent (answers and its own)

    @property
    def lean(self) -> bool:
        """The lean record layer carried this connection's records (False: OpenSSL's did)."""
        return self.transport.lean


@dataclass
class Observer:
    """Every TLSTransport made while installed, in order."""

    seen: list[Seen] = field(default_factory=list)
    by_transport: dict[int, Seen] = field(default_factory=dict)

    def mark(self) -> int:
        return len(self.seen)

    def since(self, mark: int) -> list[Seen]:
        return self.seen[mark:]

    def install(self, patch: pytest.MonkeyPatch) -> None:
        make = TLSServer.__call__
        refusal = TLSTransport._refusal
        made = TLSTransport.connection_made
        update = TLSTransport._update_write_key
        post = TLSTransport._post_handshake
        observer = self

        def call(server: TLSServer) -> TLSTransport:
            transport = make(server)
            seen = Seen(transport)
            observer.by_transport[id(transport)] = seen
            observer.seen.append(seen)
            return transport

        def connection_made(transport: TLSTransport, tcp: asyncio.BaseTransport) -> None:
            made(transport, tcp)
            seen = observer.by_transport.get(id(transport))
            if seen is not None:
                seen.peer = tcp.get_extra_info("peername")

        def observed_refusal(transport: TLSTransport, sslobj: ssl.SSLObject) -> str | None:
            seen = observer.by_transport.get(id(transport))
            if seen is not None:
                cipher = sslobj.cipher()
                seen.cipher = cipher[0] if cipher else ""
                seen.version = sslobj.version() or ""
                seen.reused = sslobj.session_reused
            return refusal(transport, sslobj)

        def update_write_key(transport: TLSTransport, *, requested: bool) -> bytes:
            seen = observer.by_transport.get(id(transport))
            if seen is not None:
                seen.server_key_updates += 1
            return update(transport, requested=requested)

        def post_handshake(transport: TLSTransport, content: bytes, plain: list[bytes]) -> bool:
            before = transport._rsecret
            kept = post(transport, content, plain)
            seen = observer.by_transport.get(id(transport))
            if seen is not None and transport._rsecret is not before and transport._rsecret:
                seen.client_key_updates += 1
            return kept

        patch.setattr(TLSServer, "__call__", call)
        patch.setattr(TLSTransport, "connection_made", connection_made)
        patch.setattr(TLSTransport, "_refusal", observed_refusal)
        patch.setattr(TLSTransport, "_update_write_key", update_write_key)
        patch.setattr(TLSTransport, "_post_handshake", post_handshake)


class LiveServer:
    """``serve()`` of migratory.server.process.app on a thread: one worker, a ``ListenEncrypted`` listener.

    ``context_hook`` may change the TLS context after ``build_context`` (e.g. its groups).
    """

    def __init__(
        self,
        folder: Path,
        pki: dict[str, Path],
        *,
        extra: dict[str, str] | None = None,
        context_hook: Callable[[ssl.SSLContext], None] | None = None,
    ) -> None:
        from migratory.server.process.app import bind_socket
        from migratory.server.transport.context import build_context

        for sub in ("logs", "state"):
            (folder / sub).mkdir(parents=True, exist_ok=True)
        lines = {
            "Listen": "127.0.0.1:0",
            "ListenEncrypted": "127.0.0.1:0",
            "TLSCertificate": str(pki["cert"]),
            "TLSKey": str(pki["key"]),
            "LogFolder": str(folder / "logs"),
            "StateFolder": str(folder / "state"),
            "Workers": "1",
            **(extra or {}),
        }
        self.config = Config.from_text("".join(f"{k} = {v}\n" for k, v in lines.items()), str(folder / "interop.conf"))
        self.context = build_context(self.config)
        if context_hook is not None:
            context_hook(self.context)
        endpoint = self.config.listen_encrypted[0]
        self.sock = bind_socket(endpoint)
        self.port = int(self.sock.getsockname()[1])
        self._endpoint = endpoint
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"live-tls-server-{self.port}", daemon=True)

    def start(self) -> LiveServer:
        self._thread.start()
        assert self._ready.wait(TIMEOUT), "the live server did not start"
        if self._failure is not None:
            raise RuntimeError("the live server failed to start") from self._failure
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:  # serving once a TLS handshake completes
            if self._failure is not None:
                raise RuntimeError("the live server failed to start") from self._failure
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=5) as raw:
                context = ssl.create_default_context()
                context.check_hostname = False
                context.verify_mode = ssl.CERT_NONE
                with context.wrap_socket(raw) as tls:
                    tls.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                    if tls.recv(12).startswith(b"HTTP/1.1"):
                        return self
            time.sleep(0.05)
        raise TimeoutError("the live server does not answer")

    def _run(self) -> None:
        from migratory.server.process.app import serve

        loop: asyncio.AbstractEventLoop
        try:
            import uvloop

            loop = uvloop.new_event_loop()
        except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
            loop = asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)

        async def main() -> None:
            self._stop = asyncio.Event()
            self._ready.set()
            await serve(self.config, [(self._endpoint, self.sock, "wss")], self._stop, epoch=1, tls=self.context)

        try:
            loop.run_until_complete(main())
        except BaseException as exc:  # reported by start() or stop()
            self._failure = exc
            self._ready.set()
        finally:
            loop.close()

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None and not self._loop.is_closed():
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(TIMEOUT)
        self.sock.close()
        assert not self._thread.is_alive(), "the live server did not stop"
        if self._failure is not None:
            raise RuntimeError("the live server failed") from self._failure


PROCESS_TALLIES = ("fallbacks", "counters", "alerts_sent", "alerts_received", "_warned")
"""The process-wide tallies of tls/stats.py (those this version has): counts, the WARNING rate limit's state."""


def isolate_tallies(patch: pytest.MonkeyPatch) -> None:
    """Copies of the TLS layer's (tls/stats.py) process-wide tallies for a test module, put back as they were after it.

    A module that makes many connections (and alerts) must not shift what another module's tests
    expect of them: the 1st, 2nd, 4th... fallback of a reason logged at INFO (test_tls_review), the
    first record-layer failure of a minute logged at WARNING, counts compared before and after.
    """
    for name in PROCESS_TALLIES:
        if hasattr(tls_stats, name):
            patch.setattr(tls_stats, name, copy.deepcopy(getattr(tls_stats, name)))


def wait_for(condition: Callable[[], object], what: str, timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


# --- clients -----------------------------------------------------------------------------------


class Stream(Protocol):
    def send(self, data: bytes) -> None: ...

    def recv(self, timeout: float = TIMEOUT) -> bytes: ...


class RecordingSocket:
    """A socket that keeps every byte it received (to find a HelloRetryRequest in the server's first flight)."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self.received = bytearray()

    def recv(self, size: int, *args: Any) -> bytes:
        data = self._sock.recv(size, *args)
        self.received += data
        return data

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


class TlsliteClient:
    """A tlslite-ng TLS 1.3 client (pure Python: none of OpenSSL's code) on a real socket."""

    def __init__(
        self,
        port: int,
        *,
        ciphers: list[str] | None = None,
        groups: list[str] | None = None,
        key_shares: list[str] | None = None,
        record_size_limit: int | None = None,
        session: Any = None,
    ) -> None:
        from tlslite import HandshakeSettings, TLSConnection

        settings = HandshakeSettings()
        settings.minVersion = settings.maxVersion = (3, 4)
        if ciphers is not None:
            settings.cipherNames = ciphers
        if groups is not None:
            settings.eccCurves = groups
        if key_shares is not None:
            settings.keyShares = key_shares
        if record_size_limit is not None:
            settings.record_size_limit = record_size_limit
        sock = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT)
        self.raw = RecordingSocket(sock)
        self.local_port = int(sock.getsockname()[1])
        self.conn = TLSConnection(self.raw)
        self.conn.handshakeClientCert(settings=settings, session=session, serverName="localhost")
        self.cipher = self.conn.getCipherName()
        self.version = self.conn.version

    @property
    def hello_retry_request(self) -> bool:
        """Whether the server's first message was a HelloRetryRequest (its fixed random)."""
        return HRR_RANDOM in bytes(self.raw.received[:200])

    @property
    def session(self) -> Any:
        return self.conn.session

    def send(self, data: bytes) -> None:
        self.conn.write(data)

    def recv(self, timeout: float = TIMEOUT) -> bytes:
        self.raw.settimeout(timeout)
        return bytes(self.conn.read(max=1 << 16))

    def key_update(self, *, requested: bool) -> None:
        """Our KeyUpdate (RFC 8446 4.6.3); with ``requested``, the server must answer with its own."""
        from tlslite.constants import KeyUpdateMessageType

        kind = KeyUpdateMessageType.update_requested if requested else KeyUpdateMessageType.update_not_requested
        for _ in self.conn.send_keyupdate_request(kind):
            pass

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.conn.close()  # close_notify
        self.raw.close()


class SClient:
    """``openssl s_client -brief``: the application data on its stdout, its status lines on stderr."""

    def __init__(self, port: int, ca: Path, *args: str, msgfile: Path | None = None, commands: bool = False) -> None:
        command = ["openssl", "s_client", "-connect", f"127.0.0.1:{port}", "-CAfile", str(ca)]
        command += ["-verify_return_error", "-brief", "-tls1_3", *args]
        self.commands = commands
        if not commands:
            # s_client takes a read of its stdin that starts with Q, R, K, k (or C) for a command: a
            # WebSocket frame split over its reads could start one with a payload byte
            command.append("-nocommands")
        if msgfile is not None:
            command += ["-msg", "-msgfile", str(msgfile)]
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self._out = bytearray()
        self._err = bytearray()
        self._ended: set[str] = set()  # "out", "err": that pipe is at its end
        self._lock = threading.Condition()
        self._readers = [
            threading.Thread(target=self._pump, args=(self.proc.stdout, self._out, "out"), daemon=True),
            threading.Thread(target=self._pump, args=(self.proc.stderr, self._err, "err"), daemon=True),
        ]
        for reader in self._readers:
            reader.start()
        self.wait_err("CONNECTION ESTABLISHED\n")
        self.wait_err(r"Server Temp Key: [^\n]*\n")  # the last line of its summary (-brief), whole

    def _pump(self, pipe: Any, into: bytearray, name: str) -> None:
        while True:
            data = os.read(pipe.fileno(), 65536)
            with self._lock:
                if data:
                    into += data
                else:
                    self._ended.add(name)
                self._lock.notify_all()
            if not data:
                return

    @property
    def stderr(self) -> str:
        with self._lock:
            return self._err.decode(errors="replace")

    def wait_err(self, pattern: str, count: int = 1) -> None:
        """Until s_client has said ``pattern`` (a regular expression) ``count`` times on stderr."""
        deadline = time.monotonic() + TIMEOUT
        with self._lock:
            while len(re.findall(pattern, self._err.decode(errors="replace"))) < count:
                left = deadline - time.monotonic()
                if left <= 0 or "err" in self._ended:
                    raise AssertionError(f"s_client never said {pattern!r}: {self._err.decode(errors='replace')}")
                self._lock.wait(min(left, 0.5))

    def send(self, data: bytes) -> None:
        assert self.proc.stdin is not None
        assert not self.commands or len(data) <= 4096, "s_client could read a command letter inside it"
        self.proc.stdin.write(data)
        self.proc.stdin.flush()

    def recv(self, timeout: float = TIMEOUT) -> bytes:
        """What s_client printed of the server's application data (b"" once it has ended)."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while not self._out and "out" not in self._ended:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"s_client received nothing: {self._err.decode(errors='replace')}")
                self._lock.wait(min(left, 0.5))
            data = bytes(self._out)
            self._out.clear()
            return data

    def key_update(self, *, requested: bool) -> None:
        """s_client's ``K`` (update_requested) or ``k`` command: one read of its stdin, alone.

        Only with ``commands``: then every write must be one read of s_client's, so that it starts
        with the frame's first byte (0x82), not with a command letter: at most PIPE_BUF (4096) bytes,
        written once the previous one was answered.
        """
        assert self.commands, "s_client was started with -nocommands"
        before = self.stderr.count("KEYUPDATE")
        self.send(b"K\n" if requested else b"k\n")
        self.wait_err("KEYUPDATE", before + 1)  # said once it has read the command: what follows is a new read

    def close(self) -> str:
        """End of its stdin: s_client sends close_notify and exits; what it said on stderr."""
        with contextlib.suppress(OSError):
            assert self.proc.stdin is not None
            self.proc.stdin.close()
        try:
            self.proc.wait(TIMEOUT)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for reader in self._readers:
            reader.join(5)
        for pipe in (self.proc.stdout, self.proc.stderr):
            if pipe is not None:
                pipe.close()
        return self.stderr


Client = TypeVar("Client", TlsliteClient, SClient)


@contextlib.contextmanager
def closing(client: Client) -> Iterator[Client]:
    try:
        yield client
    finally:
        client.close()


# --- what goes through: a WebSocket session of the native protocol, or /health -----------------


class NativeSession:
    """A WebSocket (RFC 6455, masked client frames) carrying the native protocol, over any :class:`Stream`."""

    def __init__(self, stream: Stream) -> None:
        self.stream = stream
        self.buffer = b""
        self.frames: list[protocol.ServerFrame] = []

    def upgrade(self) -> None:
        key = base64.b64encode(os.urandom(16)).decode()
        self.stream.send(
            (
                "GET / HTTP/1.1\r\nHost: localhost\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n"
                "Sec-WebSocket-Protocol: migratory.v1\r\n\r\n"
            ).encode()
        )
        while b"\r\n\r\n" not in self.buffer:
            self._read()
        head, _, self.buffer = self.buffer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 101 "), head

    def _read(self) -> None:
        data = self.stream.recv()
        assert data, f"the connection ended: {getattr(self.stream, 'stderr', '')}"
        self.buffer += data

    def send(self, message: bytes) -> None:
        self.stream.send(_mask(message))  # a masked binary frame, as the benchmark's clients send them

    def next_frame(self) -> protocol.ServerFrame:
        while True:
            frame = self._frame()
            if frame is not None:
                return frame
            self._read()

    def _frame(self) -> protocol.ServerFrame | None:
        buf = self.buffer
        if len(buf) < 2:
            return None
        length, start = buf[1] & 0x7F, 2
        if length == 126:
            if len(buf) < 4:
                return None
            length, start = struct.unpack("!H", buf[2:4])[0], 4
        elif length == 127:
            if len(buf) < 10:
                return None
            length, start = struct.unpack("!Q", buf[2:10])[0], 10
        if len(buf) < start + length:
            return None
        opcode, payload = buf[0] & 0x0F, buf[start : start + length]
        self.buffer = buf[start + length :]
        assert buf[0] & 0x80 and opcode == 2, f"unexpected WebSocket frame {buf[:2].hex()}"
        return protocol.decode_server(payload)

    def expect(self, kind: type[Any]) -> Any:
        frame = self.next_frame()
        assert isinstance(frame, kind), frame
        return frame

    def connect(self) -> None:
        self.upgrade()
        self.send(protocol.encode_connect())
        self.expect(protocol.Connected)

    def subscribe(self, subject: str) -> None:
        self.send(protocol.encode_subscribe([subject]))
        status = self.expect(protocol.SubscribeStatus)
        assert status.status == protocol.Status.OK and status.subject == subject, status

    def round_trip(self, subject: str, content: bytes) -> None:
        """PUBLISH to a subject this session subscribed to: its PUBLISH_STATUS OK and the MESSAGE back."""
        closure = os.urandom(4).hex()
        self.send(protocol.encode_publish(subject, content, closure=closure))
        status: protocol.PublishStatus | None = None
        delivered: protocol.Delivery | None = None
        while status is None or delivered is None:
            frame = self.next_frame()
            if isinstance(frame, protocol.PublishStatus):
                status = frame
            elif isinstance(frame, protocol.Delivery) and frame.subject == subject:
                if not frame.snapshot:  # a snapshot: what an earlier session published
                    delivered = frame
            else:
                raise AssertionError(f"unexpected {frame}")
        assert status.status == protocol.Status.OK and status.closure == closure, status
        assert delivered.content == content, (len(delivered.content), len(content))


def pub_sub(stream: Stream, subject: str, contents: list[bytes]) -> NativeSession:
    """A WebSocket upgrade, CONNECT, SUBSCRIBE, then one PUBLISH and its MESSAGE back per content."""
    session = NativeSession(stream)
    session.connect()
    session.subscribe(subject)
    for content in contents:
        session.round_trip(subject, content)
    return session


def health(stream: Stream) -> bytes:
    """``GET /health`` answered 200: the answer's head and body (the server closes after it)."""
    stream.send(b"GET /health HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
    answer = b""
    while b"\r\n\r\n" not in answer or b'"status"' not in answer:
        data = stream.recv()
        if not data:
            break
        answer += data
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:300]
    return answer
