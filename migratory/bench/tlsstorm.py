"""A storm of TLS reconnections: full handshakes, then the same clients resuming with session tickets.

Issue 35 (item 3) asks what a reconnect storm of encrypted clients costs the server, and how much
TLS 1.3 session resumption saves. ``migratory bench tls-storm`` starts the server (``wss://`` on
the lean record layer, OpenSSL doing the handshakes), then, from several client processes:

1. **full**: N clients connect, complete a full TLS 1.3 handshake and a WebSocket upgrade
   (which also delivers the server's NewSessionTicket messages), and keep the session;
2. every client disconnects;
3. **resumed**: the same N clients reconnect at once, each offering its ticket
   (``SSLContext.wrap_bio(session=...)``), and upgrade again.

For each storm: the server's CPU (every process, user + system) from the first connect until
every client has its 101 answer, per connection; the storm's wall time; and how many handshakes
the server actually resumed (``SSLObject.session_reused`` on the client). The clients drive
OpenSSL through memory BIOs, as the event loop's own TLS transport would not let them offer a
session. The workers are forked from the supervisor after it built the TLS context, so they share
its ticket keys: a ticket issued by one worker resumes on another.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import socket
import ssl
import time
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from migratory.bench.servers import MultiMeter, ProcessMeter, spawn

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
    full_connected: int = 0
    full_seconds: float = 0.0
    full_server_cpu_seconds: float = 0.0
    full_server_cpu_us_per_connection: float = 0.0
    resumed_connected: int = 0
    resumed_reused: int = 0  # handshakes the server resumed (the rest fell back to full ones)
    resumed_seconds: float = 0.0
    resumed_server_cpu_seconds: float = 0.0
    resumed_server_cpu_us_per_connection: float = 0.0
    saved_ratio: float = 0.0  # resumed CPU a connection / full CPU a connection
    errors: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class _Client:
    """One TLS client over a non-blocking socket and two memory BIOs."""

    def __init__(self, context: ssl.SSLContext, host: str, session: ssl.SSLSession | None) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setblocking(False)
        self.incoming, self.outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        self.tls = context.wrap_bio(self.incoming, self.outgoing, server_hostname=host, session=session)

    async def _flush(self, loop: asyncio.AbstractEventLoop) -> None:
        data = self.outgoing.read()
        if data:
            await loop.sock_sendall(self.sock, data)

    async def _fill(self, loop: asyncio.AbstractEventLoop) -> None:
        chunk = await loop.sock_recv(self.sock, 65536)
        if not chunk:
            raise ConnectionError("the server closed the connection")
        self.incoming.write(chunk)

    async def run(self, loop: asyncio.AbstractEventLoop, address: tuple[str, int], source: str) -> None:
        """Connect, handshake, upgrade; return once the 101 answer (and the tickets before it) arrived."""
        self.sock.bind((source, 0))
        await loop.sock_connect(self.sock, address)
        while True:
            try:
                self.tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                await self._flush(loop)
                await self._fill(loop)
        self.tls.write(_UPGRADE.format(host=address[0]).encode())
        await self._flush(loop)
        answer = b""
        while b"\r\n\r\n" not in answer:
            try:
                answer += self.tls.read(65536)
            except ssl.SSLWantReadError:
                await self._fill(loop)
        if not answer.startswith(b"HTTP/1.1 101"):
            raise ConnectionError(f"upgrade refused: {answer[:40]!r}")

    def close(self) -> None:
        self.sock.close()


async def _wave(
    context: ssl.SSLContext,
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
            client = _Client(context, address[0], sessions[i])
            try:
                await client.run(loop, address, sources[i % len(sources)])
            except (OSError, ConnectionError, ssl.SSLError) as exc:
                client.close()
                reason = f"{type(exc).__name__}: {exc}"[:80]
                errors[reason] = errors.get(reason, 0) + 1
                return
            clients[i] = client

    await asyncio.gather(*(one(i) for i in range(len(sessions))))
    return [c for c in clients if c is not None], errors


def _client_main(
    address: tuple[str, int], ca: str, sources: list[str], count: int, concurrency: int, pipe: Connection
) -> None:
    """A client process: ``count`` clients, full storm then resumed storm, each on the parent's word."""
    import uvloop

    async def main() -> None:
        context = ssl.create_default_context(cafile=ca)
        context.minimum_version = ssl.TLSVersion.TLSv1_3
        sessions: list[ssl.SSLSession | None] = [None] * count
        for phase in ("full", "resumed"):
            if pipe.recv() != phase:
                raise RuntimeError(f"expected {phase!r} from the parent")
            done, errors = await _wave(context, address, sources, sessions, concurrency)
            reused = sum(1 for c in done if c.tls.session_reused)
            cipher = done[0].tls.cipher() if done else None
            if phase == "full":
                sessions = [c.tls.session for c in done] + [None] * (count - len(done))
            pipe.send((len(done), reused, cipher[0] if cipher else "", errors))
            pipe.recv()  # "close"
            for c in done:
                c.close()
            pipe.send("closed")

    uvloop.run(main())


def storm(
    clients: int = 20_000, workers: int = 2, processes: int = 2, concurrency: int = 200, sources: str = ""
) -> StormReport:
    """Run both storms against a spawned ``wss://`` server; see the module's docstring."""
    report = StormReport(clients, workers, processes)
    server = spawn("migratory-wss", workers=workers)
    try:
        meter = MultiMeter([ProcessMeter(server.proc.pid)])
        pool = [s for s in sources.split(",") if s] or ["127.0.0.1"]
        context = multiprocessing.get_context("fork")
        pipes, procs = [], []
        for index in range(processes):
            count = len(range(index, clients, processes))
            parent, child = context.Pipe()
            proc = context.Process(
                target=_client_main,
                args=(
                    (server.host, server.port),
                    server.extra["ca"],
                    pool[index::processes] or pool,
                    count,
                    concurrency,
                    child,
                ),
                daemon=True,
            )
            proc.start()
            pipes.append(parent)
            procs.append(proc)
        time.sleep(0.5)
        for phase in ("full", "resumed"):
            before, started = sum(meter.cpu_split()), time.monotonic()
            for pipe in pipes:
                pipe.send(phase)
            answers = [pipe.recv() for pipe in pipes]
            seconds, cpu = time.monotonic() - started, sum(meter.cpu_split()) - before
            connected = sum(a[0] for a in answers)
            for _, _, _, errors in answers:
                for reason, count in errors.items():
                    report.errors.append(f"{phase}: {count} x {reason}")
            if phase == "full":
                report.full_connected, report.full_seconds = connected, round(seconds, 2)
                report.full_server_cpu_seconds = round(cpu, 2)
                report.full_server_cpu_us_per_connection = round(cpu * 1e6 / max(connected, 1), 1)
                report.cipher = next((a[2] for a in answers if a[2]), "")
            else:
                report.resumed_connected, report.resumed_seconds = connected, round(seconds, 2)
                report.resumed_reused = sum(a[1] for a in answers)
                report.resumed_server_cpu_seconds = round(cpu, 2)
                report.resumed_server_cpu_us_per_connection = round(cpu * 1e6 / max(connected, 1), 1)
            for pipe in pipes:
                pipe.send("close")
            for pipe in pipes:
                pipe.recv()
            time.sleep(1.0)  # the server's side of the closes, before the next storm is metered
        if report.full_server_cpu_us_per_connection:
            report.saved_ratio = round(
                report.resumed_server_cpu_us_per_connection / report.full_server_cpu_us_per_connection, 3
            )
        for proc in procs:
            proc.join(10)
    finally:
        server.stop()
    if report.full_connected < clients or report.resumed_connected < clients:
        report.errors.append(
            f"connected {report.full_connected} (full) and {report.resumed_connected} (resumed) of {clients}"
        )
    if report.resumed_reused < report.resumed_connected:
        report.errors.append(f"{report.resumed_connected - report.resumed_reused} reconnections were not resumed")
    return report
