"""The Python client library (asyncio): subscribe, publish, snapshots, fail-over.

Usage from a plain script::

    import asyncio
    from migratory.client import MigratoryClient

    async def main() -> None:
        async with MigratoryClient(["ws://127.0.0.1:8800"], token="...") as client:
            await client.subscribe(["/Stocks/NYSE/IBM"])
            await client.publish("/Stocks/NYSE/IBM", b"193", fields={"volume": "6.62M"})
            async for message in client.messages():
                print(message.subject, message.content, message.fields)

    asyncio.run(main())

The client keeps one connection to one server of its list, chosen at random in
proportion to the servers' weights. When that connection fails it reconnects with
exponential backoff (trying other servers first) and subscribes again to
everything it was subscribed to. Listeners receive messages and status events
(server up/down, subscribe allowed/denied, publish outcome).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import itertools
import logging
import random
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import WebSocketException
from websockets.typing import Subprotocol

from migratory import protocol as p
from migratory.message import MessageType
from migratory.protocol import Status

__all__ = ["ClientMessage", "EventKind", "MigratoryClient", "PublishError", "StatusEvent"]

log = logging.getLogger("migratory.client")


class EventKind(enum.Enum):
    """Status notifications delivered to ``on_status`` listeners."""

    SERVER_UP = "server_up"
    SERVER_DOWN = "server_down"
    SUBSCRIBE_ALLOW = "subscribe_allow"
    SUBSCRIBE_DENY = "subscribe_deny"
    PUBLISH_OK = "publish_ok"
    PUBLISH_NO_SUBSCRIBER = "publish_no_subscriber"
    PUBLISH_DENIED = "publish_denied"
    PUBLISH_FAILED = "publish_failed"
    ERROR = "error"


@dataclass(frozen=True, slots=True)
class StatusEvent:
    kind: EventKind
    detail: str = ""
    subject: str = ""
    closure: str = ""
    status: Status | None = None


@dataclass(frozen=True, slots=True)
class ClientMessage:
    """A delivered message: SNAPSHOT first after subscribe, then UPDATEs."""

    subject: str
    content: bytes
    fields: Mapping[str, str]
    type: MessageType
    seq: int
    epoch: int
    retained: bool = True


class PublishError(Exception):
    """Raised by :meth:`MigratoryClient.publish` with ``raise_on_error=True``."""

    def __init__(self, status: Status, reason: str) -> None:
        super().__init__(f"{status.name}: {reason}")
        self.status = status
        self.reason = reason


MessageListener = Callable[[ClientMessage], Awaitable[None] | None]
StatusListener = Callable[[StatusEvent], Awaitable[None] | None]


@dataclass(slots=True)
class _Server:
    url: str
    weight: float
    failures: int = 0


@dataclass(slots=True)
class _Pending:
    publishes: dict[str, asyncio.Future[tuple[Status, str]]] = field(default_factory=dict)
    subscribes: dict[str, list[asyncio.Future[tuple[Status, str]]]] = field(default_factory=dict)


def _parse_servers(servers: Iterable[str | tuple[str, float]]) -> list[_Server]:
    out = []
    for item in servers:
        url, weight = (item, 1.0) if isinstance(item, str) else item
        if not url.startswith(("ws://", "wss://")):
            raise ValueError(f"server URL must start with ws:// or wss://: {url!r}")
        if weight <= 0:
            raise ValueError(f"server weight must be positive: {url!r} has {weight}")
        out.append(_Server(url, float(weight)))
    if not out:
        raise ValueError("at least one server is required")
    return out


class MigratoryClient:
    """One logical client of a cluster: reconnects, resubscribes, and reports status."""

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
        self._queue: asyncio.Queue[ClientMessage] = asyncio.Queue()
        self._ws: ClientConnection | None = None
        self._connected = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self._pending = _Pending()
        self._closures = itertools.count(1)
        self.session = ""
        self.server = ""

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
        """Start the connection loop and wait until a server accepted the session."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="migratory-client")
        await asyncio.wait_for(self._connected.wait(), timeout or self.request_timeout)

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

    # --- requests -----------------------------------------------------------------

    async def subscribe(self, subjects: Iterable[str], conflation_ms: int = 0) -> dict[str, Status]:
        """Subscribe (optionally conflated); return each subject's status from the server.

        Subjects are remembered even while disconnected and subscribed again after
        every reconnection; a denied or invalid subject is forgotten.
        """
        subjects = list(subjects)
        loop = asyncio.get_running_loop()
        futures: dict[str, asyncio.Future[tuple[Status, str]]] = {}
        for subject in subjects:
            self._subscriptions[subject] = conflation_ms
            fut: asyncio.Future[tuple[Status, str]] = loop.create_future()
            self._pending.subscribes.setdefault(subject, []).append(fut)
            futures[subject] = fut
        if self._ws is not None and self._connected.is_set():
            await self._send(p.encode_subscribe(subjects, conflation_ms))
        results: dict[str, Status] = {}
        for subject, fut in futures.items():
            try:
                status, _ = await asyncio.wait_for(fut, self.request_timeout)
            except TimeoutError:
                status = Status.FAILED
            results[subject] = status
        return results

    async def unsubscribe(self, subjects: Iterable[str]) -> None:
        subjects = [s for s in subjects if self._subscriptions.pop(s, None) is not None]
        if subjects and self._ws is not None and self._connected.is_set():
            await self._send(p.encode_unsubscribe(subjects))

    async def publish(
        self,
        subject: str,
        content: bytes | str,
        *,
        fields: Mapping[str, str] | None = None,
        closure: str | None = None,
        retained: bool = True,
        guaranteed: bool = False,
        raise_on_error: bool = False,
    ) -> Status:
        """Publish and wait for the server's publish status (OK, NO_SUBSCRIBER, DENIED, ...)."""
        data = content.encode("utf-8") if isinstance(content, str) else content
        closure = closure if closure is not None else f"c{next(self._closures)}"
        if self._ws is None or not self._connected.is_set():
            status, reason = Status.FAILED, "not connected"
        else:
            fut: asyncio.Future[tuple[Status, str]] = asyncio.get_running_loop().create_future()
            self._pending.publishes[closure] = fut
            try:
                await self._send(p.encode_publish(subject, data, fields, closure, retained, guaranteed))
                status, reason = await asyncio.wait_for(fut, self.request_timeout)
            except (TimeoutError, WebSocketException, OSError) as exc:
                status, reason = Status.FAILED, f"no publish status: {exc or type(exc).__name__}"
            finally:
                self._pending.publishes.pop(closure, None)
        if status not in (Status.OK, Status.NO_SUBSCRIBER) and raise_on_error:
            raise PublishError(status, reason)
        return status

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
            except (OSError, WebSocketException, TimeoutError, p.DecodeError) as exc:
                reason = f"{type(exc).__name__}: {exc}"
            was_up = self._connected.is_set()
            self._connected.clear()
            self._ws = None
            self._fail_pending("connection lost")
            if was_up:
                delay = self.backoff_initial
            if self._closing:
                return
            await self._emit(StatusEvent(EventKind.SERVER_DOWN, f"{server.url}: {reason}"))
            if self._closing or not self.reconnect:
                return
            last = server
            await asyncio.sleep(delay * random.uniform(0.5, 1.0))
            delay = min(delay * 2, self.backoff_max)

    async def _read(self, ws: ClientConnection, server: _Server) -> None:
        async for raw in ws:
            if isinstance(raw, str):
                raise p.DecodeError("server sent a text message")
            frame = p.decode_server(raw)
            if isinstance(frame, p.Delivery):
                message = ClientMessage(
                    frame.subject,
                    frame.content,
                    frame.fields,
                    MessageType.SNAPSHOT if frame.snapshot else MessageType.UPDATE,
                    frame.seq,
                    frame.epoch,
                    frame.retained,
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
            elif isinstance(frame, p.SubscribeStatus):
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
                    await self._emit(
                        StatusEvent(
                            EventKind.SUBSCRIBE_DENY,
                            frame.reason,
                            subject=frame.subject,
                            status=frame.status,
                        )
                    )
            elif isinstance(frame, p.Connected):
                self.session = frame.session
                self.server = server.url
                server.failures = 0
                await self._resubscribe(ws)
                self._connected.set()
                await self._emit(StatusEvent(EventKind.SERVER_UP, server.url))
            elif isinstance(frame, p.ErrorNotice):
                await self._emit(StatusEvent(EventKind.ERROR, frame.reason, status=frame.status))

    async def _resubscribe(self, ws: ClientConnection) -> None:
        by_period: dict[int, list[str]] = {}
        for subject, period in self._subscriptions.items():
            by_period.setdefault(period, []).append(subject)
        for period, subjects in by_period.items():
            await ws.send(p.encode_subscribe(subjects, period))

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
