"""Client-side wire formats of every target the kit can drive, without I/O.

``migratory``: the native protocol over WebSocket; ``ws-broadcast`` and
``websockets``: plain WebSocket, every binary message goes to every client;
``nats``: the NATS text protocol; ``mqtt``: MQTT 3.1.1 with QoS 0 (Mosquitto);
``migratory-mqtt`` and ``nats-mqtt``: the same MQTT, to this server's ``ListenMqtt`` and
to nats-server's MQTT listener, so that MQTT servers compare on identical workloads;
``migratory-stream``: the native protocol over HTTP streaming (``GET /stream``,
``POST /stream/<id>``, the browsers' fallback). ``migratory-wss``,
``nats-tls`` and ``mqtt-tls`` are the same over TLS (the loaders trust the test CA
the kit makes). Each codec turns
subscriptions and publications into bytes and incoming bytes into message
payloads (whose first 8 bytes are the publisher's clock, for latency).
"""

from __future__ import annotations

import base64
import os
import re
import struct
from collections.abc import Sequence

from migratory import protocol as p
from migratory.websocket import apply_mask

__all__ = ["MQTT_TARGETS", "TARGETS", "TLS_TARGETS", "Codec", "StreamCodec", "base_target", "codec_for", "mqtt_topic"]

TARGETS = (
    "migratory",
    "migratory-wss",
    "migratory-stream",
    "ws-broadcast",
    "websockets",
    "nats",
    "nats-tls",
    "mqtt",
    "mqtt-tls",
    "migratory-mqtt",
    "nats-mqtt",
)
TLS_TARGETS = ("migratory-wss", "nats-tls", "mqtt-tls")
"""The targets reached over TLS: the server presents a certificate from the kit's test CA."""

_BASES = {
    "migratory-wss": "migratory",
    "migratory-stream": "migratory",
    "nats-tls": "nats",
    "mqtt-tls": "mqtt",
    "migratory-mqtt": "mqtt",
    "nats-mqtt": "mqtt",
}
MQTT_TARGETS = ("mqtt", "migratory-mqtt", "nats-mqtt")
"""The MQTT servers, driven by the same client code (:class:`MqttCodec`): Mosquitto, this server, nats-server."""


def base_target(target: str) -> str:
    """The wire protocol of a target: ``migratory-wss`` speaks what ``migratory`` speaks, over TLS.

    ``migratory-stream``'s publisher speaks it too (over WebSocket): only its subscribers stream;
    ``migratory-mqtt`` and ``nats-mqtt`` speak ``mqtt``.
    """
    return _BASES.get(target, target)


def _mask(payload: bytes) -> bytes:
    """A masked client frame (RFC 6455 requires clients to mask)."""
    key = os.urandom(4)
    n = len(payload)
    if n < 126:
        header = bytes((0x82, 0x80 | n))
    elif n < 65536:
        header = struct.pack("!BBH", 0x82, 0x80 | 126, n)
    else:
        header = struct.pack("!BBQ", 0x82, 0x80 | 127, n)
    return header + key + apply_mask(payload, key)


class Codec:
    """Base: a stream parser that yields message payloads."""

    def __init__(self) -> None:
        self.buf = b""
        self.ready = False
        self.subscribed = 0  # subscriptions the server confirmed (native protocol)

    def is_ready(self, subjects: int) -> bool:
        """Connected and subscribed, as far as the protocol lets a client know."""
        return self.ready

    def hello(self, host: str, subjects: Sequence[str]) -> bytes:
        raise NotImplementedError

    def publish(self, subject: str, payload: bytes) -> bytes:
        raise NotImplementedError

    def feed(self, data: bytes) -> tuple[list[bytes], bytes]:
        """Payloads of complete messages, and bytes to answer (pongs)."""
        raise NotImplementedError


def _read_native(codec: Codec, message: bytes, out: list[bytes]) -> bool:
    """Handle a native server message that both transports handle alike; False for any other.

    A delivery's content goes to ``out`` (unless a snapshot); a confirmed subscription counts.
    """
    if message[0] == p.Op.MESSAGE:
        frame = p.decode_server(message)
        assert isinstance(frame, p.Delivery)
        if not frame.snapshot:
            out.append(frame.content)
        return True
    if message[0] == p.Op.SUBSCRIBE_STATUS and message[1] == p.Status.OK:
        codec.subscribed += 1
        return True
    return False


_RETRY_AFTER = re.compile(rb"\r\nretry-after:[ \t]*(\d{1,6})[ \t]*(?=\r\n|$)", re.IGNORECASE)
_TOLD = re.compile(r"\(Retry-After: (\d+)\)")


def retry_after(exc: BaseException) -> float | None:
    """Seconds a refused upgrade said to wait (503 with Retry-After: a server's admission, docs/operations.md)."""
    told = _TOLD.search(str(exc))
    return float(told.group(1)) if told else None


class _Http(Codec):
    """A codec whose server answers first with an HTTP response head."""

    def check_head(self, buf: bytes, end: int) -> None:
        """Raise ConnectionError unless the response head ``buf[:end]`` is the one expected."""
        raise NotImplementedError

    def past_head(self, data: bytes) -> bytes | None:
        """The bytes buffered and ``data``, past the response head; None (kept) while the head is incomplete."""
        buf = self.buf + data if self.buf else data
        if not self.ready:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                self.buf = buf
                return None
            self.check_head(buf, end)
            self.ready = True
            buf = buf[end + 4 :]
        return buf


class _WebSocket(_Http):
    def hello(self, host: str, subjects: Sequence[str]) -> bytes:
        key = base64.b64encode(os.urandom(16)).decode()
        return (
            f"GET / HTTP/1.1\r\nHost: {host}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
        ).encode() + self.after_upgrade(subjects)

    def after_upgrade(self, subjects: Sequence[str]) -> bytes:
        return b""

    def check_head(self, buf: bytes, end: int) -> None:
        if not buf.startswith(b"HTTP/1.1 101"):
            wait = _RETRY_AFTER.search(buf[:end])
            told = f" (Retry-After: {int(wait.group(1))})" if wait else ""
            raise ConnectionError(f"upgrade refused: {buf[:40]!r}{told}")

    def frames(self, data: bytes) -> tuple[list[tuple[int, bytes]], bytes]:
        buf = self.past_head(data)
        if buf is None:
            return [], b""
        out: list[tuple[int, bytes]] = []
        pong = b""
        pos = 0
        n = len(buf)
        while n - pos >= 2:
            length = buf[pos + 1] & 0x7F
            head = 2
            if length == 126:
                if n - pos < 4:
                    break
                (length,) = struct.unpack_from("!H", buf, pos + 2)
                head = 4
            elif length == 127:
                if n - pos < 10:
                    break
                (length,) = struct.unpack_from("!Q", buf, pos + 2)
                head = 10
            if n - pos < head + length:
                break
            opcode = buf[pos] & 0x0F
            payload = buf[pos + head : pos + head + length]
            if opcode == 0x9:
                pong += _mask_control(0xA, payload)
            else:
                out.append((opcode, payload))
            pos += head + length
        self.buf = buf[pos:]
        return out, pong


def _mask_control(opcode: int, payload: bytes) -> bytes:
    frame = bytearray(_mask(payload))
    frame[0] = 0x80 | opcode
    return bytes(frame)


PUBLISH_RETRIES = 20


class MigratoryCodec(_WebSocket):
    """The native protocol. A publication answered FAILED (its outcome unknown: a coordinator changed in a
    failover) is sent again with its publish id, as the client library's ``publish(retries=N)`` does, at
    most :data:`PUBLISH_RETRIES` times, and counted refused only if never acknowledged: the cluster numbers
    it once however often it arrives."""

    refused: dict[str, int]  # a publisher's publications answered other than OK, by status and reason
    # subject -> publications answered neither OK nor NO_SUBSCRIBER: never published, so never delivered
    unpublished: dict[str, int]

    def __init__(self) -> None:
        super().__init__()
        self.refused = {}
        self.unpublished = {}
        self._prefix = os.urandom(4).hex()
        self._count = 0
        self._waiting: dict[str, tuple[str, bytes, int]] = {}  # closure -> (subject, frame, attempts so far)
        self._due: list[bytes] = []  # FAILED ones, to send again
        self.retried = 0

    def after_upgrade(self, subjects: Sequence[str]) -> bytes:
        out = _mask(p.encode_connect())
        if subjects:
            out += _mask(p.encode_subscribe(list(subjects)))
        return out

    def publish(self, subject: str, payload: bytes) -> bytes:
        self._count += 1
        closure = f"{subject} {self._count}"
        frame = _mask(
            p.encode_publish(
                subject, payload, closure=closure, retained=True, publish_id=f"{self._prefix}-{self._count}"
            )
        )
        self._waiting[closure] = (subject, frame, 0)
        return frame

    def take_retries(self) -> bytes:
        """The publications answered FAILED since the last call, to send again (same publish ids)."""
        due, self._due = self._due, []
        return b"".join(due)

    @property
    def unanswered(self) -> int:
        """Publications sent and not yet answered for good (their first answer, or a retry's, still to come)."""
        return len(self._waiting)

    def _answered(self, answer: p.PublishStatus) -> None:
        waiting = self._waiting.pop(answer.closure, None)
        subject = waiting[0] if waiting is not None else answer.closure.rpartition(" ")[0]
        if answer.status is p.Status.OK:
            return
        if answer.status is p.Status.FAILED and waiting is not None and waiting[2] < PUBLISH_RETRIES:
            self._waiting[answer.closure] = (subject, waiting[1], waiting[2] + 1)
            self._due.append(waiting[1])
            self.retried += 1
            return
        why = f"{answer.status.name}: {answer.reason}"[:100]
        self.refused[why] = self.refused.get(why, 0) + 1
        if answer.status is not p.Status.NO_SUBSCRIBER:
            self.unpublished[subject] = self.unpublished.get(subject, 0) + 1

    def feed(self, data: bytes) -> tuple[list[bytes], bytes]:
        frames, pong = self.frames(data)
        out: list[bytes] = []
        for opcode, payload in frames:
            if opcode != 0x2 or not payload or _read_native(self, payload, out):
                continue
            if payload[0] == p.Op.PUBLISH_STATUS:
                answer = p.decode_server(payload)
                assert isinstance(answer, p.PublishStatus)
                self._answered(answer)
        return out, pong

    def is_ready(self, subjects: int) -> bool:
        return self.ready and self.subscribed >= subjects


class BroadcastCodec(_WebSocket):
    def publish(self, subject: str, payload: bytes) -> bytes:
        return _mask(payload)

    def feed(self, data: bytes) -> tuple[list[bytes], bytes]:
        frames, pong = self.frames(data)
        return [payload for opcode, payload in frames if opcode == 0x2], pong


class StreamCodec(_Http):
    """The native protocol over HTTP streaming (docs/protocol.md), a subscriber's side.

    :meth:`hello` is ``GET /stream``; the response head names the stream
    (:attr:`stream_id`), then the chunked body carries ``u32`` length-prefixed native
    messages (zero-length ones keep proxies awake). What the client says goes as
    ``POST /stream/<id>`` on another connection: :meth:`posts`.
    """

    def __init__(self) -> None:
        super().__init__()
        self.stream_id = ""
        self.body = b""  # de-chunked bytes not yet a whole native message
        self.chunk_left = 0  # bytes of the current chunk still to come (then its CRLF)

    def hello(self, host: str, subjects: Sequence[str]) -> bytes:
        return f"GET /stream HTTP/1.1\r\nHost: {host}\r\nAccept: application/octet-stream\r\n\r\n".encode()

    def posts(self, host: str, subjects: Sequence[str]) -> tuple[bytes, int]:
        """Pipelined ``POST /stream/<id>`` requests (CONNECT, then SUBSCRIBE), the last closing; and their count."""
        messages = [p.encode_connect()]
        if subjects:
            messages.append(p.encode_subscribe(list(subjects)))
        out = []
        for i, message in enumerate(messages):
            close = "Connection: close\r\n" if i == len(messages) - 1 else ""
            out.append(
                f"POST /stream/{self.stream_id} HTTP/1.1\r\nHost: {host}\r\n{close}"
                f"Content-Type: application/octet-stream\r\nContent-Length: {len(message)}\r\n\r\n".encode()
                + message
            )
        return b"".join(out), len(messages)

    def publish(self, subject: str, payload: bytes) -> bytes:
        raise NotImplementedError("migratory-stream publishes over WebSocket (codec_for(base_target(...)))")

    def _dechunk(self, buf: bytes) -> bytes:
        """The chunk bodies in ``buf``; an incomplete chunk header stays in ``self.buf``."""
        out = []
        pos = 0
        n = len(buf)
        while pos < n:
            left = self.chunk_left
            if left > 2:  # body bytes, then the chunk's CRLF
                take = min(left - 2, n - pos)
                out.append(buf[pos : pos + take])
                pos += take
                self.chunk_left -= take
            elif left:  # the CRLF after a chunk body
                take = min(left, n - pos)
                pos += take
                self.chunk_left -= take
            else:
                end = buf.find(b"\r\n", pos)
                if end < 0:
                    break
                size = int(buf[pos:end].split(b";", 1)[0], 16)
                if size == 0:
                    raise ConnectionError("the server ended the stream")
                pos = end + 2
                self.chunk_left = size + 2
        self.buf = buf[pos:]
        return b"".join(out)

    def check_head(self, buf: bytes, end: int) -> None:
        head = buf[:end].decode("latin-1")
        if not head.startswith("HTTP/1.1 200"):
            raise ConnectionError(f"stream refused: {head[:40]!r}")
        for line in head.split("\r\n")[1:]:
            name, _, value = line.partition(":")
            if name.strip().lower() == "x-migratory-stream":
                self.stream_id = value.strip()
        if not self.stream_id:
            raise ConnectionError("no X-Migratory-Stream header")

    def feed(self, data: bytes) -> tuple[list[bytes], bytes]:
        buf = self.past_head(data)
        if buf is None:
            return [], b""
        body = self.body + self._dechunk(buf) if self.body else self._dechunk(buf)
        out: list[bytes] = []
        pos = 0
        n = len(body)
        while n - pos >= 4:
            length = int.from_bytes(body[pos : pos + 4], "big")
            if n - pos - 4 < length:
                break
            message = body[pos + 4 : pos + 4 + length]
            pos += 4 + length
            if message:  # an empty one is a keep-alive
                _read_native(self, message, out)
        self.body = body[pos:]
        return out, b""

    def is_ready(self, subjects: int) -> bool:
        return self.ready and self.subscribed >= subjects


def nats_subject(subject: str) -> str:
    return subject.strip("/").replace("/", ".")


class NatsCodec(Codec):
    def hello(self, host: str, subjects: Sequence[str]) -> bytes:
        out = [b'CONNECT {"verbose":false,"pedantic":false}\r\n']
        out += [f"SUB {nats_subject(s)} {i + 1}\r\n".encode() for i, s in enumerate(subjects)]
        out.append(b"PING\r\n")
        return b"".join(out)

    def publish(self, subject: str, payload: bytes) -> bytes:
        return f"PUB {nats_subject(subject)} {len(payload)}\r\n".encode() + payload + b"\r\n"

    def feed(self, data: bytes) -> tuple[list[bytes], bytes]:
        buf = self.buf + data if self.buf else data
        out: list[bytes] = []
        answer = b""
        pos = 0
        while True:
            end = buf.find(b"\r\n", pos)
            if end < 0:
                break
            line = buf[pos:end]
            if line.startswith(b"MSG "):
                size = int(line.rsplit(b" ", 1)[1])
                if len(buf) < end + 2 + size + 2:
                    break
                out.append(buf[end + 2 : end + 2 + size])
                pos = end + 2 + size + 2
                continue
            if line == b"PING":
                answer += b"PONG\r\n"
            elif line.startswith(b"-ERR"):
                raise ConnectionError(line.decode(errors="replace"))
            elif line == b"PONG":
                self.ready = True
            pos = end + 2
        self.buf = buf[pos:]
        return out, answer


def _remaining(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n % 128
        n //= 128
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _mqtt_str(text: str) -> bytes:
    data = text.encode()
    return struct.pack("!H", len(data)) + data


def mqtt_topic(subject: str) -> str:
    """The MQTT topic of a kit subject: ``/bench/s1`` is ``bench/s1``.

    This server maps topic ``a/b`` to subject ``/a/b`` and takes topics of two levels or more
    (a subject has at least two segments), so a one-level subject becomes ``bench/<level>``
    (``/s1``: ``bench/s1``), the same on every MQTT target. The kit's subjects (``/bench/sN``)
    already have two levels: their topics are those Mosquitto always got.
    """
    topic = subject.strip("/")
    return topic if "/" in topic else f"bench/{topic}"


class MqttCodec(Codec):
    """MQTT 3.1.1, QoS 0, clean session, no keep-alive: what every MQTT target is driven with."""

    want_suback = False

    def hello(self, host: str, subjects: Sequence[str]) -> bytes:
        self.want_suback = bool(subjects)
        client_id = "b" + os.urandom(8).hex()
        variable = _mqtt_str("MQTT") + bytes((4, 0x02)) + struct.pack("!H", 0)  # clean session, no keepalive
        body = variable + _mqtt_str(client_id)
        out = bytes((0x10,)) + _remaining(len(body)) + body
        if subjects:
            payload = b"".join(_mqtt_str(mqtt_topic(s)) + b"\x00" for s in subjects)
            sub = struct.pack("!H", 1) + payload
            out += bytes((0x82,)) + _remaining(len(sub)) + sub
        return out

    def publish(self, subject: str, payload: bytes) -> bytes:
        body = _mqtt_str(mqtt_topic(subject)) + payload
        return bytes((0x30,)) + _remaining(len(body)) + body

    def feed(self, data: bytes) -> tuple[list[bytes], bytes]:
        buf = self.buf + data if self.buf else data
        out: list[bytes] = []
        pos = 0
        n = len(buf)
        while n - pos >= 2:
            first = buf[pos]
            length = 0
            shift = 0
            i = pos + 1
            while True:
                if i >= n:
                    self.buf = buf[pos:]
                    return out, b""
                byte = buf[i]
                length |= (byte & 0x7F) << shift
                shift += 7
                i += 1
                if not byte & 0x80:
                    break
            if n - i < length:
                break
            body = buf[i : i + length]
            kind = first >> 4
            if kind == 3:
                (topic_len,) = struct.unpack_from("!H", body, 0)
                skip = 2 + topic_len + (2 if first & 0x06 else 0)
                out.append(body[skip:])
            elif kind == 2 and len(body) >= 2 and body[1]:
                raise ConnectionError(f"CONNACK refused the connection: return code {body[1]}")
            elif kind == 9 and 0x80 in body[2:]:
                raise ConnectionError("SUBACK refused the subscription (return code 0x80)")
            elif kind == 9 or (kind == 2 and not self.want_suback):
                self.ready = True
            pos = i + length
        self.buf = buf[pos:]
        return out, b""


def codec_for(target: str) -> Codec:
    if target == "migratory-stream":
        return StreamCodec()
    kind = base_target(target)
    if kind == "migratory":
        return MigratoryCodec()
    if kind in ("ws-broadcast", "websockets"):
        return BroadcastCodec()
    if kind == "nats":
        return NatsCodec()
    if kind == "mqtt":
        return MqttCodec()
    raise ValueError(f"unknown target {target!r}; choose one of {', '.join(TARGETS)}")
