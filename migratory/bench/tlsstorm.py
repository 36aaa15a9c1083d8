"""A storm of TLS reconnections: full handshakes, then the same clients resuming with session tickets.

Issue 35 (item 3) asks what a reconnect storm of encrypted clients costs the server, and how much
TLS 1.3 session resumption saves. ``migratory bench tls-storm`` runs, from several client processes
(each client from one of several loopback addresses, closing abortively so that it can come back
at once from the same address):

0. **plain**: N clients connect to a ``ws://`` server and upgrade (the floor: accept, HTTP, close);

then against a ``wss://`` server (the lean record layer, OpenSSL doing the handshakes):

1. **full**: N clients connect, complete a full TLS 1.3 handshake and a WebSocket upgrade
   (which also delivers the server's NewSessionTicket messages), and keep the session;
2. every client disconnects;
3. **resumed**: the same N clients reconnect at once, each offering its ticket
   (``SSLContext.wrap_bio(session=...)``), and upgrade again.

For each storm: the server's CPU (every process, user + system) from the first connect until
every client has its 101 answer, per connection (over the plain storm's: the handshake's cost); the
storm's wall time; and how many handshakes the server actually resumed
(``SSLObject.session_reused`` on the client). The clients drive
OpenSSL through memory BIOs, as the event loop's own TLS transport would not let them offer a
session. The workers are forked from the supervisor after it built the TLS context, so they share
its ticket keys: a ticket issued by one worker resumes on another.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import socket
import ssl
import struct
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from migratory.bench.servers import ProcessMeter, spawn

__all__ = ["StormReport", "storm"]

_UPGRADE = (
    "GET /ws HTTP/1.1\r\nHost: {host}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
    "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
)


@dataclass
class StormReport:
    clients: int
    workers: int
    processes: int
    cipher: str = ""
    plain_connected: int = 0  # the same storm over ws:// (no TLS): the floor the handshakes add to
    plain_seconds: float = 0.0
    plain_server_cpu_seconds: float = 0.0
    plain_server_cpu_us_per_connection: float = 0.0
    full_connected: int = 0
    full_seconds: float = 0.0
    full_server_cpu_seconds: float = 0.0
    full_server_cpu_us_per_connection: float = 0.0
    resumed_connected: int = 0
    resumed_reused: int = 0  # handshakes the server resumed (the rest fell back to full ones)
    resumed_seconds: float = 0.0
    resumed_server_cpu_seconds: float = 0.0
    resumed_server_cpu_us_per_connection: float = 0.0
    handshake_us_full: float = 0.0  # server CPU a connection over the plain storm's: the TLS handshake
    handshake_us_resumed: float = 0.0
    saved_ratio: float = 0.0  # resumed handshake CPU / full handshake CPU
    errors: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class _Client:
    """One client over a non-blocking socket: plain, or TLS through two memory BIOs (so it can offer a session)."""

    def __init__(self, context: ssl.SSLContext | None, host: str, session: ssl.SSLSession | None) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setblocking(False)
        self.incoming: ssl.MemoryBIO | None = ssl.MemoryBIO()
        self.outgoing: ssl.MemoryBIO | None = ssl.MemoryBIO()
        self.tls: ssl.SSLObject | None = (
            context.wrap_bio(self.incoming, self.outgoing, server_hostname=host, session=session)
            if context is not None
            else None
        )
        # what the handshake gave, kept once the SSLObject is dropped (its 25 KB a client would not fit a
        # storm of hundreds of thousands held open at once): the session to offer next time, and whether
        # this one was resumed
        self.session: ssl.SSLSession | None = None
        self.reused = False
        self.cipher = ""

    async def _flush(self, loop: asyncio.AbstractEventLoop) -> None:
        data = self.outgoing.read() if self.outgoing is not None else b""
        if data:
            await loop.sock_sendall(self.sock, data)

    async def _fill(self, loop: asyncio.AbstractEventLoop) -> bytes:
        chunk = await loop.sock_recv(self.sock, 65536)
        if not chunk:
            raise ConnectionError("the server closed the connection")
        if self.incoming is not None:
            self.incoming.write(chunk)
        return chunk

    async def run(self, loop: asyncio.AbstractEventLoop, address: tuple[str, int], source: str) -> None:
        """Connect, handshake, upgrade; return once the 101 answer (and the tickets before it) arrived."""
        self.sock.bind((source, 0))
        await loop.sock_connect(self.sock, address)
        request = _UPGRADE.format(host=address[0]).encode()
        answer = b""
        if self.tls is None:
            await loop.sock_sendall(self.sock, request)
            while b"\r\n\r\n" not in answer:
                answer += await self._fill(loop)
        else:
            while True:
                try:
                    self.tls.do_handshake()
                    break
                except ssl.SSLWantReadError:
                    await self._flush(loop)
                    await self._fill(loop)
            self.tls.write(request)
            await self._flush(loop)
            while b"\r\n\r\n" not in answer:
                try:
                    answer += self.tls.read(65536)
                except ssl.SSLWantReadError:
                    await self._fill(loop)
        if not answer.startswith(b"HTTP/1.1 101"):
            raise ConnectionError(f"upgrade refused: {answer[:40]!r}")
        if self.tls is not None:  # the tickets came before the 101: the session is complete
            cipher = self.tls.cipher()
            self.session, self.reused, self.cipher = (
                self.tls.session,
                self.tls.session_reused,
                cipher[0] if cipher else "",
            )
            self.tls = None  # the socket alone stays open until the wave closes
            self.incoming = self.outgoing = None

    def close(self) -> None:
        """Abortive (RST, no TIME_WAIT): the same clients come back at once from the same addresses."""
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_ABORT)
        self.sock.close()


_LINGER_ABORT = struct.pack("ii", 1, 0)


async def _wave(
    context: ssl.SSLContext | None,
    address: tuple[str, int],
    sources: list[str],
    sessions: list[ssl.SSLSession | None],
    concurrency: int,
) -> tuple[list[_Client], dict[str, int]]:
    """Every client of this process connected at once (``concurrency`` in flight), offering ``sessions``."""
    loop = asyncio.get_running_loop()
    gate = asyncio.Semaphore(concurrency)
    clients: list[_Client | None] = [None] * len(sessions)
    errors: dict[str, int] = {}

    async def one(i: int) -> None:
        async with gate:
            client = None
            try:
                client = _Client(context, address[0], sessions[i])
                await asyncio.wait_for(client.run(loop, address, sources[i % len(sources)]), 60)
            except (OSError, ConnectionError, ssl.SSLError, TimeoutError) as exc:
                if client is not None:
                    client.close()
                reason = f"{type(exc).__name__}: {exc}"[:80]
                errors[reason] = errors.get(reason, 0) + 1
                return
            clients[i] = client

    await asyncio.gather(*(one(i) for i in range(len(sessions))))
    return [c for c in clients if c is not None], errors


def _client_main(sources: list[str], count: int, concurrency: int, pipe: Connection) -> None:
    """A client process: ``count`` clients per wave; each wave on the parent's word
    ``(address, ca, resume)``, answered with what connected, then closed on the next word."""
    import resource

    import uvloop

    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))

    async def main() -> None:
        sessions: list[ssl.SSLSession | None] = [None] * count
        contexts: dict[str, ssl.SSLContext] = {}
        while True:
            order = pipe.recv()
            if order is None:
                return
            address, ca, resume = order
            context = contexts.get(ca) if ca else None
            if ca and context is None:  # one per server: a session resumes only from the context that made it
                context = contexts[ca] = ssl.create_default_context(cafile=ca)
                context.minimum_version = ssl.TLSVersion.TLSv1_3
            offered: list[ssl.SSLSession | None] = sessions if resume else [None] * count
            done, errors = await _wave(context, address, sources, offered, concurrency)
            reused = sum(1 for c in done if c.reused)
            if ca and not resume:
                sessions = [c.session for c in done] + [None] * (count - len(done))
            pipe.send((len(done), reused, done[0].cipher if done else "", errors))
            pipe.recv()  # "close"
            for c in done:
                c.close()
            pipe.send("closed")

    uvloop.run(main())


def _addresses(count: int) -> list[str]:
    return [f"127.0.2.{1 + n}" for n in range(count)]


def storm(
    clients: int = 20_000, workers: int = 2, processes: int = 2, concurrency: int = 200, sources: Sequence[str] = ()
) -> StormReport:
    """Run the three storms (plain, full TLS, resumed TLS); see the module's docstring."""
    report = StormReport(clients, workers, processes)
    pool = list(sources) or _addresses(max(2, processes * 2))
    context = multiprocessing.get_context("fork")
    pipes, procs = [], []
    for index in range(processes):
        parent, child = context.Pipe()
        count = len(range(index, clients, processes))
        proc = context.Process(
            target=_client_main, args=(pool[index::processes] or pool, count, concurrency, child), daemon=True
        )
        proc.start()
        child.close()  # a client process that dies is an EOF here, not a wait forever
        pipes.append(parent)
        procs.append(proc)
    try:
        for kind, waves in (("migratory", ("plain",)), ("migratory-wss", ("full", "resumed"))):
            server = spawn(kind, workers=workers)
            try:
                meter = ProcessMeter(server.proc.pid)
                time.sleep(0.5)
                for wave in waves:
                    _wave_measured(report, wave, meter, pipes, (server.host, server.port), server.extra.get("ca", ""))
            finally:
                server.stop()
    finally:
        for pipe in pipes:
            pipe.send(None)
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.terminate()
    for name, ours in (("plain", report.plain_connected), ("full", report.full_connected)):
        if ours < clients:
            report.errors.append(f"{name}: connected {ours} of {clients}")
    if report.resumed_connected < clients:
        report.errors.append(f"resumed: connected {report.resumed_connected} of {clients}")
    if report.resumed_reused < report.resumed_connected:
        report.errors.append(f"{report.resumed_connected - report.resumed_reused} reconnections were not resumed")
    if report.full_server_cpu_us_per_connection:
        base = report.plain_server_cpu_us_per_connection
        full, resumed = (
            report.full_server_cpu_us_per_connection - base,
            report.resumed_server_cpu_us_per_connection - base,
        )
        report.handshake_us_full = round(full, 1)
        report.handshake_us_resumed = round(resumed, 1)
        report.saved_ratio = round(resumed / full, 3) if full > 0 else 0.0
    return report


def _wave_measured(
    report: StormReport, wave: str, meter: ProcessMeter, pipes: list[Connection], address: tuple[str, int], ca: str
) -> None:
    """One storm of every client process at once, the server's CPU metered from its start to its last 101."""
    before, started = sum(meter.cpu_split()), time.monotonic()
    for pipe in pipes:
        pipe.send((address, ca, wave == "resumed"))
    answers = [pipe.recv() for pipe in pipes]
    seconds, cpu = time.monotonic() - started, sum(meter.cpu_split()) - before
    connected = sum(a[0] for a in answers)
    for _, _, _, errors in answers:
        for reason, count in errors.items():
            report.errors.append(f"{wave}: {count} x {reason}")
    per = round(cpu * 1e6 / max(connected, 1), 1)
    setattr(report, f"{wave}_connected", connected)
    setattr(report, f"{wave}_seconds", round(seconds, 2))
    setattr(report, f"{wave}_server_cpu_seconds", round(cpu, 2))
    setattr(report, f"{wave}_server_cpu_us_per_connection", per)
    if wave == "resumed":
        report.resumed_reused = sum(a[1] for a in answers)
    if wave == "full":
        report.cipher = next((a[2] for a in answers if a[2]), "")
    for pipe in pipes:
        pipe.send("close")
    for pipe in pipes:
        pipe.recv()
    _quiet(meter)  # the server's side of the closes, before the next storm is metered


def _quiet(meter: ProcessMeter, limit: float = 30.0) -> None:
    """Wait (at most ``limit`` s) until the server uses under 2% of a core over half a second."""
    deadline = time.monotonic() + limit
    last = sum(meter.cpu_split())
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = sum(meter.cpu_split())
        if now - last < 0.01:
            return
        last = now
