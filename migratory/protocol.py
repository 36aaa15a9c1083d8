"""The native protocol, versions 1 to 3: binary messages carried in WebSocket binary frames.

Both directions are encoded and decoded here, without I/O, so the server, the
client library and the tests share one codec (specified in docs/protocol.md).

Layout of every native message: one opcode byte, then opcode-specific fields.
Integers are unsigned LEB128 varints; strings are a varint byte length followed by
UTF-8; the content of PUBLISH and MESSAGE is the rest of the frame, binary-safe, so
nothing is base64-encoded and the overhead per delivered message is constant.

Version 2 adds what failover needs: SUBSCRIBE may carry the last ``(epoch, seq)`` the
client saw of each subject, PUBLISH a publish id that makes retries idempotent,
MESSAGE a RECOVERED flag, and the server's NOTIFY (data in sync / resynchronised).
Version 3 adds the server's keep-alive: CONNECTED says how long the server may stay silent, and
NOTIFY ``KEEPALIVE`` breaks a longer silence, so a client notices a server that hangs (a paused
cluster member) and fails over. A server speaks every version; a session never receives a
message of a later version than the one it spoke in CONNECT.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

__all__ = [
    "PROTOCOL_VERSION",
    "SUPPORTED_VERSIONS",
    "Connect",
    "Connected",
    "DecodeError",
    "Delivery",
    "ErrorNotice",
    "Notify",
    "NotifyCode",
    "Op",
    "Publish",
    "PublishStatus",
    "Status",
    "Subscribe",
    "SubscribeStatus",
    "Unsubscribe",
    "decode_client",
    "decode_server",
    "encode_connect",
    "encode_connected",
    "encode_delivery",
    "encode_error",
    "encode_notify",
    "encode_publish",
    "encode_publish_status",
    "encode_subscribe",
    "encode_subscribe_status",
    "encode_unsubscribe",
]

PROTOCOL_VERSION = 3
SUPPORTED_VERSIONS = (1, 2, 3)

# Limits that keep a hostile frame from making the decoder allocate without bound.
MAX_FIELDS = 1024
MAX_SUBJECTS_PER_REQUEST = 10000


class Op(enum.IntEnum):
    """Opcodes; client-to-server below 0x80, server-to-client from 0x80."""

    CONNECT = 0x01
    SUBSCRIBE = 0x02
    UNSUBSCRIBE = 0x03
    PUBLISH = 0x04
    CONNECTED = 0x81
    SUBSCRIBE_STATUS = 0x82
    MESSAGE = 0x83
    PUBLISH_STATUS = 0x84
    NOTIFY = 0x85
    ERROR = 0x8F


class Status(enum.IntEnum):
    """Outcome codes shared by subscribe and publish statuses and errors."""

    OK = 0
    DENIED = 1
    FAILED = 2
    NO_SUBSCRIBER = 3
    INVALID_SUBJECT = 4
    TOO_LARGE = 5
    LIMIT_EXCEEDED = 6
    REVOKED = 7
    NOT_CONNECTED = 8
    PROTOCOL_ERROR = 9


class NotifyCode(enum.IntEnum):
    """NOTIFY codes (version 2), named as in the product's client API."""

    DATA_SYNC = 1  # after a resubscription: the missed messages (if any) were sent, none is missing
    DATA_RESYNC = 2  # the missed messages are gone: the current snapshot follows
    KEEPALIVE = 3  # version 3: the server is alive; nothing else was sent for a while (the subject is empty)


# flag bits
SUBSCRIBE_POSITIONS = 0x01
PUBLISH_RETAINED = 0x01
PUBLISH_GUARANTEED = 0x02
PUBLISH_ID = 0x04
MESSAGE_SNAPSHOT = 0x01
MESSAGE_RETAINED = 0x02
MESSAGE_GUARANTEED = 0x04
MESSAGE_RECOVERED = 0x08


class DecodeError(ValueError):
    """A malformed native message; the text says what is wrong with it."""


# --- frames as values ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Connect:
    version: int
    token: str


@dataclass(frozen=True, slots=True)
class Subscribe:
    """``positions[i]``: the last ``(epoch, seq)`` seen of ``subjects[i]`` ((0, 0): none); version 2."""

    subjects: tuple[str, ...]
    conflation_ms: int = 0
    positions: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True, slots=True)
class Unsubscribe:
    subjects: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Publish:
    subject: str
    content: bytes
    fields: Mapping[str, str] = field(default_factory=dict)
    closure: str = ""
    retained: bool = True
    guaranteed: bool = False
    publish_id: str = ""


@dataclass(frozen=True, slots=True)
class Connected:
    """``max_message_size`` (version 2): the server's MessageSizeLimit, so a client refuses bigger ones itself.
    ``keepalive_ms`` (version 3): the longest the server stays silent on this connection (0: no promise)."""

    version: int
    session: str
    epoch: int
    max_message_size: int = 0
    keepalive_ms: int = 0


@dataclass(frozen=True, slots=True)
class SubscribeStatus:
    status: Status
    subject: str
    reason: str


@dataclass(frozen=True, slots=True)
class Delivery:
    subject: str
    content: bytes
    fields: Mapping[str, str]
    seq: int
    epoch: int
    snapshot: bool
    retained: bool
    guaranteed: bool
    recovered: bool = False


@dataclass(frozen=True, slots=True)
class Notify:
    code: NotifyCode
    subject: str


@dataclass(frozen=True, slots=True)
class PublishStatus:
    status: Status
    closure: str
    reason: str


@dataclass(frozen=True, slots=True)
class ErrorNotice:
    status: Status
    reason: str


ClientFrame = Connect | Subscribe | Unsubscribe | Publish
ServerFrame = Connected | SubscribeStatus | Delivery | PublishStatus | Notify | ErrorNotice


# --- primitives ------------------------------------------------------------------------


def _varint(value: int) -> bytes:
    if value < 0x80:
        return bytes((value,))
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _string(text: str) -> bytes:
    data = text.encode("utf-8")
    return _varint(len(data)) + data


def _fields(fields: Mapping[str, str]) -> bytes:
    if not fields:
        return b"\x00"
    parts = [_varint(len(fields))]
    for name, value in fields.items():
        parts.append(_string(name))
        parts.append(_string(value))
    return b"".join(parts)


class _Reader:
    """Cursor over one native message; every read checks bounds."""

    __slots__ = ("data", "pos")

    def __init__(self, data: bytes, pos: int = 1) -> None:
        self.data = data
        self.pos = pos

    def byte(self, what: str) -> int:
        if self.pos >= len(self.data):
            raise DecodeError(f"truncated message: missing {what}")
        value = self.data[self.pos]
        self.pos += 1
        return value

    def varint(self, what: str) -> int:
        result = 0
        shift = 0
        while True:
            b = self.byte(what)
            result |= (b & 0x7F) << shift
            if b < 0x80:
                return result
            shift += 7
            if shift > 63:
                raise DecodeError(f"{what}: varint longer than 64 bits")

    def string(self, what: str) -> str:
        length = self.varint(what)
        end = self.pos + length
        if end > len(self.data):
            raise DecodeError(f"truncated message: {what} claims {length} bytes")
        raw = self.data[self.pos : end]
        self.pos = end
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise DecodeError(f"{what} is not valid UTF-8") from None

    def fields(self) -> dict[str, str]:
        count = self.varint("field count")
        if count > MAX_FIELDS:
            raise DecodeError(f"too many fields ({count} > {MAX_FIELDS})")
        out: dict[str, str] = {}
        for _ in range(count):
            name = self.string("field name")
            out[name] = self.string("field value")
        return out

    def count(self) -> int:
        count = self.varint("subject count")
        if count == 0:
            raise DecodeError("no subject given")
        if count > MAX_SUBJECTS_PER_REQUEST:
            raise DecodeError(f"too many subjects in one request ({count})")
        return count

    def subjects(self) -> tuple[str, ...]:
        return tuple(self.string("subject") for _ in range(self.count()))

    def rest(self) -> bytes:
        out = self.data[self.pos :]
        self.pos = len(self.data)
        return out

    def end(self) -> None:
        if self.pos != len(self.data):
            raise DecodeError(f"{len(self.data) - self.pos} unexpected trailing bytes")


# --- client -> server ------------------------------------------------------------------


def encode_connect(token: str = "", version: int = PROTOCOL_VERSION) -> bytes:
    return bytes((Op.CONNECT,)) + _varint(version) + _string(token)


def encode_subscribe(
    subjects: Sequence[str], conflation_ms: int = 0, positions: Sequence[tuple[int, int]] = ()
) -> bytes:
    """SUBSCRIBE; with ``positions`` (one per subject, version 2) the server recovers what was missed."""
    if positions and len(positions) != len(subjects):
        raise ValueError("one position per subject")
    flags = SUBSCRIBE_POSITIONS if positions else 0
    body = [bytes((Op.SUBSCRIBE, flags)), _varint(conflation_ms), _varint(len(subjects))]
    if positions:
        for subject, (epoch, seq) in zip(subjects, positions, strict=True):
            body += [_string(subject), _varint(epoch), _varint(seq)]
    else:
        body.extend(_string(s) for s in subjects)
    return b"".join(body)


def encode_unsubscribe(subjects: Sequence[str]) -> bytes:
    body = [bytes((Op.UNSUBSCRIBE,)), _varint(len(subjects))]
    body.extend(_string(s) for s in subjects)
    return b"".join(body)


def encode_publish(
    subject: str,
    content: bytes,
    fields: Mapping[str, str] | None = None,
    closure: str = "",
    retained: bool = True,
    guaranteed: bool = False,
    publish_id: str = "",
) -> bytes:
    """PUBLISH; a ``publish_id`` (version 2) lets the cluster recognise a retry of the same message."""
    flags = (
        (PUBLISH_RETAINED if retained else 0)
        | (PUBLISH_GUARANTEED if guaranteed else 0)
        | (PUBLISH_ID if publish_id else 0)
    )
    return b"".join(
        (
            bytes((Op.PUBLISH, flags)),
            _string(closure),
            _string(publish_id) if publish_id else b"",
            _string(subject),
            _fields(fields or {}),
            content,
        )
    )


def decode_client(data: bytes) -> ClientFrame:
    """Decode one client-to-server message or raise :class:`DecodeError`."""
    if not data:
        raise DecodeError("empty message")
    op = data[0]
    r = _Reader(data)
    if op == Op.CONNECT:
        version = r.varint("version")
        token = r.string("token")
        r.end()
        return Connect(version, token)
    if op == Op.SUBSCRIBE:
        flags = r.byte("flags")
        if flags & ~SUBSCRIBE_POSITIONS:
            raise DecodeError(f"unknown subscribe flags 0x{flags:02x}")
        conflation = r.varint("conflation time")
        if not flags:
            subjects = r.subjects()
            r.end()
            return Subscribe(subjects, conflation)
        count = r.count()
        names: list[str] = []
        positions: list[tuple[int, int]] = []
        for _ in range(count):
            names.append(r.string("subject"))
            positions.append((r.varint("epoch"), r.varint("seq")))
        r.end()
        return Subscribe(tuple(names), conflation, tuple(positions))
    if op == Op.UNSUBSCRIBE:
        subjects = r.subjects()
        r.end()
        return Unsubscribe(subjects)
    if op == Op.PUBLISH:
        flags = r.byte("flags")
        if flags & ~(PUBLISH_RETAINED | PUBLISH_GUARANTEED | PUBLISH_ID):
            raise DecodeError(f"unknown publish flags 0x{flags:02x}")
        closure = r.string("closure")
        publish_id = r.string("publish id") if flags & PUBLISH_ID else ""
        subject = r.string("subject")
        fields = r.fields()
        return Publish(
            subject,
            r.rest(),
            fields,
            closure,
            bool(flags & PUBLISH_RETAINED),
            bool(flags & PUBLISH_GUARANTEED),
            publish_id,
        )
    raise DecodeError(f"unknown opcode 0x{op:02x}")


# --- server -> client ------------------------------------------------------------------


def encode_connected(
    session: str, epoch: int, version: int = PROTOCOL_VERSION, max_message_size: int = 0, keepalive_ms: int = 0
) -> bytes:
    head = bytes((Op.CONNECTED,)) + _varint(version) + _string(session) + _varint(epoch)
    if version >= 2:
        head += _varint(max_message_size)
    if version >= 3:
        head += _varint(keepalive_ms)
    return head


def encode_subscribe_status(status: Status, subject: str, reason: str = "") -> bytes:
    return bytes((Op.SUBSCRIBE_STATUS, status)) + _string(subject) + _string(reason)


def encode_delivery(
    subject: str,
    content: bytes,
    fields: Mapping[str, str],
    seq: int,
    epoch: int,
    *,
    snapshot: bool = False,
    retained: bool = True,
    guaranteed: bool = False,
    recovered: bool = False,
) -> bytes:
    """Encode a MESSAGE; built once per publication and shared by all subscribers."""
    flags = (
        (MESSAGE_SNAPSHOT if snapshot else 0)
        | (MESSAGE_RETAINED if retained else 0)
        | (MESSAGE_GUARANTEED if guaranteed else 0)
        | (MESSAGE_RECOVERED if recovered else 0)
    )
    return b"".join(
        (
            bytes((Op.MESSAGE, flags)),
            _string(subject),
            _fields(fields),
            _varint(seq),
            _varint(epoch),
            content,
        )
    )


def encode_publish_status(status: Status, closure: str, reason: str = "") -> bytes:
    return bytes((Op.PUBLISH_STATUS, status)) + _string(closure) + _string(reason)


def encode_notify(code: NotifyCode, subject: str) -> bytes:
    """NOTIFY (version 2 sessions only)."""
    return bytes((Op.NOTIFY, code)) + _string(subject)


def encode_error(status: Status, reason: str) -> bytes:
    return bytes((Op.ERROR,)) + _varint(status) + _string(reason)


def _status(value: int) -> Status:
    try:
        return Status(value)
    except ValueError:
        raise DecodeError(f"unknown status {value}") from None


def decode_server(data: bytes) -> ServerFrame:
    """Decode one server-to-client message or raise :class:`DecodeError`."""
    if not data:
        raise DecodeError("empty message")
    op = data[0]
    r = _Reader(data)
    if op == Op.MESSAGE:
        flags = r.byte("flags")
        subject = r.string("subject")
        fields = r.fields()
        seq = r.varint("seq")
        epoch = r.varint("epoch")
        return Delivery(
            subject,
            r.rest(),
            fields,
            seq,
            epoch,
            bool(flags & MESSAGE_SNAPSHOT),
            bool(flags & MESSAGE_RETAINED),
            bool(flags & MESSAGE_GUARANTEED),
            bool(flags & MESSAGE_RECOVERED),
        )
    if op == Op.CONNECTED:
        version = r.varint("version")
        session = r.string("session")
        epoch = r.varint("epoch")
        limit = r.varint("message size limit") if version >= 2 else 0
        keepalive = r.varint("keep-alive") if version >= 3 else 0
        r.end()
        return Connected(version, session, epoch, limit, keepalive)
    if op == Op.SUBSCRIBE_STATUS:
        status = _status(r.byte("status"))
        subject = r.string("subject")
        reason = r.string("reason")
        r.end()
        return SubscribeStatus(status, subject, reason)
    if op == Op.PUBLISH_STATUS:
        status = _status(r.byte("status"))
        closure = r.string("closure")
        reason = r.string("reason")
        r.end()
        return PublishStatus(status, closure, reason)
    if op == Op.NOTIFY:
        code = r.byte("code")
        try:
            notify_code = NotifyCode(code)
        except ValueError:
            raise DecodeError(f"unknown notify code {code}") from None
        subject = r.string("subject")
        r.end()
        return Notify(notify_code, subject)
    if op == Op.ERROR:
        status = _status(r.varint("status"))
        reason = r.string("reason")
        r.end()
        return ErrorNotice(status, reason)
    raise DecodeError(f"unknown opcode 0x{op:02x}")
