"""The bus, without I/O: routing inside a node, and the frames of both layers.

Two layers, one idea (the paper's "subject groups, a coordinator per group"):

- **Inside a node**, subjects are partitioned over the worker processes: the worker
  :func:`owner` names numbers a subject's messages and owns its snapshot; a worker
  that accepts a publication for another worker's subject forwards it there, and the
  coordinator broadcasts the numbered message to every other worker.
- **Across a cluster**, subjects are partitioned into groups (migratory/groups.py)
  over the members; each member's *agent* process numbers the groups its member
  coordinates and replicates every numbered message to the other members' agents.
  In a member, the agent plays the coordinating worker for every subject: workers
  forward every publication to it and receive every numbered message from it.

Both layers speak the frames below. A frame is ``u32 length`` + ``u8 kind`` +
``u8 flags`` + body; integers are big-endian ``u64`` (``u32`` for lengths and
counts), strings and bytes are length-prefixed.
"""

from __future__ import annotations

import contextlib
import enum
import struct
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from migratory.message import Snapshot
from migratory.replica import Entry, SubjectSync

__all__ = [
    "MAX_BUS_FRAME",
    "PREAUTH_MAX_FRAME",
    "Ack",
    "BusDecoder",
    "BusError",
    "BusFrame",
    "Challenge",
    "ClusterInfo",
    "Forward",
    "ForwardStatus",
    "Heartbeat",
    "Hello",
    "Interest",
    "Kind",
    "Leaving",
    "Proof",
    "Published",
    "Relay",
    "SyncDone",
    "SyncRequest",
    "SyncSubject",
    "TableFrame",
    "Welcome",
    "decode",
    "encode",
    "owner",
    "sync_frames",
]

MAX_BUS_FRAME = 64 * 1024 * 1024
SYNC_CHUNK_BYTES = 1 << 20  # a subject's cached history is sent in frames of about this size
PREAUTH_MAX_FRAME = 4096  # what a peer that has not yet proved the secret may make us buffer


def owner(subject: str, workers: int) -> int:
    """The worker coordinating ``subject``'s group inside one node (stable across restarts)."""
    if workers <= 1:
        return 0
    return zlib.crc32(subject.encode("utf-8")) % workers


class BusError(ValueError):
    """A malformed bus frame: a bug, a corrupted link or a stranger; never client input."""


class Kind(enum.IntEnum):
    HELLO = 1
    FORWARD = 2
    FORWARD_STATUS = 3
    PUBLISHED = 4
    INTEREST = 5
    SYNC = 6
    CHALLENGE = 7
    PROOF = 8
    WELCOME = 9
    HEARTBEAT = 10
    TABLE = 11
    SYNC_REQUEST = 12
    SYNC_DONE = 13
    ACK = 14
    CLUSTER_INFO = 15
    RELAY = 16
    LEAVING = 17


# _HOT: the frames built and decoded at every hop of every publication (Forward, ForwardStatus, Published,
# Interest, Ack) are plain slotted dataclasses, never changed once built: a frozen one's __init__ goes
# through object.__setattr__ for each field (2.8 us for a Published against 0.6), and a Guaranteed
# publication builds about twenty of them across a cluster (bench/ingest.md).
@dataclass(frozen=True, slots=True)
class Hello:
    """First frame of a link inside a node: who is speaking, and the node's secret proof."""

    worker: int
    proof: bytes = b""


@dataclass(slots=True, unsafe_hash=True)  # not frozen: see _HOT
class Forward:
    """A publication on its way to the coordinator of its subject."""

    request: int
    subject: str
    content: bytes
    fields: Mapping[str, str]
    retained: bool
    guaranteed: bool
    origin: Mapping[str, str] = field(default_factory=dict)
    publish_id: str = ""
    hops: int = 0


@dataclass(slots=True, unsafe_hash=True)  # not frozen: see _HOT
class ForwardStatus:
    """The coordinator's answer to a Forward: status, the message's (epoch, seq), subscribers reached."""

    request: int
    status: int
    seq: int
    reason: str
    epoch: int = 0
    recipients: int = 0


@dataclass(slots=True, unsafe_hash=True)  # not frozen: see _HOT
class Published:
    """A numbered publication, sent by its coordinator to every replica."""

    subject: str
    content: bytes
    fields: Mapping[str, str]
    seq: int
    epoch: int
    retained: bool
    guaranteed: bool
    publish_id: str = ""

    def entry(self) -> Entry:
        return Entry(self.epoch, self.seq, self.content, self.fields, self.retained, self.publish_id, self.guaranteed)

    @classmethod
    def of(cls, subject: str, entry: Entry, guaranteed: bool = False) -> Published:
        return cls(
            subject, entry.content, entry.fields, entry.seq, entry.epoch, entry.retained, guaranteed, entry.publish_id
        )


@dataclass(slots=True, unsafe_hash=True)  # not frozen: see _HOT
class Interest:
    """How many subscribers of ``subject`` the sender now has (a worker's, or a member's total)."""

    subject: str
    count: int


@dataclass(frozen=True, slots=True)
class SyncSubject:
    """One subject's state (see migratory/replica.py); ``more``: further entries follow in the next frame."""

    state: SubjectSync
    more: bool = False
    fence: int = 0  # the sending member's epoch of the subject's group (0: a worker's or agent's own state)
    # Guaranteed, between members: the first seq the sender holds back from its subscribers (not yet known to
    # be held by two members); 0: none. The receiver holds those back too, until the coordinator confirms them.
    held: int = 0


@dataclass(frozen=True, slots=True)
class Challenge:
    """Member link, acceptor first: who it is and a fresh nonce to prove the password over."""

    member: int
    incarnation: int
    nonce: bytes


@dataclass(frozen=True, slots=True)
class Proof:
    """Member link, dialer: who it is, its own nonce, and HMAC(password key, both nonces, both ids)."""

    member: int
    incarnation: int
    nonce: bytes
    mac: bytes


@dataclass(frozen=True, slots=True)
class Welcome:
    """Member link, acceptor: its proof over the dialer's nonce (the authentication is mutual)."""

    mac: bytes


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """Liveness, readiness and a status summary, every ClusterHeartbeatInterval on each member link.

    ``sent`` is the sender's clock (µs); ``echo`` the last ``sent`` it received from the
    peer and ``held`` how long ago (µs), so the peer can compute the link's round-trip time.
    """

    member: int
    ready: bool
    leader: bool
    quorum: bool
    table_version: int
    sent: int
    echo: int
    held: int
    status: bytes = b""


@dataclass(frozen=True, slots=True)
class TableFrame:
    """Guaranteed mode: the seed members' agreed table (migratory/groups.py)."""

    version: int
    members: tuple[int, ...]
    epochs: tuple[int, ...]
    admitted: tuple[int, ...] = ()
    incarnations: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class SyncRequest:
    """Ask a peer for state, optionally claiming groups first.

    ``fence`` lists ``(group, epoch)`` pairs the sender now coordinates: the receiver
    adopts a higher epoch before it answers, and from then on refuses messages of older
    epochs for those groups. ``everything`` asks for every subject (a joining member);
    otherwise the subjects of the fenced groups. Without ``reply`` only the fence is
    applied (a coordinator announcing itself on a new link).
    """

    request: int
    fence: tuple[tuple[int, int], ...]
    everything: bool = False
    reply: bool = True


@dataclass(frozen=True, slots=True)
class SyncDone:
    """All state for ``request`` was sent; ``epochs``: the replier's epochs of the fenced groups."""

    request: int
    epochs: tuple[tuple[int, int], ...] = ()


@dataclass(slots=True, unsafe_hash=True)  # not frozen: see _HOT
class Ack:
    """Guaranteed mode: the sender has cached ``subject`` up to ``seq`` of the coordinator's epoch."""

    subject: str
    epoch: int
    seq: int


@dataclass(frozen=True, slots=True)
class ClusterInfo:
    """Agent to workers: readiness and the cluster's status, as JSON (for /health and /cluster)."""

    ready: bool
    document: bytes


@dataclass(frozen=True, slots=True)
class Relay:
    """A native message POSTed for an HTTP stream held by another worker of the node."""

    worker: int
    stream: str
    payload: bytes


@dataclass(frozen=True, slots=True)
class Leaving:
    """A member stopping on purpose (SIGTERM, a drain) tells its peers before its links close: they log its
    departure as what it is, not as a lost link."""

    member: int
    reason: str = ""


BusFrame = (
    Hello
    | Forward
    | ForwardStatus
    | Published
    | Interest
    | SyncSubject
    | Challenge
    | Proof
    | Welcome
    | Heartbeat
    | TableFrame
    | SyncRequest
    | SyncDone
    | Ack
    | ClusterInfo
    | Relay
    | Leaving
)

_U32 = struct.Struct("!I")
_Q = struct.Struct("!Q")
_QQI = struct.Struct("!QQI")  # a publication's seq, epoch and publish id length
_QQ = struct.Struct("!QQ")
_KIND_LEN = struct.Struct("!BBI").pack  # a frame's kind, flags and its first string's length
_ACK = struct.Struct("!BBQQI").pack  # kind, flags, epoch, seq, the subject's length
_FORWARD_HEAD = struct.Struct("!BBQBI")  # kind, flags, request, hops, the subject's length
_FORWARD = _FORWARD_HEAD.pack
_FORWARD_AT = struct.Struct("!QBI").unpack_from  # the same after kind and flags
_STATUS = struct.Struct("!BBQQQQ").pack  # kind, status, request, seq, epoch, recipients
_QQQQ = struct.Struct("!QQQQ")
_BQQI = struct.Struct("!BQQI")  # a cached message's retained flag, epoch, seq and publish id length


def _b(data: bytes) -> bytes:
    return _U32.pack(len(data)) + data


def _s(text: str) -> bytes:
    return _b(text.encode("utf-8"))


_NO_MAP = b"\x00\x00\x00\x00"  # most publications carry no fields and no origin


def _map(values: Mapping[str, str]) -> bytes:
    if not values:
        return _NO_MAP
    return _U32.pack(len(values)) + b"".join(_s(k) + _s(v) for k, v in values.items())


def _ints(values: tuple[int, ...]) -> bytes:
    return _U32.pack(len(values)) + b"".join(_Q.pack(v) for v in values)


def _pairs(values: tuple[tuple[int, int], ...]) -> bytes:
    return _U32.pack(len(values)) + b"".join(_Q.pack(a) + _Q.pack(b) for a, b in values)


def _entry(entry: Entry) -> bytes:
    return b"".join(
        (
            bytes((entry.retained | entry.guaranteed << 1,)),
            _Q.pack(entry.epoch),
            _Q.pack(entry.seq),
            _s(entry.publish_id),
            _map(entry.fields),
            _b(entry.content),
        )
    )


def _head(kind: Kind, flags: int = 0) -> bytes:
    return bytes((kind, flags))


def encode(frame: BusFrame) -> bytes:
    """One length-prefixed bus frame."""
    body = _encode_body(frame)
    return _U32.pack(len(body)) + body


def _encode_body(frame: BusFrame) -> bytes:
    if isinstance(frame, Published):
        subject = frame.subject.encode("utf-8")
        publish_id = frame.publish_id.encode("utf-8")
        return b"".join(
            (
                _KIND_LEN(Kind.PUBLISHED, frame.retained | frame.guaranteed << 1, len(subject)),
                subject,
                _map(frame.fields),
                _QQI.pack(frame.seq, frame.epoch, len(publish_id)),
                publish_id,
                _U32.pack(len(frame.content)),
                frame.content,
            )
        )
    if isinstance(frame, Ack):
        subject = frame.subject.encode("utf-8")
        return _ACK(Kind.ACK, 0, frame.epoch, frame.seq, len(subject)) + subject
    if isinstance(frame, Forward):
        subject = frame.subject.encode("utf-8")
        return b"".join(
            (
                _FORWARD(Kind.FORWARD, frame.retained | frame.guaranteed << 1, frame.request, frame.hops, len(subject)),
                subject,
                _map(frame.fields),
                _map(frame.origin),
                _s(frame.publish_id),
                _b(frame.content),
            )
        )
    if isinstance(frame, ForwardStatus):
        reason = frame.reason.encode("utf-8")
        head = _STATUS(Kind.FORWARD_STATUS, frame.status, frame.request, frame.seq, frame.epoch, frame.recipients)
        return head + _U32.pack(len(reason)) + reason
    if isinstance(frame, Interest):
        return _head(Kind.INTEREST) + _Q.pack(frame.count) + _s(frame.subject)
    if isinstance(frame, SyncSubject):
        state = frame.state
        snap = state.snapshot
        parts = [
            _head(
                Kind.SYNC,
                (snap is not None)
                | frame.more << 1
                | bool(state.ids) << 2
                | bool(frame.held) << 3
                | bool(snap is not None and snap.guaranteed) << 4,
            ),
            _s(state.subject),
            _Q.pack(state.epoch),
            _Q.pack(state.seq),
            _Q.pack(frame.fence),
        ]
        if snap is not None:
            parts += [_Q.pack(snap.seq), _Q.pack(snap.epoch), _map(snap.fields), _b(snap.content)]
        parts.append(_U32.pack(len(state.entries)))
        parts.extend(_entry(entry) for entry in state.entries)
        if state.ids:
            parts.append(_U32.pack(len(state.ids)))
            parts.extend(_s(pid) + _Q.pack(epoch) + _Q.pack(seq) for pid, epoch, seq in state.ids)
        if frame.held:
            parts.append(_Q.pack(frame.held))
        return b"".join(parts)
    if isinstance(frame, Hello):
        return _head(Kind.HELLO) + _Q.pack(frame.worker) + _b(frame.proof)
    if isinstance(frame, Challenge):
        return _head(Kind.CHALLENGE) + _Q.pack(frame.member) + _Q.pack(frame.incarnation) + _b(frame.nonce)
    if isinstance(frame, Proof):
        return _head(Kind.PROOF) + _Q.pack(frame.member) + _Q.pack(frame.incarnation) + _b(frame.nonce) + _b(frame.mac)
    if isinstance(frame, Welcome):
        return _head(Kind.WELCOME) + _b(frame.mac)
    if isinstance(frame, Heartbeat):
        flags = frame.ready | frame.leader << 1 | frame.quorum << 2
        return b"".join(
            (
                _head(Kind.HEARTBEAT, flags),
                _Q.pack(frame.member),
                _Q.pack(frame.table_version),
                _Q.pack(frame.sent),
                _Q.pack(frame.echo),
                _Q.pack(frame.held),
                _b(frame.status),
            )
        )
    if isinstance(frame, TableFrame):
        head = _head(Kind.TABLE, bool(frame.incarnations)) + _Q.pack(frame.version)
        body = head + _ints(frame.members) + _ints(frame.epochs) + _ints(frame.admitted)
        return body + _ints(frame.incarnations) if frame.incarnations else body
    if isinstance(frame, SyncRequest):
        flags = frame.everything | frame.reply << 1
        return _head(Kind.SYNC_REQUEST, flags) + _Q.pack(frame.request) + _pairs(frame.fence)
    if isinstance(frame, SyncDone):
        return _head(Kind.SYNC_DONE) + _Q.pack(frame.request) + _pairs(frame.epochs)
    if isinstance(frame, Relay):
        return _head(Kind.RELAY) + _Q.pack(frame.worker) + _s(frame.stream) + _b(frame.payload)
    if isinstance(frame, Leaving):
        return _head(Kind.LEAVING) + _Q.pack(frame.member) + _s(frame.reason)
    return _head(Kind.CLUSTER_INFO, frame.ready) + _b(frame.document)


@contextlib.contextmanager
def _read_in_place() -> Iterator[None]:
    """What reading in place raises, as a BusError: a length past the end, or text that is not UTF-8."""
    try:
        yield
    except struct.error:
        raise BusError("truncated bus frame") from None
    except UnicodeDecodeError:
        raise BusError("bus frame string is not UTF-8") from None


class _Cursor:
    __slots__ = ("data", "pos")

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 2

    def u8(self) -> int:
        if self.pos >= len(self.data):
            raise BusError("truncated bus frame")
        value = self.data[self.pos]
        self.pos += 1
        return value

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

    def count(self, item_size: int) -> int:
        """A count of items of at least ``item_size`` bytes each, checked against what is left."""
        n = self.u32()
        if n * item_size > len(self.data) - self.pos:
            raise BusError("bus frame claims more items than it holds")
        return n

    def raw(self) -> bytes:
        n = self.u32()
        if self.pos + n > len(self.data):
            raise BusError("truncated bus frame")
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def text(self) -> str:
        try:
            return self.raw().decode("utf-8")
        except UnicodeDecodeError:
            raise BusError("bus frame string is not UTF-8") from None

    def mapping(self) -> dict[str, str]:
        return {self.text(): self.text() for _ in range(self.count(8))}

    def ints(self) -> tuple[int, ...]:
        return tuple(self.u64() for _ in range(self.count(8)))

    def pairs(self) -> tuple[tuple[int, int], ...]:
        return tuple((self.u64(), self.u64()) for _ in range(self.count(16)))

    def entries(self) -> tuple[Entry, ...]:
        """A state's cached messages, read in place as _published reads a publication: a rejoining agent
        decodes its peers' whole caches (200,000 messages: 44% of its CPU through the method calls).
        A length that runs past the end makes a later read fail or the final position differ from the
        body's length (:meth:`end`); either is a BusError."""
        n = self.count(29)
        data, pos = self.data, self.pos
        unpack = _U32.unpack_from
        head = _BQQI.unpack_from
        out = []
        with _read_in_place():
            for _ in range(n):
                retained, epoch, seq, k = head(data, pos)
                pos += 21
                publish_id = data[pos : pos + k].decode("utf-8")
                pos += k
                fields, pos = _fields_at(data, pos)
                (k,) = unpack(data, pos)
                pos += 4
                content = data[pos : pos + k]
                out.append(Entry(epoch, seq, content, fields, bool(retained & 1), publish_id, bool(retained & 2)))
                pos += k
        self.pos = pos
        return tuple(out)

    def ids(self) -> tuple[tuple[str, int, int], ...]:
        """A state's recent publish ids with their positions, read in place as :meth:`entries`."""
        n = self.count(20)
        data, pos = self.data, self.pos
        unpack = _U32.unpack_from
        pair = _QQ.unpack_from
        out = []
        with _read_in_place():
            for _ in range(n):
                (k,) = unpack(data, pos)
                pid = data[pos + 4 : pos + 4 + k].decode("utf-8")
                pos += 4 + k
                epoch, seq = pair(data, pos)
                pos += 16
                out.append((pid, epoch, seq))
        self.pos = pos
        return tuple(out)

    def end(self) -> None:
        if self.pos > len(self.data):
            raise BusError("truncated bus frame")  # a length ran past the end (read in place, unchecked)
        if self.pos != len(self.data):
            raise BusError(f"{len(self.data) - self.pos} trailing bytes in bus frame")


def _fields_at(data: bytes, pos: int) -> tuple[dict[str, str], int]:
    """The fields map at ``pos``, read in place, and the position after it (for _published and
    _Cursor.entries, which turn struct.error and UnicodeDecodeError into BusError)."""
    unpack = _U32.unpack_from
    (count,) = unpack(data, pos)
    pos += 4
    if count * 8 > len(data) - pos:
        raise BusError("bus frame claims more items than it holds")
    fields: dict[str, str] = {}
    for _ in range(count):
        (n,) = unpack(data, pos)
        key = data[pos + 4 : pos + 4 + n].decode("utf-8")
        pos += 4 + n
        (n,) = unpack(data, pos)
        fields[key] = data[pos + 4 : pos + 4 + n].decode("utf-8")
        pos += 4 + n
    return fields, pos


def _published(body: bytes, flag: int) -> Published:
    """The frame every worker decodes for every message: read in place, without a cursor's method calls.

    A length that runs past the end makes the next read fail (struct.error) or the final position
    differ from the body's length; either is a BusError, as with the cursor."""
    unpack = _U32.unpack_from
    try:
        (n,) = unpack(body, 2)
        pos = 6 + n
        subject = body[6:pos].decode("utf-8")
        fields, pos = _fields_at(body, pos)
        seq, epoch, n = _QQI.unpack_from(body, pos)
        pos += 20
        publish_id = body[pos : pos + n].decode("utf-8")
        pos += n
        (n,) = unpack(body, pos)
        pos += 4
        content = body[pos : pos + n]
        pos += n
    except struct.error:
        raise BusError("truncated bus frame") from None
    except UnicodeDecodeError:
        raise BusError("bus frame string is not UTF-8") from None
    _ends_at(body, pos)
    return Published(subject, content, fields, seq, epoch, bool(flag & 1), bool(flag & 2), publish_id)


def _forward(body: bytes, flag: int) -> Forward:
    """Every publication's first hop or two, read in place as :func:`_published`."""
    unpack = _U32.unpack_from
    try:
        request, hops, n = _FORWARD_AT(body, 2)
        pos = 15 + n
        subject = body[15:pos].decode("utf-8")
        fields, pos = _fields_at(body, pos)
        origin, pos = _fields_at(body, pos)
        (n,) = unpack(body, pos)
        publish_id = body[pos + 4 : pos + 4 + n].decode("utf-8")
        pos += 4 + n
        (n,) = unpack(body, pos)
        pos += 4
        content = body[pos : pos + n]
        pos += n
    except struct.error:
        raise BusError("truncated bus frame") from None
    except UnicodeDecodeError:
        raise BusError("bus frame string is not UTF-8") from None
    _ends_at(body, pos)
    return Forward(request, subject, content, fields, bool(flag & 1), bool(flag & 2), origin, publish_id, hops)


def _forward_status(body: bytes, flag: int) -> ForwardStatus:
    try:
        request, seq, epoch, recipients = _QQQQ.unpack_from(body, 2)
        (n,) = _U32.unpack_from(body, 34)
        reason = body[38 : 38 + n].decode("utf-8")
    except struct.error:
        raise BusError("truncated bus frame") from None
    except UnicodeDecodeError:
        raise BusError("bus frame string is not UTF-8") from None
    _ends_at(body, 38 + n)
    return ForwardStatus(request, flag, seq, reason, epoch, recipients)


def _ack(body: bytes, flag: int) -> Ack:
    try:
        epoch, seq, n = _QQI.unpack_from(body, 2)
        subject = body[22 : 22 + n].decode("utf-8")
    except struct.error:
        raise BusError("truncated bus frame") from None
    except UnicodeDecodeError:
        raise BusError("bus frame string is not UTF-8") from None
    _ends_at(body, 22 + n)
    return Ack(subject, epoch, seq)


def _ends_at(body: bytes, pos: int) -> None:
    if pos != len(body):
        raise BusError("truncated bus frame" if pos > len(body) else f"{len(body) - pos} trailing bytes in bus frame")


# the frames of every publication, read in place without a cursor's method calls
_IN_PLACE: dict[int, Callable[[bytes, int], BusFrame]] = {
    Kind.PUBLISHED: _published,
    Kind.FORWARD: _forward,
    Kind.FORWARD_STATUS: _forward_status,
    Kind.ACK: _ack,
}


def decode(body: bytes) -> BusFrame:
    """Decode one frame body (without its length prefix); raises :class:`BusError`."""
    if len(body) < 2:
        raise BusError("bus frame too short")
    kind, flag = body[0], body[1]
    if kind in _IN_PLACE:
        return _IN_PLACE[kind](body, flag)
    c = _Cursor(body)
    frame: BusFrame
    if kind == Kind.INTEREST:
        count = c.u64()
        frame = Interest(c.text(), count)
    elif kind == Kind.SYNC:
        subject = c.text()
        epoch = c.u64()
        seq = c.u64()
        fence = c.u64()
        snapshot = None
        if flag & 1:
            snap_seq = c.u64()
            snap_epoch = c.u64()
            snap_fields = c.mapping()
            snapshot = Snapshot(subject, c.raw(), snap_fields, snap_seq, snap_epoch, bool(flag & 16))
        entries = c.entries()
        ids: tuple[tuple[str, int, int], ...] = ()
        if flag & 4:
            ids = c.ids()
        held = c.u64() if flag & 8 else 0
        frame = SyncSubject(SubjectSync(subject, epoch, seq, snapshot, entries, ids), bool(flag & 2), fence, held)
    elif kind == Kind.HELLO:
        worker = c.u64()
        frame = Hello(worker, c.raw())
    elif kind == Kind.CHALLENGE:
        member = c.u64()
        incarnation = c.u64()
        frame = Challenge(member, incarnation, c.raw())
    elif kind == Kind.PROOF:
        member = c.u64()
        incarnation = c.u64()
        nonce = c.raw()
        frame = Proof(member, incarnation, nonce, c.raw())
    elif kind == Kind.WELCOME:
        frame = Welcome(c.raw())
    elif kind == Kind.HEARTBEAT:
        member = c.u64()
        version = c.u64()
        sent = c.u64()
        echo = c.u64()
        held = c.u64()
        frame = Heartbeat(member, bool(flag & 1), bool(flag & 2), bool(flag & 4), version, sent, echo, held, c.raw())
    elif kind == Kind.TABLE:
        version = c.u64()
        members = c.ints()
        epochs = c.ints()
        admitted = c.ints()
        frame = TableFrame(version, members, epochs, admitted, c.ints() if flag & 1 else ())
    elif kind == Kind.SYNC_REQUEST:
        request = c.u64()
        frame = SyncRequest(request, c.pairs(), bool(flag & 1), bool(flag & 2))
    elif kind == Kind.SYNC_DONE:
        request = c.u64()
        frame = SyncDone(request, c.pairs())
    elif kind == Kind.CLUSTER_INFO:
        frame = ClusterInfo(bool(flag & 1), c.raw())
    elif kind == Kind.RELAY:
        worker = c.u64()
        stream = c.text()
        frame = Relay(worker, stream, c.raw())
    elif kind == Kind.LEAVING:
        member = c.u64()
        frame = Leaving(member, c.text())
    else:
        raise BusError(f"unknown bus frame kind {kind}")
    c.end()
    return frame


def sync_frames(state: SubjectSync, fence: int = 0, held: int = 0) -> Iterable[SyncSubject]:
    """One subject's state as frames of at most about SYNC_CHUNK_BYTES each, sent under epoch ``fence``.

    A full cache at ``MaxCachedMessagesPerSubject``'s maximum is megabytes: chunks keep every frame
    far below :data:`MAX_BUS_FRAME` and let the receiver merge as it goes.
    """
    entries = state.entries
    if not entries:
        yield SyncSubject(state, False, fence, held)
        return
    if len(entries) * 64 + sum(len(e.content) for e in entries) < SYNC_CHUNK_BYTES:
        yield SyncSubject(state, False, fence, held)
        return
    start, size = 0, 0
    for i, entry in enumerate(entries):
        size += len(entry.content) + 64
        if size >= SYNC_CHUNK_BYTES and i + 1 < len(entries):
            yield SyncSubject(
                SubjectSync(state.subject, state.epoch, state.seq, state.snapshot, entries[start : i + 1]), True, fence
            )
            start, size = i + 1, 0
    yield SyncSubject(
        SubjectSync(state.subject, state.epoch, state.seq, state.snapshot, entries[start:], state.ids),
        False,
        fence,
        held,
    )


class BusDecoder:
    """Splits a byte stream into bus frames; ``max_frame`` bounds what a peer may make us buffer.

    Before a peer has authenticated, read with :meth:`push` and :meth:`next_frame`: one frame at a
    time under the small pre-authentication limit, so whatever arrived in the same read after the
    Hello waits in the buffer and is decoded only once the caller has raised ``max_frame`` (a state
    sync follows the Hello at once, and one read often holds both).
    """

    __slots__ = ("_buf", "max_frame")

    def __init__(self, max_frame: int = MAX_BUS_FRAME) -> None:
        self._buf = b""
        self.max_frame = max_frame

    def push(self, data: bytes) -> None:
        """Buffer ``data`` without decoding it (pre-authentication; bounded by one read)."""
        self._buf += data

    def next_frame(self) -> BusFrame | None:
        """The next complete frame under the current ``max_frame``, or None until more bytes arrive."""
        buf = self._buf
        if len(buf) < 4:
            return None
        (length,) = _U32.unpack_from(buf, 0)
        if length > self.max_frame:
            raise BusError(f"bus frame of {length} bytes (at most {self.max_frame})")
        if len(buf) - 4 < length:
            return None
        self._buf = buf[4 + length :]
        return decode(buf[4 : 4 + length])

    def feed(self, data: bytes) -> list[BusFrame]:
        return [decode(body) for body in self.bodies(data)]

    def bodies(self, data: bytes) -> list[bytes]:
        """The complete frames' bodies, not decoded yet (a member link decodes them a few at a time)."""
        buf = self._buf + data if self._buf else data
        out: list[bytes] = []
        pos = 0
        while len(buf) - pos >= 4:
            (length,) = _U32.unpack_from(buf, pos)
            if length > self.max_frame:
                raise BusError(f"bus frame of {length} bytes (at most {self.max_frame})")
            if len(buf) - pos - 4 < length:
                break
            out.append(buf[pos + 4 : pos + 4 + length])
            pos += 4 + length
        self._buf = buf[pos:]
        return out
