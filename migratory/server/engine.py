"""The node's publish/subscribe engine: snapshots, subscriptions, fan-out, timers.

One published message goes: connection decodes PUBLISH -> :meth:`Engine.publish`
checks it -> the subject's coordinator numbers it (this worker, another worker of
the node over the bus, or, in a cluster, the member agent, which hands it to the
coordinating member) and every replica applies it (migratory/replica.py) ->
:meth:`Engine.deliver` encodes the WebSocket frame once and queues the same bytes
object on every subscriber -> once per event-loop turn (or per ``BatchingTime``)
each dirty connection writes everything pending with one syscall. Conflated
subscribers get per-period aggregates instead, encoded once per subject and period.

A client that resubscribes with the position of the last message it saw (protocol
version 2) gets what it missed from the replica's cache, or the snapshot flagged as
a resync; subscribers of a subject whose history was replaced by a merge (a member
that rejoined after a partition) get the same resync.

Timers share two callbacks: a one-second housekeeping tick drives a coarse timer
wheel (handshake deadlines, keepalive pings, dead-peer detection, log flushes), and
one timer per active conflation period drains its buffer.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import hmac
import inspect
import json
import logging
import os
import random
import secrets
import sys
import time
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from migratory.bus import (
    BusFrame,
    ClusterInfo,
    Forward,
    ForwardStatus,
    Interest,
    Published,
    Relay,
    SyncSubject,
    owner,
    sync_frames,
)
from migratory.config import Config
from migratory.conflation import ConflationBuffer, next_boundary, round_conflation
from migratory.entitlement import AddressList, CustomEntitlement, Decision, Entitlement, build_entitlement
from migratory.logs import JsonLineWriter
from migratory.message import Message, QoS
from migratory.protocol import NotifyCode, Status, encode_delivery, encode_notify
from migratory.replica import Applied, Entry, RecoveryKind, Replica
from migratory.subjects import InvalidSubject, check_subject
from migratory.subscriptions import (
    SubscriptionIndex,
    subject_set_add,
    subject_set_contains,
    subject_set_items,
    subject_set_len,
    subject_set_remove,
)
from migratory.websocket import OP_BINARY, build_frame

if TYPE_CHECKING:
    from migratory.server.bus import Bus
    from migratory.server.connection import Connection
    from migratory.server.session import Session

__all__ = ["Authorizer", "Engine", "Origin", "PublishResult", "Stats"]

log = logging.getLogger("migratory.server")


@dataclass(frozen=True, slots=True)
class Origin:
    """Who sent a request, for entitlement decisions and logs."""

    addr: str
    port: int
    session: str
    protocol: str
    token: str = ""
    listener: str = ""


@dataclass(frozen=True, slots=True)
class PublishResult:
    status: Status
    reason: str = ""
    reason_code: str = ""
    recipients: int = 0
    seq: int = 0
    epoch: int = 0


Reply = Callable[["PublishResult"], None]
RESERVED_PREFIX = "/migratory/"
INTERNAL = Origin("127.0.0.1", 0, "server", "internal")
CUSTOM_ENTITLEMENT_TIMEOUT = 5.0
FORWARD_TIMEOUT = 8.0  # the member agent answers within 6 s, the client library waits 10 s
FORWARD_GIVE_UP = 30.0  # s a live agent's late answer is waited for (it answers within 6 s of reading)
MAX_INFLIGHT_PER_CONNECTION = 256  # publications one connection may have unanswered before it is not read
WORKER_FORWARD_BUDGET = 2000  # publications unanswered by coordinators, per worker, before publishers are held
WORKER_PAUSE = 2.5  # s since the one-second tick after which a worker knows it did not run (and says not ready)
AGENT_SILENCE = 3.5  # s without the agent's ClusterInfo (sent every second) before a member worker stops taking clients


def _origin_fields(origin: Origin) -> dict[str, str]:
    """The publisher's identity as it travels over the bus and into message.log."""
    return {"addr": origin.addr, "port": str(origin.port), "session": origin.session, "protocol": origin.protocol}


def _bus_message(frame: Forward) -> Message:
    """The message carried by a forwarded publication."""
    qos = QoS.GUARANTEED if frame.guaranteed else QoS.STANDARD
    return Message(frame.subject, frame.content, frame.fields, frame.retained, qos, publish_id=frame.publish_id)


class Authorizer(Protocol):
    """Entitlement hook: return ``None`` to allow, or ``(reason_code, reason)`` to deny."""

    def check_subscribe(self, origin: Origin, subject: str) -> tuple[str, str] | None: ...

    def check_publish(self, origin: Origin, subject: str) -> tuple[str, str] | None: ...


class Gatekeeper:
    """The configured entitlement plus the publish address list, for every interface."""

    def __init__(self, entitlement: Entitlement, addresses: AddressList) -> None:
        self.entitlement = entitlement
        self.addresses = addresses

    def check_subscribe(self, origin: Origin, subject: str) -> tuple[str, str] | None:
        return self.entitlement.check_subscribe(origin.token, subject, origin.addr)

    def check_publish(self, origin: Origin, subject: str) -> tuple[str, str] | None:
        if not self.addresses.allows(origin.addr):
            return ("address_not_allowed", f"{origin.addr} is not in PublishAllowFromAddressList")
        return self.entitlement.check_publish(origin.token, subject, origin.addr)


@dataclass(slots=True)
class Stats:
    """Counters since start; read by /health and the benchmarks."""

    connections: int = 0
    connections_total: int = 0
    disconnections_total: int = 0
    messages_in: int = 0
    messages_out: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    slow_consumers_disconnected: int = 0
    messages_dropped: int = 0
    denied: int = 0
    messages_recovered: int = 0
    resyncs: int = 0
    timer_errors: int = 0
    subscriptions: int = 0
    subjects: int = 0
    snapshots: int = 0

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


class Engine:
    """Everything one server process decides, driven by its connections and timers."""

    def __init__(
        self,
        config: Config,
        epoch: int,
        loop: asyncio.AbstractEventLoop,
        access_log: JsonLineWriter | None = None,
        message_log: JsonLineWriter | None = None,
        worker: int = 0,
        workers: int = 1,
        incarnation: int = 0,
    ) -> None:
        self.config = config
        self.worker = worker
        self.workers = workers
        self.bus: Bus | None = None
        self.peer_interest: dict[str, dict[int, int]] = {}
        self._forwards: dict[int, tuple[Reply, float, float]] = {}  # request -> reply, deadline, give up at
        # Backpressure: a publisher is not read while it has MAX_INFLIGHT_PER_CONNECTION publications unanswered,
        # or while this worker waits for WORKER_FORWARD_BUDGET answers; TCP then slows it down (no FAILED)
        self.inflight: dict[Session, int] = {}
        self.held: dict[Session, list[Any]] = {}  # sessions not read, with what they sent that waits
        self._forward_ids = 0
        # server-given publish ids must be unique in the whole cluster: session names repeat across members
        # (every fresh member's first session is "1-0-1"), and an id seen twice is numbered once
        self._id_prefix = secrets.token_hex(8)
        self.loop = loop
        self.epoch = epoch
        self.cluster = config.clustered
        self.agent = workers  # the member agent's index on the bus, in a cluster
        self._agent_ready = False  # what the agent last said of the node (ClusterInfo)
        self._agent_said = -1e9  # when (loop time)
        self._housekept = loop.time()  # the last one-second tick: much later means this worker did not run
        self.cluster_info: dict[str, Any] = {}
        guaranteed = config.cluster_delivery_mode.value == "Guaranteed" and self.cluster
        self.replica = Replica(
            config.max_cached_messages_per_subject if guaranteed else 0, float(config.cache_expire_time)
        )
        self._partial: dict[tuple[int, str], list[Entry]] = {}
        self.index: SubscriptionIndex[Connection] = SubscriptionIndex()
        self.connections: set[Connection] = set()
        self.stats = Stats()
        self.entitlement = build_entitlement(
            config.entitlement,
            config.entitlement_allow_token,
            config.entitlement_jwt_secret,
            config.entitlement_jwt_public_key,
            config.entitlement_custom_class,
        )
        self.gatekeeper = Gatekeeper(self.entitlement, AddressList(config.publish_allow_from))
        self.authorizer: Authorizer = self.gatekeeper
        self.async_entitlement = isinstance(self.entitlement, CustomEntitlement) and self.entitlement.is_async
        self._chains: dict[str, asyncio.Task[None]] = {}
        self._rates: dict[str, tuple[float, float]] = {}
        self.access_log = access_log
        self.message_log = message_log
        self.max_message_size = config.message_size_limit
        self.batching_time = config.batching_time / 1000.0
        self.batching_size = config.batching_size
        self.max_pending = config.max_pending_output
        self.drop_slow = config.slow_consumer_policy.value == "Drop"
        self._sessions = 0
        # a restarted worker keeps its index but must not reuse its predecessor's session ids
        self._session_prefix = f"{epoch}-{worker}." + str(incarnation) if incarnation else f"{epoch}-{worker}"
        self._dirty: list[Connection] = []
        self._flush_armed = False
        self._batch_dirty: list[Connection] = []
        self._batch_armed = False
        self._conflation: dict[int, ConflationBuffer] = {}
        self._conflation_armed: set[int] = set()
        self._snapshot_frames: dict[str, tuple[int, bytes]] = {}
        self._wheel: dict[int, set[Connection]] = {}
        self._tick: asyncio.TimerHandle | None = None
        self._timer_error_logged: dict[str, float] = {}
        self._closed = False
        self.on_tick: list[Callable[[], None]] = []
        self.denied_reasons: dict[str, int] = {}
        self._interest_dirty: set[str] = set()
        self.streams: dict[int, Connection] = {}  # HTTP streams of this process, by connection number
        self._stream_secret = secrets.token_bytes(16)
        self.listener_connections: dict[str, int] = {}

    # --- lifecycle ------------------------------------------------------------------

    def start(self) -> None:
        """Start the housekeeping tick."""
        self._tick = self.loop.call_later(1.0, self._housekeeping)

    def new_session(self) -> int:
        """A connection number; :meth:`session_name` turns it into the logged session id."""
        self._sessions += 1
        return self._sessions

    def session_name(self, number: int) -> str:
        return f"{self._session_prefix}-{number}"

    def register(self, conn: Connection) -> None:
        self.connections.add(conn)

    def admit(self, address: str, now: float) -> bool:
        """Token bucket per client address (``MaxConnectionsPerSecondPerAddress``)."""
        rate = self.config.max_connection_rate_per_address
        if not rate:
            return True
        tokens, last = self._rates.get(address, (2.0 * rate, now))
        tokens = min(2.0 * rate, tokens + (now - last) * rate)
        if tokens < 1.0:
            self._rates[address] = (tokens, now)
            return False
        self._rates[address] = (tokens - 1.0, now)
        if len(self._rates) > 100_000:  # forget idle addresses (full buckets)
            self._rates = {a: v for a, v in self._rates.items() if now - v[1] < 2.0}
        return True

    def unregister(self, conn: Connection) -> None:
        """Forget a closed connection, its timer and its subscriptions."""
        self.connections.discard(conn)
        if self.streams.get(conn.sid) is conn:
            del self.streams[conn.sid]
        if conn.wheel_at:
            self._unschedule(conn)
        subjects = subject_set_items(conn.subscriptions)
        conn.subscriptions = ()
        self.stats.subscriptions -= len(subjects)
        for subject in subjects:
            self.index.remove(subject, conn)
            self._interest_changed(subject)

    async def shutdown(self, timeout: float = 2.0) -> None:
        """Close every connection politely (close frame 1001), then stop timers."""
        self._closed = True
        for conn in list(self.connections):
            conn.shutdown()
        self.flush_dirty()
        deadline = self.loop.time() + timeout
        while self.connections and self.loop.time() < deadline:
            await asyncio.sleep(0.02)
        for conn in list(self.connections):
            conn.abort("server_shutdown")
        if self._tick is not None:
            self._tick.cancel()
        for writer in (self.access_log, self.message_log):
            if writer is not None:
                writer.close()

    # --- HTTP streams -----------------------------------------------------------------

    def _stream_tag(self, sid: int) -> str:
        return hmac.new(self._stream_secret, str(sid).encode(), hashlib.sha256).hexdigest()[:24]

    def open_stream(self, conn: Connection) -> str:
        """Register an HTTP stream; its id names this worker and is unguessable (it lets one act as the client)."""
        self.streams[conn.sid] = conn
        return f"w{self.worker}.{conn.sid}.{self._stream_tag(conn.sid)}"

    def stream_input(self, stream: str, payload: bytes) -> bool:
        """A POSTed native message for stream ``stream``: feed it here, or relay it to the worker that holds it."""
        worker_text, _, rest = stream.partition(".")
        sid_text, _, tag = rest.partition(".")
        if not (worker_text.startswith("w") and worker_text[1:].isdigit() and sid_text.isdigit()):
            return False
        worker = int(worker_text[1:])
        if worker != self.worker:
            if self.bus is None or worker >= self.workers:
                return False
            target = self.agent if self.cluster else worker
            return self.bus.send(target, Relay(worker, stream, payload))
        sid = int(sid_text)
        conn = self.streams.get(sid)
        if conn is None or not hmac.compare_digest(tag, self._stream_tag(sid)):
            return False
        conn.stream_input(payload)  # type: ignore[attr-defined]
        return True

    # --- output scheduling ----------------------------------------------------------

    # Connection.send registers a connection with output pending in ``_dirty`` itself
    # (inlined: it runs once per delivery); flush_dirty writes them at the end of the turn.

    def mark_batch(self, conn: Connection) -> None:
        """With BatchingTime: the connection's output waits for the shared batching timer."""
        self._batch_dirty.append(conn)
        if not self._batch_armed:
            self._batch_armed = True
            self.loop.call_later(self.batching_time, self._flush_batches)

    def flush_dirty(self) -> None:
        self._flush_armed = False
        dirty = self._dirty
        self._dirty = []
        for conn in dirty:
            conn.flush()

    def _flush_batches(self) -> None:
        self._batch_armed = False
        dirty = self._batch_dirty
        self._batch_dirty = []
        for conn in dirty:
            conn.flush()

    # --- timers ---------------------------------------------------------------------

    def schedule(self, conn: Connection, when: float) -> None:
        """Have ``conn.on_timer`` called at (about) loop time ``when``, at 1 s granularity.

        A connection sits in one slot at a time (rescheduling moves it), and leaves
        the wheel when it closes, so a closed connection is never kept alive by it.
        """
        key = int(when) + 1
        old = conn.wheel_at
        if old == key:
            return
        if old:
            self._unschedule(conn)
        self._wheel.setdefault(key, set()).add(conn)
        conn.wheel_at = key

    def _unschedule(self, conn: Connection) -> None:
        bucket = self._wheel.get(conn.wheel_at)
        if bucket is not None:
            bucket.discard(conn)
            if not bucket:
                del self._wheel[conn.wheel_at]
        conn.wheel_at = 0

    def _housekeeping(self) -> None:
        """The one-second tick. No failure of one duty may stop the others, or the tick itself."""
        try:
            now = self.loop.time()
            if now - self._housekept > WORKER_PAUSE:
                # this worker did not run (SIGSTOP, a frozen VM): what the agent said before is no evidence of
                # what the node can do now; the next ClusterInfo decides
                self._agent_said = -1e9
            self._housekept = now
            for second in [s for s in self._wheel if s <= now]:
                for conn in self._wheel.pop(second):
                    conn.wheel_at = 0
                    if conn.open:
                        self._guard("connection timer", conn.on_timer, now)
            for writer in (self.access_log, self.message_log):
                if writer is not None:
                    self._guard(f"writing {writer.path.name}", writer.flush)
            if self._forwards:
                self._guard("forward time-outs", self._expire_forwards, now)
            self._guard("cache expiry", self.replica.expire, now)
            for callback in self.on_tick:
                self._guard(getattr(callback, "__qualname__", "tick callback"), callback)
        finally:
            if not self._closed:
                self._tick = self.loop.call_later(1.0, self._housekeeping)

    def _guard(self, what: str, call: Callable[..., object], *args: object) -> None:
        """Run one housekeeping duty; a failure is counted and logged (once a minute per duty), never raised."""
        try:
            call(*args)
        except Exception as exc:
            self.stats.timer_errors += 1
            now = self.loop.time()
            if now - self._timer_error_logged.get(what, -1e9) >= 60.0:
                self._timer_error_logged[what] = now
                log.error("housekeeping: %s failed (%s: %s); retrying every second", what, type(exc).__name__, exc)

    # --- subscribe ------------------------------------------------------------------

    def check_subject(self, subject: str) -> str | None:
        """Return the reason ``subject`` is invalid, or None."""
        try:
            check_subject(subject)
        except InvalidSubject as exc:
            return exc.reason
        return None

    def subscribe(
        self, conn: Connection, subject: str, conflation_ms: int, decided: Decision | bool = False
    ) -> tuple[Status, str]:
        """Subscribe ``conn``. Returns (status, reason).

        ``decided`` carries an entitlement decision already awaited (asynchronous
        custom entitlement); by default the entitlement is asked here.
        """
        reason = self.check_subject(subject)
        if reason is not None:
            self.deny(conn.origin(), "subscribe", "invalid_subject", reason, subject)
            return Status.INVALID_SUBJECT, reason
        if (
            not subject_set_contains(conn.subscriptions, subject)
            and subject_set_len(conn.subscriptions) >= self.config.max_subscriptions_per_client
        ):
            reason = f"MaxSubscriptionsPerClient ({self.config.max_subscriptions_per_client}) reached"
            self.deny(conn.origin(), "subscribe", "subscription_limit", reason, subject)
            return Status.LIMIT_EXCEEDED, reason
        denial = self.authorizer.check_subscribe(conn.origin(), subject) if decided is False else decided
        if isinstance(denial, tuple):
            self.deny(conn.origin(), "subscribe", denial[0], denial[1], subject)
            return Status.DENIED, denial[1]
        period = round_conflation(conflation_ms)
        subject = sys.intern(subject)  # one string per subject, not one per subscriber
        if not subject_set_contains(conn.subscriptions, subject):
            self.stats.subscriptions += 1
        self.index.add(subject, conn, period)
        conn.subscriptions = subject_set_add(conn.subscriptions, subject)
        self._interest_changed(subject)
        self.access("subscribe", conn, subject=subject, conflation_ms=period)
        return Status.OK, ""

    def snapshot_frame(self, subject: str) -> bytes | None:
        """The encoded SNAPSHOT frame of ``subject`` (cached per sequence number)."""
        if not self.config.publish_snapshot_message:
            return None
        snapshot = self.replica.get(subject)
        if snapshot is None:
            return None
        cached = self._snapshot_frames.get(subject)
        if cached is not None and cached[0] == snapshot.seq:
            return cached[1]
        frame = build_frame(
            OP_BINARY,
            encode_delivery(
                subject,
                snapshot.content,
                snapshot.fields,
                snapshot.seq,
                snapshot.epoch,
                snapshot=True,
            ),
        )
        self._snapshot_frames[subject] = (snapshot.seq, frame)
        return frame

    def unsubscribe(self, conn: Connection, subject: str) -> bool:
        conn.subscriptions, found = subject_set_remove(conn.subscriptions, subject)
        if not found:
            return False
        self.stats.subscriptions -= 1
        self.index.remove(subject, conn)
        self._interest_changed(subject)
        self.access("unsubscribe", conn, subject=subject)
        return True

    # --- publish --------------------------------------------------------------------

    def publish(self, message: Message, origin: Origin, reply: Reply, received_ns: int | None = None) -> None:
        """Check one publication and have its subject's coordinator sequence it.

        ``reply`` gets the outcome: at once when refused or coordinated here, or when
        the coordinating worker answers over the bus.
        """
        start = received_ns if received_ns is not None else time.perf_counter_ns()
        self.stats.messages_in += 1
        self.stats.bytes_in += len(message.content)
        reason = self.check_subject(message.subject)
        if reason is not None:
            self.deny(origin, "publish", "invalid_subject", reason, message.subject)
            reply(PublishResult(Status.INVALID_SUBJECT, reason, "invalid_subject"))
            return
        if message.subject.startswith(RESERVED_PREFIX):
            reason = f"subjects under {RESERVED_PREFIX} are the server's own (monitoring); clients cannot publish there"
            self.deny(origin, "publish", "reserved_subject", reason, message.subject)
            reply(PublishResult(Status.DENIED, reason, "reserved_subject"))
            return
        if len(message.content) > self.max_message_size:
            reason = f"content of {len(message.content)} bytes exceeds MessageSizeLimit ({self.max_message_size})"
            self.deny(origin, "publish", "message_too_big", reason, message.subject)
            reply(PublishResult(Status.TOO_LARGE, reason, "message_too_big"))
            return
        if self.async_entitlement:
            if not self.gatekeeper.addresses.allows(origin.addr):
                denial: Decision = ("address_not_allowed", f"{origin.addr} is not in PublishAllowFromAddressList")
            else:
                self.in_order(origin.session, self._publish_after_decision(message, origin, reply, start))
                return
        else:
            denial = self.authorizer.check_publish(origin, message.subject)
        if denial is not None:
            self.deny(origin, "publish", denial[0], denial[1], message.subject)
            reply(PublishResult(Status.DENIED, denial[1], denial[0]))
            return
        self._route(message, origin, reply, start)

    def publish_internal(self, subject: str, content: bytes, fields: Mapping[str, str]) -> None:
        """The server's own publication (monitoring): no entitlement, no publisher to answer."""
        self._route(Message(subject, content, fields), INTERNAL, lambda result: None, time.perf_counter_ns())

    async def _publish_after_decision(self, message: Message, origin: Origin, reply: Reply, start: int) -> None:
        denial = await self.custom_decision("authorize_publish", origin, message.subject)
        if denial is not None:
            self.deny(origin, "publish", denial[0], denial[1], message.subject)
            reply(PublishResult(Status.DENIED, denial[1], denial[0]))
            return
        self._route(message, origin, reply, start)

    # --- asynchronous custom entitlement ----------------------------------------------

    async def custom_decision(self, method: str, origin: Origin, subject: str) -> Decision:
        """Await an async custom entitlement method (bounded, its failures denied)."""
        assert isinstance(self.entitlement, CustomEntitlement)
        try:
            answer = getattr(self.entitlement.impl, method)(origin.token, subject, origin.addr)
            if inspect.isawaitable(answer):
                answer = await asyncio.wait_for(answer, CUSTOM_ENTITLEMENT_TIMEOUT)
        except Exception as exc:
            return CustomEntitlement.verdict(method, exc)
        return CustomEntitlement.verdict(method, answer)

    def in_order(self, key: str, step: Coroutine[Any, Any, None]) -> None:
        """Run ``step`` after every earlier step of the same client (its requests keep their order)."""
        previous = self._chains.get(key)

        async def chained() -> None:
            if previous is not None:
                with contextlib.suppress(Exception):
                    await previous
            await step

        task = self.loop.create_task(chained())
        self._chains[key] = task
        task.add_done_callback(lambda done: self._chains.pop(key, None) if self._chains.get(key) is done else None)

    def _route(self, message: Message, origin: Origin, reply: Reply, start: int) -> None:
        """Sequence here, or forward to the subject's coordinator (a worker, or the member agent)."""
        if self.cluster:
            coordinator = self.agent
            if not message.publish_id:  # a retry inside the cluster must not number it twice
                self._forward_ids += 1
                publish_id = f"{self._id_prefix}/{origin.session}/{self._forward_ids}"
                message = dataclasses.replace(message, publish_id=publish_id)
            reply = self._logged_reply(message, _origin_fields(origin), start, reply)
        else:
            coordinator = owner(message.subject, self.workers)
            if coordinator == self.worker or self.bus is None:
                reply(self.sequence(message, _origin_fields(origin), start))
                return
        if self.bus is None:
            reply(PublishResult(Status.FAILED, "no coordinator"))
            return
        self._forward_ids += 1
        request = self._forward_ids
        frame = Forward(
            request,
            message.subject,
            message.content,
            message.fields,
            message.retained,
            message.qos == QoS.GUARANTEED,
            _origin_fields(origin),
            message.publish_id,
        )
        if not self.bus.send(coordinator, frame, queue_if_down=not self.cluster):
            reply(PublishResult(Status.FAILED, "the coordinator is unavailable"))
            return
        now = self.loop.time()
        self._forwards[request] = (reply, now + FORWARD_TIMEOUT, now + FORWARD_GIVE_UP)

    def _logged_reply(self, message: Message, origin: Mapping[str, str], start: int, reply: Reply) -> Reply:
        """In a cluster the publishing worker logs the publication once the coordinator answered."""

        def logged(result: PublishResult) -> None:
            self._log_publish(message, origin, result, start, len(message.content) + len(message.subject) + 16)
            reply(result)

        return logged

    def sequence(self, message: Message, origin: Mapping[str, str], start: int) -> PublishResult:
        """Coordinating worker: number, snapshot, deliver here, broadcast to the other workers, log."""
        subject = message.subject
        entry = Entry(self.epoch, self.replica.next_seq(subject), message.content, message.fields, message.retained)
        self.replica.apply(subject, entry)
        guaranteed = message.qos == QoS.GUARANTEED
        recipients, frame_size = self.deliver(subject, entry, guaranteed)
        if self.bus is not None:
            self.bus.broadcast(Published.of(subject, entry, guaranteed))
            remote = self.peer_interest.get(subject)
            if remote:
                recipients += sum(remote.values())
        if recipients and not frame_size:
            frame_size = len(message.content) + len(subject) + 16
        status = Status.OK if recipients else Status.NO_SUBSCRIBER
        result = PublishResult(status, "", "", recipients, entry.seq, entry.epoch)
        self._log_publish(message, origin, result, start, frame_size)
        return result

    def _log_publish(
        self, message: Message, origin: Mapping[str, str], result: PublishResult, start: int, frame_size: int
    ) -> None:
        if (
            self.message_log is None
            or origin.get("protocol") == "internal"  # the server's own (monitoring) publications
            or (self.config.message_log_sampling < 1.0 and random.random() >= self.config.message_log_sampling)
        ):
            return
        self.message_log.write(
            {
                "event": "publish",
                "subject": message.subject,
                "size": len(message.content),
                "fields": len(message.fields),
                **origin,
                "port": int(origin.get("port", "0")),
                "qos": "guaranteed" if message.qos == QoS.GUARANTEED else "standard",
                "retained": message.retained,
                "status": result.status.name,
                "recipients": result.recipients,
                "bytes_out": result.recipients * frame_size,
                "latency_us": (time.perf_counter_ns() - start) // 1000,
                "seq": result.seq,
                "epoch": result.epoch,
                "sampling": self.config.message_log_sampling,
            }
        )

    # --- the bus: other workers of the node, or the member agent ----------------------------

    def on_bus_frame(self, frame: BusFrame, peer: int) -> None:
        if isinstance(frame, Published):
            entry = frame.entry()
            applied = self.replica.apply(frame.subject, entry, self.loop.time())
            if applied is Applied.GAP:
                # messages before it never reached this replica (a merge adopted another history): its
                # subscribers are told and get the snapshot, never a silent jump in the seq
                self.resync(frame.subject)
                if entry.retained:
                    return  # the snapshot they just got is this message
            if applied is not Applied.DUPLICATE:
                self.deliver(frame.subject, entry, frame.guaranteed)
        elif isinstance(frame, Forward):
            result = self.sequence(_bus_message(frame), frame.origin, time.perf_counter_ns())
            if self.bus is not None:
                status = ForwardStatus(frame.request, result.status, result.seq, result.reason, result.epoch)
                self.bus.send(peer, status, queue_if_down=True)
        elif isinstance(frame, ForwardStatus):
            waiting = self._forwards.pop(frame.request, None)
            if waiting is not None:
                waiting[0](
                    PublishResult(Status(frame.status), frame.reason, "", frame.recipients, frame.seq, frame.epoch)
                )
        elif isinstance(frame, Interest):
            counts = self.peer_interest.setdefault(frame.subject, {})
            if frame.count:
                counts[peer] = frame.count
            else:
                counts.pop(peer, None)
                if not counts:
                    del self.peer_interest[frame.subject]
        elif isinstance(frame, SyncSubject):
            self._merge(frame)
        elif isinstance(frame, Relay):
            self.stream_input(frame.stream, frame.payload)
        elif isinstance(frame, ClusterInfo):
            self._agent_ready = frame.ready
            self._agent_said = self.loop.time()
            try:
                self.cluster_info = dict(json.loads(frame.document))
            except (ValueError, TypeError):
                self.cluster_info = {}

    def _merge(self, frame: SyncSubject) -> None:
        """Another replica's state of a subject: deliver what we missed, or resync our subscribers."""
        state = frame.state
        key = (-1, state.subject)
        if frame.more:
            self._partial.setdefault(key, []).extend(state.entries)
            return
        earlier = self._partial.pop(key, None)
        if earlier:
            state = dataclasses.replace(state, entries=(*earlier, *state.entries))
        merged = self.replica.merge(state, self.loop.time())
        for entry in merged.new:
            self.deliver(state.subject, entry, False)
        if merged.resync:
            self.resync(state.subject)

    def on_link_up(self, peer: int) -> None:
        """A (re)started peer: send it our whole state before anything else."""
        if self.bus is None:
            return
        for subject in self.replica.subjects():
            state = self.replica.sync(subject)
            if state is not None:
                for frame in sync_frames(state):
                    self.bus.send(peer, frame)
        for subject in self.index.subjects():
            self.bus.send(peer, Interest(subject, self.index.count(subject)))
        # a peer that restarted lost its subscribers: forget what it had told us
        for counts in self.peer_interest.values():
            counts.pop(peer, None)
        for subject in [s for s, c in self.peer_interest.items() if not c]:
            del self.peer_interest[subject]

    def on_link_down(self, peer: int) -> None:
        if self.cluster and peer == self.agent:
            self._agent_ready = False  # no cluster behind us until the agent is back and synchronised
            # what the agent had not answered will never be: the publishers hear it now, not after 8 s, and
            # retry with the same publish id (the cluster numbers it once if the agent had numbered it)
            forwards, self._forwards = self._forwards, {}
            for reply, _, _ in forwards.values():
                reply(PublishResult(Status.FAILED, "the member agent restarted; retry with the same publish id"))

    def _interest_changed(self, subject: str) -> None:
        """Subscriber counts go to the peers once per loop turn, whatever the number of (un)subscriptions."""
        if self.bus is None:
            return
        if not self._interest_dirty:
            self.loop.call_soon(self._flush_interest)
        self._interest_dirty.add(subject)

    def _flush_interest(self) -> None:
        dirty, self._interest_dirty = self._interest_dirty, set()
        if self.bus is not None:
            for subject in dirty:
                self.bus.broadcast(Interest(subject, self.index.count(subject)))

    def publish_started(self, session: Session) -> None:
        """A client's publication enters: past its connection's or this worker's budget, stop reading it."""
        count = self.inflight[session] = self.inflight.get(session, 0) + 1
        if session not in self.held and (
            count >= MAX_INFLIGHT_PER_CONNECTION or len(self._forwards) >= WORKER_FORWARD_BUDGET
        ):
            self.held[session] = []
            session.hold_input()

    def publish_done(self, session: Session) -> None:
        """A publication was answered: read the held publishers again once the budgets are half free."""
        count = self.inflight.get(session, 0) - 1
        if count > 0:
            self.inflight[session] = count
        else:
            self.inflight.pop(session, None)
        if self.held and len(self._forwards) <= WORKER_FORWARD_BUDGET // 2:
            for held in [s for s in self.held if self.inflight.get(s, 0) <= MAX_INFLIGHT_PER_CONNECTION // 2]:
                held.release_input(self.held.pop(held))

    def forget_session(self, session: Session) -> None:
        self.inflight.pop(session, None)
        self.held.pop(session, None)

    def _expire_forwards(self, now: float) -> None:
        alive = self.cluster and self.bus is not None and self.bus.linked(self.agent)
        alive = alive and now - self._agent_said <= AGENT_SILENCE
        for request, (reply, deadline, give_up) in list(self._forwards.items()):
            if deadline <= now:
                if alive and now < give_up:
                    # a live agent answers everything it read, within 6 s of reading it: a late answer is
                    # queueing between us, and failing it would report FAILED for what gets numbered
                    self._forwards[request] = (reply, now + FORWARD_TIMEOUT, give_up)
                    continue
                del self._forwards[request]
                reply(PublishResult(Status.FAILED, "no answer from the coordinator"))

    # --- fan-out ----------------------------------------------------------------------

    def deliver(self, subject: str, entry: Entry, guaranteed: bool) -> tuple[int, int]:
        """Queue one message for every local subscriber; return (recipients, frame size)."""
        index = self.index.get(subject)
        if index is None:
            return 0, 0
        recipients = 0
        frame_size = 0
        if index.plain:
            frame = build_frame(
                OP_BINARY,
                encode_delivery(
                    subject,
                    entry.content,
                    entry.fields,
                    entry.seq,
                    entry.epoch,
                    retained=entry.retained,
                    guaranteed=guaranteed,
                ),
            )
            for conn in index.plain:
                conn.send(frame)  # kept a method call: the queueing rules live in one place
            recipients = len(index.plain)
            frame_size = len(frame)
            self.stats.bytes_out += recipients * frame_size
        for period, members in index.conflated.items():
            buffer = self._conflation.get(period)
            if buffer is None:
                buffer = self._conflation[period] = ConflationBuffer(period)
            buffer.add(subject, entry.content, entry.fields, entry.seq, entry.epoch, entry.retained)
            if period not in self._conflation_armed:
                self._arm_conflation(period)
            recipients += len(members)
        self.stats.messages_out += recipients
        return recipients, frame_size

    def resync(self, subject: str) -> None:
        """The subject's history was replaced: its subscribers get the snapshot, flagged as a resync."""
        index = self.index.get(subject)
        if index is None:
            return
        self.stats.resyncs += 1
        snapshot = self.snapshot_frame(subject)
        notify = build_frame(OP_BINARY, encode_notify(NotifyCode.DATA_RESYNC, subject))
        for conn in (*index.plain, *(c for members in index.conflated.values() for c in members)):
            if conn.version >= 2:
                conn.send(notify)
            if snapshot is not None:
                conn.send(snapshot)

    def initial_frames(self, conn_version: int, subject: str, position: tuple[int, int] | None) -> list[bytes]:
        """What a new subscription gets first: the snapshot, or (version 2, with a position) recovery."""
        snapshot = self.snapshot_frame(subject)
        if position is None:
            return [snapshot] if snapshot is not None else []
        recovery = self.replica.recover(subject, *position)
        if recovery.kind is RecoveryKind.RESYNC:
            frames = [build_frame(OP_BINARY, encode_notify(NotifyCode.DATA_RESYNC, subject))]
            return frames + ([snapshot] if snapshot is not None and recovery.snapshot is not None else [])
        frames = [
            build_frame(
                OP_BINARY,
                encode_delivery(subject, e.content, e.fields, e.seq, e.epoch, retained=e.retained, recovered=True),
            )
            for e in recovery.entries
        ]
        self.stats.messages_recovered += len(frames)
        frames.append(build_frame(OP_BINARY, encode_notify(NotifyCode.DATA_SYNC, subject)))
        return frames

    def _arm_conflation(self, period: int) -> None:
        self._conflation_armed.add(period)
        now_ms = int(time.time() * 1000)
        delay = (next_boundary(now_ms, period) - now_ms) / 1000.0
        self.loop.call_later(delay, self._drain_conflation, period)

    def _drain_conflation(self, period: int) -> None:
        self._conflation_armed.discard(period)
        buffer = self._conflation.get(period)
        if buffer is None:
            return
        for item in buffer.drain():
            entry = self.index.get(item.subject)
            members = entry.conflated.get(period) if entry is not None else None
            if not members:
                continue
            frame = build_frame(
                OP_BINARY,
                encode_delivery(
                    item.subject,
                    item.content,
                    item.fields,
                    item.seq,
                    item.epoch,
                    retained=item.retained,
                ),
            )
            for conn in members:
                conn.send(frame)
            self.stats.bytes_out += len(frame) * len(members)

    # --- logs -----------------------------------------------------------------------

    def access(self, event: str, conn: Connection, **fields: Any) -> None:
        if event == "connect":
            self.listener_connections[conn.listener] = self.listener_connections.get(conn.listener, 0) + 1
        elif event == "disconnect":
            self.listener_connections[conn.listener] = self.listener_connections.get(conn.listener, 0) - 1
        if self.access_log is not None:
            self.access_log.write({"event": event, **conn.log_fields(), **fields})

    def deny(
        self,
        origin: Origin,
        request: str,
        reason_code: str,
        reason: str,
        subject: str | None = None,
    ) -> None:
        """Count and log one refused request (every refusal is logged once, with its reason)."""
        self.stats.denied += 1
        self.denied_reasons[reason_code] = self.denied_reasons.get(reason_code, 0) + 1
        if self.access_log is not None:
            self.access_log.write(
                {
                    "event": "denied",
                    "session": origin.session,
                    "addr": origin.addr,
                    "port": origin.port,
                    "listener": origin.listener,
                    "protocol": origin.protocol,
                    "tls": origin.protocol in ("wss", "https"),
                    "request": request,
                    "reason_code": reason_code,
                    "reason": reason,
                    "subject": subject,
                }
            )

    def count_replica(self) -> None:
        """Copy the replica's subject and snapshot counts into the statistics (both are kept, O(1))."""
        self.stats.subjects = self.replica.subject_count()
        self.stats.snapshots = len(self.replica)

    @property
    def ready(self) -> bool:
        """Whether this worker takes clients: alone, always; in a member, while the agent says the node is
        ready (state held, members linked, every worker linked), recently, and we are linked to it both ways."""
        if not self.cluster:
            return True
        now = self.loop.time()
        return (
            self._agent_ready
            and now - self._agent_said <= AGENT_SILENCE
            and now - self._housekept <= WORKER_PAUSE  # we ran recently: a resumed worker answers from a new word
            and self.bus is not None
            and self.bus.linked(self.agent)
        )

    @property
    def healthy(self) -> bool:
        """What /health answers: :attr:`ready`, and in Guaranteed mode a quorum and a place in the table."""
        return self.ready and (not self.cluster or bool(self.cluster_info.get("healthy", True)))

    def not_ready_reason(self) -> str:
        if self.ready:
            return "" if self.healthy else str(self.cluster_info.get("reason", ""))
        if self.bus is None or not self.bus.linked(self.agent):
            return "this worker is not linked to the member agent"
        if self.loop.time() - self._agent_said > AGENT_SILENCE:
            return f"no word from the member agent for over {AGENT_SILENCE:.1f} s"
        return str(self.cluster_info.get("reason") or "synchronising with the cluster")

    def health(self) -> Mapping[str, Any]:
        self.count_replica()  # the monitor's copy is up to a second old; a probe right after a sync must see it
        healthy = self.healthy
        document: dict[str, Any] = {
            "status": "ok" if healthy else "syncing",
            "ready": healthy,
            "epoch": self.epoch,
            "worker": self.worker,
            "pid": os.getpid(),
            "workers": self.workers,
            **self.stats.as_dict(),
        }
        if self.cluster:
            document["cluster"] = self.cluster_info
            if not healthy:
                document["reason"] = self.not_ready_reason()
        return document
