"""The intra-node bus between worker processes, without I/O: routing and frame codec.

Subjects are partitioned into groups; each group has one coordinator, the worker
that numbers its messages and owns its snapshot (the paper's "subject groups, a
coordinator per group"). A worker that accepts a publication for a subject it
does not coordinate forwards it to the coordinator; the coordinator gives it the
next sequence number, delivers it to its own subscribers and broadcasts it to
every other worker, which deliver it to theirs and keep a replica of the snapshot.
So every subscriber sees one order per subject and one snapshot for the node, and a
restarted worker gets its groups' state back from its peers' replicas.

Frames are ``u32 length`` + ``u8 kind`` + body, strings and bytes length-prefixed.
"""

from __future__ import annotations

import enum
import struct
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = [
    "BusDecoder",
    "BusError",
    "Forward",
    "ForwardStatus",
    "Hello",
    "Interest",
    "Kind",
    "Published",
    "SyncSubject",
    "encode",
    "owner",
]

MAX_BUS_FRAME = 64 * 1024 * 1024


def owner(subject: str, workers: int) -> int:
    """The worker coordinating ``subject``'s group (stable across processes and restarts)."""
    if workers <= 1:
        return 0
    return zlib.crc32(subject.encode("utf-8")) % workers


class BusError(ValueError):
    """A malformed bus frame: a bug or a corrupted link, never client input."""


class Kind(enum.IntEnum):
    HELLO = 1
    FORWARD = 2
    FORWARD_STATUS = 3
    PUBLISHED = 4
    INTEREST = 5
    SYNC = 6


@dataclass(frozen=True, slots=True)
class Hello:
    worker: int


@dataclass(frozen=True, slots=True)
class Forward:
    """A publication on its way to the subject's coordinator."""

    request: int
    subject: str
    content: bytes
    fields: Mapping[str, str]
    retained: bool
    guaranteed: bool
    origin: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ForwardStatus:
    request: int
    status: int
    seq: int
    reason: str


@dataclass(frozen=True, slots=True)
class Published:
    """A sequenced publication, broadcast by the coordinator to every other worker."""

    subject: str
    content: bytes
    fields: Mapping[str, str]
    seq: int
    epoch: int
    retained: bool
    guaranteed: bool


@dataclass(frozen=True, slots=True)
class Interest:
    """How many local subscribers the sender now has for ``subject``."""

    subject: str
    count: int


@dataclass(frozen=True, slots=True)
class SyncSubject:
    """State of one subject sent when a link comes up: last seq and snapshot, if any."""

    subject: str
    seq: int
    has_snapshot: bool
    content: bytes
    fields: Mapping[str, str]
    snapshot_seq: int


BusFrame = Hello | Forward | ForwardStatus | Published | Interest | SyncSubject

_U32 = struct.Struct("!I")
_Q = struct.Struct("!Q")


def _b(data: bytes) -> bytes:
    return _U32.pack(len(data)) + data


def _s(text: str) -> bytes:
    return _b(text.encode("utf-8"))


def _map(values: Mapping[str, str]) -> bytes:
    return _U32.pack(len(values)) + b"".join(_s(k) + _s(v) for k, v in values.items())


def encode(frame: BusFrame) -> bytes:
    """One length-prefixed bus frame."""
    if isinstance(frame, Published):
        body = b"".join(
            (
                bytes((Kind.PUBLISHED, frame.retained | frame.guaranteed << 1)),
                _s(frame.subject),
                _map(frame.fields),
                _Q.pack(frame.seq),
                _Q.pack(frame.epoch),
                _b(frame.content),
            )
        )
    elif isinstance(frame, Forward):
        body = b"".join(
            (
                bytes((Kind.FORWARD, frame.retained | frame.guaranteed << 1)),
                _Q.pack(frame.request),
                _s(frame.subject),
                _map(frame.fields),
                _map(frame.origin),
                _b(frame.content),
            )
        )
    elif isinstance(frame, ForwardStatus):
        body = (
            bytes((Kind.FORWARD_STATUS, frame.status)) + _Q.pack(frame.request) + _Q.pack(frame.seq) + _s(frame.reason)
        )
    elif isinstance(frame, Interest):
        body = bytes((Kind.INTEREST, 0)) + _Q.pack(frame.count) + _s(frame.subject)
    elif isinstance(frame, SyncSubject):
        body = b"".join(
            (
                bytes((Kind.SYNC, frame.has_snapshot)),
                _s(frame.subject),
                _Q.pack(frame.seq),
                _Q.pack(frame.snapshot_seq),
                _map(frame.fields),
                _b(frame.content),
            )
        )
    else:
        body = bytes((Kind.HELLO, 0)) + _Q.pack(frame.worker)
    return _U32.pack(len(body)) + body


class _Cursor:
    __slots__ = ("data", "pos")

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 2

    def u32(self) -> int:
        if self.pos + 4 > len(self.data):
            raise BusError("truncated bus frame")
        (value,) = _U32.unpack_from(self.data, self.pos)
        self.pos += 4
        return int(value)

    def u64(self) -> int:
        if self.pos + 8 > len(self.data):
            raise BusError("truncated bus frame")
        (value,) = _Q.unpack_from(self.data, self.pos)
        self.pos += 8
        return int(value)

    def raw(self) -> bytes:
        n = self.u32()
        if self.pos + n > len(self.data):
            raise BusError("truncated bus frame")
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def text(self) -> str:
        return self.raw().decode("utf-8")

    def mapping(self) -> dict[str, str]:
        return {self.text(): self.text() for _ in range(self.u32())}


def decode(body: bytes) -> BusFrame:
    """Decode one frame body (without its length prefix)."""
    if len(body) < 2:
        raise BusError("bus frame too short")
    kind, flag = body[0], body[1]
    c = _Cursor(body)
    if kind == Kind.PUBLISHED:
        subject = c.text()
        fields = c.mapping()
        seq = c.u64()
        epoch = c.u64()
        return Published(subject, c.raw(), fields, seq, epoch, bool(flag & 1), bool(flag & 2))
    if kind == Kind.FORWARD:
        request = c.u64()
        subject = c.text()
        fields = c.mapping()
        origin = c.mapping()
        return Forward(request, subject, c.raw(), fields, bool(flag & 1), bool(flag & 2), origin)
    if kind == Kind.FORWARD_STATUS:
        request = c.u64()
        seq = c.u64()
        return ForwardStatus(request, flag, seq, c.text())
    if kind == Kind.INTEREST:
        count = c.u64()
        return Interest(c.text(), count)
    if kind == Kind.SYNC:
        subject = c.text()
        seq = c.u64()
        snapshot_seq = c.u64()
        fields = c.mapping()
        return SyncSubject(subject, seq, bool(flag), c.raw(), fields, snapshot_seq)
    if kind == Kind.HELLO:
        return Hello(c.u64())
    raise BusError(f"unknown bus frame kind {kind}")


class BusDecoder:
    """Splits a byte stream into bus frames."""

    __slots__ = ("_buf",)

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, data: bytes) -> list[BusFrame]:
        buf = self._buf + data if self._buf else data
        out: list[BusFrame] = []
        pos = 0
        while len(buf) - pos >= 4:
            (length,) = _U32.unpack_from(buf, pos)
            if length > MAX_BUS_FRAME:
                raise BusError(f"bus frame of {length} bytes")
            if len(buf) - pos - 4 < length:
                break
            out.append(decode(buf[pos + 4 : pos + 4 + length]))
            pos += 4 + length
        self._buf = buf[pos:]
        return out
