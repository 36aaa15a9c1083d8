"""MQTT 3.1.1 and 5.0 packets, without I/O: a stream reader, decoders of what clients send,
encoders of what the server sends (OASIS MQTT 3.1.1 and MQTT Version 5.0).

Why our own and not a library's: the session lives on the worker's epoll set beside the native
protocol (migratory/server/sessions/mqtt.py) and keeps no reader or buffer while idle, the way
migratory/websocket.py does; the client libraries (paho, gmqtt) bring their own event loops.
Everything a client sends is checked as the specifications say a server must: a packet that
breaks a rule raises :class:`MqttError` with the reason code a version 5 client is told in
CONNACK or DISCONNECT (a version 3.1.1 client is simply disconnected, as 3.1.1 requires).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = [
    "CONNECT",
    "DISCONNECT",
    "PINGREQ",
    "PINGRESP_PACKET",
    "PUBACK",
    "PUBCOMP",
    "PUBLISH",
    "PUBREC",
    "PUBREL",
    "SUBSCRIBE",
    "UNSUBSCRIBE",
    "Connect",
    "Disconnect",
    "MqttError",
    "PacketReader",
    "PubAck",
    "Publish",
    "Rc",
    "Subscribe",
    "Subscription",
    "Unsubscribe",
    "Will",
    "decode",
    "decode_connect",
    "encode_ack",
    "encode_connack",
    "encode_disconnect",
    "encode_publish",
    "encode_suback",
    "encode_unsuback",
]

CONNECT, CONNACK, PUBLISH, PUBACK, PUBREC, PUBREL, PUBCOMP = 1, 2, 3, 4, 5, 6, 7
SUBSCRIBE, SUBACK, UNSUBSCRIBE, UNSUBACK, PINGREQ, PINGRESP, DISCONNECT, AUTH = 8, 9, 10, 11, 12, 13, 14, 15

PINGRESP_PACKET = b"\xd0\x00"

MAX_REMAINING = 268_435_455  # the largest four-byte Remaining Length
MAX_USER_PROPERTIES = 64
"""User properties accepted per packet: a property flood is refused, not stored."""


class Rc:
    """Reason codes (MQTT 5.0 section 2.4) the server uses, and the 3.1.1 CONNACK return codes."""

    SUCCESS = 0x00
    GRANTED_QOS_1 = 0x01
    GRANTED_QOS_2 = 0x02
    NO_MATCHING_SUBSCRIBERS = 0x10
    NO_SUBSCRIPTION_EXISTED = 0x11
    UNSPECIFIED = 0x80
    MALFORMED = 0x81
    PROTOCOL_ERROR = 0x82
    IMPLEMENTATION_SPECIFIC = 0x83
    UNSUPPORTED_VERSION = 0x84
    CLIENT_ID_NOT_VALID = 0x85
    BAD_USERNAME_PASSWORD = 0x86
    NOT_AUTHORIZED = 0x87
    SERVER_UNAVAILABLE = 0x88
    SERVER_BUSY = 0x89
    BAD_AUTH_METHOD = 0x8C
    KEEP_ALIVE_TIMEOUT = 0x8D
    SESSION_TAKEN_OVER = 0x8E
    TOPIC_FILTER_INVALID = 0x8F
    TOPIC_NAME_INVALID = 0x90
    PACKET_ID_IN_USE = 0x91
    PACKET_ID_NOT_FOUND = 0x92
    RECEIVE_MAXIMUM_EXCEEDED = 0x93
    TOPIC_ALIAS_INVALID = 0x94
    PACKET_TOO_LARGE = 0x95
    QUOTA_EXCEEDED = 0x97
    PAYLOAD_FORMAT_INVALID = 0x99
    QOS_NOT_SUPPORTED = 0x9B
    SERVER_SHUTTING_DOWN = 0x8B
    SHARED_NOT_SUPPORTED = 0x9E
    USE_ANOTHER_SERVER = 0x9C
    SUBSCRIPTION_IDS_NOT_SUPPORTED = 0xA1
    WILDCARDS_NOT_SUPPORTED = 0xA2
    # MQTT 3.1.1 CONNACK return codes
    V3_UNACCEPTABLE_VERSION = 0x01
    V3_IDENTIFIER_REJECTED = 0x02
    V3_SERVER_UNAVAILABLE = 0x03
    V3_BAD_USERNAME_PASSWORD = 0x04
    V3_NOT_AUTHORIZED = 0x05


V3_CONNACK = {
    Rc.UNSUPPORTED_VERSION: Rc.V3_UNACCEPTABLE_VERSION,
    Rc.CLIENT_ID_NOT_VALID: Rc.V3_IDENTIFIER_REJECTED,
    Rc.SERVER_UNAVAILABLE: Rc.V3_SERVER_UNAVAILABLE,
    Rc.SERVER_BUSY: Rc.V3_SERVER_UNAVAILABLE,
    Rc.BAD_USERNAME_PASSWORD: Rc.V3_BAD_USERNAME_PASSWORD,
    Rc.NOT_AUTHORIZED: Rc.V3_NOT_AUTHORIZED,
}
"""A version 5 refusal as the nearest 3.1.1 CONNACK return code (others are not sent: the connection closes)."""


class MqttError(Exception):
    """A packet the server must refuse; ``code`` is its MQTT 5 reason code, the text says why."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


# --- properties (MQTT 5.0 section 2.2.2) ----------------------------------------------------

_BYTE, _TWO, _FOUR, _VARINT, _STRING, _BINARY, _PAIR = range(7)
_PROPERTY_TYPES = {
    0x01: _BYTE,  # payload format indicator
    0x02: _FOUR,  # message expiry interval
    0x03: _STRING,  # content type
    0x08: _STRING,  # response topic
    0x09: _BINARY,  # correlation data
    0x0B: _VARINT,  # subscription identifier
    0x11: _FOUR,  # session expiry interval
    0x12: _STRING,  # assigned client identifier
    0x13: _TWO,  # server keep alive
    0x15: _STRING,  # authentication method
    0x16: _BINARY,  # authentication data
    0x17: _BYTE,  # request problem information
    0x18: _FOUR,  # will delay interval
    0x19: _BYTE,  # request response information
    0x1A: _STRING,  # response information
    0x1C: _STRING,  # server reference
    0x1F: _STRING,  # reason string
    0x21: _TWO,  # receive maximum
    0x22: _TWO,  # topic alias maximum
    0x23: _TWO,  # topic alias
    0x24: _BYTE,  # maximum QoS
    0x25: _BYTE,  # retain available
    0x26: _PAIR,  # user property
    0x27: _FOUR,  # maximum packet size
    0x28: _BYTE,  # wildcard subscription available
    0x29: _BYTE,  # subscription identifier available
    0x2A: _BYTE,  # shared subscription available
}
P_FORMAT, P_EXPIRY, P_CONTENT_TYPE, P_RESPONSE_TOPIC, P_CORRELATION = 0x01, 0x02, 0x03, 0x08, 0x09
P_SUBSCRIPTION_ID, P_SESSION_EXPIRY, P_ASSIGNED_ID, P_SERVER_KEEP_ALIVE = 0x0B, 0x11, 0x12, 0x13
P_AUTH_METHOD, P_REQUEST_PROBLEM, P_WILL_DELAY, P_REASON, P_RECEIVE_MAX = 0x15, 0x17, 0x18, 0x1F, 0x21
P_ALIAS_MAX, P_ALIAS, P_MAX_QOS, P_RETAIN_AVAILABLE, P_USER = 0x22, 0x23, 0x24, 0x25, 0x26
P_MAX_PACKET, P_WILDCARDS, P_SUB_IDS, P_SHARED = 0x27, 0x28, 0x29, 0x2A

_ALLOWED = {
    CONNECT: {P_SESSION_EXPIRY, P_AUTH_METHOD, 0x16, P_REQUEST_PROBLEM, 0x19, P_RECEIVE_MAX, P_ALIAS_MAX}
    | {P_USER, P_MAX_PACKET},
    PUBLISH: {P_FORMAT, P_EXPIRY, P_CONTENT_TYPE, P_RESPONSE_TOPIC, P_CORRELATION, P_ALIAS, P_USER},
    0: {P_FORMAT, P_EXPIRY, P_CONTENT_TYPE, P_RESPONSE_TOPIC, P_CORRELATION, P_WILL_DELAY, P_USER},  # will
    PUBACK: {P_REASON, P_USER},
    SUBSCRIBE: {P_SUBSCRIPTION_ID, P_USER},
    UNSUBSCRIBE: {P_USER},
    DISCONNECT: {P_SESSION_EXPIRY, P_REASON, P_USER, 0x1C},
}
_ALLOWED[PUBREC] = _ALLOWED[PUBREL] = _ALLOWED[PUBCOMP] = _ALLOWED[PUBACK]

Properties = dict[int, object]
"""Property id -> value; user properties (0x26) are a list of (name, value) pairs."""


class _Reader:
    """Reads one packet's variable header and payload; every short read is a malformed packet."""

    __slots__ = ("data", "pos")

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def _take(self, n: int, what: str) -> bytes:
        end = self.pos + n
        if end > len(self.data):
            raise MqttError(Rc.MALFORMED, f"packet ends inside its {what}")
        chunk = self.data[self.pos : end]
        self.pos = end
        return chunk

    def byte(self, what: str) -> int:
        return self._take(1, what)[0]

    def two(self, what: str) -> int:
        return int.from_bytes(self._take(2, what), "big")

    def four(self, what: str) -> int:
        return int.from_bytes(self._take(4, what), "big")

    def varint(self, what: str) -> int:
        value = shift = 0
        for _ in range(4):
            b = self.byte(what)
            value |= (b & 0x7F) << shift
            if not b & 0x80:
                return value
            shift += 7
        raise MqttError(Rc.MALFORMED, f"{what}: variable byte integer longer than four bytes")

    def binary(self, what: str) -> bytes:
        return self._take(self.two(what), what)

    def string(self, what: str) -> str:
        return utf8(self.binary(what), what)

    def rest(self) -> bytes:
        chunk = self.data[self.pos :]
        self.pos = len(self.data)
        return chunk

    @property
    def left(self) -> int:
        return len(self.data) - self.pos

    def properties(self, kind: int) -> Properties:
        length = self.varint("property length")
        end = self.pos + length
        if end > len(self.data):
            raise MqttError(Rc.MALFORMED, "property length runs past the packet")
        allowed = _ALLOWED[kind]
        props: Properties = {}
        users: list[tuple[str, str]] = []
        while self.pos < end:
            pid = self.varint("property identifier")
            kind_of = _PROPERTY_TYPES.get(pid)
            if kind_of is None or pid not in allowed:
                raise MqttError(Rc.MALFORMED, f"property 0x{pid:02x} is not allowed in this packet")  # 5.0 2.2.2.2
            value: object
            if kind_of == _BYTE:
                value = self.byte("property")
            elif kind_of == _TWO:
                value = self.two("property")
            elif kind_of == _FOUR:
                value = self.four("property")
            elif kind_of == _VARINT:
                value = self.varint("property")
            elif kind_of == _STRING:
                value = self.string("property")
            elif kind_of == _BINARY:
                value = self.binary("property")
            else:
                users.append((self.string("user property name"), self.string("user property value")))
                if len(users) > MAX_USER_PROPERTIES:
                    raise MqttError(Rc.IMPLEMENTATION_SPECIFIC, f"more than {MAX_USER_PROPERTIES} user properties")
                continue
            if pid in props:
                raise MqttError(Rc.PROTOCOL_ERROR, f"property 0x{pid:02x} appears twice")
            props[pid] = value
        if self.pos != end:
            raise MqttError(Rc.MALFORMED, "a property runs past the property length")
        if users:
            props[P_USER] = users
        return props


def utf8(raw: bytes, what: str) -> str:
    """A UTF-8 Encoded String as MQTT defines it: well formed, no U+0000 (surrogates are refused by the codec)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise MqttError(Rc.MALFORMED, f"{what} is not valid UTF-8") from None
    if "\x00" in text:
        raise MqttError(Rc.MALFORMED, f"{what} contains U+0000")
    return text


# --- packets as values ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Will:
    topic: str
    payload: bytes
    qos: int
    retain: bool
    props: Properties = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Connect:
    level: int  # 4: MQTT 3.1.1 (and 3.1), 5: MQTT 5.0
    clean: bool
    keep_alive: int
    client_id: str
    will: Will | None
    username: str | None
    password: bytes | None
    props: Properties = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Publish:
    topic: str
    payload: bytes
    qos: int
    retain: bool
    dup: bool
    packet_id: int
    props: Properties = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class PubAck:
    """PUBACK, PUBREC, PUBREL or PUBCOMP (``kind``)."""

    kind: int
    packet_id: int
    code: int = 0


@dataclass(frozen=True, slots=True)
class Subscription:
    filter: str
    qos: int
    no_local: bool = False
    retain_as_published: bool = False
    retain_handling: int = 0


@dataclass(frozen=True, slots=True)
class Subscribe:
    packet_id: int
    subscriptions: tuple[Subscription, ...]
    props: Properties = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Unsubscribe:
    packet_id: int
    filters: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Disconnect:
    code: int = 0
    props: Properties = field(default_factory=dict)


Packet = Connect | Publish | PubAck | Subscribe | Unsubscribe | Disconnect | None
"""``None`` is PINGREQ."""


# --- the stream ------------------------------------------------------------------------------


class PacketReader:
    """Splits a byte stream into (type, flags, body) packets; holds only an unfinished packet.

    ``max_size`` bounds a whole packet (fixed header included): a larger one raises
    PACKET_TOO_LARGE as soon as its header is read, before its body is buffered.
    """

    __slots__ = ("buf", "max_size")

    def __init__(self, max_size: int) -> None:
        self.buf = b""
        self.max_size = max_size

    def feed(self, data: bytes) -> list[tuple[int, int, bytes]]:
        buf = self.buf + data if self.buf else data
        packets: list[tuple[int, int, bytes]] = []
        pos = 0
        size = len(buf)
        while size - pos >= 2:
            first = buf[pos]
            length = shift = 0
            i = pos + 1
            while True:
                if i >= size:
                    self.buf = buf[pos:]
                    return packets
                b = buf[i]
                length |= (b & 0x7F) << shift
                i += 1
                if not b & 0x80:
                    break
                shift += 7
                if shift > 21:
                    raise MqttError(Rc.MALFORMED, "remaining length longer than four bytes")
            total = i - pos + length
            if total > self.max_size:
                raise MqttError(Rc.PACKET_TOO_LARGE, f"packet of {total} bytes exceeds the maximum ({self.max_size})")
            if size - i < length:
                break
            packets.append((first >> 4, first & 0x0F, buf[i : i + length]))
            pos = i + length
        self.buf = buf[pos:] if pos < size else b""
        return packets

    @property
    def idle(self) -> bool:
        return not self.buf


# --- decoding what a client sends --------------------------------------------------------------

_PROTOCOL_NAMES = {4: b"MQTT", 5: b"MQTT", 3: b"MQIsdp"}


def decode_connect(flags: int, body: bytes) -> Connect:
    """CONNECT: the first packet, whatever the version (raises UNSUPPORTED_VERSION for an unknown one).

    MQTT 3.1 (``MQIsdp``, level 3) is decoded as 3.1.1 (level 4): its packets are the same after CONNECT,
    and a 3.1 client reads 3.1.1's answers (Mosquitto does the same); 3.1 requires a client identifier."""
    if flags:
        raise MqttError(Rc.MALFORMED, "CONNECT with reserved flags set")
    r = _Reader(body)
    name = r.binary("protocol name")
    level = r.byte("protocol level")
    if name not in (b"MQTT", b"MQIsdp") or _PROTOCOL_NAMES.get(level) != name:
        raise MqttError(
            Rc.UNSUPPORTED_VERSION, f"protocol {name!r} level {level}: this server speaks MQTT 3.1.1 and 5.0"
        )
    cflags = r.byte("connect flags")
    if cflags & 0x01:
        raise MqttError(Rc.MALFORMED, "CONNECT flags: the reserved bit is set")
    will_flag, will_qos, will_retain = bool(cflags & 0x04), (cflags >> 3) & 0x03, bool(cflags & 0x20)
    has_password, has_username = bool(cflags & 0x40), bool(cflags & 0x80)
    if not will_flag and (will_qos or will_retain):
        raise MqttError(Rc.MALFORMED, "CONNECT flags: will QoS or retain without a will")
    if will_qos == 3:
        raise MqttError(Rc.MALFORMED, "CONNECT flags: will QoS 3")
    if level != 5 and has_password and not has_username:
        raise MqttError(Rc.MALFORMED, "CONNECT flags: a password without a user name")
    keep_alive = r.two("keep alive")
    props = r.properties(CONNECT) if level == 5 else {}
    if props.get(P_RECEIVE_MAX) == 0 or props.get(P_MAX_PACKET) == 0:
        raise MqttError(Rc.PROTOCOL_ERROR, "receive maximum and maximum packet size may not be 0")
    client_id = r.string("client identifier")
    will = None
    if will_flag:
        will_props = r.properties(0) if level == 5 else {}
        topic = r.string("will topic")
        will = Will(topic, r.binary("will payload"), will_qos, will_retain, will_props)
    username = r.string("user name") if has_username else None
    password = r.binary("password") if has_password else None
    if r.left:
        raise MqttError(Rc.MALFORMED, "bytes after the CONNECT payload")
    if level == 3:
        if not client_id:
            raise MqttError(Rc.CLIENT_ID_NOT_VALID, "MQTT 3.1 needs a client identifier")
        level = 4
    return Connect(level, bool(cflags & 0x02), keep_alive, client_id, will, username, password, props)


def decode(kind: int, flags: int, body: bytes, level: int) -> Packet:
    """Any packet after CONNECT; ``level`` is the session's protocol level (4 or 5)."""
    v5 = level == 5
    if kind == PUBLISH:
        qos = (flags >> 1) & 0x03
        if qos == 3:
            raise MqttError(Rc.MALFORMED, "PUBLISH with QoS 3")
        dup = bool(flags & 0x08)
        if dup and qos == 0:
            raise MqttError(Rc.MALFORMED, "PUBLISH with QoS 0 and the DUP flag")
        r = _Reader(body)
        topic = r.string("topic name")
        packet_id = 0
        if qos:
            packet_id = r.two("packet identifier")
            if not packet_id:
                raise MqttError(Rc.MALFORMED, "PUBLISH with packet identifier 0")
        props = r.properties(PUBLISH) if v5 else {}
        return Publish(topic, r.rest(), qos, bool(flags & 0x01), dup, packet_id, props)
    if kind in (PUBACK, PUBREC, PUBREL, PUBCOMP):
        if flags != (0x02 if kind == PUBREL else 0):
            raise MqttError(Rc.MALFORMED, f"wrong fixed-header flags in packet type {kind}")
        r = _Reader(body)
        packet_id = r.two("packet identifier")
        code = r.byte("reason code") if v5 and r.left else 0
        if v5 and r.left:
            r.properties(kind)
        if r.left:
            raise MqttError(Rc.MALFORMED, "bytes after an acknowledgement")
        return PubAck(kind, packet_id, code)
    if kind == SUBSCRIBE:
        if flags != 0x02:
            raise MqttError(Rc.MALFORMED, "SUBSCRIBE without the reserved flags 0010")
        r = _Reader(body)
        packet_id = r.two("packet identifier")
        if not packet_id:
            raise MqttError(Rc.MALFORMED, "SUBSCRIBE with packet identifier 0")
        props = r.properties(SUBSCRIBE) if v5 else {}
        if props.get(P_SUBSCRIPTION_ID) == 0:
            raise MqttError(Rc.PROTOCOL_ERROR, "subscription identifier 0")
        subs: list[Subscription] = []
        while r.left:
            topic_filter = r.string("topic filter")
            options = r.byte("subscription options")
            if options & (0xC0 if v5 else 0xFC) or (options & 0x03) == 3 or (options >> 4) & 0x03 == 3:
                raise MqttError(Rc.MALFORMED, "subscription options with reserved bits or values")
            subs.append(
                Subscription(
                    topic_filter, options & 0x03, bool(options & 0x04), bool(options & 0x08), (options >> 4) & 0x03
                )
            )
        if not subs:
            raise MqttError(Rc.PROTOCOL_ERROR, "SUBSCRIBE without a topic filter")
        return Subscribe(packet_id, tuple(subs), props)
    if kind == UNSUBSCRIBE:
        if flags != 0x02:
            raise MqttError(Rc.MALFORMED, "UNSUBSCRIBE without the reserved flags 0010")
        r = _Reader(body)
        packet_id = r.two("packet identifier")
        if not packet_id:
            raise MqttError(Rc.MALFORMED, "UNSUBSCRIBE with packet identifier 0")
        if v5:
            r.properties(UNSUBSCRIBE)
        filters: list[str] = []
        while r.left:
            filters.append(r.string("topic filter"))
        if not filters:
            raise MqttError(Rc.PROTOCOL_ERROR, "UNSUBSCRIBE without a topic filter")
        return Unsubscribe(packet_id, tuple(filters))
    if kind == PINGREQ:
        if flags or body:
            raise MqttError(Rc.MALFORMED, "PINGREQ with flags or a body")
        return None
    if kind == DISCONNECT:
        if flags:
            raise MqttError(Rc.MALFORMED, "DISCONNECT with reserved flags set")
        if not v5:
            if body:
                raise MqttError(Rc.MALFORMED, "a 3.1.1 DISCONNECT has no body")
            return Disconnect()
        r = _Reader(body)
        code = r.byte("reason code") if r.left else 0
        props = r.properties(DISCONNECT) if r.left else {}
        if r.left:
            raise MqttError(Rc.MALFORMED, "bytes after DISCONNECT's properties")
        return Disconnect(code, props)
    if kind == CONNECT:
        raise MqttError(Rc.PROTOCOL_ERROR, "a second CONNECT")
    if kind == AUTH and v5:
        raise MqttError(Rc.BAD_AUTH_METHOD, "enhanced authentication (AUTH) is not supported")
    raise MqttError(Rc.MALFORMED if v5 else Rc.PROTOCOL_ERROR, f"packet type {kind} is not sent by a client")


# --- encoding what the server sends -------------------------------------------------------------


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _string(text: str) -> bytes:
    raw = text.encode("utf-8")
    return struct.pack("!H", len(raw)) + raw


def encode_properties(props: Properties, sub_ids: Sequence[int] = ()) -> bytes:
    """Properties in id order; user properties as pairs. Values are the types of :data:`_PROPERTY_TYPES`.
    ``sub_ids``: subscription identifiers, each its own property (a PUBLISH may carry several)."""
    out = bytearray()
    for sub_id in sub_ids:
        out += b"\x0b" + _varint(sub_id)
    for pid, value in props.items():
        kind = _PROPERTY_TYPES[pid]
        if kind == _PAIR:
            assert isinstance(value, list)
            for name, text in value:
                out += b"\x26" + _string(name) + _string(text)
            continue
        out += _varint(pid)
        if kind == _BYTE:
            assert isinstance(value, int)
            out.append(value)
        elif kind == _TWO:
            assert isinstance(value, int)
            out += struct.pack("!H", value)
        elif kind == _FOUR:
            assert isinstance(value, int)
            out += struct.pack("!I", value)
        elif kind == _VARINT:
            assert isinstance(value, int)
            out += _varint(value)
        elif kind == _STRING:
            assert isinstance(value, str)
            out += _string(value)
        else:
            assert isinstance(value, bytes)
            out += struct.pack("!H", len(value)) + value
    return _varint(len(out)) + bytes(out)


def _packet(first: int, body: bytes) -> bytes:
    return bytes((first,)) + _varint(len(body)) + body


def encode_connack(level: int, session_present: bool, code: int, props: Properties | None = None) -> bytes:
    if level == 5:
        return _packet(0x20, bytes((int(session_present), code)) + encode_properties(props or {}))
    return _packet(0x20, bytes((int(session_present), code)))


def publish_header(topic: str, qos: int, retain: bool, dup: bool, packet_id: int) -> tuple[int, bytes]:
    """The first byte and the topic (and packet id): the part of a PUBLISH before its properties."""
    first = 0x30 | (0x08 if dup else 0) | (qos << 1) | int(retain)
    head = _string(topic)
    if qos:
        head += struct.pack("!H", packet_id)
    return first, head


def encode_publish(
    level: int,
    topic: str,
    payload: bytes,
    qos: int = 0,
    retain: bool = False,
    dup: bool = False,
    packet_id: int = 0,
    props: Properties | bytes | None = None,
) -> bytes:
    """One PUBLISH; ``props`` may be already encoded (shared by every subscriber of a message)."""
    first, head = publish_header(topic, qos, retain, dup, packet_id)
    if level == 5:
        head += props if isinstance(props, bytes) else encode_properties(props or {})
    return bytes((first,)) + _varint(len(head) + len(payload)) + head + payload


def encode_ack(kind: int, packet_id: int, level: int, code: int = 0, reason: str = "") -> bytes:
    """PUBACK, PUBREC, PUBREL (flags 0010) or PUBCOMP; a version 5 reason code when not success."""
    first = (kind << 4) | (0x02 if kind == PUBREL else 0)
    body = struct.pack("!H", packet_id)
    if level == 5 and (code or reason):
        body += bytes((code,)) + (encode_properties({P_REASON: reason}) if reason else b"")
    return _packet(first, body)


def encode_suback(packet_id: int, codes: list[int], level: int) -> bytes:
    body = struct.pack("!H", packet_id) + (b"\x00" if level == 5 else b"") + bytes(codes)
    return _packet(0x90, body)


def encode_unsuback(packet_id: int, codes: list[int], level: int) -> bytes:
    if level == 5:
        return _packet(0xB0, struct.pack("!H", packet_id) + b"\x00" + bytes(codes))
    return _packet(0xB0, struct.pack("!H", packet_id))


def encode_disconnect(code: int, reason: str = "") -> bytes:
    """A server DISCONNECT (version 5 only: a 3.1.1 server closes without one)."""
    props: Properties = {P_REASON: reason} if reason else {}
    return _packet(0xE0, bytes((code,)) + encode_properties(props))
