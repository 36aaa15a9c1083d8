"""RFC 6455 for the server side, without I/O: handshake key, frame parser, frame builder.

Why not websockets' ``ServerProtocol`` on the hot path: it keeps a generator, a
reader and several buffers per connection (about 10 KB), while an idle connection
here must cost under 2 KB. This parser allocates nothing until bytes arrive, and
server frames are built once per message and shared by every subscriber
(server-to-client frames are unmasked, so they are identical for all).
"""

from __future__ import annotations

import base64
import hashlib
import struct
from dataclasses import dataclass

__all__ = [
    "CLOSE_GOING_AWAY",
    "CLOSE_MESSAGE_TOO_BIG",
    "CLOSE_NORMAL",
    "CLOSE_POLICY_VIOLATION",
    "CLOSE_PROTOCOL_ERROR",
    "CLOSE_TRY_AGAIN_LATER",
    "CLOSE_UNSUPPORTED_DATA",
    "OP_BINARY",
    "OP_CLOSE",
    "OP_CONT",
    "OP_PING",
    "OP_PONG",
    "OP_TEXT",
    "OP_TOO_BIG",
    "Frame",
    "FrameParser",
    "WebSocketError",
    "accept_key",
    "apply_mask",
    "build_close",
    "build_frame",
    "close_code_allowed",
    "frame_payload",
    "parse_close",
    "valid_key",
]

GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"

OP_CONT = 0x0
OP_TEXT = 0x1
OP_BINARY = 0x2
OP_CLOSE = 0x8
OP_PING = 0x9
OP_PONG = 0xA
OP_TOO_BIG = -1
"""Pseudo-opcode: a message over the size limit was skipped; payload is its size so far."""

CLOSE_NORMAL = 1000
CLOSE_GOING_AWAY = 1001
CLOSE_PROTOCOL_ERROR = 1002
CLOSE_UNSUPPORTED_DATA = 1003
CLOSE_POLICY_VIOLATION = 1008
CLOSE_MESSAGE_TOO_BIG = 1009
CLOSE_TRY_AGAIN_LATER = 1013  # this server cannot serve now: reconnect, to another server of the list


class WebSocketError(Exception):
    """A peer broke RFC 6455; ``code`` is the close code to answer with."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Frame:
    """A complete message (fragments joined) or a control frame."""

    opcode: int
    payload: bytes


def valid_key(key: str) -> bool:
    """Whether a Sec-WebSocket-Key is the base64 of exactly 16 bytes (RFC 6455 section 4.2.1)."""
    if len(key) != 24 or not key.isascii():
        return False
    try:
        return len(base64.b64decode(key, validate=True)) == 16
    except ValueError:  # binascii.Error
        return False


def accept_key(key: str) -> str:
    """The Sec-WebSocket-Accept value for a client's Sec-WebSocket-Key (check it with :func:`valid_key`)."""
    return base64.b64encode(hashlib.sha1(key.encode("latin-1") + GUID).digest()).decode("ascii")


_CLOSE_CODES = frozenset((1000, 1001, 1002, 1003, 1007, 1008, 1009, 1010, 1011, 1012, 1013, 1014))
"""Codes below 3000 that a peer may send: RFC 6455 section 7.4.1 and the IANA registry.

1004 is reserved, 1005, 1006 and 1015 must never be sent in a close frame, and the
rest of 1000-2999 is unassigned; 3000-4999 belong to libraries and applications.
"""


def close_code_allowed(code: int) -> bool:
    """Whether a peer may send ``code`` in a close frame (RFC 6455 section 7.4)."""
    return code in _CLOSE_CODES or 3000 <= code <= 4999


def build_frame(opcode: int, payload: bytes) -> bytes:
    """One unmasked, final server frame."""
    length = len(payload)
    first = 0x80 | opcode
    if length < 126:
        header = bytes((first, length))
    elif length < 65536:
        header = struct.pack("!BBH", first, 126, length)
    else:
        header = struct.pack("!BBQ", first, 127, length)
    return header + payload


def frame_payload(frame: bytes) -> bytes:
    """The payload of an unmasked frame this module built (what the engine hands its clients)."""
    length = frame[1] & 0x7F
    return frame[2 if length < 126 else 4 if length == 126 else 10 :]


def build_close(code: int, reason: str = "") -> bytes:
    """A close frame with a status code and a reason cut to fit 125 bytes."""
    raw = reason.encode("utf-8")[:123]
    while raw:
        try:
            raw.decode("utf-8")
            break
        except UnicodeDecodeError:
            raw = raw[:-1]
    return build_frame(OP_CLOSE, struct.pack("!H", code) + raw)


def parse_close(payload: bytes) -> tuple[int, str]:
    """Code and reason of a received close frame (1005 when none was given).

    A 1-byte payload, a code that RFC 6455 section 7.4 does not allow on the wire, or
    a reason that is not UTF-8 raise :class:`WebSocketError` with code 1002.
    """
    if not payload:
        return 1005, ""
    if len(payload) == 1:
        raise WebSocketError(CLOSE_PROTOCOL_ERROR, "close frame with a 1-byte payload")
    (code,) = struct.unpack("!H", payload[:2])
    if not close_code_allowed(code):
        raise WebSocketError(CLOSE_PROTOCOL_ERROR, f"close code {code} is not allowed (RFC 6455 section 7.4)")
    try:
        reason = payload[2:].decode("utf-8")
    except UnicodeDecodeError:
        raise WebSocketError(CLOSE_PROTOCOL_ERROR, "close reason is not UTF-8") from None
    return code, reason


def apply_mask(payload: bytes, mask: bytes) -> bytes:
    """Payload XOR the 4-byte masking key: masks and unmasks alike (RFC 6455 section 5.3)."""
    if not payload:
        return payload
    # XOR through big integers: far faster in CPython than a per-byte loop.
    length = len(payload)
    repeated = (mask * (length // 4 + 1))[:length]
    value = int.from_bytes(payload, "little") ^ int.from_bytes(repeated, "little")
    return value.to_bytes(length, "little")


class FrameParser:
    """Incremental parser of client frames (which RFC 6455 requires to be masked).

    ``feed()`` returns complete messages and control frames; fragmented messages are
    reassembled. A message larger than ``max_size`` is skipped without being
    buffered and reported once as a frame with the pseudo-opcode ``OP_TOO_BIG``, so
    the connection survives it; a protocol violation raises :class:`WebSocketError`.
    """

    __slots__ = ("_buf", "_discarding", "_frag_op", "_frag_size", "_frags", "_skip", "max_size")

    def __init__(self, max_size: int) -> None:
        self.max_size = max_size
        self._buf = b""
        self._frag_op = -1
        self._frags: list[bytes] | None = None
        self._frag_size = 0
        self._skip = 0
        self._discarding = False

    @property
    def idle(self) -> bool:
        """True between messages: a fresh parser would continue exactly the same."""
        return not self._buf and self._frags is None and not self._skip and not self._discarding

    @property
    def buffered(self) -> int:
        """Bytes received but not yet part of a complete frame."""
        return len(self._buf)

    def feed(self, data: bytes) -> list[Frame]:
        frames: list[Frame] = []
        if self._skip:
            # Still inside an oversized frame: drop its bytes without buffering them.
            if len(data) <= self._skip:
                self._skip -= len(data)
                return frames
            data = data[self._skip :]
            self._skip = 0
        buf = self._buf + data if self._buf else data
        pos = 0
        end = len(buf)
        while end - pos >= 2:
            b0 = buf[pos]
            b1 = buf[pos + 1]
            if b0 & 0x70:
                raise WebSocketError(CLOSE_PROTOCOL_ERROR, "reserved bits set without a negotiated extension")
            if not b1 & 0x80:
                raise WebSocketError(CLOSE_PROTOCOL_ERROR, "client frames must be masked")
            fin = b0 & 0x80
            opcode = b0 & 0x0F
            length = b1 & 0x7F
            header = 2
            if length == 126:
                if end - pos < 4:
                    break
                (length,) = struct.unpack_from("!H", buf, pos + 2)
                header = 4
            elif length == 127:
                if end - pos < 10:
                    break
                (length,) = struct.unpack_from("!Q", buf, pos + 2)
                header = 10
                if length >> 63:
                    raise WebSocketError(CLOSE_PROTOCOL_ERROR, "frame length has its top bit set")
            if opcode >= 0x8:
                if not fin:
                    raise WebSocketError(CLOSE_PROTOCOL_ERROR, "fragmented control frame")
                if length > 125:
                    raise WebSocketError(CLOSE_PROTOCOL_ERROR, "control frame longer than 125 bytes")
                if opcode not in (OP_CLOSE, OP_PING, OP_PONG):
                    raise WebSocketError(CLOSE_PROTOCOL_ERROR, f"unknown control opcode 0x{opcode:x}")
            elif opcode not in (OP_CONT, OP_TEXT, OP_BINARY):
                raise WebSocketError(CLOSE_PROTOCOL_ERROR, f"unknown data opcode 0x{opcode:x}")
            elif end - pos < header + 4:
                break
            elif self._discarding or self._frag_size + length > self.max_size:
                # Skip the oversized message (all its fragments) but keep the connection:
                # the caller reports it once, and later messages are still read.
                if opcode == OP_CONT and self._frags is None and not self._discarding:
                    raise WebSocketError(CLOSE_PROTOCOL_ERROR, "continuation frame without a message to continue")
                if opcode != OP_CONT and (self._frags is not None or self._discarding):
                    raise WebSocketError(CLOSE_PROTOCOL_ERROR, "new message started before the previous one ended")
                size = self._frag_size + length
                if not self._discarding:
                    frames.append(Frame(OP_TOO_BIG, str(size).encode()))
                self._frags = None
                self._frag_size = 0
                self._frag_op = -1
                self._discarding = not fin
                available = end - pos - header - 4
                if available < length:
                    self._skip = length - available
                    pos = end
                    break
                pos += header + 4 + length
                continue
            total = header + 4 + length
            if end - pos < total:
                break
            mask = buf[pos + header : pos + header + 4]
            payload = apply_mask(buf[pos + header + 4 : pos + total], mask)
            pos += total
            if opcode >= 0x8:
                frames.append(Frame(opcode, payload))
            elif opcode == OP_CONT:
                if self._frags is None:
                    raise WebSocketError(CLOSE_PROTOCOL_ERROR, "continuation frame without a message to continue")
                self._frags.append(payload)
                self._frag_size += length
                if fin:
                    frames.append(Frame(self._frag_op, b"".join(self._frags)))
                    self._frags = None
                    self._frag_size = 0
                    self._frag_op = -1
            else:
                if self._frags is not None:
                    raise WebSocketError(CLOSE_PROTOCOL_ERROR, "new message started before the previous one ended")
                if fin:
                    frames.append(Frame(opcode, payload))
                else:
                    self._frags = [payload]
                    self._frag_size = length
                    self._frag_op = opcode
        self._buf = buf[pos:] if pos < end else b""
        return frames
