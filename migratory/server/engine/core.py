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
import dataclasses
import json
import logging
import os
import random
import secrets
import sys
import time
from collections.abc import Callable, Coroutine, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from migratory.bus import (
    BusFrame,
    ClusterInfo,
    Forward,
    ForwardStatus,
    Interest,
    Published,
    Relay,
    SyncSubject,
    encode,
    owner,
    sync_frames,
)
from migratory.config import Config
from migratory.conflation import round_conflation
from migratory.entitlement import AddressList, CustomEntitlement, Decision, build_entitlement
from migratory.logs import JsonLineWriter
from migratory.message import Message, QoS
from migratory.protocol import NotifyCode, Status, encode_delivery, encode_notify
from migratory.replica import Applied, Entry, RecoveryKind, Replica
from migratory.server.engine.admission import (
    Authorizer,
    ConnectionRate,
    Gatekeeper,
    InOrder,
    SessionAdmission,
    custom_decision,
)
from migratory.server.engine.fanout import FanOut
from migratory.server.engine.forwards import Forwards
from migratory.server.engine.streams import StreamRegistry
from migratory.server.engine.timers import TimerWheel
from migratory.server.engine.types import PRIVATE_PREFIX, Client, Origin, Publisher, PublishResult, Reply, Stats
from migratory.subjects import RESERVED_PREFIX, InvalidSubject, check_subject, private_first
from migratory.subscriptions import (
    subject_set_add,
    subject_set_contains,
    subject_set_items,
    subject_set_len,
    subject_set_remove,
)
from migratory.topics import is_sys, subject_matches, subject_to_topic
from migratory.websocket import OP_BINARY, build_frame

if TYPE_CHECKING:
    from migratory.server.node.bus import Bus

__all__ = ["Authorizer", "Engine", "Origin", "PublishResult", "Reply", "Stats"]

log = logging.getLogger("migratory.server")
KEEPALIVE_FLOOR_MS = 2000  # the shortest keep-alive the server promises (ServerKeepAlive below it is raised)


INTERNAL = Origin("127.0.0.1", 0, "server", "internal")
WORKER_PAUSE = 2.5  # s since the one-second tick after which a worker knows it did not run (and says not ready)
DRAIN_FLOOR = 100.0  # clients a second a draining worker sends away at least: a few leave at once
DRAIN_STEP = 0.05  # s between two batches of a drain
AGENT_SILENCE = 3.5  # s without the agent's ClusterInfo (sent every second) before a member worker stops taking clients


def _origin_fields(origin: Origin) -> dict[str, str]:
    """The publisher's identity as it travels over the bus and into message.log."""
    return {"addr": origin.addr, "port": str(origin.port), "session": origin.session, "protocol": origin.protocol}


def _bus_message(frame: Forward) -> Message:
    """The message carried by a forwarded publication."""
    qos = QoS.GUARANTEED if frame.guaranteed else QoS.STANDARD
    return Message(frame.subject, frame.content, frame.fields, frame.retained, qos, publish_id=frame.publish_id)


class Engine:
    """Everything one server process decides, driven by its connections and timers.

    Why it is still long: it keeps the paths that share the worker's replica, subscription
    index, counters and bus (subscribe, publish and sequencing, the bus conversation with the
    other workers and the agent, readiness); the parts that stand alone are modules of this
    package (fan-out, timer wheel, streams, admission, forwards) and it only ties them.
    """

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
        self.forwards = Forwards()
        self.inflight = self.forwards.inflight  # read by the connections (backpressure)
        self.held = self.forwards.held
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
            config.max_cached_messages_per_subject if guaranteed else 0,
            float(config.cache_expire_time),
            keep_size=0 if guaranteed else config.max_cached_messages_per_subject,
        )
        self._partial: dict[tuple[int, str], list[Entry]] = {}
        self.connections: set[Client] = set()
        # a session protocol that keeps state in the replica (MQTT) hears every message under its prefix (and
        # every snapshot a merge put there): the subject and its content
        self.watch: tuple[str, Callable[[str, bytes], None]] | None = None
        self.stats = Stats()
        self.batching_time = config.batching_time / 1000.0
        self.fanout = FanOut(loop, self.stats, self.snapshot_frame, self.batching_time)
        self.index = self.fanout.index
        self.wheel = TimerWheel()
        self.stream_registry = StreamRegistry(worker)
        self.streams = self.stream_registry.streams
        self.rate = ConnectionRate(config.max_connection_rate_per_address)
        self.admission = SessionAdmission(config.admission_rate)
        self._admission(config)
        self.authorizer: Authorizer = self.gatekeeper
        self._in_order = InOrder(loop)
        self.access_log = access_log
        self.message_log = message_log
        self.max_message_size = config.message_size_limit
        # protocol version 3: the longest this server stays silent on a connection (0: no promise), and the
        # NOTIFY that breaks a silence, built once
        # at least KEEPALIVE_FLOOR_MS: the checks run on the 1-second timer wheel, so the longest silence is
        # about a third of it plus a second, which must stay well inside what the client waits
        keepalive = config.server_keep_alive_ms
        self.keepalive_ms = max(keepalive, KEEPALIVE_FLOOR_MS) if keepalive else 0
        self.keepalive_frame = build_frame(OP_BINARY, encode_notify(NotifyCode.KEEPALIVE, ""))
        self.batching_size = config.batching_size
        self.max_pending = config.max_pending_output
        self.drop_slow = config.slow_consumer_policy.value == "Drop"
        self._sessions = 0
        # a restarted worker keeps its index but must not reuse its predecessor's session ids
        self._session_prefix = f"{epoch}-{worker}." + str(incarnation) if incarnation else f"{epoch}-{worker}"
        self._snapshot_frames: dict[str, tuple[int, bytes]] = {}
        # initial_frames of this loop turn: (subject, position asked, replica's position) -> (frames, recovered)
        self._initial: dict[tuple[str, tuple[int, int] | None, tuple[int, int]], tuple[tuple[bytes, ...], int]] = {}
        self._tick: asyncio.TimerHandle | None = None
        self._timer_error_logged: dict[str, float] = {}
        self._closed = False
        self.draining = ""  # why, while the server drains its clients before it stops
        self.on_tick: list[Callable[[], None]] = []
        self.denied_reasons: dict[str, int] = {}
        self._interest_dirty: set[str] = set()
        self.listener_connections: dict[str, int] = {}

    # --- lifecycle ------------------------------------------------------------------

    def reconfigure(self, config: Config) -> None:
        """SIGHUP: a configuration whose live keys (migratory/reload.py) changed, for requests from now on:
        entitlement, the publish address list, slow-consumer limits. Connections and subscriptions stay."""
        self.config = config
        replaced = self.authorizer is self.gatekeeper
        self._admission(config)
        if replaced:  # a hook set by an embedding application stays
            self.authorizer = self.gatekeeper
        self.max_pending = config.max_pending_output
        self.drop_slow = config.slow_consumer_policy.value == "Drop"

    def _admission(self, config: Config) -> None:
        """The configured entitlement and publish address list, behind the gatekeeper."""
        self.entitlement = build_entitlement(
            config.entitlement,
            config.entitlement_allow_token,
            config.entitlement_jwt_secret,
            config.entitlement_jwt_public_key,
            config.entitlement_custom_class,
        )
        self.gatekeeper = Gatekeeper(self.entitlement, AddressList(config.publish_allow_from))
        self.async_entitlement = isinstance(self.entitlement, CustomEntitlement) and self.entitlement.is_async

    def start(self) -> None:
        """Start the housekeeping tick."""
        self._tick = self.loop.call_later(1.0, self._housekeeping)

    def new_session(self) -> int:
        """A connection number; :meth:`session_name` turns it into the logged session id."""
        self._sessions += 1
        return self._sessions

    def session_name(self, number: int) -> str:
        return f"{self._session_prefix}-{number}"

    def register(self, conn: Client) -> None:
        self.connections.add(conn)

    def admit(self, address: str, now: float) -> bool:
        """Token bucket per client address (``MaxConnectionsPerSecondPerAddress``)."""
        return self.rate.admit(address, now)

    def unregister(self, conn: Client) -> None:
        """Forget a closed connection, its timer and its subscriptions."""
        self.connections.discard(conn)
        self.stream_registry.forget(conn)
        if conn.wheel_at:
            self.wheel.unschedule(conn)
        subjects = subject_set_items(conn.subscriptions)
        conn.subscriptions = ()
        self.stats.subscriptions -= len(subjects)
        for subject in subjects:
            if subject[0] == "\x00":
                self.fanout.patterns.remove(subject, conn)
                continue
            self.index.remove(subject, conn)
            self._interest_changed(subject)

    async def shutdown(self, timeout: float = 2.0) -> None:
        """Close every connection politely (close frame 1001), then stop timers."""
        self._closed = True
        for conn in list(self.connections):
            conn.shutdown()
        self.fanout.flush_dirty()
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

    async def drain(self, seconds: float) -> None:
        """Lame duck (docs/operations.md, "Draining"): with the listeners closed, /health says draining and the
        clients are sent to the other members a few at a time over at most ``seconds`` (never slower than
        DRAIN_FLOOR a second), so the survivors take them in as a trickle, not a storm."""
        self.draining = "draining: this server is stopping; its clients are moving to other members"
        clients = list(self.connections)
        if not clients or seconds <= 0:
            return
        rate = max(len(clients) / seconds, DRAIN_FLOOR)
        started = self.loop.time()
        sent = 0
        log.info("worker %d: draining %d clients over %.1f s at most", self.worker, len(clients), len(clients) / rate)
        while sent < len(clients):
            due = min(len(clients), int((self.loop.time() - started) * rate) + 1)
            for conn in clients[sent:due]:
                if conn in self.connections:
                    conn.send_away(self.draining)
            sent = due
            self.fanout.flush_dirty()
            if sent < len(clients):
                await asyncio.sleep(DRAIN_STEP)
        deadline = self.loop.time() + 1.0  # their closes written
        while self.connections and self.loop.time() < deadline:
            await asyncio.sleep(0.02)

    def send_away(self, reason: str) -> None:
        """The member cannot serve (docs/cluster.md, "An isolated member"): every client is closed with a reason
        it acts on at once (WebSocket 1013, MQTT 5 DISCONNECT 0x9C), and reconnects to another member."""
        clients = list(self.connections)
        for conn in clients:
            conn.send_away(reason)
        self.fanout.flush_dirty()
        if clients:
            log.warning("worker %d: %s: sent %d clients to the other members", self.worker, reason, len(clients))

    # --- HTTP streams -----------------------------------------------------------------

    def open_stream(self, conn: Client) -> str:
        """Register an HTTP stream; its id names this worker and is unguessable (it lets one act as the client)."""
        return self.stream_registry.open(conn)

    def stream_input(self, stream: str, payload: bytes) -> bool:
        """A POSTed native message for stream ``stream``: feed it here, or relay it to the worker that holds it."""
        worker = StreamRegistry.worker_of(stream)
        if worker is None:
            return False
        if worker != self.worker:
            if self.bus is None or worker >= self.workers:
                return False
            target = self.agent if self.cluster else worker
            return self.bus.send(target, Relay(worker, stream, payload))
        return self.stream_registry.input(stream, payload)

    # --- timers -----------------------------------------------------------------------

    def schedule(self, conn: Client, when: float) -> None:
        """Have ``conn.on_timer`` called at (about) loop time ``when``, at 1 s granularity."""
        self.wheel.schedule(conn, when)

    def _housekeeping(self) -> None:
        """The one-second tick. No failure of one duty may stop the others, or the tick itself."""
        try:
            now = self.loop.time()
            if now - self._housekept > WORKER_PAUSE:
                # this worker did not run (SIGSTOP, a frozen VM): what the agent said before is no evidence of
                # what the node can do now; the next ClusterInfo decides
                self._agent_said = -1e9
            self._housekept = now
            for conn in self.wheel.due(now):
                if conn.open:
                    self._guard("connection timer", conn.on_timer, now)
            for writer in (self.access_log, self.message_log):
                if writer is not None:
                    self._guard(f"writing {writer.path.name}", writer.flush)
            if self.forwards.waiting:
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
        self, conn: Client, subject: str, conflation_ms: int, decided: Decision | bool = False
    ) -> tuple[Status, str]:
        """Subscribe ``conn``. Returns (status, reason).

        ``decided`` carries an entitlement decision already awaited (asynchronous
        custom entitlement); by default the entitlement is asked here.
        """
        reason = self.check_subject(subject)
        if reason is not None:
            self.deny(conn.origin(), "subscribe", "invalid_subject", reason, subject)
            return Status.INVALID_SUBJECT, reason
        if subject.startswith(PRIVATE_PREFIX):
            reason = f"subjects under {PRIVATE_PREFIX} are the server's private state"
            self.deny(conn.origin(), "subscribe", "reserved_subject", reason, subject)
            return Status.DENIED, reason
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
                guaranteed=snapshot.guaranteed,
            ),
        )
        self._snapshot_frames[subject] = (snapshot.seq, frame)
        return frame

    def subscribe_pattern(self, conn: Client, key: str, pattern: tuple[str, ...]) -> tuple[Status, str]:
        """A wildcard subscription (MQTT), already entitled by the session; ``key`` names it (NUL-led)."""
        if (
            not subject_set_contains(conn.subscriptions, key)
            and subject_set_len(conn.subscriptions) >= self.config.max_subscriptions_per_client
        ):
            reason = f"MaxSubscriptionsPerClient ({self.config.max_subscriptions_per_client}) reached"
            self.deny(conn.origin(), "subscribe", "subscription_limit", reason, key[1:])
            return Status.LIMIT_EXCEEDED, reason
        if not subject_set_contains(conn.subscriptions, key):
            self.stats.subscriptions += 1
        key = sys.intern(key)
        self.fanout.patterns.add(key, pattern, conn)
        conn.subscriptions = subject_set_add(conn.subscriptions, key)
        self.access("subscribe", conn, subject=key[1:], conflation_ms=0)
        return Status.OK, ""

    def hold_marker(self, conn: Client, subject: str, held: bool) -> None:
        """A private marker ``conn`` stands for (an MQTT shared subscription group here, subjects.SHARE_PREFIX):
        counted in this worker's interest, which its peers hear; never published."""
        if held:
            self.index.add(subject, conn, 0)
        else:
            self.index.remove(subject, conn)
        self._interest_changed(subject)

    def matching_subjects(self, pattern: tuple[str, ...]) -> list[str]:
        """The subjects with a snapshot here that ``pattern`` matches (what a wildcard subscription gets first)."""
        return [s for s in self.replica.subjects() if subject_matches(pattern, s) and not s.startswith(PRIVATE_PREFIX)]

    def unsubscribe(self, conn: Client, subject: str) -> bool:
        conn.subscriptions, found = subject_set_remove(conn.subscriptions, subject)
        if not found:
            return False
        self.stats.subscriptions -= 1
        if subject[0] == "\x00":  # a wildcard pattern's key (subscribe_pattern)
            self.fanout.patterns.remove(subject, conn)
            self.access("unsubscribe", conn, subject=subject[1:])
            return True
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
        if message.subject.startswith(RESERVED_PREFIX) or _is_sys_subject(message.subject):
            reason = (
                f"subjects under {RESERVED_PREFIX} and /$SYS are the server's own (monitoring, MQTT's $SYS); "
                "clients cannot publish there"
            )
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
                self._in_order.run(origin.session, self._publish_after_decision(message, origin, reply, start))
                return
        else:
            denial = self.authorizer.check_publish(origin, message.subject)
        if denial is not None:
            self.deny(origin, "publish", denial[0], denial[1], message.subject)
            reply(PublishResult(Status.DENIED, denial[1], denial[0]))
            return
        self._route(message, origin, reply, start)

    def publish_internal(
        self,
        subject: str,
        content: bytes,
        fields: Mapping[str, str],
        qos: QoS = QoS.STANDARD,
        reply: Reply | None = None,
    ) -> None:
        """The server's own publication (monitoring, MQTT session records): no entitlement."""
        message = Message(subject, content, fields, qos=qos)
        self._route(message, INTERNAL, reply or (lambda result: None), time.perf_counter_ns())

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
        return await custom_decision(self.entitlement, method, origin, subject)

    def in_order(self, key: str, step: Coroutine[Any, Any, None]) -> None:
        """Run ``step`` after every earlier step of the same client (its requests keep their order)."""
        self._in_order.run(key, step)

    def _route(self, message: Message, origin: Origin, reply: Reply, start: int) -> None:
        """Sequence here, or forward to the subject's coordinator (a worker, or the member agent)."""
        if self.cluster:
            coordinator = self.agent
            if not message.publish_id:  # a retry inside the cluster must not number it twice
                publish_id = f"{self._id_prefix}/{origin.session}/{self.forwards.next_id()}"
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
        request = self.forwards.next_id()
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
        self.forwards.add(request, reply, self.loop.time())

    def _logged_reply(self, message: Message, origin: Mapping[str, str], start: int, reply: Reply) -> Reply:
        """In a cluster the publishing worker logs the publication once the coordinator answered."""

        def logged(result: PublishResult) -> None:
            self._log_publish(message, origin, result, start, len(message.content) + len(message.subject) + 16)
            reply(result)

        return logged

    def sequence(self, message: Message, origin: Mapping[str, str], start: int) -> PublishResult:
        """Coordinating worker: number, snapshot, deliver here, broadcast to the other workers, log."""
        subject = message.subject
        guaranteed = message.qos == QoS.GUARANTEED
        seq = self.replica.next_seq(subject)
        entry = Entry(self.epoch, seq, message.content, message.fields, message.retained, "", guaranteed)
        self.replica.apply(subject, entry, self.loop.time())
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
            self.forwards.answer(
                frame.request,
                PublishResult(Status(frame.status), frame.reason, "", frame.recipients, frame.seq, frame.epoch),
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
            was = self.cluster_info.get("isolated", "")
            try:
                self.cluster_info = dict(json.loads(frame.document))
            except (ValueError, TypeError):
                self.cluster_info = {}
            isolated = self.cluster_info.get("isolated", "")
            if isolated and not was:
                self.send_away(str(isolated))

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
            watch = self.watch
            if watch is not None and state.subject.startswith(watch[0]):
                snapshot = self.replica.get(state.subject)
                watch[1](state.subject, snapshot.content if snapshot is not None else b"")
            self.resync(state.subject)

    def _state_bytes(self, subjects: list[str]) -> Iterator[bytes]:
        """Our state of ``subjects`` as it is when each is read (the bus renders it as the peer takes it)."""
        for subject in subjects:
            state = self.replica.sync(subject)
            if state is not None:
                for frame in sync_frames(state):
                    yield encode(frame)

    def on_link_up(self, peer: int) -> None:
        """A (re)started peer: send it our whole state before anything else."""
        if self.bus is None:
            return
        self.bus.send_stream(peer, self._state_bytes(private_first(self.replica.subjects())))
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
            self.forwards.fail_all("the member agent restarted; retry with the same publish id")

    def _interest_changed(self, subject: str) -> None:
        """Subscriber counts go to the peers once per loop turn, whatever the number of (un)subscriptions."""
        if self.bus is None:
            return
        if not self._interest_dirty:
            self.loop.call_soon(self._flush_interest)
            self.fanout.before_flush = self._flush_interest
        self._interest_dirty.add(subject)

    def _flush_interest(self) -> None:
        """The changed counts, written to the peers now: this runs before the clients' replies are written, so
        a subscriber told OK is known to the coordinating worker before it can publish (else, on a busy machine,
        the publication through another worker came first and was answered NO_SUBSCRIBER)."""
        self.fanout.before_flush = None
        dirty, self._interest_dirty = self._interest_dirty, set()
        if self.bus is not None and dirty:
            for subject in dirty:
                self.bus.broadcast(Interest(subject, self.index.count(subject)))
            self.bus.flush()

    def publish_started(self, session: Publisher) -> None:
        """A client's publication enters: past its connection's or this worker's budget, stop reading it."""
        self.forwards.started(session)

    def publish_done(self, session: Publisher) -> None:
        """A publication was answered: read the held publishers again once the budgets are half free."""
        self.forwards.done(session)

    def forget_session(self, session: Publisher) -> None:
        self.forwards.forget(session)

    def _expire_forwards(self, now: float) -> None:
        alive = self.cluster and self.bus is not None and self.bus.linked(self.agent)
        self.forwards.expire(now, alive and now - self._agent_said <= AGENT_SILENCE)

    # --- fan-out ----------------------------------------------------------------------

    def deliver(self, subject: str, entry: Entry, guaranteed: bool) -> tuple[int, int]:
        """Queue one message for every local subscriber; return (recipients, frame size)."""
        watch = self.watch
        if watch is not None and subject.startswith(watch[0]):
            watch[1](subject, entry.content)
        return self.fanout.deliver(subject, entry, guaranteed)

    def resync(self, subject: str) -> None:
        """The subject's history was replaced: its subscribers get the snapshot, flagged as a resync."""
        self.fanout.resync(subject)

    def initial_frames(self, conn_version: int, subject: str, position: tuple[int, int] | None) -> Sequence[bytes]:
        """What a new subscription gets first: the snapshot, or (version 2, with a position) recovery.

        Built once per loop turn for every client asking the same subject from the same
        position (the reconnect storm after a member's death: thousands of clients of one
        subject at once), and shared: the frames are immutable bytes.
        """
        key = (subject, position, self.replica.position(subject))
        built = self._initial.get(key)
        if built is None:
            built = self._build_initial(subject, position)
            if not self._initial:
                self.loop.call_soon(self._initial.clear)  # the replica moves on between turns
            self._initial[key] = built
        else:
            self.stats.recoveries_shared += 1
        frames, recovered = built
        self.stats.messages_recovered += recovered
        return frames

    def _build_initial(self, subject: str, position: tuple[int, int] | None) -> tuple[tuple[bytes, ...], int]:
        """The frames of :meth:`initial_frames` and how many of them are recovered messages."""
        snapshot = self.snapshot_frame(subject)
        if position is None:
            return ((snapshot,) if snapshot is not None else ()), 0
        recovery = self.replica.recover(subject, *position)
        if recovery.kind is RecoveryKind.RESYNC:
            resync = build_frame(OP_BINARY, encode_notify(NotifyCode.DATA_RESYNC, subject))
            return ((resync, snapshot) if snapshot is not None and recovery.snapshot is not None else (resync,)), 0
        frames = [
            build_frame(
                OP_BINARY,
                encode_delivery(
                    subject,
                    e.content,
                    e.fields,
                    e.seq,
                    e.epoch,
                    retained=e.retained,
                    guaranteed=e.guaranteed,
                    recovered=True,
                ),
            )
            for e in recovery.entries
        ]
        frames.append(build_frame(OP_BINARY, encode_notify(NotifyCode.DATA_SYNC, subject)))
        return tuple(frames), len(recovery.entries)

    # --- logs -----------------------------------------------------------------------

    def access(self, event: str, conn: Client, **fields: Any) -> None:
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
        """What /health answers: :attr:`ready`, and in Guaranteed mode a quorum and a place in the table; never
        while draining (a load balancer takes the server out)."""
        return self.ready and not self.draining and (not self.cluster or bool(self.cluster_info.get("healthy", True)))

    def not_ready_reason(self) -> str:
        if self.draining:
            return self.draining
        if self.ready:
            return "" if self.healthy else str(self.cluster_info.get("reason", ""))
        if self.cluster_info.get("isolated"):
            return str(self.cluster_info["isolated"])
        if self.bus is None or not self.bus.linked(self.agent):
            return "this worker is not linked to the member agent"
        if self.loop.time() - self._agent_said > AGENT_SILENCE:
            return f"no word from the member agent for over {AGENT_SILENCE:.1f} s"
        return str(self.cluster_info.get("reason") or "synchronising with the cluster")

    def health(self) -> Mapping[str, Any]:
        self.count_replica()  # the monitor's copy is up to a second old; a probe right after a sync must see it
        healthy = self.healthy
        document: dict[str, Any] = {
            "status": "ok" if healthy else "draining" if self.draining else "syncing",
            "ready": healthy,
            "epoch": self.epoch,
            "worker": self.worker,
            "pid": os.getpid(),
            "workers": self.workers,
            **self.stats.as_dict(),
        }
        if self.cluster:
            document["cluster"] = self.cluster_info
        if not healthy and (self.cluster or self.draining):
            document["reason"] = self.not_ready_reason()
        return document


def _is_sys_subject(subject: str) -> bool:
    """Whether a subject is MQTT's ``$SYS`` (the server's statistics), in its plain or escaped form."""
    if not (subject.startswith("/$") or subject.startswith("/~/~$")):
        return False
    return is_sys(subject_to_topic(subject))
