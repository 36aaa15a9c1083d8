"""The Python client library (asyncio): subscribe, publish, snapshots, cluster failover.

Usage from a plain script::

    import asyncio
    from migratory.client import MigratoryClient

    async def main() -> None:
        servers = ["100 ws://10.0.0.1:8800", "100 ws://10.0.0.2:8800", ("ws://10.0.0.3:8800", 50)]
        async with MigratoryClient(servers, token="...") as client:
            await client.subscribe(["/Stocks/NYSE/IBM"])
            await client.publish("/Stocks/NYSE/IBM", b"193", fields={"volume": "6.62M"})
            async for message in client.messages():   # the snapshot first, then updates
                print(message.type.name, message.subject, message.content, message.fields)

    asyncio.run(main())

The client keeps one connection to one server of its list, chosen at random in
proportion to the servers' weights (``"100 ws://host:port"`` or ``(url, weight)``;
a bare URL weighs 100). When that connection fails it reconnects to another server
with exponential backoff and jitter, and subscribes again to everything, telling
the server the position (epoch, seq) of the last message it received on each
subject. A cluster in Guaranteed mode then sends exactly the missed messages
(``MessageType.RECOVERED``) followed by ``NOTIFY_DATA_SYNC``; otherwise (Standard
mode, or a gap older than the servers' cache) ``NOTIFY_DATA_RESYNC`` and the current
snapshot. The application never sees a message twice or out of order: anything at
or before the last position of its subject is dropped.

Publications carry a publish id; ``publish(..., retries=N)`` resends a FAILED one
with the same id, which a cluster numbers only once. Status events use the names of
the product's client API (``NOTIFY_SERVER_UP``, ``PUBLISH_OK``, ...).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import itertools
import logging
import random
import secrets
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosedOK, InvalidStatus, WebSocketException
from websockets.typing import Data, Subprotocol

from migratory import protocol as p
from migratory.message import MessageType
from migratory.protocol import Status

__all__ = [
    "DEFAULT_WEIGHT",
    "ClientMessage",
    "EventKind",
    "MigratoryClient",
    "Publication",
    "PublishError",
    "PublishResult",
    "StatusEvent",
]

log = logging.getLogger("migratory.client")

DEFAULT_WEIGHT = 100.0


class EventKind(enum.Enum):
    """Status notifications delivered to ``on_status`` listeners (the product API's names)."""

    NOTIFY_SERVER_UP = "NOTIFY_SERVER_UP"
    NOTIFY_SERVER_DOWN = "NOTIFY_SERVER_DOWN"
    NOTIFY_DATA_SYNC = "NOTIFY_DATA_SYNC"
    NOTIFY_DATA_RESYNC = "NOTIFY_DATA_RESYNC"
    SUBSCRIBE_ALLOW = "SUBSCRIBE_ALLOW"
    SUBSCRIBE_DENY = "SUBSCRIBE_DENY"
    PUBLISH_OK = "PUBLISH_OK"
    PUBLISH_NO_SUBSCRIBER = "PUBLISH_NO_SUBSCRIBER"
    PUBLISH_DENIED = "PUBLISH_DENIED"
    PUBLISH_FAILED = "PUBLISH_FAILED"
    ERROR = "ERROR"


@dataclass(frozen=True, slots=True)
class StatusEvent:
    """``error``: with NOTIFY_SERVER_DOWN, the exception that ended the connection (None when closed cleanly)."""

    kind: EventKind
    detail: str = ""
    subject: str = ""
    closure: str = ""
    status: Status | None = None
    error: BaseException | None = None


@dataclass(frozen=True, slots=True)
class ClientMessage:
    """A delivered message: SNAPSHOT first after subscribe, then UPDATEs (RECOVERED after a failover)."""

    subject: str
    content: bytes
    fields: Mapping[str, str]
    type: MessageType
    seq: int
    epoch: int
    retained: bool = True


@dataclass(frozen=True, slots=True)
class Publication:
    """One message for :meth:`MigratoryClient.publish_all` (the arguments of :meth:`~MigratoryClient.publish`)."""

    subject: str
    content: bytes | str
    fields: Mapping[str, str] | None = None
    retained: bool = True
    guaranteed: bool = False
    publish_id: str | None = None


@dataclass(frozen=True, slots=True)
class PublishResult:
    """What the server answered one publication of :meth:`MigratoryClient.publish_all`.

    ``index``: its place in the input (results come in the order the server answers);
    ``publish_id``: the id it was sent with (its own, or the one assigned);
    ``attempts``: 1, or more when a FAILED one was sent again.
    """

    index: int
    publication: Publication
    publish_id: str
    status: Status
    reason: str
    attempts: int

    @property
    def ok(self) -> bool:
        """OK or NO_SUBSCRIBER: the server took it."""
        return self.status in (Status.OK, Status.NO_SUBSCRIBER)


@dataclass(slots=True)
class _InFlight:
    """A publication of :meth:`MigratoryClient.publish_all` between its sending and its result."""

    index: int
    publication: Publication
    data: bytes
    publish_id: str
    attempts: int = 0
    deadline: float = 0.0
    not_before: float = 0.0


class PublishError(Exception):
    """Raised by :meth:`MigratoryClient.publish` with ``raise_on_error=True``."""

    def __init__(self, status: Status, reason: str) -> None:
        super().__init__(f"{status.name}: {reason}")
        self.status = status
        self.reason = reason


MessageListener = Callable[[ClientMessage], Awaitable[None] | None]
StatusListener = Callable[[StatusEvent], Awaitable[None] | None]


KEEPALIVE_MARGIN = 0.5  # s past the server's keep-alive before a silent server is taken for hung


@dataclass(slots=True)
class _Server:
    url: str
    weight: float
    failures: int = 0


@dataclass(slots=True)
class _Pending:
    publishes: dict[str, asyncio.Future[tuple[Status, str]]] = field(default_factory=dict)
    subscribes: dict[str, list[asyncio.Future[tuple[Status, str]]]] = field(default_factory=dict)


def _retry_backoff(attempt: int) -> float:
    """Seconds before a FAILED publication is sent again: exponential, capped at 1 s, with jitter."""
    return min(1.0, 0.05 * 2.0**attempt) * random.uniform(0.5, 1.0)


async def _as_async_iterator(items: Iterable[Publication] | AsyncIterable[Publication]) -> AsyncIterator[Publication]:
    if isinstance(items, AsyncIterable):
        async for item in items:
            yield item
    else:
        for item in items:
            yield item


def _parse_server(item: str | tuple[str, float]) -> _Server:
    if isinstance(item, str):
        weight_text, _, rest = item.strip().partition(" ")
        if rest and not weight_text.startswith(("ws://", "wss://")):
            try:
                weight = float(weight_text)
            except ValueError:
                raise ValueError(f"expected 'WEIGHT URL' or 'URL', got {item!r}") from None
            url = rest.strip()
        else:
            url, weight = item.strip(), DEFAULT_WEIGHT
    else:
        url, weight = item
    if not url.startswith(("ws://", "wss://")):
        raise ValueError(f"server URL must start with ws:// or wss://: {url!r}")
    if not weight > 0:
        raise ValueError(f"server weight must be positive: {url!r} has {weight}")
    return _Server(url, float(weight))


def _parse_servers(servers: Iterable[str | tuple[str, float]]) -> list[_Server]:
    out = [_parse_server(item) for item in servers]
    if not out:
        raise ValueError("at least one server is required")
    return out


class MigratoryClient:
    """One logical client of a cluster: reconnects, recovers, deduplicates, and reports status.

    Why it is long: it is the library's whole public surface (subscribe, publish, snapshots,
    failover across a weighted server list), each method a short documented entry point.
    """

    def __init__(
        self,
        servers: Sequence[str | tuple[str, float]],
        *,
        token: str = "",
        on_message: MessageListener | None = None,
        on_status: StatusListener | None = None,
        reconnect: bool = True,
        backoff_initial: float = 0.1,
        backoff_max: float = 10.0,
        request_timeout: float = 10.0,
        ssl: Any = None,
    ) -> None:
        self._servers = _parse_servers(servers)
        self.token = token
        self.on_message = on_message
        self.on_status = on_status
        self.reconnect = reconnect
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self.request_timeout = request_timeout
        self.ssl = ssl
        self._subscriptions: dict[str, int] = {}
        self._positions: dict[str, tuple[int, int]] = {}
        self._queue: asyncio.Queue[ClientMessage] = asyncio.Queue()
        self._ws: ClientConnection | None = None
        self._connected = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self._pending = _Pending()
        self._closures = itertools.count(1)
        self._id_prefix = secrets.token_hex(8)
        self.max_message_size = 0
        self.session = ""
        self.server = ""
        self.duplicates_dropped = 0
        self._last_failure = ""
        self._last_error: BaseException | None = None

    # --- lifecycle ----------------------------------------------------------------

    async def __aenter__(self) -> MigratoryClient:
        await self.connect()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def connect(self, timeout: float | None = None) -> None:
        """Start the connection loop and wait until a server accepted the session.

        Without ``reconnect`` a failed attempt raises ConnectionError at once (with the
        cause chained) instead of waiting out the timeout.
        """
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="migratory-client")
        connected = asyncio.ensure_future(self._connected.wait())
        done, _ = await asyncio.wait(
            {connected, self._task}, timeout=timeout or self.request_timeout, return_when=asyncio.FIRST_COMPLETED
        )
        if connected in done:
            return
        connected.cancel()
        if self._task in done:
            raise ConnectionError(f"cannot connect: {self._last_failure}") from self._last_error
        raise TimeoutError(f"not connected within {timeout or self.request_timeout} s")

    async def close(self) -> None:
        """Close the connection and stop reconnecting."""
        self._closing = True
        if self._ws is not None:
            with contextlib.suppress(Exception):
                await self._ws.close()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    async def wait_connected(self, timeout: float | None = None) -> None:
        await asyncio.wait_for(self._connected.wait(), timeout or self.request_timeout)

    def position(self, subject: str) -> tuple[int, int] | None:
        """``(epoch, seq)`` of the last message received on ``subject``."""
        return self._positions.get(subject)

    # --- requests -----------------------------------------------------------------

    async def subscribe(self, subjects: Iterable[str], conflation_ms: int = 0) -> dict[str, Status]:
        """Subscribe (optionally conflated); return each subject's status from the server.

        Subjects are remembered even while disconnected and subscribed again after
        every reconnection; a denied or invalid subject is forgotten.
        """
        subjects = list(subjects)
        if conflation_ms < 0:
            raise ValueError(f"conflation_ms must be 0 or more, got {conflation_ms}")
        loop = asyncio.get_running_loop()
        futures: dict[str, asyncio.Future[tuple[Status, str]]] = {}
        for subject in subjects:
            self._subscriptions[subject] = conflation_ms
            fut: asyncio.Future[tuple[Status, str]] = loop.create_future()
            self._pending.subscribes.setdefault(subject, []).append(fut)
            futures[subject] = fut
        if self._ws is not None and self._connected.is_set():
            await self._send(self._subscribe_frame(subjects, conflation_ms))
        results: dict[str, Status] = {}
        for subject, fut in futures.items():
            try:
                status, _ = await asyncio.wait_for(fut, self.request_timeout)
            except TimeoutError:
                status = Status.FAILED
            results[subject] = status
        return results

    def _subscribe_frame(self, subjects: list[str], conflation_ms: int) -> bytes:
        positions = [self._positions.get(s, (0, 0)) for s in subjects]
        if any(positions):
            return p.encode_subscribe(subjects, conflation_ms, positions)
        return p.encode_subscribe(subjects, conflation_ms)

    async def unsubscribe(self, subjects: Iterable[str]) -> None:
        subjects = [s for s in subjects if self._subscriptions.pop(s, None) is not None]
        for subject in subjects:
            self._positions.pop(subject, None)
        if subjects and self._ws is not None and self._connected.is_set():
            await self._send(p.encode_unsubscribe(subjects))

    def new_publish_id(self) -> str:
        """A publish id no other client uses (what :meth:`publish` assigns by default)."""
        return f"{self._id_prefix}-{next(self._closures)}"

    async def publish(
        self,
        subject: str,
        content: bytes | str,
        *,
        fields: Mapping[str, str] | None = None,
        closure: str | None = None,
        retained: bool = True,
        guaranteed: bool = False,
        publish_id: str | None = None,
        retries: int = 0,
        raise_on_error: bool = False,
    ) -> Status:
        """Publish and wait for the server's publish status (OK, NO_SUBSCRIBER, DENIED, ...).

        ``retries``: how many times a FAILED publication (for example cut by a
        failover) is sent again, with the same publish id, once reconnected; the
        cluster numbers it once however many copies arrive.
        """
        data = content.encode("utf-8") if isinstance(content, str) else content
        publish_id = publish_id or self.new_publish_id()
        closure = closure if closure is not None else publish_id
        for attempt in range(retries + 1):
            fut = await self._start_publish(subject, data, fields, closure, retained, guaranteed, publish_id)
            try:
                status, reason = await asyncio.wait_for(fut, self.request_timeout)
            except TimeoutError as exc:
                status, reason = Status.FAILED, f"no publish status: {exc or type(exc).__name__}"
            finally:
                self._pending.publishes.pop(closure, None)
            if status is not Status.FAILED or attempt == retries or self._closing:
                break
            await asyncio.sleep(_retry_backoff(attempt))
            with contextlib.suppress(TimeoutError):
                await self.wait_connected()
        if status not in (Status.OK, Status.NO_SUBSCRIBER) and raise_on_error:
            raise PublishError(status, reason)
        return status

    async def publish_all(
        self,
        publications: Iterable[Publication] | AsyncIterable[Publication],
        *,
        window: int = 64,
        rate: float = 0.0,
        retries: int = 0,
    ) -> AsyncIterator[PublishResult]:
        """Publish with up to ``window`` publications awaiting their status; yield each result.

        What :meth:`publish` does one at a time, pipelined: a new publication is sent as
        soon as one of the window is answered, so throughput is bounded by the window
        and not by the round trip. ``rate`` (publications per second, 0: no limit)
        spaces the sending evenly. Results come in the order the server answers, each
        with its ``index`` in the input. Publications of one subject are sent in input
        order and a server keeps that order; a FAILED one sent again (``retries``, same
        publish id, after a backoff and once reconnected) comes after those sent
        meanwhile. Leaving the loop early stops sending; what was already sent is not
        waited for. The publish ids name each publication across attempts, so a
        cluster numbers it once.
        """
        if window < 1:
            raise ValueError(f"window must be 1 or more, got {window}")
        if rate < 0:
            raise ValueError(f"rate must be 0 or more, got {rate}")
        if retries < 0:
            raise ValueError(f"retries must be 0 or more, got {retries}")
        loop = asyncio.get_running_loop()
        source = _as_async_iterator(publications)
        inflight: dict[asyncio.Future[tuple[Status, str]], _InFlight] = {}
        again: list[_InFlight] = []  # FAILED ones waiting for their backoff, oldest first
        exhausted = False
        index = 0
        start = loop.time()
        try:
            while True:
                now = loop.time()
                while len(inflight) < window:  # fill the window with what is due
                    if again and again[0].not_before <= now and (self.connected or now >= again[0].deadline):
                        item = again.pop(0)
                    elif exhausted or (rate and start + index / rate > now):
                        break
                    else:
                        try:
                            publication = await anext(source)
                        except StopAsyncIteration:
                            exhausted = True
                            break
                        content = publication.content
                        data = content.encode("utf-8") if isinstance(content, str) else content
                        item = _InFlight(index, publication, data, publication.publish_id or self.new_publish_id())
                        index += 1
                    item.attempts += 1
                    item.deadline = loop.time() + self.request_timeout
                    pub, closure = item.publication, item.publish_id  # unique while in flight: its status's key
                    fut = await self._start_publish(
                        pub.subject, item.data, pub.fields, closure, pub.retained, pub.guaranteed, closure
                    )
                    inflight[fut] = item
                    now = loop.time()
                if not inflight and not again and exhausted:
                    return
                wake = [item.deadline for item in inflight.values()]
                if again:
                    wake.append(again[0].not_before if self.connected else now + 0.05)
                if rate and not exhausted and len(inflight) < window:
                    wake.append(start + index / rate)
                timeout = max(0.0, min(wake) - loop.time()) if wake else None
                if inflight:
                    done, _ = await asyncio.wait(inflight, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
                else:
                    await asyncio.sleep(timeout or 0.0)
                    done = set()
                now = loop.time()
                for fut in list(inflight):
                    item = inflight[fut]
                    if fut in done:
                        status, reason = fut.result()
                    elif item.deadline <= now:
                        status, reason = Status.FAILED, f"no publish status within {self.request_timeout:g} s"
                    else:
                        continue
                    del inflight[fut]
                    self._pending.publishes.pop(item.publish_id, None)
                    if status is Status.FAILED and item.attempts <= retries and not self._closing:
                        item.not_before = now + _retry_backoff(item.attempts - 1)
                        item.deadline = item.not_before + self.request_timeout  # how long to wait for a connection
                        again.append(item)
                        continue
                    yield PublishResult(item.index, item.publication, item.publish_id, status, reason, item.attempts)
        finally:
            for item in inflight.values():
                self._pending.publishes.pop(item.publish_id, None)

    def _too_large(self, data: bytes) -> str:
        """Why ``data`` cannot be published (over the server's announced limit), or ""."""
        if self.max_message_size and len(data) > self.max_message_size:
            return f"content of {len(data)} bytes exceeds the server's MessageSizeLimit ({self.max_message_size})"
        return ""

    async def _start_publish(
        self,
        subject: str,
        data: bytes,
        fields: Mapping[str, str] | None,
        closure: str,
        retained: bool,
        guaranteed: bool,
        publish_id: str,
    ) -> asyncio.Future[tuple[Status, str]]:
        """Send one publication; the future its status arrives in (already done when it could not be sent).

        The future waits under ``closure`` in the pending publications; the caller removes it once done.
        """
        fut: asyncio.Future[tuple[Status, str]] = asyncio.get_running_loop().create_future()
        if reason := self._too_large(data):
            await self._emit(StatusEvent(EventKind.PUBLISH_FAILED, reason, subject, closure, Status.TOO_LARGE))
            fut.set_result((Status.TOO_LARGE, reason))
            return fut
        if self._ws is None or not self._connected.is_set():
            await self._emit(StatusEvent(EventKind.PUBLISH_FAILED, "not connected", subject, closure, Status.FAILED))
            fut.set_result((Status.FAILED, "not connected"))
            return fut
        self._pending.publishes[closure] = fut
        try:
            await self._send(p.encode_publish(subject, data, fields, closure, retained, guaranteed, publish_id))
        except (WebSocketException, OSError, ConnectionError) as exc:
            self._pending.publishes.pop(closure, None)
            if not fut.done():
                fut.set_result((Status.FAILED, f"no publish status: {exc or type(exc).__name__}"))
        return fut

    async def messages(self) -> Any:
        """Async iterator over delivered messages (when no ``on_message`` listener is set)."""
        while True:
            yield await self._queue.get()

    async def next_message(self, timeout: float | None = None) -> ClientMessage:
        return await asyncio.wait_for(self._queue.get(), timeout)

    # --- connection loop ------------------------------------------------------------

    def _pick_server(self, exclude: _Server | None) -> _Server:
        candidates = [s for s in self._servers if s is not exclude] or self._servers
        total = sum(s.weight for s in candidates)
        point = random.uniform(0, total)
        for server in candidates:
            point -= server.weight
            if point <= 0:
                return server
        return candidates[-1]

    async def _run(self) -> None:
        delay = self.backoff_initial
        last: _Server | None = None
        while not self._closing:
            server = self._pick_server(last)
            wait = 0.0  # what a refusing server asked (503 Retry-After: its admission rate, docs/operations.md)
            try:
                async with connect(
                    server.url,
                    max_size=None,
                    compression=None,
                    subprotocols=[Subprotocol("migratory.v1")],
                    open_timeout=self.request_timeout,
                    ping_interval=20,
                    ping_timeout=20,
                    ssl=self.ssl,
                ) as ws:
                    self._ws = ws
                    await ws.send(p.encode_connect(self.token))
                    await self._read(ws, server)
                    reason = f"closed by server: {ws.close_code} {ws.close_reason or ''}".strip()
                    error: BaseException | None = None
            except (OSError, WebSocketException, TimeoutError, p.DecodeError) as exc:
                reason = f"{type(exc).__name__}: {exc}"
                error = exc
                wait = _retry_after(exc)
            self._last_failure, self._last_error = f"{server.url}: {reason}", error
            was_up = self._connected.is_set()
            self._connected.clear()
            self._ws = None
            self._fail_pending("connection lost")
            if was_up:
                delay = self.backoff_initial
            if self._closing:
                return
            server.failures += 1
            await self._emit(StatusEvent(EventKind.NOTIFY_SERVER_DOWN, f"{server.url}: {reason}", error=error))
            if self._closing or not self.reconnect:
                return
            last = server
            # jitter: a crowd of clients does not return at once; never before the server said it could take us
            await asyncio.sleep(wait + delay * random.uniform(0.5, 1.0))
            delay = min(delay * 2, self.backoff_max)

    def _accept(self, frame: p.Delivery) -> bool:
        """Record the message's position; False for a duplicate or an older message."""
        subject = frame.subject
        if frame.snapshot:
            self._positions[subject] = (frame.epoch, frame.seq)
            return True
        last = self._positions.get(subject)
        if last is not None and frame.seq <= last[1]:
            self.duplicates_dropped += 1
            return False
        self._positions[subject] = (frame.epoch, frame.seq)
        return True

    async def _next(self, ws: ClientConnection, keepalive: float) -> Data:
        """The server's next message; with its keep-alive (protocol version 3) known, a server silent for longer
        than it promised, plus half a second, is taken for hung (a paused cluster member sends nothing and closes
        nothing): the connection is cut at once and the client fails over."""
        if not keepalive:
            return await ws.recv()
        try:
            return await asyncio.wait_for(ws.recv(), keepalive + KEEPALIVE_MARGIN)
        except TimeoutError:
            ws.transport.abort()  # a close handshake would wait for the hung peer
            silent = keepalive + KEEPALIVE_MARGIN
            raise ConnectionError(f"no word from the server for {silent:.1f} s (its keep-alive)") from None

    async def _read(self, ws: ClientConnection, server: _Server) -> None:
        keepalive = 0.0
        while True:
            try:
                raw = await self._next(ws, keepalive)
            except ConnectionClosedOK:
                return
            if isinstance(raw, str):
                raise p.DecodeError("server sent a text message")
            frame = p.decode_server(raw)
            if isinstance(frame, p.Delivery):
                if frame.subject not in self._subscriptions or not self._accept(frame):
                    continue
                kind = (
                    MessageType.SNAPSHOT
                    if frame.snapshot
                    else MessageType.RECOVERED
                    if frame.recovered
                    else MessageType.UPDATE
                )
                message = ClientMessage(
                    frame.subject, frame.content, frame.fields, kind, frame.seq, frame.epoch, frame.retained
                )
                if self.on_message is not None:
                    result = self.on_message(message)
                    if result is not None:
                        await result
                else:
                    self._queue.put_nowait(message)
            elif isinstance(frame, p.PublishStatus):
                fut = self._pending.publishes.pop(frame.closure, None)
                if fut is not None and not fut.done():
                    fut.set_result((frame.status, frame.reason))
                await self._emit(
                    StatusEvent(
                        _PUBLISH_EVENTS.get(frame.status, EventKind.PUBLISH_FAILED),
                        frame.reason,
                        closure=frame.closure,
                        status=frame.status,
                    )
                )
            elif isinstance(frame, p.Notify):
                if frame.code is p.NotifyCode.KEEPALIVE:
                    continue
                if frame.code is p.NotifyCode.DATA_RESYNC:
                    self._positions.pop(frame.subject, None)  # the snapshot that follows starts afresh
                    await self._emit(StatusEvent(EventKind.NOTIFY_DATA_RESYNC, subject=frame.subject))
                else:
                    await self._emit(StatusEvent(EventKind.NOTIFY_DATA_SYNC, subject=frame.subject))
            elif isinstance(frame, p.SubscribeStatus):
                await self._subscribe_status(frame)
            elif isinstance(frame, p.Connected):
                self.session = frame.session
                self.server = server.url
                self.max_message_size = frame.max_message_size
                keepalive = frame.keepalive_ms / 1000.0
                server.failures = 0
                await self._resubscribe(ws)
                self._connected.set()
                await self._emit(StatusEvent(EventKind.NOTIFY_SERVER_UP, server.url))
            elif isinstance(frame, p.ErrorNotice):
                if frame.status is Status.TOO_LARGE:
                    self._fail_largest_publish(frame.reason)
                await self._emit(StatusEvent(EventKind.ERROR, frame.reason, status=frame.status))

    async def _subscribe_status(self, frame: p.SubscribeStatus) -> None:
        waiters = self._pending.subscribes.get(frame.subject)
        if waiters:
            fut = waiters.pop(0)
            if not waiters:
                del self._pending.subscribes[frame.subject]
            if not fut.done():
                fut.set_result((frame.status, frame.reason))
        if frame.status == Status.OK:
            await self._emit(StatusEvent(EventKind.SUBSCRIBE_ALLOW, subject=frame.subject, status=frame.status))
        else:
            self._subscriptions.pop(frame.subject, None)
            self._positions.pop(frame.subject, None)
            await self._emit(
                StatusEvent(EventKind.SUBSCRIBE_DENY, frame.reason, subject=frame.subject, status=frame.status)
            )

    async def _resubscribe(self, ws: ClientConnection) -> None:
        by_period: dict[int, list[str]] = {}
        for subject, period in self._subscriptions.items():
            by_period.setdefault(period, []).append(subject)
        for period, subjects in by_period.items():
            await ws.send(self._subscribe_frame(subjects, period))

    async def _send(self, data: bytes) -> None:
        ws = self._ws
        if ws is None:
            raise ConnectionError("not connected")
        await ws.send(data)

    def _fail_pending(self, reason: str) -> None:
        for fut in self._pending.publishes.values():
            if not fut.done():
                fut.set_result((Status.FAILED, reason))
        self._pending.publishes.clear()

    def _fail_largest_publish(self, reason: str) -> None:
        """The server refused a frame as too large before reading its closure: it was the oldest pending one."""
        for closure, fut in list(self._pending.publishes.items()):
            if not fut.done():
                fut.set_result((Status.TOO_LARGE, reason))
                del self._pending.publishes[closure]
                return

    async def _emit(self, event: StatusEvent) -> None:
        if self.on_status is None:
            return
        try:
            result = self.on_status(event)
            if result is not None:
                await result
        except Exception:  # a listener's bug must not kill the connection loop
            log.exception("status listener failed")


_PUBLISH_EVENTS = {
    Status.OK: EventKind.PUBLISH_OK,
    Status.NO_SUBSCRIBER: EventKind.PUBLISH_NO_SUBSCRIBER,
    Status.DENIED: EventKind.PUBLISH_DENIED,
}


def _retry_after(exc: BaseException) -> float:
    """The seconds a 503 answer to the upgrade asked to wait (``Retry-After``), 0 for anything else."""
    if not isinstance(exc, InvalidStatus) or exc.response.status_code != 503:
        return 0.0
    value = exc.response.headers.get("Retry-After", "")
    return float(min(int(value), 60)) if value.isdigit() else 0.0
