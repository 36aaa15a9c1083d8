"""Load-generator clients that survive a member's death: they reconnect elsewhere and recover.

``migratory bench run --preset seed-10m-failover`` (issue 35): each client keeps the
position (epoch, seq) of every subject it follows, checks that each message continues
it (a seq skipped is a message lost, a seq seen again a duplicate), and when its
connection drops it reconnects to the next member that answers and resubscribes with
its positions, as the product's client libraries do (docs/clients.md). It then gets
what it missed, flagged recovered, and NOTIFY_DATA_SYNC (or NOTIFY_DATA_RESYNC and the
snapshot, when the member could not recover the gap: counted, never hidden).

The parent process steers phases (``("phase", name)``): live latencies are kept per phase
(before the fault, during the reconnect storm, after it, after the member's rejoin). It
also says when the SIGKILL was sent (``("fault", unix_ns)``): a displaced client's outage is
measured from then until it is connected and subscribed again (``back``) and until its
recovery ended (``synced``). A message at or before the position a client resubscribed
with, sent again by a member that was behind it, is what the client libraries drop as
already seen: counted apart (``redelivered``), not as a duplicate.
"""

from __future__ import annotations

import asyncio
import random
import resource
import socket
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any, cast

from migratory import protocol as p
from migratory.bench.loader import (
    BUCKETS,
    REFUSED_RETRIES,
    LoaderSpec,
    Malformed,
    bucket_of,
    connect_from,
    open_client,
)
from migratory.bench.wire import MigratoryCodec, _mask, retry_after

__all__ = ["RoamingCodec", "roamer_main"]

BACKOFF_FIRST = 0.5
"""Seconds of random spread before a dropped client's first reconnection (the client libraries jitter)."""
BACKOFF_MAX = 5.0


class Histogram:
    """A latency histogram (the loaders' log buckets) with its count, sum and maximum."""

    __slots__ = ("buckets", "count", "max_ns", "sum_ns")

    def __init__(self) -> None:
        self.buckets = [0] * BUCKETS
        self.count = 0
        self.sum_ns = 0
        self.max_ns = 0

    def add(self, ns: int) -> None:
        ns = max(ns, 0)
        self.buckets[bucket_of(ns)] += 1
        self.count += 1
        self.sum_ns += ns
        if ns > self.max_ns:
            self.max_ns = ns

    def as_list(self) -> list[Any]:
        return [self.buckets, self.count, self.sum_ns, self.max_ns]


class RoamState:
    """What one loader process counts, sent to the parent with its stats."""

    def __init__(self) -> None:
        self.delivered = 0
        self.recovered = 0  # messages flagged recovered (what clients missed while away)
        self.redelivered = 0  # at or before a resubscription's position: dropped as already seen
        self.gaps = 0  # messages skipped: a seq jumped with no NOTIFY_DATA_RESYNC
        self.duplicates = 0  # a seq seen again
        self.resyncs = 0  # NOTIFY_DATA_RESYNC: the member could not recover the gap
        self.synced = 0  # NOTIFY_DATA_SYNC after a resubscription
        self.lost = 0  # connections that dropped (the clients of the killed member)
        self.displaced: set[int] = set()  # clients that lost a connection
        self.awaiting: set[int] = set()  # displaced clients whose recovery has not ended yet
        self.reconnect_failures = 0
        self.refused = 0  # first connections answered 503 (a member not ready for a moment) and tried again
        self.malformed = Malformed()
        self.reasons: dict[str, int] = {}
        self.phase = "before"
        self.fault_ns = 0  # when the SIGKILL was sent, from the parent
        self.latency: dict[str, Histogram] = {"before": Histogram()}
        self.back_ns: list[int] = []  # when a displaced client was connected and subscribed again (unix ns)
        self.synced_ns: list[int] = []  # when its recovery ended (DATA_SYNC, or the snapshot after a RESYNC)
        self.examples: list[str] = []  # the first few violations, for the report
        self.stopping = False

    def violation(self, text: str) -> None:
        if len(self.examples) < 5:
            self.examples.append(text)

    def _since_fault(self, times: list[int]) -> list[Any]:
        histogram = Histogram()
        for at in times:
            histogram.add(at - self.fault_ns)
        return histogram.as_list()

    def as_tuple(self, cpu: float) -> tuple[Any, ...]:
        live = sum(h.count for h in self.latency.values())
        fault = self.fault_ns
        return (
            "roam",
            self.delivered,
            live,
            cpu,
            {
                "recovered": self.recovered,
                "redelivered": self.redelivered,
                "gaps": self.gaps,
                "duplicates": self.duplicates,
                "resyncs": self.resyncs,
                "synced": self.synced,
                "lost": self.lost,
                "displaced": len(self.displaced),
                "awaiting": len(self.awaiting),
                "reconnect_failures": self.reconnect_failures,
                "latency": {phase: h.as_list() for phase, h in self.latency.items()},
                "back": self._since_fault(self.back_ns) if fault else Histogram().as_list(),
                "back_synced": self._since_fault(self.synced_ns) if fault else Histogram().as_list(),
                "examples": list(self.examples),
            },
        )


class RoamingCodec(MigratoryCodec):
    """The native protocol, keeping each subject's position and checking every message against it."""

    def __init__(self, state: RoamState, positions: dict[str, tuple[int, int]], resume: bool = False) -> None:
        super().__init__()
        self.state = state
        self.positions = positions
        self.resume = resume  # a connection after a drop: it resubscribes with positions
        self.pending_sync = 0  # subjects whose recovery has not ended yet on this connection
        self.resumed_at: dict[str, tuple[int, int]] = {}  # the positions this connection resubscribed with

    def after_upgrade(self, subjects: Sequence[str]) -> bytes:
        out = _mask(p.encode_connect())
        if self.resume:  # every subject with its position, (0, 0) if no message of it came yet
            known = [self.positions.get(s, (0, 0)) for s in subjects]
            self.resumed_at = dict(zip(subjects, known, strict=True))
            out += _mask(p.encode_subscribe(list(subjects), positions=known))
            self.pending_sync = len(subjects)
        elif subjects:
            out += _mask(p.encode_subscribe(list(subjects)))
        return out

    def deliveries(self, data: bytes) -> tuple[list[p.Delivery], bytes]:
        """Live messages (checked and positioned), and bytes to answer; recovery is handled here."""
        frames, pong = self.frames(data)
        live: list[p.Delivery] = []
        state = self.state
        for opcode, payload in frames:
            if opcode != 0x2 or not payload:
                continue
            op = payload[0]
            if op == p.Op.MESSAGE:
                frame = p.decode_server(payload)
                assert isinstance(frame, p.Delivery)
                if self._check(frame) and not frame.snapshot and not frame.recovered:
                    live.append(frame)
            elif op == p.Op.NOTIFY:
                notice = p.decode_server(payload)
                assert isinstance(notice, p.Notify)
                if notice.code is p.NotifyCode.KEEPALIVE:
                    continue  # the server lives (protocol version 3); not part of any recovery
                if notice.code is p.NotifyCode.DATA_SYNC:
                    state.synced += 1
                else:
                    state.resyncs += 1
                    state.violation(f"NOTIFY_DATA_RESYNC for {notice.subject}")
                    self.positions.pop(notice.subject, None)  # the snapshot that follows sets it
                self.pending_sync = max(0, self.pending_sync - 1)
            elif op == p.Op.SUBSCRIBE_STATUS and payload[1] == p.Status.OK:
                self.subscribed += 1
        return live, pong

    def _check(self, frame: p.Delivery) -> bool:
        """Whether ``frame`` is new; counts a skipped or repeated seq (snapshots only set the position)."""
        state = self.state
        subject = frame.subject
        known = self.positions.get(subject)
        self.positions[subject] = (frame.epoch, frame.seq)
        if frame.snapshot:
            return False
        state.delivered += 1
        if frame.recovered:
            state.recovered += 1
        if known is None:
            return True
        if frame.seq <= known[1]:
            self.positions[subject] = known
            resumed = self.resumed_at.get(subject)
            if resumed is not None and frame.seq <= resumed[1]:
                state.redelivered += 1  # a member behind the client sent it again: the libraries drop it
                return False
            state.duplicates += 1
            state.violation(f"{subject}: seq {frame.seq} again (had {known[1]})")
            return False
        if frame.seq != known[1] + 1:
            state.gaps += frame.seq - known[1] - 1
            state.violation(f"{subject}: seq {known[1]} then {frame.seq}")
        return True


class Roamer(asyncio.Protocol):
    """One connection of a roaming client."""

    def __init__(self, codec: RoamingCodec, want: int) -> None:
        self.codec = codec
        self.want = want
        self.transport: asyncio.Transport | None = None
        loop = asyncio.get_running_loop()
        self.ready: asyncio.Future[None] = loop.create_future()
        self.synced: asyncio.Future[None] = loop.create_future()
        self.lost: asyncio.Future[None] = loop.create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        codec = self.codec
        state = codec.state
        try:
            live, answer = codec.deliveries(data)
        except (ConnectionError, ValueError, p.DecodeError) as exc:
            if not self.ready.done():  # counted once, by the client's connecting loop
                self.ready.set_exception(ConnectionError(str(exc)))
            else:
                state.malformed.add(exc)
            if self.transport is not None:
                self.transport.abort()
            return
        if answer and self.transport is not None:
            self.transport.write(answer)
        if live:
            now = time.time_ns()
            histogram = state.latency[state.phase]
            for frame in live:
                histogram.add(now - int.from_bytes(frame.content[:8], "big"))
        if not self.ready.done() and codec.is_ready(self.want):
            self.ready.set_result(None)
        if self.ready.done() and not self.synced.done() and not codec.pending_sync:
            self.synced.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        for future in (self.ready, self.synced):
            if not future.done():
                future.set_exception(ConnectionError(f"connection lost: {exc}"))
                future.exception()
        if not self.lost.done():
            self.lost.set_result(None)


CLOSE_TIMEOUT = 20.0  # seconds the cancelled clients get to end before the loader reports and exits


async def _open(
    spec: LoaderSpec, endpoint: tuple[str, int], source: str, subjects: Sequence[str], codec: RoamingCodec
) -> Roamer:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        await connect_from(sock, source, endpoint)
        transport, client = await open_client(
            sock, spec.target, endpoint[0], spec.ca, lambda: Roamer(codec, len(subjects)), spec.lean_tls
        )
    except BaseException:
        sock.close()
        raise
    transport.write(codec.hello(endpoint[0], subjects))
    try:
        await client.ready
    except BaseException:
        transport.abort()
        raise
    return client


async def _client(
    spec: LoaderSpec,
    index: int,
    subjects: Sequence[str],
    state: RoamState,
    semaphore: asyncio.Semaphore,
    first: asyncio.Future[bool],
    transports: set[asyncio.Transport],
) -> None:
    """One client for the whole run: connect, follow, and after each drop reconnect to the next member."""
    endpoints = spec.endpoints or ((spec.host, spec.port),)
    at = index % len(endpoints)  # the clients spread evenly over the members, whatever the loader count
    pool = spec.sources or (spec.source,)
    source = pool[index % len(pool)]
    positions: dict[str, tuple[int, int]] = {}
    delay = BACKOFF_FIRST
    dropped = False
    refusals = 0
    while not state.stopping:
        codec = RoamingCodec(state, positions, resume=dropped)
        try:
            async with semaphore:
                client = await asyncio.wait_for(_open(spec, endpoints[at], source, subjects, codec), 60)
        except Exception as exc:  # whatever failed: the client tries again, or reports it if it never connected
            wait = retry_after(exc)
            if wait is not None:  # the member's admission said when (docs/operations.md): that, plus jitter
                state.refused += 1
                await asyncio.sleep(wait + random.random())
                continue
            if not first.done() and refusals < REFUSED_RETRIES and " 503 " in str(exc):
                refusals += 1  # a worker waiting for its agent's word: clients try again, as the loader's do
                state.refused += 1
                await asyncio.sleep(random.uniform(0.5, 1.5))
                continue
            if not first.done():
                reason = f"{type(exc).__name__}: {exc}"[:100]
                state.reasons[reason] = state.reasons.get(reason, 0) + 1
                first.set_result(False)
                return
            state.reconnect_failures += 1
            at = (at + 1) % len(endpoints)
            await asyncio.sleep(random.uniform(0.5, 1.0) * delay)
            delay = min(delay * 2, BACKOFF_MAX)
            continue
        assert client.transport is not None
        if state.stopping:  # a cancellation wait_for swallowed (3.11): the run is over, this client too
            client.transport.abort()
            return
        transports.add(client.transport)
        if not first.done():
            first.set_result(True)
        if dropped:
            state.back_ns.append(time.time_ns())
        try:
            await client.synced
            if dropped:
                state.synced_ns.append(time.time_ns())
                state.awaiting.discard(index)
        except ConnectionError:
            pass
        await client.lost
        transports.discard(client.transport)
        if state.stopping:
            return
        state.lost += 1
        state.displaced.add(index)
        state.awaiting.add(index)
        dropped = True
        delay = BACKOFF_FIRST
        at = (at + 1) % len(endpoints)
        await asyncio.sleep(random.uniform(0.0, BACKOFF_FIRST))


async def _run(spec: LoaderSpec, pipe: Connection) -> None:
    state = RoamState()
    started = time.monotonic()
    semaphore = asyncio.Semaphore(spec.concurrency)
    transports: set[asyncio.Transport] = set()
    loop = asyncio.get_running_loop()
    firsts: list[asyncio.Future[bool]] = []
    tasks = []
    for index, subjects in enumerate(spec.subjects):
        first: asyncio.Future[bool] = loop.create_future()
        firsts.append(first)
        tasks.append(asyncio.ensure_future(_client(spec, index, subjects, state, semaphore, first, transports)))
    results = await asyncio.gather(*firsts)
    ok = sum(results)
    pipe.send(("connected", ok, len(results) - ok, time.monotonic() - started, state.reasons, state.refused))

    def stats() -> None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        pipe.send(state.as_tuple(usage.ru_utime + usage.ru_stime))

    reported = 0.0
    while True:
        command: Any = pipe.recv() if pipe.poll() else None
        if command == "stop":
            break
        if isinstance(command, tuple) and command[0] == "phase":
            state.phase = command[1]
            state.latency.setdefault(command[1], Histogram())
        elif isinstance(command, tuple) and command[0] == "fault":
            state.fault_ns = command[1]
        now = time.monotonic()
        if now - reported >= 0.2:
            reported = now
            stats()
        if spec.poll > 0:
            time.sleep(spec.poll)  # as loader.py: read every socket once per interval, not on each message
            await asyncio.sleep(0)
        else:
            await asyncio.sleep(0.05)
    state.stopping = True
    stats()
    for transport in list(transports):
        transport.abort()
    for task in tasks:
        task.cancel()
    # bounded: a million-client run once hung here for good on two tasks out of 18,000 (their sockets
    # still open, the loop idle), and the parent waited for this loader's word forever
    _, hung = await asyncio.wait(tasks, timeout=CLOSE_TIMEOUT)
    for transport in list(transports):  # any a late client added meanwhile
        transport.abort()
    pipe.send(("closed", len(transports), len(hung), state.malformed.as_tuple()))


def roamer_main(spec: LoaderSpec, pipe: Connection) -> None:
    """Entry point of a roaming loader process."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    import uvloop

    uvloop.run(_run(spec, pipe))
