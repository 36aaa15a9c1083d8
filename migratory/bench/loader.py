"""A load-generator process: many asyncio clients of one target, from one or more source addresses.

The parent sends commands over a pipe ("stop") and receives progress:
``("connected", ok, errors, seconds, {reason: count})`` once every client is subscribed, then
``("stats", delivered, histogram, max_ns, sum_ns, cpu_seconds)`` a few times per second, and after
"stop" ``("closed", open, hung, (malformed, examples))``: the clients still open, those that did not end
when cancelled, and those that received what they could not decode once subscribed.
"""

from __future__ import annotations

import asyncio
import functools
import math
import random
import resource
import socket
import ssl
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TypeVar, cast

from migratory.bench.leantls import open_lean
from migratory.bench.wire import Codec, StreamCodec, base_target, codec_for, retry_after

__all__ = [
    "BUCKETS",
    "LoaderSpec",
    "bucket_of",
    "bucket_upper_ns",
    "client_context",
    "connect_from",
    "loader_main",
    "open_client",
]

P = TypeVar("P", bound=asyncio.Protocol)

BUCKETS = 420
_SCALE = 20.0  # buckets per factor e: each bucket is about 5% wide
IP_BIND_ADDRESS_NO_PORT = 24


def bucket_of(latency_ns: int) -> int:
    micros = max(latency_ns / 1000.0, 1.0)
    return min(BUCKETS - 1, int(math.log(micros) * _SCALE))


def bucket_upper_ns(index: int) -> float:
    return math.exp((index + 1) / _SCALE) * 1000.0


@dataclass(frozen=True)
class LoaderSpec:
    target: str
    host: str
    port: int
    source: str
    subjects: Sequence[Sequence[str]]  # one entry per client
    concurrency: int = 256
    ca: str = ""  # a TLS target: the CA file its certificate is checked against
    # Clients take these in turn (``source`` alone when empty). Linux looks for a free local port
    # in connect() by scanning, first in one half of ip_local_port_range: past some 14,000
    # connections from one address to one server port, every connect() burns milliseconds of
    # system CPU, so a loader of many clients spreads them over several addresses.
    sources: tuple[str, ...] = ()
    # Once every client is subscribed, read the sockets every ``poll`` seconds instead of waking on
    # each message (0: on each). Co-located load generators that sleep in epoll make every loopback
    # delivery wake a process, a cost a server never pays for remote clients; the latency measured
    # includes the wait (half the interval on average), so the server is judged no better than it is.
    poll: float = 0.0
    lean_tls: bool = False  # TLS targets: the lean TLS 1.3 client (leantls.py) instead of the event loop's
    # every member of a cluster, for clients that fail over (roaming.py): after a drop, the next one in turn
    endpoints: tuple[tuple[str, int], ...] = ()


@functools.lru_cache(maxsize=4)
def client_context(ca: str) -> ssl.SSLContext:
    """One client context per CA and process (loading the CA per connection would dominate)."""
    return ssl.create_default_context(cafile=ca)


async def open_client(
    sock: socket.socket, target: str, host: str, ca: str, factory: Callable[[], P], lean_tls: bool = False
) -> tuple[asyncio.Transport, P]:
    """A connected socket to a transport: plain, or TLS checked against ``ca`` (with ``lean_tls``, TLS 1.3
    on :mod:`migratory.bench.leantls`'s record layer instead of the event loop's TLS transport).

    NATS (2.9) speaks first in plain text even on a TLS port: its INFO line is read
    before the handshake, as its clients do.
    """
    loop = asyncio.get_running_loop()
    if not ca:
        transport, protocol = await loop.create_connection(factory, sock=sock)
        return transport, protocol
    if base_target(target) == "nats":
        info = b""
        while not info.endswith(b"\r\n"):
            chunk = await loop.sock_recv(sock, 4096)
            if not chunk:
                raise ConnectionError("NATS closed before its INFO line")
            info += chunk
    if lean_tls:
        protocol = factory()
        return await open_lean(loop, sock, ca, host, protocol), protocol
    transport, protocol = await loop.create_connection(
        factory, sock=sock, ssl=client_context(ca), server_hostname=host, ssl_handshake_timeout=60.0
    )
    return transport, protocol


class Malformed:
    """Clients that received what they could not decode once subscribed: each closes, and the run reports
    them (a frame the server got wrong must fail the run, not pass as a slow client)."""

    def __init__(self) -> None:
        self.count = 0
        self.examples: list[str] = []

    def add(self, exc: Exception) -> None:
        self.count += 1
        if len(self.examples) < 3:
            self.examples.append(f"{type(exc).__name__}: {exc}"[:120])

    def as_tuple(self) -> tuple[int, list[str]]:
        return self.count, list(self.examples)


class _State:
    def __init__(self) -> None:
        self.delivered = 0
        self.histogram = [0] * BUCKETS
        self.max_ns = 0
        self.sum_ns = 0  # for the mean latency (the seeds' benchmark states an average)
        self.reasons: dict[str, int] = {}  # why clients failed to connect, and how many
        self.ready = 0
        self.errors = 0
        self.malformed = Malformed()
        self.refused = 0  # upgrades answered 503 (a member not ready for a moment), retried as a client would


REFUSED_RETRIES = 5  # a 503 to an upgrade is tried again, after 0.5-1.5 s, this many times
ADMISSION_PATIENCE = 300.0  # s a client told Retry-After keeps coming back before it counts as an error


class _Client(asyncio.Protocol):
    def __init__(self, state: _State, codec: Codec, want: int) -> None:
        self.state = state
        self.codec = codec
        self.want = want
        self.transport: asyncio.Transport | None = None
        self.ready = asyncio.get_running_loop().create_future()
        self.opened = asyncio.get_running_loop().create_future()  # migratory-stream: the response head came

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        try:
            payloads, answer = self.codec.feed(data)
        except (ConnectionError, ValueError) as exc:
            if not self.ready.done():
                for future in (self.opened, self.ready):  # a stream's client waits on opened first
                    if not future.done():
                        future.set_exception(ConnectionError(str(exc)))
                        future.exception()  # counted once, by _connect
            else:
                self.state.malformed.add(exc)
                if self.transport is not None:
                    self.transport.abort()
            return
        if answer and self.transport is not None:
            self.transport.write(answer)
        if payloads:
            now = time.time_ns()
            state = self.state
            histogram = state.histogram
            for payload in payloads:
                state.delivered += 1
                latency = now - int.from_bytes(payload[:8], "big")
                histogram[bucket_of(latency)] += 1
                state.sum_ns += latency
                if latency > state.max_ns:
                    state.max_ns = latency
        if not self.opened.done() and self.codec.ready:
            self.opened.set_result(None)
        if not self.ready.done() and self.codec.is_ready(self.want):
            self.ready.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        for future in (self.opened, self.ready):
            if not future.done():
                future.set_exception(ConnectionError(f"connection lost: {exc}"))
                future.exception()  # counted by whoever waits on it; no "never retrieved" log for the other


async def _post(spec: LoaderSpec, requests: bytes, count: int) -> None:
    """``migratory-stream``: the client's messages as pipelined ``POST /stream/<id>`` on a short connection.

    A browser's ``fetch`` reuses a pooled connection instead; here each client's
    CONNECT and SUBSCRIBE go on one connection that closes once answered, so that
    only the streams stay open while memory is measured.
    """
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_IP, IP_BIND_ADDRESS_NO_PORT, 1)
        sock.bind((spec.source, 0))
        sock.setblocking(False)
        await loop.sock_connect(sock, (spec.host, spec.port))
        await loop.sock_sendall(sock, requests)
        answer = b""
        while True:
            chunk = await loop.sock_recv(sock, 65536)
            if not chunk:
                break
            answer += chunk
    finally:
        sock.close()
    if answer.count(b"HTTP/1.1 204") != count:
        raise ConnectionError(f"POST /stream refused: {answer[:60]!r}")


async def connect_from(sock: socket.socket, source: str, endpoint: tuple[str, int]) -> None:
    """Connect ``sock`` to ``endpoint`` from address ``source`` (its port chosen at connect: many per address)."""
    sock.setsockopt(socket.SOL_IP, IP_BIND_ADDRESS_NO_PORT, 1)
    sock.bind((source, 0))
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, endpoint)


async def _connect(
    spec: LoaderSpec, subjects: Sequence[str], state: _State, source: str, slots: asyncio.Semaphore
) -> asyncio.Transport | None:
    """One client connected and subscribed, or None (counted, with its reason). A member that answers the
    upgrade 503 (not ready: a worker that did not run for seconds waits for its agent's word) is tried
    again after a jittered pause, as the client libraries do; one that says Retry-After (its admission,
    docs/operations.md) is tried again after that wait plus up to a second of jitter, as the Python
    client does, for up to ADMISSION_PATIENCE. The retries are counted apart; a client waiting gives
    its slot of ``slots`` (the connecting concurrency) to the next."""
    refusals = 0
    patience = time.monotonic() + ADMISSION_PATIENCE
    while True:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        transport: asyncio.Transport | None = None
        try:
            async with slots:
                await connect_from(sock, source, (spec.host, spec.port))
                codec = codec_for(spec.target)
                transport, client = await open_client(
                    sock,
                    spec.target,
                    spec.host,
                    spec.ca,
                    functools.partial(_Client, state, codec, len(subjects)),
                    spec.lean_tls,
                )
                transport.write(codec.hello(spec.host, subjects))
                if isinstance(codec, StreamCodec):
                    await asyncio.wait_for(client.opened, 60)
                    await asyncio.wait_for(_post(spec, *codec.posts(spec.host, subjects)), 60)
                await asyncio.wait_for(client.ready, 60)
            return transport
        except (OSError, ConnectionError, TimeoutError, ssl.SSLError) as exc:
            if transport is not None:
                transport.abort()  # the event loop's transport owns the socket once made
            sock.close()
            wait = retry_after(exc)
            if wait is not None and time.monotonic() + wait < patience:
                state.refused += 1
                await asyncio.sleep(wait + random.random())
                continue
            if refusals < REFUSED_RETRIES and " 503 " in str(exc):
                refusals += 1
                state.refused += 1
                await asyncio.sleep(0.5 + random.random())
                continue
            state.errors += 1
            reason = f"{type(exc).__name__}: {exc}"[:100]
            state.reasons[reason] = state.reasons.get(reason, 0) + 1
            return None


async def _run(spec: LoaderSpec, pipe: Connection) -> None:
    state = _State()
    started = time.monotonic()
    semaphore = asyncio.Semaphore(spec.concurrency)

    pool = spec.sources or (spec.source,)

    async def one(index: int, subjects: Sequence[str]) -> asyncio.Transport | None:
        return await _connect(spec, subjects, state, pool[index % len(pool)], semaphore)

    opened = await asyncio.gather(*(one(i, s) for i, s in enumerate(spec.subjects)))
    transports = [t for t in opened if t is not None]
    pipe.send(("connected", len(transports), state.errors, time.monotonic() - started, state.reasons, state.refused))

    # The pipe stays a blocking descriptor (no add_reader: it would make our sends
    # non-blocking and fail when the parent is busy); commands are polled instead.
    def stats() -> None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        cpu = usage.ru_utime + usage.ru_stime
        pipe.send(("stats", state.delivered, list(state.histogram), state.max_ns, state.sum_ns, cpu))

    reported = 0.0
    while not (pipe.poll() and pipe.recv() == "stop"):
        now = time.monotonic()
        if now - reported >= 0.2:
            reported = now
            stats()
        if spec.poll > 0:
            # asleep outside epoll: a message that arrives meanwhile wakes nobody; the loop turn that
            # follows reads every socket that became readable (uvloop polls without blocking while
            # a callback is ready, which sleep(0) makes)
            time.sleep(spec.poll)
            await asyncio.sleep(0)
        else:
            await asyncio.sleep(0.2)
    stats()
    for transport in transports:
        transport.abort()
    pipe.send(("closed", len(transports), 0, state.malformed.as_tuple()))


def loader_main(spec: LoaderSpec, pipe: Connection) -> None:
    """Entry point of a loader process."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    import uvloop

    uvloop.run(_run(spec, pipe))
