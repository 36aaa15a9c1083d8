"""An MQTT 3.1.1 or 5.0 client: a session protocol beside the native one (docs/mqtt.md).

The same engine serves it: its subscriptions sit in the engine's index (wildcards in the
fan-out's pattern index), its publications are numbered by the subject's coordinator like any
other, and what reaches it is the engine's one frame per publication, turned into a PUBLISH
here. The conversion is cached for the frame being fanned out (the last one seen), so a
message reaching many MQTT subscribers is decoded once and, for QoS 0 without per-client
properties, encoded once.

One class carries TCP (``ListenMqtt``), TLS (``ListenMqttEncrypted``, the lean record layer
under it) and WebSocket (``/mqtt`` on the client listeners, subprotocol ``mqtt``: the HTTP
connection hands its transport over after the upgrade). Like the native connection it has no
task or timer of its own: the engine's timer wheel drives the CONNECT deadline and keep-alive.

Publications are acknowledged in the order they arrived (3.1.1 requires it; 5.0 clients expect
it). A publication the cluster could not take (FAILED, a coordinator moving) is never
acknowledged: the connection closes (version 5: DISCONNECT "server unavailable") and the client
sends it again with DUP set, which is MQTT's at-least-once contract.
"""

from __future__ import annotations

import asyncio
import time
import zlib
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from typing import Any, cast

from migratory import mqtt as m
from migratory import protocol as p
from migratory.message import Message, QoS
from migratory.mqttfields import RESERVED, from_fields, published_qos, to_fields
from migratory.server.engine.core import Engine, Origin, PublishResult
from migratory.server.engine.types import Client
from migratory.server.sessions.base import ConnectionBase
from migratory.server.sessions.mqttshare import ShareGroups
from migratory.server.sessions.mqttstore import Record, SessionStore
from migratory.subscriptions import SubjectSet
from migratory.topics import (
    SHARE,
    Filter,
    TopicError,
    parse_filter,
    parse_shared,
    subject_matches,
    subject_to_topic,
    topic_levels,
    topic_to_subject,
)
from migratory.websocket import (
    CLOSE_NORMAL,
    OP_BINARY,
    OP_CLOSE,
    OP_PING,
    OP_PONG,
    FrameParser,
    WebSocketError,
    build_close,
    build_frame,
    frame_payload,
)

__all__ = ["MqttConnection", "mqtt_connection"]

_CONNECTING = 0
_CONNECTED = 1
_CLOSING = 2
_CLOSED = 3

_NO_LIMITS = (65535, 0)

RECORDED_QOS1 = 1000
"""QoS 1 messages in flight a session record lists, with their packet ids (resent under them when the session
resumes elsewhere; beyond, under new ones). Every QoS 2 one is listed: exactly once depends on it."""

TOPIC_ALIAS_MAXIMUM = 32
"""Topic aliases a version 5 client may set on this server (each costs one dict entry)."""

_FRAME_CACHE: list[Any] = [None, None, b"", b"", b"", {}, 0, 0]
"""[frame, its Delivery, its topic, its version 5 properties, its QoS 0 PUBLISH (3.1.1), its fields as user
properties, when it expires (ms, 0: never), the QoS it was published with]: the frame being fanned out now."""

EXPIRY_FIELD = "mqtt-expiry"
"""The field carrying an MQTT 5 message expiry: ``<unix ms>:<crc32 of the content>`` (docs/mqtt.md)."""

_STATUS_CODES = {
    p.Status.OK: m.Rc.SUCCESS,
    p.Status.NO_SUBSCRIBER: m.Rc.NO_MATCHING_SUBSCRIBERS,
    p.Status.DENIED: m.Rc.NOT_AUTHORIZED,
    p.Status.INVALID_SUBJECT: m.Rc.TOPIC_NAME_INVALID,
    p.Status.TOO_LARGE: m.Rc.IMPLEMENTATION_SPECIFIC,
    p.Status.LIMIT_EXCEEDED: m.Rc.QUOTA_EXCEEDED,
}
"""A publication's outcome as a PUBACK reason code (FAILED has none: the connection closes, the client resends)."""


class _SubOptions:
    """What a subscription asked for: granted QoS, its subscription identifier, retain-as-published.

    Shared: every client subscribed the same way to the same filter holds the same object
    (:meth:`of`), so a million subscribers of one topic cost one.
    """

    __slots__ = ("filter", "no_local", "qos", "rap", "sub_id")

    _shared: dict[tuple[str, int, int, bool, bool], _SubOptions] = {}

    def __init__(self, filt: Filter, qos: int, sub_id: int, rap: bool, no_local: bool = False) -> None:
        self.filter = filt
        self.qos = qos
        self.sub_id = sub_id
        self.rap = rap
        self.no_local = no_local

    @classmethod
    def of(cls, filt: Filter, qos: int, sub_id: int, rap: bool, no_local: bool = False) -> _SubOptions:
        key = (filt.key, qos, sub_id, rap, no_local)
        found = cls._shared.get(key)
        if found is None:
            if len(cls._shared) > 100_000:  # bounded: distinct filters beyond it are simply not shared
                return cls(filt, qos, sub_id, rap, no_local)
            found = cls._shared[key] = cls(filt, qos, sub_id, rap, no_local)
        return found


_Sent = tuple[bytes, str, int, int]
"""An unacknowledged delivery: (the packet sent again on reconnection, subject, epoch, seq)."""


def _qos_of(packet: bytes) -> int:
    """0, 1 or 2 for a PUBLISH; 3 for a PUBREL (the second half of a QoS 2 delivery)."""
    return (packet[0] >> 1) & 0x03 if packet[0] >> 4 == m.PUBLISH else 3


class _Flow:
    """The per-client state of QoS 1 and 2 and of version 5 extras, created on first use (idle clients have none)."""

    __slots__ = (
        "acks",
        "aliases",
        "awaiting_rel",
        "expiry",
        "held",
        "inflight",
        "next_id",
        "own",
        "positions",
        "qos1_in",
        "queue",
        "resend",
        "since",
        "unsure",
    )

    def __init__(self) -> None:
        # packet id -> (the PUBLISH as resent, with DUP, or for QoS 2 once PUBREC came, the PUBREL; its subject,
        # epoch and seq), awaiting PUBACK or PUBCOMP
        self.inflight: dict[int, _Sent] = {}
        # output waiting for the session record that names it to be stored (QoS 2 to a stored session, and what
        # follows it): (packet id, packet, the inflight entry it belongs to or None)
        self.held: list[tuple[int, bytes, _Sent | None]] = []
        # a resumed session's messages sent before and not acknowledged: (subject, epoch, seq) -> (their packet
        # id, their QoS), sent again under the same packet id with DUP [MQTT-4.4.0-1]
        self.resend: dict[tuple[str, int, int], tuple[int, int]] = {}
        self.unsure = False  # while a session resumes from a record its connection did not write last
        # QoS 1 and 2 deliveries beyond the client's receive maximum: (packet id, PUBLISH, subject, epoch, seq)
        self.queue: deque[tuple[int, bytes, str, int, int]] = deque()
        self.next_id = 0
        self.acks: deque[list[Any]] = deque()  # [packet id, kind, reason code or None while unanswered]
        self.awaiting_rel: set[int] = set()  # QoS 2 publications acknowledged with PUBREC, until PUBREL
        self.qos1_in = 0  # QoS 1 publications not yet acknowledged (with awaiting_rel: the receive maximum's count)
        self.aliases: dict[int, str] = {}
        # No Local: (subject, crc32 of the content) of this client's last 64 publications, not delivered back to
        # it; made by its first publication with a No Local subscription
        self.own: deque[tuple[str, int]] | None = None
        # a session kept beyond its connection (clean session 0, or a session expiry interval)
        self.expiry = 0  # seconds it outlives the connection
        self.since = 0.0  # when this connection took it (wall clock)
        self.positions: dict[str, tuple[int, int]] = {}  # subject -> the last QoS 1 or 2 message acknowledged


class MqttConnection(ConnectionBase, asyncio.Protocol):
    """One MQTT client connection; ``__slots__`` keep an idle one as small as a native one."""

    __slots__ = (
        "bytes_in",
        "client_id",
        "flow",
        "keep_alive",
        "last_rx",
        "level",
        "limits",
        "listener",
        "msgs_in",
        "options",
        "reader",
        "reason",
        "started",
        "state",
        "subscriptions",
        "token",
        "wheel_at",
        "will",
        "wsparser",
    )

    version = 2  # the engine sends NOTIFY_DATA_RESYNC and its snapshot: the snapshot becomes a retained PUBLISH

    scheme = "mqtt"  # "mqtt", "mqtts", "ws-mqtt" or "wss-mqtt": a class each (no slot per connection)

    def __init__(self, engine: Engine, listener: str) -> None:
        self.engine = engine
        self.listener = listener
        self.transport: asyncio.Transport | None = None
        self.state = _CONNECTING
        self.reader: m.PacketReader | None = None
        self.wsparser: FrameParser | None = None
        self.level = 4
        self.client_id = ""
        self.keep_alive = 0
        self.limits = _NO_LIMITS  # the client's receive maximum and maximum packet size (0: none)
        # its subscriptions' options: one (most clients subscribe once: no dict), or key -> options
        self.options: _SubOptions | dict[str, _SubOptions] | None = None
        self.flow: _Flow | None = None
        self.will: m.Will | None = None
        self.token = ""
        self.subscriptions: SubjectSet = ()
        self.pending: bytes | list[bytes] | None = None
        self.pending_bytes = 0
        self.paused = False
        self.sid = 0
        self.addr = ""
        self.port = 0
        self.reason = ""
        self.started = self.last_rx = 0.0
        self.msgs_in = self.msgs_out = self.bytes_in = self.bytes_out = 0
        self.wheel_at = 0

    # --- identity ---------------------------------------------------------------------

    @property
    def websocket(self) -> bool:
        return self.scheme.startswith("ws")

    @property
    def open(self) -> bool:
        return self.state < _CLOSING

    @property
    def session(self) -> str:
        return self.engine.session_name(self.sid)

    def origin(self) -> Origin:
        return Origin(self.addr, self.port, self.session, self.scheme, self.token, self.listener)

    def log_fields(self) -> dict[str, Any]:
        return {
            "session": self.session,
            "addr": self.addr,
            "port": self.port,
            "listener": self.listener,
            "protocol": self.scheme,
            "tls": self.scheme in ("mqtts", "wss-mqtt"),
            "client_id": self.client_id,
        }

    def __hash__(self) -> int:
        return id(self)

    # --- asyncio.Protocol -------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if not self.admitted(transport):
            self.state = _CLOSING
            return
        self._start(self.engine.loop.time())

    def adopt(self, transport: asyncio.Transport, addr: str, port: int, sid: int, rest: bytes) -> None:
        """MQTT over WebSocket: take over an upgraded HTTP connection's transport (and what followed the upgrade)."""
        self.transport = transport
        self.addr, self.port, self.sid = addr, port, sid
        self._start(self.engine.loop.time())
        transport.set_protocol(self)
        if rest:
            self.data_received(rest)

    def _start(self, now: float) -> None:
        engine = self.engine
        self.started = self.last_rx = now
        engine.register(cast(Client, self))
        engine.schedule(cast(Client, self), self._deadline())

    def connection_lost(self, exc: Exception | None) -> None:
        previous = self.state
        self.state = _CLOSED
        self.pending = None
        self.reader = None
        self.wsparser = None
        engine = self.engine
        if self.client_id:
            self._publish_will()
        if self.options is not None:
            self._leave_groups()
        engine.unregister(cast(Client, self))
        if engine.inflight or engine.held:
            engine.forget_session(self)
        if self.client_id:
            flow = self.flow
            if flow is not None and flow.since:  # a stored session: kept (open: false), or emptied
                SessionStore.of(engine).release(self, self.record(closed=True) if flow.expiry else None, write=True)
            else:
                SessionStore.of(engine).release(self, None, write=False)
            engine.stats.connections -= 1
            engine.stats.disconnections_total += 1
            engine.access(
                "disconnect",
                cast(Client, self),
                duration_ms=int((engine.loop.time() - self.started) * 1000),
                reason=self.reason or ("connection_lost" if previous != _CLOSING else "client_closed"),
                msgs_in=self.msgs_in,
                msgs_out=self.msgs_out,
                bytes_in=self.bytes_in,
                bytes_out=self.bytes_out,
            )

    def eof_received(self) -> bool | None:
        self.reason = self.reason or "client_closed"
        return None

    def data_received(self, data: bytes) -> None:
        if self.state >= _CLOSING:
            return
        self.last_rx = self.engine.loop.time()
        self.bytes_in += len(data)
        if self.websocket:
            self._ws_received(data)
            return
        self._mqtt_received(data)

    def _ws_received(self, data: bytes) -> None:
        parser = self.wsparser
        if parser is None:
            parser = self.wsparser = FrameParser(self.engine.max_message_size + 65536)
        try:
            frames = parser.feed(data)
        except WebSocketError as exc:
            self._refuse(m.Rc.MALFORMED, f"WebSocket: {exc.reason}", "malformed")
            return
        if parser.idle:
            self.wsparser = None
        for frame in frames:
            if self.state >= _CLOSING:
                return
            if frame.opcode == OP_BINARY:
                self._mqtt_received(frame.payload)
            elif frame.opcode == OP_PING:
                self._write_raw(build_frame(OP_PONG, frame.payload))
            elif frame.opcode == OP_CLOSE:
                self._write_raw(build_close(CLOSE_NORMAL))
                self.close("client_closed")
                return
            elif frame.opcode != OP_PONG:
                self._refuse(m.Rc.MALFORMED, "MQTT over WebSocket uses binary frames only", "malformed")
                return

    def _mqtt_received(self, data: bytes) -> None:
        reader = self.reader
        if reader is None:
            reader = self.reader = m.PacketReader(self._max_packet())
        try:
            packets = reader.feed(data)
        except m.MqttError as exc:
            self._refuse(exc.code, exc.reason, "message_too_big" if exc.code == m.Rc.PACKET_TOO_LARGE else "malformed")
            return
        if reader.idle:
            self.reader = None  # idle clients keep no reader
        self._packets(packets)

    def _max_packet(self) -> int:
        """The largest packet accepted: MessageSizeLimit for the payload, plus room for topic and properties."""
        return self.engine.max_message_size + 8192

    def _packets(self, packets: list[tuple[int, int, bytes]]) -> None:
        held = self.engine.held
        for i, (kind, flags, body) in enumerate(packets):
            if self.state >= _CLOSING:
                return
            if held and self in held:  # a publication before this one filled a budget: the rest waits
                held[self].extend(packets[i:])
                return
            self.msgs_in += 1
            try:
                if self.state == _CONNECTING:
                    if kind != m.CONNECT:
                        raise m.MqttError(m.Rc.PROTOCOL_ERROR, "the first packet must be CONNECT")
                    self._connect(m.decode_connect(flags, body))
                else:
                    self._packet(m.decode(kind, flags, body, self.level))
            except m.MqttError as exc:
                self._refuse(exc.code, exc.reason, "malformed")
                return

    # --- backpressure (engine.publish_started) ------------------------------------------

    def release_input(self, waiting: list[Any]) -> None:
        if self.transport is None or self.state != _CONNECTED:
            return
        if not self.paused:
            self.transport.resume_reading()
        if waiting:
            self.engine.loop.call_soon(self._packets, waiting)

    # --- CONNECT ------------------------------------------------------------------------

    def _connect(self, packet: m.Connect) -> None:
        engine = self.engine
        self.level = packet.level
        if not engine.ready:
            self._refuse_connect(m.Rc.SERVER_UNAVAILABLE, "this cluster member is synchronising; try another member")
            return
        wait = engine.admission.admit(engine.loop.time())
        if wait:  # (3.1.1: 0x03 server unavailable; MQTT 5 is also told the wait, as a Server Keep Alive)
            reason = f"this server admits {engine.config.admission_rate} new sessions a second; come back in {wait} s"
            self._refuse_connect(m.Rc.SERVER_BUSY, reason, {m.P_SERVER_KEEP_ALIVE: wait})
            return
        client_id = packet.client_id
        assigned = ""
        if not client_id:
            if not packet.clean and packet.level == 4:
                self._refuse_connect(m.Rc.CLIENT_ID_NOT_VALID, "an empty client identifier needs a clean session")
                return
            client_id = assigned = f"migratory-{self.session}"
        if len(client_id.encode()) > 256:
            self._refuse_connect(m.Rc.CLIENT_ID_NOT_VALID, "client identifiers are at most 256 bytes here")
            return
        if packet.props.get(m.P_AUTH_METHOD) is not None:
            self._refuse_connect(m.Rc.BAD_AUTH_METHOD, "enhanced authentication is not supported")
            return
        # the entitlement token: the password (a JWT, or EntitlementAllowToken), else the user name
        if packet.password:
            self.token = m.utf8(packet.password, "password") if _is_text(packet.password) else ""
        elif packet.username:
            self.token = packet.username
        if not self.token and not engine.config.mqtt_allow_anonymous:
            self._refuse_connect(m.Rc.NOT_AUTHORIZED, "anonymous connections are refused (MqttAllowAnonymous)")
            return
        denial = engine.entitlement.authenticate(self.token) if self.token else None
        if denial is not None:  # a bad credential is refused now, not at the first request
            code = m.Rc.NOT_AUTHORIZED if denial[0] == "expired" else m.Rc.BAD_USERNAME_PASSWORD
            self._refuse_connect(code, denial[1])
            return
        if packet.will is not None:
            try:
                topic_to_subject(packet.will.topic)
            except TopicError as exc:
                self._refuse_connect(m.Rc.TOPIC_NAME_INVALID, f"will: {exc.reason}")
                return
            self.will = packet.will
        receive_max = int(cast(int, packet.props.get(m.P_RECEIVE_MAX, 65535)))
        max_packet = int(cast(int, packet.props.get(m.P_MAX_PACKET, 0)))
        self.limits = (receive_max, max_packet) if (receive_max, max_packet) != _NO_LIMITS else _NO_LIMITS
        keep_alive = packet.keep_alive
        cap = engine.config.mqtt_max_keep_alive
        capped = bool(cap) and (keep_alive == 0 or keep_alive > cap)
        if capped and packet.level != 5:
            self._refuse_connect(m.Rc.CLIENT_ID_NOT_VALID, f"a keep-alive of at most {cap} s is required here")
            return
        self.keep_alive = cap if capped else keep_alive
        self.client_id = client_id  # not interned: the interpreter's table would cost more than it saves
        self.state = _CONNECTED
        expiry = int(cast(int, packet.props.get(m.P_SESSION_EXPIRY, 0))) if packet.level == 5 else 0
        if packet.level == 4 and not packet.clean:
            expiry = 0xFFFFFFFF
        expiry = min(expiry, engine.config.mqtt_session_expiry)
        store = SessionStore.of(engine)
        record = None
        unacked: dict[int, _Sent] = {}
        unsure = False
        self.started = engine.loop.time()  # from now on: when it took its client id (see since)
        if packet.clean:
            store.forget(self)
        else:
            local = store.live.get(client_id)  # taken over on this worker: its state is newer than its record
            record = local.record() if local is not None else None
            if isinstance(local, MqttConnection) and local.flow is not None:
                # what no cache holds, and the PUBRELs it is owed, move to this connection, to be sent again (a
                # PUBLISH with DUP set); the others are recovered from the cache (QoS 2 under the same packet ids)
                holds = engine.replica.holds
                unacked = {
                    i: sent for i, sent in local.flow.inflight.items() if _qos_of(sent[0]) == 3 or not holds(*sent[1:])
                }
                unacked.update((q[0], (_dup(q[1]), q[2], q[3], q[4])) for q in local.flow.queue if not holds(*q[2:]))
            if record is None:
                record = store.load(client_id)
                # its connection ended without writing it (a member's death, a takeover from afar): what was
                # sent since its last write is unknown, so every message recovered is flagged DUP
                unsure = record is not None and record.open
            if record is not None and record.expired(time.time()):
                record = None
        engine.stats.connections += 1
        engine.stats.connections_total += 1
        engine.access("connect", cast(Client, self), mqtt_level=packet.level, clean=packet.clean)
        props: m.Properties = {}
        if packet.level == 5:
            props = {
                m.P_MAX_PACKET: self._max_packet(),
                m.P_ALIAS_MAX: TOPIC_ALIAS_MAXIMUM,
                m.P_SHARED: 1,
                m.P_RETAIN_AVAILABLE: 1,
                m.P_WILDCARDS: 1,
                m.P_SUB_IDS: 1,
                m.P_RECEIVE_MAX: engine.config.mqtt_receive_maximum,
            }
            if capped:
                props[m.P_SERVER_KEEP_ALIVE] = cap
            if assigned:
                props[m.P_ASSIGNED_ID] = assigned
            if packet.props.get(m.P_SESSION_EXPIRY, 0) != expiry:
                props[m.P_SESSION_EXPIRY] = expiry  # capped by MqttSessionExpiry
        self._queue(m.encode_connack(packet.level, record is not None, 0, props))
        self._schedule_keepalive(self.last_rx)
        if expiry or not packet.clean:
            flow = self.flow or self._new_flow()
            flow.expiry = expiry
            flow.since = time.time()
            if record is not None:
                for packet_id, sent in unacked.items():  # first: older than anything recovered, ids kept
                    flow.inflight[packet_id] = sent
                    self._queue(sent[0])
                flow.unsure = unsure
                self._resume(record)
                flow.unsure = False
            store.claim(self)
        else:
            store.register(self, announce=not assigned)  # an id the server assigned is nobody else's

    def _refuse_connect(self, code: int, reason: str, props: m.Properties | None = None) -> None:
        """CONNACK with a refusal (its nearest 3.1.1 return code), then close."""
        self.engine.deny(self.origin(), "connect", "mqtt_connect", reason)
        if self.level == 5:
            self._queue(m.encode_connack(5, False, code, {**(props or {}), m.P_REASON: reason}))
        elif code in m.V3_CONNACK:
            self._queue(m.encode_connack(4, False, m.V3_CONNACK[code]))
        self.close("connect_refused")

    @property
    def owner(self) -> str:
        """This connection's name across the cluster (in its session record)."""
        return f"{SessionStore.of(self.engine).tag}/{self.sid}"

    @property
    def since(self) -> float:
        """When this connection took its client id (wall clock): the newer one of two keeps it."""
        flow = self.flow
        if flow is not None and flow.since:
            return flow.since
        return time.time() - (self.engine.loop.time() - self.started)  # no slot spent on it

    def record(self, *, closed: bool = False) -> Record | None:
        """The session as stored (docs/mqtt.md, "Sessions"); None for a session that ends with its connection."""
        flow = self.flow
        if flow is None or not flow.since or not flow.expiry:
            return None
        subs = [(o.filter.text, o.qos, o.sub_id, o.rap) for k, o in self._all_options().items() if k[0] != "\x01"]
        sent: list[tuple[int, str, int, int, int]] = []
        qos1 = 0
        for packet_id, (packet, subject, epoch, seq) in flow.inflight.items():
            kind = _qos_of(packet)
            if kind == 1:
                qos1 += 1
                if qos1 > RECORDED_QOS1:
                    continue
            sent.append((packet_id, subject, epoch, seq, kind))
        return Record(self.owner, flow.since, not closed, flow.expiry, time.time(), subs, dict(flow.positions), sent)

    def written(self) -> Callable[[PublishResult], None] | None:
        """What to do once the record being written now is stored: send what waited for it (:attr:`_Flow.held`)."""
        flow = self.flow
        if flow is None or not flow.held:
            return None
        held, flow.held = flow.held, []

        def stored(result: PublishResult) -> None:
            if self.state != _CONNECTED or self.flow is not flow:
                return  # what it named is sent again, from the record, on the next connection
            if result.status == p.Status.FAILED:
                flow.held[:0] = held  # tried again with the next write
                SessionStore.of(self.engine).mark(self)
                return
            for packet_id, packet, sent in held:
                if sent is None or flow.inflight.get(packet_id) is sent:
                    self._queue(packet)

        return stored

    def _resume(self, record: Record) -> None:
        """A stored session: its subscriptions again, then what its QoS 1 subscriptions missed, from the caches."""
        engine = self.engine
        flow = self.flow or self._new_flow()
        flow.positions = dict(record.pos)
        for packet_id, subject, epoch, seq, kind in record.sent:
            if packet_id in flow.inflight:
                continue  # moved from a connection on this worker
            if kind == 3:  # the client has it: only its PUBREL is owed
                rel = m.encode_ack(m.PUBREL, packet_id, self.level)
                flow.inflight[packet_id] = (rel, subject, epoch, seq)
                self._queue(rel)
            else:  # sent, perhaps received: sent again from the cache under the same packet id, with DUP
                flow.resend[(subject, epoch, seq)] = (packet_id, kind)
        conn = cast(Client, self)
        resumed: list[_SubOptions] = []
        for text, qos, sub_id, rap in record.subs:
            try:
                filt = parse_filter(text)
            except TopicError:
                continue
            if filt.subject is not None:
                status, _ = engine.subscribe(conn, filt.subject, 0)
            else:
                status, filt = self._subscribe_pattern(filt, False)
            if status != p.Status.OK:
                continue
            options = _SubOptions.of(filt, qos, sub_id, rap)
            self._set_options(filt.key, options)
            if qos:
                resumed.append(options)
        for options in resumed:
            filt = options.filter
            if filt.subject is not None:
                subjects = [filt.subject]
            else:
                assert filt.pattern is not None
                subjects = engine.matching_subjects(filt.pattern)
            for subject in subjects:
                if self._options_for(subject) is not options:
                    continue  # another of its subscriptions delivers this subject
                # the native recovery (version 2): the missed messages flagged recovered, or the snapshot; its
                # notices have no MQTT form and are skipped by _deliver
                for frame in engine.initial_frames(2, subject, flow.positions.get(subject, (0, 0))):
                    self._deliver(frame, options)
        for (subject, epoch, seq), (packet_id, kind) in flow.resend.items():
            if kind != 2:
                continue
            # gone from the cache (or no longer subscribed): released, so that the client's copy of the packet
            # id does not swallow a later message sent under it
            rel = m.encode_ack(m.PUBREL, packet_id, self.level)
            flow.inflight[packet_id] = (rel, subject, epoch, seq)
            self._queue(rel)
        flow.resend.clear()

    def taken_over(self) -> None:
        """Another connection came with this client identifier: this one ends (no will: the session lives on)."""
        self.will = None
        if self.level == 5:
            self._queue(m.encode_disconnect(m.Rc.SESSION_TAKEN_OVER, "another connection took this session over"))
        self.close("session_taken_over")

    # --- packets after CONNECT ------------------------------------------------------------

    def _packet(self, packet: m.Packet) -> None:
        if packet is None:  # PINGREQ
            self._queue(m.PINGRESP_PACKET)
        elif isinstance(packet, m.Publish):
            self._publish(packet)
        elif isinstance(packet, m.PubAck):
            self._ack_received(packet)
        elif isinstance(packet, m.Subscribe):
            if self.engine.async_entitlement:
                self.engine.in_order(self.session, self._subscribe_async(packet))
            else:
                self._subscribe(packet, None)
        elif isinstance(packet, m.Unsubscribe):
            codes = []
            for topic_filter in packet.filters:
                if topic_filter.startswith(SHARE):
                    shared = "\x01" + topic_filter
                    found = shared in self._all_options()
                    self._leave_groups(shared)
                    codes.append(m.Rc.SUCCESS if found else m.Rc.NO_SUBSCRIPTION_EXISTED)
                    continue
                try:
                    key = parse_filter(topic_filter).key
                except TopicError:
                    codes.append(m.Rc.TOPIC_FILTER_INVALID)
                    continue
                found = self.engine.unsubscribe(cast(Client, self), key)
                if found:
                    self._drop_options(key)
                    if self.flow is not None and self.flow.expiry:
                        SessionStore.of(self.engine).mark(self)
                codes.append(m.Rc.SUCCESS if found else m.Rc.NO_SUBSCRIPTION_EXISTED)
            self._queue(m.encode_unsuback(packet.packet_id, codes, self.level))
        elif isinstance(packet, m.Disconnect):
            expiry = packet.props.get(m.P_SESSION_EXPIRY)
            if isinstance(expiry, int):  # MQTT 5: the session's expiry, changed as it ends (3.14.2.2.2)
                flow = self.flow
                if expiry and (flow is None or not flow.expiry):
                    raise m.MqttError(m.Rc.PROTOCOL_ERROR, "a session expiry in DISCONNECT after 0 in CONNECT")
                if flow is not None and flow.since:
                    flow.expiry = min(expiry, self.engine.config.mqtt_session_expiry)
            if packet.code != 0x04:  # "disconnect with will message": the will is published
                self.will = None
            self.close("client_disconnected")
        elif isinstance(packet, m.Connect):  # decode() raises for a second CONNECT; kept for the type checker
            raise m.MqttError(m.Rc.PROTOCOL_ERROR, "a second CONNECT")

    # --- PUBLISH from the client ----------------------------------------------------------

    def _publish(self, packet: m.Publish) -> None:
        flow = self.flow  # made only when needed: a QoS 0 publisher keeps none
        topic = packet.topic
        if self.level == 5:
            alias = cast(int | None, packet.props.get(m.P_ALIAS))
            if alias is not None:
                flow = flow or self._new_flow()
                if not 0 < alias <= TOPIC_ALIAS_MAXIMUM:
                    raise m.MqttError(m.Rc.TOPIC_ALIAS_INVALID, f"topic alias {alias} (at most {TOPIC_ALIAS_MAXIMUM})")
                if topic:
                    flow.aliases[alias] = topic
                elif alias in flow.aliases:
                    topic = flow.aliases[alias]
                else:
                    raise m.MqttError(m.Rc.PROTOCOL_ERROR, f"topic alias {alias} was never set")
            elif not topic:
                raise m.MqttError(m.Rc.PROTOCOL_ERROR, "PUBLISH without a topic name or alias")
        if packet.qos == 2 and flow is not None and packet.packet_id in flow.awaiting_rel:
            self._queue(m.encode_ack(m.PUBREC, packet.packet_id, self.level))  # a resend: already taken
            return
        if "+" in topic or "#" in topic:  # [MQTT-3.3.2-2]: a malformed packet, not a refused topic
            raise m.MqttError(m.Rc.MALFORMED, f"topic name {topic!r} contains a wildcard (+ or #)")
        try:
            subject = topic_to_subject(topic)
        except TopicError as exc:
            self.engine.deny(self.origin(), "publish", "invalid_subject", exc.reason, "/" + topic)
            self._publish_refused(packet, m.Rc.TOPIC_NAME_INVALID, exc.reason)
            return
        fields = _user_fields(packet.props)
        if self.level == 5 or packet.retain or packet.qos == 2:
            fields.update(to_fields(packet.props, packet.payload, packet.retain, packet.qos))  # forwarded unaltered
        expiry = packet.props.get(m.P_EXPIRY)
        if isinstance(expiry, int):
            # when the message expires, and whose it is (a snapshot's fields are a union: an older message's
            # expiry must not apply to a newer content)
            fields[EXPIRY_FIELD] = f"{int(time.time() * 1000) + expiry * 1000}:{zlib.crc32(packet.payload)}"
        qos = QoS.GUARANTEED if packet.qos else QoS.STANDARD
        message = Message(subject, packet.payload, fields, packet.retain, qos)
        if self._no_local():
            flow = flow or self._new_flow()
            if flow.own is None:
                flow.own = deque(maxlen=64)
            flow.own.append((subject, zlib.crc32(packet.payload)))
        engine = self.engine
        if packet.qos == 0:
            engine.publish(message, self.origin(), self._qos0_answered)
            return
        flow = flow or self._new_flow()
        if self.level == 5 and flow.qos1_in + len(flow.awaiting_rel) >= engine.config.mqtt_receive_maximum:
            limit = engine.config.mqtt_receive_maximum
            raise m.MqttError(m.Rc.RECEIVE_MAXIMUM_EXCEEDED, f"more than {limit} QoS 1 and 2 publications in flight")
        entry: list[Any] = [packet.packet_id, m.PUBACK if packet.qos == 1 else m.PUBREC, None, ""]
        flow.acks.append(entry)
        if packet.qos == 2:
            flow.awaiting_rel.add(packet.packet_id)
        else:
            flow.qos1_in += 1
        engine.publish_started(self)

        def answered(result: PublishResult) -> None:
            engine.publish_done(self)
            if self.state >= _CLOSING:
                return
            if result.status == p.Status.FAILED:
                self._unavailable(result.reason)
                return
            entry[2] = _STATUS_CODES.get(result.status, m.Rc.UNSPECIFIED)
            entry[3] = result.reason
            self._send_acks(flow)

        engine.publish(message, self.origin(), answered)

    def _qos0_answered(self, result: PublishResult) -> None:
        if result.status == p.Status.FAILED and self.state < _CLOSING:
            self._unavailable(result.reason)  # nothing tells a QoS 0 publisher; its next try goes elsewhere

    def _publish_refused(self, packet: m.Publish, code: int, reason: str) -> None:
        """A publication refused before it reached the engine: the reason code (5), or the connection (3.1.1)."""
        if self.level == 4 or packet.qos == 0:
            self._refuse(code, reason, "invalid_subject")
            return
        flow = self.flow or self._new_flow()
        flow.acks.append([packet.packet_id, m.PUBACK if packet.qos == 1 else m.PUBREC, code, reason])
        if packet.qos == 1:
            flow.qos1_in += 1  # (counted down as it is sent)
        self._send_acks(flow)

    def _send_acks(self, flow: _Flow) -> None:
        """Acknowledge, in arrival order, every publication answered so far."""
        acks = flow.acks
        while acks and acks[0][2] is not None:
            packet_id, kind, code, reason = acks.popleft()
            if kind == m.PUBACK:
                flow.qos1_in -= 1
            if self.level == 4 and code >= 0x80:
                self.engine.deny(self.origin(), "publish", "mqtt_publish", reason)
                self._refuse(code, reason, "publish_refused")  # 3.1.1 has no negative acknowledgement
                return
            if kind == m.PUBREC and code >= 0x80:
                flow.awaiting_rel.discard(packet_id)
            self._queue(m.encode_ack(kind, packet_id, self.level, code if code != m.Rc.SUCCESS else 0, reason))

    def _unavailable(self, reason: str) -> None:
        """The cluster could not take a publication now: close without acknowledging it (the client resends)."""
        self.engine.deny(self.origin(), "publish", "failed", reason)
        if self.level == 5:
            self._queue(m.encode_disconnect(m.Rc.SERVER_UNAVAILABLE, f"{reason}; reconnect and resend"))
        self.will = None
        self.close("publish_failed")

    def _ack_received(self, packet: m.PubAck) -> None:
        flow = self.flow
        if packet.kind == m.PUBREL:
            known = flow is not None and packet.packet_id in flow.awaiting_rel
            if flow is not None:
                flow.awaiting_rel.discard(packet.packet_id)
            code = 0 if known or self.level == 4 else m.Rc.PACKET_ID_NOT_FOUND
            self._queue(m.encode_ack(m.PUBCOMP, packet.packet_id, self.level, code))
            return
        packet_id = packet.packet_id
        sent = flow.inflight.get(packet_id) if flow is not None else None
        if packet.kind == m.PUBREC and (sent is None or _qos_of(sent[0]) < 2):
            # a PUBREC of nothing this server has in flight: released, so that the client forgets it too
            code = m.Rc.PACKET_ID_NOT_FOUND if self.level == 5 else 0
            self._queue(m.encode_ack(m.PUBREL, packet_id, self.level, code))
            return
        if flow is None or sent is None:
            return  # an acknowledgement of nothing: ignored, as 5.0 section 4.3.2 allows
        qos = _qos_of(sent[0])
        if packet.kind == m.PUBREC:
            if qos == 3:
                self._queue(sent[0])  # PUBREC again: its PUBREL was lost
                return
            if packet.code >= 0x80:  # the client refused it: done, as with a PUBACK
                del flow.inflight[packet_id]
                self._acknowledged(flow, sent)
            else:
                rel = m.encode_ack(m.PUBREL, packet_id, self.level)
                released = flow.inflight[packet_id] = (rel, *sent[1:])
                self._acknowledged(flow, sent)
                # once the record says it was received: sent before, the client would forget the packet id, and a
                # member's death would bring the message back under it as a new one
                self._send_held(flow, packet_id, rel, released)
                return
        elif packet.kind != _ENDS.get(qos):
            raise m.MqttError(m.Rc.PROTOCOL_ERROR, f"{_ACK_NAMES[packet.kind]} for a {_SENT_NAMES[qos]} in flight")
        else:
            del flow.inflight[packet_id]
            if qos == 1:
                self._acknowledged(flow, sent)
            elif flow.expiry:
                SessionStore.of(self.engine).mark(self)  # the record's list of QoS 2 in flight changed
        while flow.queue and len(flow.inflight) < self.limits[0]:
            packet_id, packet_bytes, subject, epoch, seq = flow.queue.popleft()
            self._send_inflight(flow, packet_id, packet_bytes, subject, epoch, seq)

    def _acknowledged(self, flow: _Flow, sent: _Sent) -> None:
        """A stored session's client has a message: recovery resumes after it."""
        if flow.expiry:
            _, subject, epoch, seq = sent
            if seq > flow.positions.get(subject, (0, 0))[1]:
                flow.positions[subject] = (epoch, seq)
                SessionStore.of(self.engine).mark(self)

    def _send_inflight(self, flow: _Flow, packet_id: int, packet: bytes, subject: str, epoch: int, seq: int) -> None:
        sent = flow.inflight[packet_id] = (_dup(packet), subject, epoch, seq)
        if _qos_of(packet) == 2:
            self._send_held(flow, packet_id, packet, sent)  # sent once the record names it (see _Flow.held)
        elif flow.held:
            flow.held.append((packet_id, packet, None))  # in order behind what waits
        else:
            self._queue(packet)

    def _send_held(self, flow: _Flow, packet_id: int, packet: bytes, sent: _Sent) -> None:
        if not (flow.expiry and flow.since):
            self._queue(packet)  # a session that ends with its connection: nothing to store
            return
        flow.held.append((packet_id, packet, sent))
        SessionStore.of(self.engine).mark(self)

    def _new_flow(self) -> _Flow:
        self.flow = _Flow()
        return self.flow

    # --- SUBSCRIBE ------------------------------------------------------------------------

    async def _subscribe_async(self, packet: m.Subscribe) -> None:
        decisions: list[Any] = []
        for sub in packet.subscriptions:
            try:
                filt = parse_filter(sub.filter)
            except TopicError:
                decisions.append(False)
                continue
            decisions.append(
                await self.engine.custom_decision("authorize_subscribe", self.origin(), filt.entitlement_subject())
            )
        if self.open:
            self._subscribe(packet, decisions)

    def _subscribe(self, packet: m.Subscribe, decisions: list[Any] | None) -> None:
        engine = self.engine
        conn = cast(Client, self)
        sub_id = int(cast(int, packet.props.get(m.P_SUBSCRIPTION_ID, 0)))
        conflation = 0
        for name, value in cast(list[tuple[str, str]], packet.props.get(m.P_USER, [])):
            if name == "conflation" and value.isdigit():
                conflation = int(value)
        codes: list[int] = []
        granted_now: list[tuple[_SubOptions, list[str]]] = []
        retained: list[tuple[_SubOptions, list[str]]] = []
        for i, sub in enumerate(packet.subscriptions):
            decided = decisions[i] if decisions is not None else False
            if sub.filter.startswith(SHARE):
                codes.append(self._subscribe_shared(sub, sub_id, decided))
                continue
            try:
                filt = parse_filter(sub.filter)
            except TopicError as exc:
                engine.deny(self.origin(), "subscribe", "invalid_subject", exc.reason, sub.filter)
                codes.append(m.Rc.TOPIC_FILTER_INVALID)
                continue
            new = filt.key not in self._all_options()
            if filt.subject is not None:
                status, _ = engine.subscribe(conn, filt.subject, conflation, decided)
                subjects = [filt.subject]
            else:
                status, filt = self._subscribe_pattern(filt, decided)
                subjects = (
                    engine.matching_subjects(cast(tuple[str, ...], filt.pattern)) if status == p.Status.OK else []
                )
            if status != p.Status.OK:
                codes.append(
                    m.Rc.NOT_AUTHORIZED
                    if status == p.Status.DENIED
                    else m.Rc.QUOTA_EXCEEDED
                    if status == p.Status.LIMIT_EXCEEDED
                    else m.Rc.TOPIC_FILTER_INVALID
                )
                continue
            granted = sub.qos
            options = _SubOptions.of(filt, granted, sub_id, sub.retain_as_published, sub.no_local)
            self._set_options(filt.key, options)
            codes.append(granted)
            granted_now.append((options, subjects))
            if sub.retain_handling == 0 or (sub.retain_handling == 1 and new):
                retained.append((options, subjects))
        if self.level == 4:
            codes = [c if c < 0x80 else 0x80 for c in codes]  # 3.1.1 has one failure code
        self._queue(m.encode_suback(packet.packet_id, codes, self.level))
        flow = self.flow
        if flow is not None and flow.expiry:  # what a stored session will recover from: now
            replica = engine.replica
            for options, subjects in granted_now:  # the subjects each subscription of this packet matches
                if options.qos:
                    for subject in subjects:
                        flow.positions.setdefault(subject, replica.position(subject))
            SessionStore.of(engine).write(self)  # now: every worker is to keep what it subscribed to
        for options, subjects in retained:
            for subject in subjects:
                frame = engine.snapshot_frame(subject)
                if frame is not None:
                    self._deliver(frame, retained_for=options)

    def _subscribe_shared(self, sub: m.Subscription, sub_id: int, decided: Any) -> int:
        """``$share/{group}/{filter}``: entitled as the filter is, then a member of the group (mqttshare.py); no
        retained message is sent for it (MQTT 5 4.8.2). Its SUBACK code."""
        engine = self.engine
        origin = self.origin()
        try:
            filt = parse_shared(sub.filter)
        except TopicError as exc:
            engine.deny(origin, "subscribe", "invalid_subject", exc.reason, sub.filter)
            return m.Rc.TOPIC_FILTER_INVALID
        if decided is not False:
            denial = decided
        elif filt.subject is not None:
            denial = engine.authorizer.check_subscribe(origin, filt.subject)
        else:
            entitled, denial = _entitled(filt, lambda form: engine.authorizer.check_subscribe(origin, form))
            filt = Filter(filt.text, None, entitled.pattern)
            filt.key = "\x01" + filt.text
        if denial:
            engine.deny(origin, "subscribe", denial[0], denial[1], filt.entitlement_subject())
            return m.Rc.NOT_AUTHORIZED
        options = _SubOptions(filt, sub.qos, sub_id, sub.retain_as_published)
        status = ShareGroups.of(engine).join(self, filt.text, filt, options)
        if status != p.Status.OK:
            return m.Rc.QUOTA_EXCEEDED if status == p.Status.LIMIT_EXCEEDED else m.Rc.UNSPECIFIED
        self._set_options(filt.key, options)
        engine.access("subscribe", cast(Client, self), subject=filt.text, conflation_ms=0)
        return sub.qos

    def deliver_shared(self, frame: bytes, options: _SubOptions) -> None:
        """A message its shared subscription's group gave to this member (mqttshare.py)."""
        if self.state == _CONNECTED:
            self._deliver(frame, options)

    def _leave_groups(self, only: str | None = None) -> None:
        """Out of its shared subscriptions' groups (``only``: one of them); what it had not acknowledged goes to
        another member."""
        table = self._all_options()
        keys = [k for k in table if k[0] == "\x01" and (only is None or k == only)]
        if not keys:
            return
        flow = self.flow
        unacknowledged: set[tuple[str, int]] = set()
        if flow is not None:
            unacknowledged = {(s, q) for packet, s, _, q in flow.inflight.values() if _qos_of(packet) < 3}
            unacknowledged.update((q[2], q[4]) for q in flow.queue)
        groups = ShareGroups.of(self.engine)
        for key in keys:
            groups.leave(self, key[1:], unacknowledged)
            if only is not None:
                self._drop_options(key)

    def _subscribe_pattern(self, filt: Filter, decided: Any) -> tuple[p.Status, Filter]:
        engine = self.engine
        origin = self.origin()
        if decided is False:
            filt, denial = _entitled(filt, lambda form: engine.authorizer.check_subscribe(origin, form))
        else:
            denial = decided
        if denial:
            engine.deny(origin, "subscribe", denial[0], denial[1], filt.entitlement_subject())
            return p.Status.DENIED, filt
        parent = filt.parent()
        if parent is not None and engine.authorizer.check_subscribe(origin, parent) is not None:
            filt = filt.children_only()  # may read below the level, not the level itself
        assert filt.pattern is not None
        status, _ = engine.subscribe_pattern(cast(Client, self), filt.key, filt.pattern)
        return status, filt

    # --- output -------------------------------------------------------------------------

    def send(self, data: bytes) -> None:
        """A frame from the engine (a delivery, a snapshot, a notice): a PUBLISH, or nothing."""
        if self.state == _CONNECTED and data[0] & 0x0F == OP_BINARY:
            self._deliver(data, None)

    def _deliver(self, frame: bytes, retained_for: _SubOptions | None) -> None:
        cache = _FRAME_CACHE
        if cache[0] is not frame:
            payload = frame_payload(frame)
            if not payload or payload[0] != p.Op.MESSAGE:
                return  # NOTIFY, statuses and errors have no MQTT form
            delivery = p.decode_server(payload)
            assert isinstance(delivery, p.Delivery)
            topic = subject_to_topic(delivery.subject)
            expires = _expires(delivery)
            base: m.Properties = {}
            if delivery.fields:
                base = from_fields(delivery.fields, delivery.content)
                users = [(k, v) for k, v in delivery.fields.items() if k != EXPIRY_FIELD and k not in RESERVED]
                if users:
                    base[m.P_USER] = users
            props = m.encode_properties(base)
            published = published_qos(delivery.fields, delivery.content, delivery.guaranteed)
            cache[:] = [frame, delivery, topic, props, b"", base, expires, published]
        delivery = cast(p.Delivery, cache[1])
        topic = cast(str, cache[2])
        expires = cast(int, cache[6])
        remaining = 0
        if expires:  # MQTT 5 message expiry: never delivered late, and sent with what is left of it
            remaining = -(-(expires - int(time.time() * 1000)) // 1000)
            if remaining <= 0:
                return
        options = retained_for if retained_for is not None else self._options_for(delivery.subject)
        if options is None:
            return
        snapshot = delivery.snapshot
        if snapshot and not delivery.content and not _own_fields(delivery.fields):
            return  # an empty retained message clears the retained message (MQTT): nothing is sent
        if options.no_local and not snapshot and self.flow is not None and self.flow.own:
            mine = (delivery.subject, zlib.crc32(delivery.content))
            if mine in self.flow.own:
                self.flow.own.remove(mine)  # its own publication (MQTT 5 No Local)
                return
        retain = snapshot or (options.rap and delivery.retained)
        qos = min(options.qos, cast(int, cache[7]))  # the lower of the granted and the published QoS
        level = self.level
        flow = self.flow
        resent = 0  # a resumed session's message, sent before under this packet id
        if qos and delivery.recovered and flow is not None and flow.resend:
            resent = flow.resend.pop((delivery.subject, delivery.epoch, delivery.seq), (0, 0))[0]
        if level == 4 and qos == 0 and not retain:
            packet = cast(bytes, cache[4])
            if not packet:
                packet = cache[4] = m.encode_publish(4, topic, delivery.content)
        else:
            props = cast(bytes, cache[3])
            if level == 5:
                if retained_for is not None or not isinstance(self.options, dict):
                    sub_ids = [options.sub_id] if options.sub_id else []  # (a retained one: the subscription asking)
                else:
                    sub_ids = self._subscription_ids(delivery.subject, self.options)
                if sub_ids or remaining:  # else the frame's properties, encoded once for every subscriber
                    extra: m.Properties = {m.P_EXPIRY: remaining} if remaining else {}
                    props = m.encode_properties({**extra, **cast(m.Properties, cache[5])}, sub_ids)
            packet_id = resent or (self._next_packet_id() if qos else 0)
            dup = bool(resent) or (qos > 0 and delivery.recovered and flow is not None and flow.unsure)
            packet = m.encode_publish(level, topic, delivery.content, qos, retain, dup, packet_id, props)
        max_packet = self.limits[1]
        if max_packet and len(packet) > max_packet:
            self.engine.stats.messages_dropped += 1  # the client said it cannot take it (MQTT 5 section 3.1.2.11)
            return
        if qos:
            flow = flow or self._new_flow()
            subject, epoch, seq = delivery.subject, delivery.epoch, delivery.seq
            if resent:  # the record names it already: sent now
                flow.inflight[packet_id] = (packet, subject, epoch, seq)
            elif len(flow.inflight) >= self.limits[0]:
                flow.queue.append((packet_id, packet, subject, epoch, seq))
                if len(flow.queue) * len(packet) > self.engine.max_pending:
                    self._slow_consumer()
                return
            else:
                self._send_inflight(flow, packet_id, packet, subject, epoch, seq)
                return
        elif flow is not None:
            if flow.expiry and options.qos and not snapshot and not flow.queue:
                # a QoS 0 message a recovering subscription got: not sent again on its return, unless an older
                # one of its subject is unacknowledged (written with the next change; a member's death before
                # it may bring it again)
                subject, seq = delivery.subject, delivery.seq
                if seq > flow.positions.get(subject, (0, 0))[1] and all(
                    sent[1] != subject for sent in flow.inflight.values()
                ):
                    flow.positions[subject] = (delivery.epoch, seq)
            if flow.held:
                flow.held.append((0, packet, None))  # in order behind what waits for the record
                return
        self._queue(packet)

    def _no_local(self) -> bool:
        """Whether a subscription of this client has No Local (asked once per publication: no dict made)."""
        options = self.options
        if self.level != 5 or options is None:
            return False
        if isinstance(options, _SubOptions):
            return options.no_local
        return any(o.no_local for o in options.values())

    def _all_options(self) -> dict[str, _SubOptions]:
        options = self.options
        if options is None:
            return {}
        return {options.filter.key: options} if isinstance(options, _SubOptions) else options

    def _set_options(self, key: str, options: _SubOptions) -> None:
        current = self.options
        if current is None or (isinstance(current, _SubOptions) and current.filter.key == key):
            self.options = options
        else:
            table = self._all_options()
            if key[0] == "\x00" and key not in table:
                table = {key: options, **table}  # patterns first: a delivery looks at them only (see _matching)
            else:
                table[key] = options
            self.options = table

    def _drop_options(self, key: str) -> None:
        table = self._all_options()
        table.pop(key, None)
        self.options = None if not table else next(iter(table.values())) if len(table) == 1 else table

    def _options_for(self, subject: str) -> _SubOptions | None:
        options = self.options
        if options is None:
            return None
        if isinstance(options, _SubOptions):
            pattern = options.filter.pattern
            if options.filter.subject == subject or (pattern is not None and subject_matches(pattern, subject)):
                return options
            return None
        best = options.get(subject)  # and any pattern granting more: the highest QoS of them all (MQTT 5 3.3.4)
        for candidate in self._matching(subject, options):
            if best is None or candidate.qos > best.qos:
                best = candidate
        return best

    @staticmethod
    def _matching(subject: str, options: dict[str, _SubOptions]) -> Iterator[_SubOptions]:
        """Every pattern subscription of a client that matches ``subject`` (its exact one is found by key). The
        patterns come first in the table (:meth:`_set_options`): a client of many exact subjects is not scanned."""
        levels: list[str] | None = None
        for key, candidate in options.items():
            if key[0] != "\x00":
                return
            pattern = candidate.filter.pattern
            if levels is None:
                levels = topic_levels(subject)  # once, for every pattern
            if pattern is not None and subject_matches(pattern, subject, levels):
                yield candidate

    def _subscription_ids(self, subject: str, table: dict[str, _SubOptions]) -> list[int]:
        """The subscription identifiers of every subscription of this client matching ``subject`` (MQTT 5
        3.3.4: a message matching several goes once, with all of them)."""
        found = [table[subject]] if subject in table else []
        found.extend(self._matching(subject, table))
        return sorted({o.sub_id for o in found if o.sub_id})

    def _next_packet_id(self) -> int:
        flow = self.flow or self._new_flow()
        packet_id = flow.next_id
        for _ in range(65536):
            packet_id = packet_id % 65535 + 1
            if packet_id not in flow.inflight and not (flow.resend and _resent(flow, packet_id)):
                break
        flow.next_id = packet_id
        return packet_id

    _queue = ConnectionBase.queue_output  # an MQTT packet, queued like any output

    def flush(self) -> None:
        data = self.take_output()
        if data is not None:
            self._write_raw(build_frame(OP_BINARY, data) if self.websocket else data)

    def _write_raw(self, data: bytes) -> None:
        if self.transport is not None:
            self.transport.write(data)

    def _slow_consumer(self) -> None:
        engine = self.engine
        engine.stats.slow_consumers_disconnected += 1
        engine.deny(
            self.origin(),
            "frame",
            "slow_consumer",
            f"pending output exceeded MaxPendingOutput ({engine.max_pending} bytes)",
        )
        self.abort("slow_consumer")

    # --- closing ------------------------------------------------------------------------

    def _refuse(self, code: int, reason: str, reason_code: str) -> None:
        """A protocol violation: DISCONNECT with the reason code (5; CONNACK before CONNECT), then close."""
        self.engine.deny(self.origin(), "frame", reason_code, reason)
        if self.state == _CONNECTING:
            self._refuse_connect(code, reason)
            return
        if self.level == 5:
            self._queue(m.encode_disconnect(code, reason))
        self.close("protocol_error")

    def close(self, reason: str) -> None:
        """Flush what is pending, then close."""
        self.reason = self.reason or reason
        if self.state >= _CLOSING:
            return
        self.flush()
        if self.state == _CONNECTING:
            self.client_id = ""
        self.state = _CLOSING
        self.pending = None
        if self.transport is not None:
            if self.websocket:
                self.transport.write(build_close(CLOSE_NORMAL))
            self.transport.close()

    def abort(self, reason: str) -> None:
        self.reason = self.reason or reason
        self.pending = None
        if self.state < _CLOSING:
            self.state = _CLOSING
        if self.transport is not None:
            self.transport.abort()

    def shutdown(self) -> None:
        """Server shutdown: version 5 clients hear why."""
        if self.state == _CONNECTED and self.level == 5:
            self._queue(m.encode_disconnect(m.Rc.SERVER_SHUTTING_DOWN, "server shutdown"))
        self.will = None
        self.close("server_shutdown")

    def send_away(self, reason: str) -> None:
        """This member cannot serve: version 5 clients hear "use another server" (0x9C); the session, kept in
        the cluster, is resumed on the member they reach, and the will is not published (the client lives)."""
        if self.state == _CONNECTED and self.level == 5:
            self._queue(m.encode_disconnect(m.Rc.USE_ANOTHER_SERVER, reason[:100]))
        self.will = None
        self.close("sent_away")

    def _publish_will(self) -> None:
        """The last will: now, or after its delay interval (MQTT 5) unless the client id came back meanwhile."""
        will, self.will = self.will, None
        if will is None:
            return
        delay = int(cast(int, will.props.get(m.P_WILL_DELAY, 0)))
        flow = self.flow
        # the session's end publishes it, whichever comes first: now, for a session that ends with its connection
        delay = min(delay, flow.expiry if flow is not None else 0)
        if delay:
            store, client_id = SessionStore.of(self.engine), self.client_id

            def later() -> None:
                if client_id not in store.live:  # resumed on this worker: no will (MQTT 5 3.1.3.2.2)
                    self._send_will(will)

            self.engine.loop.call_later(delay, later)
            return
        self._send_will(will)

    def _send_will(self, will: m.Will) -> None:
        try:
            subject = topic_to_subject(will.topic)
        except TopicError:
            return
        fields = _user_fields(will.props)
        fields.update(to_fields(will.props, will.payload, will.retain, will.qos))
        qos = QoS.GUARANTEED if will.qos else QoS.STANDARD
        self.engine.publish(Message(subject, will.payload, fields, will.retain, qos), self.origin(), _ignore)

    # --- timers -------------------------------------------------------------------------

    def on_timer(self, now: float) -> None:
        engine = self.engine
        if self.state == _CONNECTING:
            if now >= self._deadline():
                engine.deny(
                    self.origin(), "connect", "handshake_timeout", "CONNECT not received within HandshakeTimeout"
                )
                self.abort("handshake_timeout")
            else:
                engine.schedule(cast(Client, self), self._deadline())
            return
        if self.state != _CONNECTED:
            return
        expiry = engine.entitlement.expires_at(self.token) if self.token else None
        if expiry and time.time() >= expiry:
            engine.deny(self.origin(), "connect", "entitlement", "the token has expired")
            if self.level == 5:
                self._queue(m.encode_disconnect(m.Rc.NOT_AUTHORIZED, "the token has expired"))
            self.close("token_expired")
            return
        if not self.keep_alive:
            if expiry:
                engine.schedule(cast(Client, self), now + max(1.0, expiry - time.time()))
            return
        if engine.held and self in engine.held:  # not read on purpose (backpressure): its silence is ours
            engine.schedule(cast(Client, self), now + self.keep_alive)
            return
        limit = self.last_rx + 1.5 * self.keep_alive
        if now >= limit:
            engine.deny(self.origin(), "frame", "keepalive_timeout", f"nothing received for 1.5 x {self.keep_alive} s")
            if self.level == 5:
                self._queue(m.encode_disconnect(m.Rc.KEEP_ALIVE_TIMEOUT, "keep-alive timeout"))
            self.close("keepalive_timeout")
            return
        if expiry:
            limit = min(limit, now + max(1.0, expiry - time.time()))
        engine.schedule(cast(Client, self), limit)

    def _deadline(self) -> float:
        """When a connection that sent no CONNECT is closed (HandshakeTimeout after it opened)."""
        return self.started + self.engine.config.handshake_timeout / 1000.0

    def _schedule_keepalive(self, now: float) -> None:
        expiry = self.engine.entitlement.expires_at(self.token) if self.token else None
        if self.keep_alive or expiry:
            self.engine.schedule(cast(Client, self), now + (1.5 * self.keep_alive if self.keep_alive else 1.0))


class _MqttTls(MqttConnection):
    __slots__ = ()
    scheme = "mqtts"


class _MqttWebSocket(MqttConnection):
    __slots__ = ()
    scheme = "ws-mqtt"


class _MqttSecureWebSocket(MqttConnection):
    __slots__ = ()
    scheme = "wss-mqtt"


_CLASSES: dict[str, type[MqttConnection]] = {
    "mqtt": MqttConnection,
    "mqtts": _MqttTls,
    "ws-mqtt": _MqttWebSocket,
    "wss-mqtt": _MqttSecureWebSocket,
}


def mqtt_connection(engine: Engine, listener: str, scheme: str) -> MqttConnection:
    """A new MQTT connection of ``scheme`` (mqtt, mqtts, ws-mqtt, wss-mqtt) on ``listener``."""
    return _CLASSES[scheme](engine, listener)


def _user_fields(props: m.Properties) -> dict[str, str]:
    """A publication's user properties as fields, without the names the server gives a meaning to."""
    fields = dict(cast(list[tuple[str, str]], props.get(m.P_USER, [])))
    for name in RESERVED.intersection(fields) if fields else ():
        del fields[name]
    fields.pop(EXPIRY_FIELD, None)
    return fields


def _own_fields(fields: Mapping[str, str]) -> bool:
    """Whether a message has fields of its own (not only the server's, which a snapshot's union keeps)."""
    return any(name != EXPIRY_FIELD and name not in RESERVED for name in fields) if fields else False


def _expires(delivery: p.Delivery) -> int:
    """When the delivered message expires (unix ms), 0 for never: its expiry field, if it is this content's."""
    value = delivery.fields.get(EXPIRY_FIELD)
    if not value:
        return 0
    when, _, crc = value.partition(":")
    if not (when.isdigit() and crc.isdigit()) or int(crc) != zlib.crc32(delivery.content):
        return 0  # another (older) message's, kept by the snapshot's union of fields
    return int(when)


def _ignore(result: PublishResult) -> None:
    return None


def _is_text(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


_ACK_NAMES = {m.PUBACK: "PUBACK", m.PUBREC: "PUBREC", m.PUBCOMP: "PUBCOMP"}
_ENDS = {1: m.PUBACK, 3: m.PUBCOMP}
"""What ends a delivery in flight: a QoS 1 PUBLISH's PUBACK, a PUBREL's PUBCOMP (a QoS 2 PUBLISH is not ended)."""
_SENT_NAMES = {1: "QoS 1 PUBLISH", 2: "QoS 2 PUBLISH", 3: "PUBREL"}


def _resent(flow: _Flow, packet_id: int) -> bool:
    """Whether a resumed session's ``packet_id`` still waits to be sent again (only while it resumes)."""
    return any(packet_id == sent[0] for sent in flow.resend.values())


def _dup(packet: bytes) -> bytes:
    """The same PUBLISH with the DUP flag: what is resent if the client comes back without acknowledging it."""
    return bytes((packet[0] | 0x08,)) + packet[1:]


def _entitled(filt: Filter, check: Callable[[str], Any]) -> tuple[Filter, Any]:
    """A pattern as the entitlement allows it: whole, kept to the plain or the escaped subjects (docs/mqtt.md,
    "Mapping") if only one form is entitled, or the denial of both."""
    plain, escaped = filt.entitlement_subjects()
    escaped_denial = check(escaped)
    if plain is None:
        return filt, escaped_denial
    plain_denial = check(plain)
    if plain_denial and not escaped_denial:
        return filt.restricted(plain=False), None
    if escaped_denial and not plain_denial:
        return filt.restricted(plain=True), None
    return filt, plain_denial
