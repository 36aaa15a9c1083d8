"""Hostile MQTT clients over raw sockets: malformed packets, floods, slowloris and fuzz.

Every case speaks bytes (no MQTT library) to one server started for this module and checks the
answer the specifications require (OASIS MQTT 3.1.1 and MQTT Version 5.0; sections cited per
case): a version 5 session hears DISCONNECT with the reason code, then the connection closes;
a 3.1.1 session is closed without a word (3.1.1 section 4.8); a refused CONNECT gets a CONNACK
only where the spec defines a return code. After every test the server must be unharmed: its
process alive, no Traceback on its stderr or in its logs, and a fresh client still served. When
the module ends, every refusal the tests provoked must be in access.log as a "denied" line.
"""

from __future__ import annotations

import json
import os
import random
import select
import signal
import socket
import struct
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from itertools import count
from pathlib import Path
from typing import NamedTuple

import pytest

from tests.conftest import ServerProcess, free_port, start_server

TIMEOUT = 5.0
MESSAGE_SIZE_LIMIT = 65536
MAX_PACKET = MESSAGE_SIZE_LIMIT + 8192  # the server's limit on a whole packet (MessageSizeLimit + 8192)
HANDSHAKE_TIMEOUT_MS = 2000
MAX_SUBSCRIPTIONS = 2100
FLOOD = 2000

CONNECT, CONNACK, PUBLISH, PUBACK, PUBREC, PUBREL, PUBCOMP = 1, 2, 3, 4, 5, 6, 7
SUBSCRIBE, SUBACK, UNSUBSCRIBE, UNSUBACK, PINGREQ, PINGRESP, DISCONNECT = 8, 9, 10, 11, 12, 13, 14

MALFORMED, PROTOCOL_ERROR, IMPLEMENTATION_SPECIFIC = 0x81, 0x82, 0x83
TOPIC_NAME_INVALID, TOPIC_ALIAS_INVALID, PACKET_TOO_LARGE, QUOTA_EXCEEDED = 0x90, 0x94, 0x95, 0x97

_ids = count(1)


# --- encoding ------------------------------------------------------------------------------


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def u16(n: int) -> bytes:
    return struct.pack("!H", n)


def string(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return u16(len(raw)) + raw


def packet(first: int, body: bytes) -> bytes:
    return bytes((first,)) + varint(len(body)) + body


def props(*items: bytes) -> bytes:
    """A property block: its length, then the properties (each already encoded)."""
    raw = b"".join(items)
    return varint(len(raw)) + raw


def p_byte(pid: int, value: int) -> bytes:
    return bytes((pid, value))


def p_two(pid: int, value: int) -> bytes:
    return bytes((pid,)) + u16(value)


def p_four(pid: int, value: int) -> bytes:
    return bytes((pid,)) + struct.pack("!I", value)


def p_string(pid: int, text: str | bytes) -> bytes:
    return bytes((pid,)) + string(text)


def p_user(name: str | bytes, value: str | bytes) -> bytes:
    return b"\x26" + string(name) + string(value)


def connect_packet(
    level: int,
    client_id: str,
    *,
    name: bytes = b"MQTT",
    cflags: int = 0x02,
    keep_alive: int = 0,
    first: int = 0x10,
    properties: bytes = b"",
) -> bytes:
    """CONNECT (clean session / clean start); level 5 carries a property block."""
    body = string(name) + bytes((level, cflags)) + u16(keep_alive)
    if level == 5:
        body += props(properties)
    return packet(first, body + string(client_id))


def subscribe_packet(
    level: int, packet_id: int, filters: list[tuple[str | bytes, int]], *, first: int = 0x82, properties: bytes = b""
) -> bytes:
    body = u16(packet_id) + (props(properties) if level == 5 else b"")
    for topic_filter, options in filters:
        body += string(topic_filter) + bytes((options,))
    return packet(first, body)


def unsubscribe_packet(level: int, packet_id: int, filters: list[str], *, first: int = 0xA2) -> bytes:
    body = u16(packet_id) + (props(b"") if level == 5 else b"")
    return packet(first, body + b"".join(string(f) for f in filters))


def publish_packet(
    level: int,
    topic: str | bytes,
    payload: bytes = b"x",
    *,
    qos: int = 0,
    packet_id: int = 1,
    dup: bool = False,
    retain: bool = False,
    first: int | None = None,
    properties: bytes = b"",
) -> bytes:
    """PUBLISH; ``first`` overrides the fixed header's first byte (the packet id follows ``qos``)."""
    if first is None:
        first = 0x30 | (0x08 if dup else 0) | (qos << 1) | int(retain)
    body = string(topic) + (u16(packet_id) if qos else b"") + (props(properties) if level == 5 else b"")
    return packet(first, body + payload)


# --- decoding what the server sends -----------------------------------------------------------


class Packet(NamedTuple):
    kind: int
    flags: int
    body: bytes


_PROP_SIZES = {0x01: 1, 0x02: 4, 0x0B: -1, 0x11: 4, 0x13: 2, 0x17: 1, 0x19: 1, 0x21: 2, 0x22: 2, 0x23: 2}
_PROP_SIZES |= {0x24: 1, 0x25: 1, 0x27: 4, 0x28: 1, 0x29: 1, 0x2A: 1}
"""Fixed-size properties (bytes; -1: a variable byte integer); the others are strings, binary or pairs."""


def read_varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7


def parse_props(data: bytes, pos: int) -> dict[int, object]:
    """A property block the server sent (user properties are left out)."""
    length, pos = read_varint(data, pos)
    end = pos + length
    found: dict[int, object] = {}
    while pos < end:
        pid, pos = read_varint(data, pos)
        size = _PROP_SIZES.get(pid)
        if size == -1:
            found[pid], pos = read_varint(data, pos)
        elif size is not None:
            found[pid] = int.from_bytes(data[pos : pos + size], "big")
            pos += size
        else:
            n = int.from_bytes(data[pos : pos + 2], "big")
            found[pid] = data[pos + 2 : pos + 2 + n].decode()
            pos += 2 + n
            if pid == 0x26:  # a pair: skip the value
                pos += 2 + int.from_bytes(data[pos : pos + 2], "big")
    assert pos == end, f"property block ends at {pos}, announced {end}"
    return found


def reason_code(pkt: Packet) -> int:
    """The reason code of a version 5 DISCONNECT or acknowledgement (absent: 0)."""
    if pkt.kind == DISCONNECT:
        return pkt.body[0] if pkt.body else 0
    return pkt.body[2] if len(pkt.body) > 2 else 0


def reason_string(pkt: Packet) -> str:
    try:
        start = 1 if pkt.kind == DISCONNECT else 3
        return str(parse_props(pkt.body, start).get(0x1F, "")) if len(pkt.body) > start else ""
    except (IndexError, UnicodeDecodeError, AssertionError):
        return "?"


class Raw:
    """One TCP connection speaking bytes, with a small fixed-header parser for what comes back."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.port = int(self.sock.getsockname()[1])  # what access.log names this connection by
        self.buf = b""
        self.closed = False

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def _parse(self) -> Packet | None:
        buf = self.buf
        if len(buf) < 2:
            return None
        length = shift = 0
        i = 1
        while True:
            if i >= len(buf):
                return None
            byte = buf[i]
            i += 1
            length |= (byte & 0x7F) << shift
            if not byte & 0x80:
                break
            shift += 7
            assert shift <= 21, "the server sent a remaining length of more than four bytes"
        if len(buf) - i < length:
            return None
        self.buf = buf[i + length :]
        return Packet(buf[0] >> 4, buf[0] & 0x0F, buf[i : i + length])

    def read(self, timeout: float = TIMEOUT) -> Packet | None:
        """The next packet, or None when the server closed the connection (FIN or RST)."""
        deadline = time.monotonic() + timeout
        while True:
            pkt = self._parse()
            if pkt is not None:
                return pkt
            if self.closed:
                assert not self.buf, f"the connection closed inside a packet: {self.buf[:32]!r}"
                return None
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"nothing from the server within {timeout} s (buffer {self.buf[:32]!r})")
            self.sock.settimeout(left)
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                continue
            except (ConnectionResetError, BrokenPipeError):
                data = b""
            if not data:
                self.closed = True
            self.buf += data

    def expect(self, kind: int, timeout: float = TIMEOUT) -> Packet:
        pkt = self.read(timeout)
        assert pkt is not None, f"connection closed while waiting for packet type {kind}"
        assert pkt.kind == kind, f"expected packet type {kind}, got {pkt.kind} ({pkt.body[:40]!r})"
        return pkt

    def until_closed(self, timeout: float = TIMEOUT) -> list[Packet]:
        """Every packet up to the close; fails when the server keeps the connection open."""
        deadline = time.monotonic() + timeout
        got: list[Packet] = []
        while True:
            pkt = self.read(max(0.01, deadline - time.monotonic()))
            if pkt is None:
                return got
            got.append(pkt)

    def expect_silent_close(self, what: str) -> None:
        got = self.until_closed()
        assert got == [], f"{what}: expected a close without a packet, got {got}"

    def expect_disconnect(self, codes: tuple[int, ...], what: str) -> Packet:
        got = self.until_closed()
        assert len(got) == 1 and got[0].kind == DISCONNECT, f"{what}: expected one DISCONNECT then a close, got {got}"
        code = reason_code(got[0])
        assert code in codes, (
            f"{what}: DISCONNECT reason 0x{code:02x} ({reason_string(got[0])!r}), expected "
            + " or ".join(f"0x{c:02x}" for c in codes)
        )
        return got[0]

    def ping(self) -> None:
        self.send(b"\xc0\x00")
        self.expect(PINGRESP)

    def close(self) -> None:
        self.sock.close()


# --- the server --------------------------------------------------------------------------------


@dataclass
class Broker:
    srv: ServerProcess
    port: int
    max_packet: int = 0  # as its version 5 CONNACK says
    stderr: bytes = b""
    refused: list[tuple[int, str]] = field(default_factory=list)  # (client port, case): each a "denied" line

    def session(self, level: int, client_id: str = "", *, properties: bytes = b"") -> Raw:
        """A connection with a successful CONNACK (clean session, no keep-alive)."""
        raw = Raw(self.port)
        raw.send(connect_packet(level, client_id or f"hostile-{next(_ids)}", properties=properties))
        connack = raw.expect(CONNACK)
        assert connack.body[:2] == b"\x00\x00", f"CONNACK refused: {connack.body!r}"
        if level == 5:
            value = parse_props(connack.body, 2).get(0x27, 0)
            assert isinstance(value, int)
            self.max_packet = value
        return raw

    def refused_by(self, raw: Raw, case: str) -> None:
        self.refused.append((raw.port, case))

    def drain_stderr(self) -> None:
        pipe = self.srv.proc.stderr
        if pipe is None or pipe.closed:
            return
        fd = pipe.fileno()
        os.set_blocking(fd, False)
        while True:
            try:
                chunk = os.read(fd, 65536)
            except BlockingIOError:
                return
            if not chunk:
                return
            self.stderr += chunk

    def assert_no_traceback(self) -> None:
        self.drain_stderr()
        assert b"Traceback" not in self.stderr, f"server stderr:\n{self.stderr.decode(errors='replace')[-4000:]}"
        for path in sorted(self.srv.log_folder.iterdir()):
            if path.is_file():
                text = path.read_text(errors="replace")
                assert "Traceback" not in text, (
                    f"Traceback in {path.name}:\n{text[max(0, text.index('Traceback') - 500) :][:4000]}"
                )

    def assert_serves(self, topic: str) -> None:
        """A fresh subscriber and a fresh publisher: the publication arrives."""
        sub = self.session(5)
        sub.send(subscribe_packet(5, 1, [(topic, 1)]))
        suback = sub.expect(SUBACK)
        assert suback.body == u16(1) + b"\x00\x01", f"SUBACK {suback.body!r}"
        pub = self.session(4)
        pub.send(publish_packet(4, topic, b"still here", qos=1, packet_id=7))
        assert pub.expect(PUBACK).body == u16(7)
        got = sub.expect(PUBLISH)
        qos = (got.flags >> 1) & 0x03
        topic_len = int.from_bytes(got.body[:2], "big")
        assert got.body[2 : 2 + topic_len] == topic.encode()
        assert got.body.endswith(b"still here")
        if qos:
            sub.send(packet(0x40, got.body[2 + topic_len : 4 + topic_len]))
        for raw in (sub, pub):
            raw.send(b"\xe0\x00")
            raw.until_closed()
            raw.close()


def _denied_ports(access_log: Path) -> set[int]:
    ports = set()
    for line in access_log.read_text().splitlines():
        record = json.loads(line)
        if record.get("event") == "denied":
            ports.add(int(record["port"]))
    return ports


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Broker]:
    """One server for the module (a start costs seconds; each test uses fresh connections)."""
    port = free_port()
    srv = start_server(
        tmp_path_factory.mktemp("mqtt-hostile"),
        {
            "ListenMqtt": f"127.0.0.1:{port}",
            "MessageSizeLimit": str(MESSAGE_SIZE_LIMIT),
            "HandshakeTimeout": str(HANDSHAKE_TIMEOUT_MS),
            "MaxSubscriptionsPerClient": str(MAX_SUBSCRIPTIONS),
        },
    )
    b = Broker(srv, port)
    try:
        yield b
        assert srv.proc.poll() is None, f"the server exited with {srv.proc.returncode}"
    finally:
        code = srv.stop(signal.SIGTERM)
        b.drain_stderr()  # to its end: the process is gone
        if srv.proc.stderr is not None:
            srv.proc.stderr.close()
    b.assert_no_traceback()  # the logs are complete now (flushed at shutdown)
    assert code == 0, f"the server's clean shutdown exited with {code}"
    denied = _denied_ports(srv.log_folder / "access.log")
    missing = [(p, case) for p, case in b.refused if p not in denied]
    assert not missing, f"refusals without a 'denied' line in access.log: {missing[:20]}"


@pytest.fixture(autouse=True)
def unharmed(broker: Broker) -> Iterator[Broker]:
    """After each test: the process lives, no Traceback anywhere, a fresh client is answered."""
    yield broker
    assert broker.srv.proc.poll() is None, f"the server died with {broker.srv.proc.returncode}"
    broker.assert_no_traceback()
    probe = broker.session(5)
    probe.ping()
    probe.close()


# --- 1. the fixed header: remaining length and packet size --------------------------------------


@pytest.mark.parametrize("level", [4, 5])
def test_remaining_length_of_five_bytes_is_malformed(broker: Broker, level: int) -> None:
    """5.0 sections 1.5.5, 2.1.4: at most four bytes, more is a Malformed Packet (0x81). 3.1.1 (2.2.3): close."""
    raw = broker.session(level)
    raw.send(b"\x30\xff\xff\xff\xff\x7f")  # four continuation bytes, then a fifth byte
    if level == 5:
        raw.expect_disconnect((MALFORMED,), "5-byte remaining length")
    else:
        raw.expect_silent_close("5-byte remaining length")
    broker.refused_by(raw, "remaining length")


@pytest.mark.parametrize("level", [4, 5])
@pytest.mark.parametrize("remaining", [MAX_PACKET - 4 + 1, 268_435_455], ids=["max+1", "256MB"])
def test_packet_larger_than_the_maximum_is_refused_before_its_body(broker: Broker, level: int, remaining: int) -> None:
    """5.0 section 3.2.2.3.6: a packet over the Maximum Packet Size of CONNACK is answered with DISCONNECT 0x95."""
    raw = broker.session(level)
    if level == 5:
        assert broker.max_packet == MAX_PACKET, f"CONNACK Maximum Packet Size {broker.max_packet}"
    raw.send(b"\x30" + varint(remaining))  # the header only: the answer may not wait for the body
    if level == 5:
        raw.expect_disconnect((PACKET_TOO_LARGE,), f"remaining length {remaining}")
    else:
        raw.expect_silent_close(f"remaining length {remaining}")
    broker.refused_by(raw, "too large")


def test_packet_of_exactly_the_maximum_size_is_accepted(broker: Broker) -> None:
    """The Maximum Packet Size in CONNACK is inclusive: a PUBLISH of exactly that many bytes is taken."""
    raw = broker.session(5)
    payload = b"p" * MESSAGE_SIZE_LIMIT  # MessageSizeLimit itself is allowed
    topic = "hostile/max"

    def build(filler: int) -> bytes:  # a content type fills the packet up to the size wanted
        return publish_packet(5, topic, payload, qos=1, packet_id=3, properties=p_string(0x03, "c" * filler))

    data = build(8000 + MAX_PACKET - len(build(8000)))
    assert len(data) == MAX_PACKET == broker.max_packet
    raw.send(data)
    ack = raw.expect(PUBACK)
    assert ack.body[:2] == u16(3)
    assert reason_code(ack) in (0x00, 0x10), f"PUBACK 0x{reason_code(ack):02x} {reason_string(ack)!r}"
    raw.ping()
    raw.close()


# --- 2. fixed-header flags and other malformed packets after CONNECT ----------------------------

Build = Callable[[int], bytes]

AFTER_CONNECT: list[tuple[str, Build, tuple[int, ...]]] = [
    # [MQTT-3.8.1-1] / 3.1.1 [MQTT-3.8.1-1]: SUBSCRIBE flags must be 0010, anything else is malformed
    ("subscribe-flags-0", lambda lv: subscribe_packet(lv, 1, [("a/b", 0)], first=0x80), (MALFORMED,)),
    # [MQTT-3.10.1-1]
    ("unsubscribe-flags-0", lambda lv: unsubscribe_packet(lv, 1, ["a/b"], first=0xA0), (MALFORMED,)),
    # [MQTT-3.6.1-1]: PUBREL flags must be 0010
    ("pubrel-flags-0", lambda lv: packet(0x60, u16(1)), (MALFORMED,)),
    # 5.0 section 2.1.3: reserved flags of PINGREQ and DISCONNECT; [MQTT-3.14.1-1]
    ("pingreq-flags", lambda lv: b"\xc1\x00", (MALFORMED,)),
    ("disconnect-flags", lambda lv: b"\xe2\x00", (MALFORMED,)),
    # 5.0 section 3.3.1.2 / [MQTT-3.3.1-4]: QoS 3 is malformed
    ("publish-qos-3", lambda lv: publish_packet(lv, "a/b", qos=1, first=0x36), (MALFORMED,)),
    # [MQTT-3.3.1-2]: DUP must be 0 with QoS 0
    ("publish-qos0-dup", lambda lv: publish_packet(lv, "a/b", dup=True), (MALFORMED,)),
    # [MQTT-2.2.1-3]: a PUBLISH with QoS > 0 and SUBSCRIBE carry a non-zero packet identifier
    ("publish-packet-id-0", lambda lv: publish_packet(lv, "a/b", qos=1, packet_id=0), (MALFORMED, PROTOCOL_ERROR)),
    ("subscribe-packet-id-0", lambda lv: subscribe_packet(lv, 0, [("a/b", 0)]), (MALFORMED, PROTOCOL_ERROR)),
    # 5.0 section 3.8.3: "A SUBSCRIBE packet with no Payload is a Protocol Error"; likewise UNSUBSCRIBE (3.10.3)
    ("subscribe-no-filter", lambda lv: packet(0x82, u16(1) + (b"\x00" if lv == 5 else b"")), (PROTOCOL_ERROR,)),
    ("unsubscribe-no-filter", lambda lv: packet(0xA2, u16(1) + (b"\x00" if lv == 5 else b"")), (PROTOCOL_ERROR,)),
    # [MQTT-3.8.3-5]: reserved bits of the subscription options
    ("subscribe-reserved-options", lambda lv: subscribe_packet(lv, 1, [("a/b", 0xC1)]), (MALFORMED,)),
    ("subscribe-qos-3", lambda lv: subscribe_packet(lv, 1, [("a/b", 0x03)]), (MALFORMED,)),
    # a packet shorter than its variable header
    ("puback-truncated", lambda lv: b"\x40\x01\x00", (MALFORMED,)),
    ("publish-topic-past-the-end", lambda lv: packet(0x30, b"\x00\x09a/b"), (MALFORMED,)),
    # the reserved packet type 0 and a packet only a server sends (Table 2-1)
    ("reserved-type-0", lambda lv: b"\x00\x00", (MALFORMED, PROTOCOL_ERROR)),
    ("connack-from-a-client", lambda lv: b"\x20\x02\x00\x00", (MALFORMED, PROTOCOL_ERROR)),
    # [MQTT-3.1.0-2]: a second CONNECT is a Protocol Error
    ("second-connect", lambda lv: connect_packet(lv, "again"), (PROTOCOL_ERROR,)),
]


@pytest.mark.parametrize("level", [4, 5])
@pytest.mark.parametrize(("case", "build", "codes"), AFTER_CONNECT, ids=[c[0] for c in AFTER_CONNECT])
def test_malformed_packet_after_connect(
    broker: Broker, level: int, case: str, build: Build, codes: tuple[int, ...]
) -> None:
    """5.0 section 4.13: DISCONNECT with the reason code, then close. 3.1.1 section 4.8: close."""
    raw = broker.session(level)
    raw.send(build(level))
    if level == 5:
        raw.expect_disconnect(codes, case)
    else:
        raw.expect_silent_close(case)
    broker.refused_by(raw, case)


# --- 3. topic names ----------------------------------------------------------------------------

TOPICS: list[tuple[str, bytes, int]] = [
    # 5.0 section 1.5.4 [MQTT-1.5.4-1], [MQTT-1.5.4-2]: ill-formed UTF-8 or U+0000 is a Malformed Packet
    ("invalid-utf8", b"a/\xff\xfe", MALFORMED),
    ("overlong-utf8", b"a/\xc0\xaf", MALFORMED),
    ("utf16-surrogate", b"a/\xed\xa0\x80", MALFORMED),
    ("nul", b"a/b\x00c", MALFORMED),
    # [MQTT-3.3.2-2]: "The Topic Name in the PUBLISH packet MUST NOT contain wildcard characters"; a
    # violation is a Malformed Packet (4.13 and 2.2 of 5.0), whatever the QoS
    ("wildcard-plus", b"a/+", MALFORMED),
    ("wildcard-hash", b"a/#", MALFORMED),
    ("wildcard-alone", b"#", MALFORMED),
    # well formed but not accepted here: Topic Name invalid (0x90); $-topics are the server's
    ("dollar", b"$SYS/x", TOPIC_NAME_INVALID),
    ("too-long-for-a-subject", b"t" * 1100, TOPIC_NAME_INVALID),
]


@pytest.mark.parametrize(
    ("level", "qos"), [(5, 0), (5, 1), (5, 2), (4, 0), (4, 1)], ids=["v5q0", "v5q1", "v5q2", "v3q0", "v3q1"]
)
@pytest.mark.parametrize(("case", "topic", "code"), TOPICS, ids=[t[0] for t in TOPICS])
def test_bad_topic_names(broker: Broker, level: int, qos: int, case: str, topic: bytes, code: int) -> None:
    """Malformed (UTF-8): DISCONNECT 0x81 whatever the QoS. Not accepted: PUBACK/PUBREC 0x90 at QoS 1/2 (the
    connection lives on), DISCONNECT 0x90 at QoS 0 (no acknowledgement to carry it). 3.1.1: close."""
    raw = broker.session(level)
    raw.send(publish_packet(level, topic, b"payload", qos=qos, packet_id=5))
    if level == 4:
        raw.expect_silent_close(case)
    elif code == MALFORMED or qos == 0:
        raw.expect_disconnect((code,), case)
    else:
        ack = raw.expect(PUBACK if qos == 1 else PUBREC)
        assert ack.body[:2] == u16(5)
        assert reason_code(ack) == code, f"{case}: reason 0x{reason_code(ack):02x}, expected 0x{code:02x}"
        raw.ping()  # a refused publication is not a protocol error: the session goes on
        raw.send(b"\xe0\x00")
        assert raw.until_closed() == []
    broker.refused_by(raw, case)
    raw.close()


# --- 4. properties (version 5) -----------------------------------------------------------------

PROPERTIES: list[tuple[str, bytes, bytes, int]] = [
    # MAX_USER_PROPERTIES = 64 in migratory/mqtt.py: a flood is an implementation-specific refusal
    ("65-user-properties", b"a/b", b"".join(p_user(f"k{i}", "v") for i in range(65)), IMPLEMENTATION_SPECIFIC),
    # 5.0 section 3.3.2.3: "It is a Protocol Error to include the <property> more than once"
    ("duplicate-payload-format", b"a/b", p_byte(0x01, 0) + p_byte(0x01, 1), PROTOCOL_ERROR),
    ("duplicate-content-type", b"a/b", p_string(0x03, "x") + p_string(0x03, "y"), PROTOCOL_ERROR),
    # 5.0 section 2.2.2.2: "A Control Packet which contains an Identifier which is not valid for its packet type
    # ... is a Malformed Packet. If received, use a CONNACK or DISCONNECT packet with Reason Code 0x81"
    ("subscription-id-in-publish", b"a/b", b"\x0b\x01", MALFORMED),
    ("session-expiry-in-publish", b"a/b", p_four(0x11, 10), MALFORMED),
    ("unknown-property-0x7f", b"a/b", p_byte(0x7F, 0), MALFORMED),
    # a property that runs past the property length, or the packet
    ("property-past-its-length", b"a/b", b"\x03\x00\x05ab", MALFORMED),
    ("user-property-invalid-utf8", b"a/b", p_user(b"k\xff", "v"), MALFORMED),
    # 5.0 section 3.3.2.3.4: Topic Alias 0 or above the server's maximum (32 here): DISCONNECT 0x94
    ("topic-alias-0", b"a/b", p_two(0x23, 0), TOPIC_ALIAS_INVALID),
    ("topic-alias-too-big", b"a/b", p_two(0x23, 33), TOPIC_ALIAS_INVALID),
    # 5.0 section 3.3.2.1: "It is a Protocol Error if the Topic Name is zero length and there is no Topic Alias"
    ("empty-topic-without-alias", b"", b"", PROTOCOL_ERROR),
]


@pytest.mark.parametrize(("case", "topic", "properties", "code"), PROPERTIES, ids=[p[0] for p in PROPERTIES])
def test_bad_properties(broker: Broker, case: str, topic: bytes, properties: bytes, code: int) -> None:
    raw = broker.session(5)
    raw.send(publish_packet(5, topic, b"payload", qos=1, packet_id=9, properties=properties))
    raw.expect_disconnect((code,), case)
    broker.refused_by(raw, case)


def test_64_user_properties_are_accepted(broker: Broker) -> None:
    raw = broker.session(5)
    users = b"".join(p_user(f"k{i}", "v") for i in range(64))
    raw.send(publish_packet(5, "hostile/users", b"payload", qos=1, packet_id=9, properties=users))
    ack = raw.expect(PUBACK)
    assert ack.body[:2] == u16(9) and reason_code(ack) in (0x00, 0x10), ack
    raw.close()


def test_bad_property_in_connect_closes_without_disconnect(broker: Broker) -> None:
    """5.0 [MQTT-3.14.0-1]: no DISCONNECT before a successful CONNACK; a refusing CONNACK (>= 0x80) may come."""
    raw = Raw(broker.port)
    raw.send(connect_packet(5, "bad-prop", properties=p_two(0x23, 1)))  # Topic Alias is not a CONNECT property
    got = raw.until_closed()
    assert all(p.kind == CONNACK for p in got) and len(got) <= 1, got
    if got:
        assert got[0].body[1] == MALFORMED, f"CONNACK reason 0x{got[0].body[1]:02x} (section 2.2.2.2: 0x81)"
    broker.refused_by(raw, "connect property")


# --- 5. CONNECT: first packet, flags, protocol version ---------------------------------------------


@pytest.mark.parametrize(
    "first",
    [
        publish_packet(4, "a/b", b"x"),
        subscribe_packet(4, 1, [("a/b", 0)]),
        b"\xc0\x00",  # PINGREQ
        b"\xe0\x00",  # DISCONNECT
    ],
    ids=["publish", "subscribe", "pingreq", "disconnect"],
)
def test_packet_before_connect_is_refused_and_closed(broker: Broker, first: bytes) -> None:
    """[MQTT-3.1.0-1] (both versions): the first packet must be CONNECT. The server knows no protocol version yet,
    so it has no CONNACK to send: it closes (what the code does: _refuse_connect with 0x82, no 3.1.1 form)."""
    raw = Raw(broker.port)
    raw.send(first)
    raw.expect_silent_close("a packet before CONNECT")
    broker.refused_by(raw, "before CONNECT")


@pytest.mark.parametrize("level", [4, 5])
@pytest.mark.parametrize(
    ("first", "cflags"), [(0x11, 0x02), (0x18, 0x02), (0x10, 0x03)], ids=["0x11", "0x18", "reserved-bit"]
)
def test_connect_with_reserved_flags(broker: Broker, level: int, first: int, cflags: int) -> None:
    """Fixed-header flags of CONNECT are 0000 (2.1.3), the reserved connect flag is 0 ([MQTT-3.1.2-3]): malformed.
    Before a CONNACK the server may not send DISCONNECT ([MQTT-3.14.0-1]); version 5 may get CONNACK 0x81."""
    raw = Raw(broker.port)
    raw.send(connect_packet(level, "flags", first=first, cflags=cflags))
    got = raw.until_closed()
    if level == 4:
        assert got == [], f"3.1.1 has no return code for a malformed CONNECT: expected a close, got {got}"
    else:
        assert len(got) <= 1 and all(p.kind == CONNACK and p.body[1] == MALFORMED for p in got), got
    broker.refused_by(raw, "CONNECT flags")


@pytest.mark.parametrize(("name", "level"), [(b"MQIsdp", 4), (b"MQTT", 6), (b"MQTT", 3), (b"MQTT", 0)])
def test_unsupported_protocol_level(broker: Broker, name: bytes, level: int) -> None:
    """3.1.1 [MQTT-3.1.2-2]: CONNACK return code 0x01 (unacceptable protocol level), then close."""
    raw = Raw(broker.port)
    body = string(name) + bytes((level, 0x02)) + u16(0) + string("old")
    raw.send(packet(0x10, body))
    got = raw.until_closed()
    assert got == [Packet(CONNACK, 0, b"\x00\x01")], got
    broker.refused_by(raw, f"protocol level {level}")


def test_mqtt_3_1_is_accepted_and_needs_a_client_identifier(broker: Broker) -> None:
    """MQTT 3.1 (MQIsdp, level 3), still spoken by older devices: CONNACK 0 as Mosquitto answers; without a
    client identifier, which 3.1 requires, CONNACK 0x02 (identifier rejected)."""
    raw = Raw(broker.port)
    raw.send(packet(0x10, string(b"MQIsdp") + bytes((3, 0x02)) + u16(30) + string("old-device")))
    assert raw.expect(CONNACK).body == b"\x00\x00"
    raw.ping()
    raw.close()
    anonymous = Raw(broker.port)
    anonymous.send(packet(0x10, string(b"MQIsdp") + bytes((3, 0x02)) + u16(30) + string("")))
    assert anonymous.until_closed() == [Packet(CONNACK, 0, b"\x00\x02")]
    broker.refused_by(anonymous, "MQTT 3.1 without a client identifier")


@pytest.mark.parametrize("slow", [False, True], ids=["silent", "slowloris"])
def test_connect_never_completed_is_closed_after_handshake_timeout(broker: Broker, slow: bool) -> None:
    """A connection that never completes CONNECT (silent, or one byte every 0.5 s) is closed after
    HandshakeTimeout. The deadline sits on the engine's timer wheel: slots of 1 s (rounded up) checked by a
    1 s tick, so the close comes at most about 2 s after the deadline."""
    started = time.monotonic()
    raw = Raw(broker.port)
    # a CONNECT announcing 200 bytes: at one byte every 0.5 s it would take 100 s
    trickle = b"\x10" + varint(200) + string("MQTT") + b"\x05\x02\x00\x00\x00" + b"\x00\xb8" + b"s" * 200
    sent = 0
    closed_at = 0.0
    while time.monotonic() - started < HANDSHAKE_TIMEOUT_MS / 1000 + 6:
        if slow:
            try:
                raw.send(trickle[sent : sent + 1])
                sent += 1
            except (BrokenPipeError, ConnectionResetError):
                closed_at = time.monotonic()
                break
        readable, _, _ = select.select([raw.sock], [], [], 0.5)
        if readable:
            try:
                data = raw.sock.recv(1024)
            except ConnectionResetError:
                data = b""
            assert data == b"", f"the server answered an unfinished CONNECT with {data!r}"
            closed_at = time.monotonic()
            break
    assert closed_at, "the connection is still open"
    elapsed = closed_at - started
    limit = HANDSHAKE_TIMEOUT_MS / 1000
    assert limit - 0.05 <= elapsed <= limit + 2.0 + 0.75, f"closed after {elapsed:.2f} s (HandshakeTimeout {limit} s)"
    if slow:
        assert sent >= 3, f"only {sent} bytes were sent before the close"
    broker.refused_by(raw, "handshake timeout")
    raw.close()


# --- 6. SUBSCRIBE floods and the subscription limit ------------------------------------------------


@pytest.mark.parametrize("level", [4, 5])
def test_subscribe_flood_is_answered_in_order(broker: Broker, level: int) -> None:
    """[MQTT-3.8.4-1], [MQTT-3.8.4-2]: every SUBSCRIBE gets its SUBACK with its packet identifier."""
    raw = broker.session(level)
    prefix = f"flood{level}"
    burst = b"".join(subscribe_packet(level, i, [(f"{prefix}/{i}/x", 1)]) for i in range(1, FLOOD + 1))
    raw.send(burst)  # pipelined: one write
    expected_tail = b"\x00\x01" if level == 5 else b"\x01"
    for i in range(1, FLOOD + 1):
        suback = raw.expect(SUBACK)
        assert suback.body == u16(i) + expected_tail, f"SUBACK #{i}: {suback.body!r}"
    # the flooding client is still a client: a publication to one of its filters reaches it
    pub = broker.session(4)
    pub.send(publish_packet(4, f"{prefix}/{FLOOD}/x", b"to the flooder"))
    got = raw.expect(PUBLISH)
    assert got.body.endswith(b"to the flooder")
    raw.close()
    pub.close()
    broker.assert_serves(f"hostile/after/flood{level}")


@pytest.mark.parametrize(("level", "refusal"), [(5, QUOTA_EXCEEDED), (4, 0x80)])
def test_max_subscriptions_per_client(broker: Broker, level: int, refusal: int) -> None:
    """Past MaxSubscriptionsPerClient: 0x97 Quota exceeded (5.0 Table 3-10); 3.1.1 has only 0x80
    ([MQTT-3.9.3-2]: other return codes are reserved). Subscribing again to a held filter replaces it: granted."""
    raw = broker.session(level)
    filters: list[tuple[str | bytes, int]] = [(f"limit{level}/{i}/x", 1) for i in range(MAX_SUBSCRIPTIONS + 1)]
    raw.send(subscribe_packet(level, 1, filters))
    suback = raw.expect(SUBACK)
    codes = suback.body[3:] if level == 5 else suback.body[2:]
    assert suback.body[:2] == u16(1) and len(codes) == MAX_SUBSCRIPTIONS + 1
    assert set(codes[:MAX_SUBSCRIPTIONS]) == {1}
    assert codes[MAX_SUBSCRIPTIONS] == refusal, f"code 0x{codes[MAX_SUBSCRIPTIONS]:02x}, expected 0x{refusal:02x}"
    raw.send(subscribe_packet(level, 2, [(f"limit{level}/0/x", 0), (f"limit{level}/new/x", 0)]))
    again = raw.expect(SUBACK)
    assert again.body[-2:] == bytes((0, refusal)), again
    raw.ping()
    broker.refused_by(raw, "subscription limit")
    raw.close()


def test_invalid_filter_suback_codes(broker: Broker) -> None:
    """5.0: 0x8F Topic Filter invalid; 3.1.1: 0x80, the only failure return code ([MQTT-3.9.3-2])."""
    for level, refusal in ((5, 0x8F), (4, 0x80)):
        raw = broker.session(level)
        raw.send(subscribe_packet(level, 4, [("a/#/b", 0), ("ok/x", 0), ("a/b+", 0)]))
        suback = raw.expect(SUBACK)
        codes = suback.body[3:] if level == 5 else suback.body[2:]
        assert codes == bytes((refusal, 0, refusal)), f"level {level}: SUBACK codes {codes.hex()}"
        raw.close()


# --- 7. fuzz ---------------------------------------------------------------------------------------

SEED = 0x4D515454


def _fuzz_cases(n: int = 300) -> list[bytes]:
    """Deterministic garbage after CONNECT: random bytes, random packets with a correct length, and
    valid packets with bytes changed, cut out or inserted."""
    rng = random.Random(SEED)
    valid = [
        publish_packet(5, "fz/a", b"hello", properties=p_user("k", "v") + p_string(0x03, "text/plain")),
        publish_packet(5, "fz/b", b"q1", qos=1, packet_id=11, properties=p_two(0x23, 2)),
        publish_packet(5, "fz/c", b"q2", qos=2, packet_id=12, retain=True, properties=p_four(0x02, 60)),
        subscribe_packet(5, 3, [("fz/+", 0x01), ("fz/#", 0x2A)], properties=b"\x0b\x05" + p_user("conflation", "0")),
        unsubscribe_packet(5, 4, ["fz/+", "fz/#"]),
        packet(0x40, u16(1) + b"\x10" + props(p_string(0x1F, "why"))),
        packet(0x62, u16(12)),
        b"\xc0\x00",
        packet(0xE0, b"\x04" + props(p_four(0x11, 0))),
    ]
    cases: list[bytes] = []
    for i in range(n):
        if i % 3 == 0:
            cases.append(rng.randbytes(rng.randint(1, 48)))
        elif i % 3 == 1:
            body = rng.randbytes(rng.randint(0, 40))
            cases.append(bytes((rng.randrange(256),)) + varint(len(body)) + body)
        else:
            data = bytearray(rng.choice(valid))
            for _ in range(rng.randint(1, 4)):
                pos = rng.randrange(len(data))
                op = rng.randrange(3)
                if op == 0:
                    data[pos] = rng.randrange(256)
                elif op == 1 and len(data) > 2:
                    del data[pos : pos + rng.randint(1, 3)]
                else:
                    data[pos:pos] = rng.randbytes(rng.randint(1, 3))
            cases.append(bytes(data))
    return cases


def test_fuzz_after_connect_never_harms_the_server(broker: Broker) -> None:
    """300 deterministic random inputs, each on its own version 5 session (then EOF): every connection ends,
    whatever the server answered, and afterwards a fresh client is served."""
    answered: dict[str, int] = {}
    for i, data in enumerate(_fuzz_cases()):
        raw = broker.session(5)
        try:
            raw.send(data)
            raw.sock.shutdown(socket.SHUT_WR)
        except (BrokenPipeError, ConnectionResetError):
            pass
        try:
            got = raw.until_closed()
        except AssertionError as exc:
            raise AssertionError(f"fuzz case {i} ({data.hex()}): {exc}") from None
        for pkt in got:
            assert pkt.kind in (PUBACK, PUBREC, PUBCOMP, SUBACK, UNSUBACK, PINGRESP, DISCONNECT, PUBLISH), (i, pkt)
            if pkt.kind == DISCONNECT:
                assert reason_code(pkt) >= 0x80, f"fuzz case {i}: DISCONNECT {pkt}"
        key = "disconnect" if got and got[-1].kind == DISCONNECT else "answered" if got else "closed"
        answered[key] = answered.get(key, 0) + 1
        raw.close()
        if i % 50 == 49:
            assert broker.srv.proc.poll() is None, f"the server died after fuzz case {i} ({data.hex()})"
    assert answered.get("disconnect", 0) > 50, answered  # the corpus does reach the decoder's refusals
    broker.assert_serves("hostile/after/fuzz")
