"""The MQTT codec (migratory/mqtt.py) and topic mapping (migratory/topics.py), without a server.

Properties are checked differentially against paho-mqtt's own implementation (a reference
nobody here wrote) on random input, both ways; the stream reader on random splits.
"""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from migratory import mqtt as m
from migratory.topics import TopicError, parse_filter, subject_matches, subject_to_topic, topic_to_subject

TEXT = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=20)
PUBLISH_PROPS = st.fixed_dictionaries(
    {},
    optional={
        "MessageExpiryInterval": st.integers(0, 2**32 - 1),
        "ContentType": TEXT,
        "ResponseTopic": TEXT,
        "CorrelationData": st.binary(max_size=20),
        "TopicAlias": st.integers(1, 65535),
        "PayloadFormatIndicator": st.integers(0, 1),
        "UserProperty": st.lists(st.tuples(TEXT, TEXT), min_size=1, max_size=5),
    },
)
_IDS = {
    "MessageExpiryInterval": m.P_EXPIRY,
    "ContentType": m.P_CONTENT_TYPE,
    "ResponseTopic": m.P_RESPONSE_TOPIC,
    "CorrelationData": m.P_CORRELATION,
    "TopicAlias": m.P_ALIAS,
    "PayloadFormatIndicator": m.P_FORMAT,
    "UserProperty": m.P_USER,
}


def _publish_body(topic: str, props: bytes, payload: bytes, packet_id: int = 0) -> bytes:
    raw = topic.encode()
    return struct.pack("!H", len(raw)) + raw + (struct.pack("!H", packet_id) if packet_id else b"") + props + payload


@settings(max_examples=300, deadline=None)
@given(PUBLISH_PROPS, st.binary(max_size=50))
def test_publish_properties_paho_encodes_we_decode(props: dict[str, object], payload: bytes) -> None:
    theirs = Properties(PacketTypes.PUBLISH)
    for name, value in props.items():
        setattr(theirs, name, value)
    body = _publish_body("a/b", theirs.pack(), payload, 7)
    packet = m.decode(m.PUBLISH, 0x02, body, 5)
    assert isinstance(packet, m.Publish)
    assert packet.payload == payload and packet.packet_id == 7 and packet.qos == 1
    assert packet.props == {_IDS[name]: value for name, value in props.items()}


@settings(max_examples=300, deadline=None)
@given(PUBLISH_PROPS, st.binary(max_size=50), st.integers(1, 2**28 - 1))
def test_publish_we_encode_paho_decodes(props: dict[str, object], payload: bytes, sub_id: int) -> None:
    ours: m.Properties = {_IDS[name]: value for name, value in props.items() if name != "TopicAlias"}
    ours[m.P_SUBSCRIPTION_ID] = sub_id
    packet = m.encode_publish(5, "x/y", payload, 1, True, False, 9, ours)
    assert packet[0] == 0x33
    reader = m.PacketReader(1 << 20)
    [(kind, flags, body)] = reader.feed(packet)
    assert (kind, flags) == (m.PUBLISH, 0x03)
    props_at = 2 + 3 + 2
    theirs = Properties(PacketTypes.PUBLISH)
    _, used = theirs.unpack(body[props_at:])
    assert body[props_at + used :] == payload
    for name, value in props.items():
        if name != "TopicAlias":
            assert getattr(theirs, name) == value
    assert theirs.SubscriptionIdentifier == [sub_id]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(min_size=0, max_size=300), min_size=1, max_size=8), st.data())
def test_the_reader_reassembles_packets_split_anywhere(payloads: list[bytes], data: st.DataObject) -> None:
    stream = b"".join(m.encode_publish(4, "s/t", p) for p in payloads)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=6)))
    reader = m.PacketReader(1 << 20)
    out: list[bytes] = []
    last = 0
    for cut in [*cuts, len(stream)]:
        for kind, flags, body in reader.feed(stream[last:cut]):
            packet = m.decode(kind, flags, body, 4)
            assert isinstance(packet, m.Publish)
            out.append(packet.payload)
        last = cut
    assert out == payloads and reader.idle


def test_the_reader_refuses_an_oversized_packet_before_its_body() -> None:
    reader = m.PacketReader(1000)
    with pytest.raises(m.MqttError) as refused:
        reader.feed(b"\x30\xff\xff\x03")  # announces 65,535 bytes; none of them has arrived
    assert refused.value.code == m.Rc.PACKET_TOO_LARGE
    with pytest.raises(m.MqttError) as malformed:
        m.PacketReader(1 << 30).feed(b"\x30\xff\xff\xff\xff\x01")
    assert malformed.value.code == m.Rc.MALFORMED


def _connect(level: int, flags: int, client_id: str = "c", extra: bytes = b"", props: bytes = b"\x00") -> bytes:
    name = b"MQTT" if level != 3 else b"MQIsdp"
    body = struct.pack("!H", len(name)) + name + bytes((level, flags)) + struct.pack("!H", 30)
    if level == 5:
        body += props
    raw = client_id.encode()
    return body + struct.pack("!H", len(raw)) + raw + extra


def test_mqtt_3_1_is_read_as_3_1_1() -> None:
    connect = m.decode_connect(0, _connect(3, 0x02, client_id="old-device"))
    assert (connect.level, connect.client_id, connect.clean) == (4, "old-device", True)


@pytest.mark.parametrize(
    ("body", "code"),
    [
        (_connect(3, 0x02, client_id=""), m.Rc.CLIENT_ID_NOT_VALID),  # 3.1 requires one
        (_connect(6, 0x02), m.Rc.UNSUPPORTED_VERSION),
        (_connect(4, 0x03), m.Rc.MALFORMED),  # the reserved bit
        (_connect(4, 0x42), m.Rc.MALFORMED),  # a password without a user name (3.1.1)
        (_connect(4, 0x1A), m.Rc.MALFORMED),  # will QoS 3
        (_connect(4, 0x22), m.Rc.MALFORMED),  # will retain without a will
        (_connect(5, 0x02, props=b"\x03\x21\x00\x00"), m.Rc.PROTOCOL_ERROR),  # receive maximum 0
        (_connect(5, 0x02, props=b"\x02\x01\x01"), m.Rc.MALFORMED),  # a PUBLISH property in CONNECT
        (_connect(4, 0x02, extra=b"trailing"), m.Rc.MALFORMED),
        (_connect(4, 0x02, client_id="a\x00b"), m.Rc.MALFORMED),
    ],
)
def test_connect_refusals(body: bytes, code: int) -> None:
    with pytest.raises(m.MqttError) as refused:
        m.decode_connect(0, body)
    assert refused.value.code == code


def test_connect_with_will_and_credentials() -> None:
    will = struct.pack("!H", 3) + b"w/t" + struct.pack("!H", 3) + b"bye"
    creds = struct.pack("!H", 1) + b"u" + struct.pack("!H", 2) + b"pw"
    packet = m.decode_connect(0, _connect(4, 0xC0 | 0x20 | 0x08 | 0x04 | 0x02, "dev", will + creds))
    assert packet.will == m.Will("w/t", b"bye", 1, True)
    assert (packet.username, packet.password, packet.clean, packet.client_id) == ("u", b"pw", True, "dev")


@pytest.mark.parametrize(
    ("kind", "flags", "body", "code"),
    [
        (m.PUBLISH, 0x06, _publish_body("a/b", b"", b"", 1), m.Rc.MALFORMED),  # QoS 3
        (m.PUBLISH, 0x08, _publish_body("a/b", b"", b""), m.Rc.MALFORMED),  # DUP with QoS 0
        (m.PUBLISH, 0x02, _publish_body("a/b", b"", b"", 0) + b"\x00\x00", m.Rc.MALFORMED),  # packet id 0
        (m.PUBLISH, 0x00, b"\x00\x02\xff\xfe", m.Rc.MALFORMED),  # topic not UTF-8
        (m.SUBSCRIBE, 0x00, b"\x00\x01\x00\x01a\x01", m.Rc.MALFORMED),  # flags must be 0010
        (m.SUBSCRIBE, 0x02, b"\x00\x01", m.Rc.PROTOCOL_ERROR),  # no filter
        (m.SUBSCRIBE, 0x02, b"\x00\x01\x00\x01a\x04", m.Rc.MALFORMED),  # reserved option bits (3.1.1)
        (m.PUBREL, 0x00, b"\x00\x01", m.Rc.MALFORMED),
        (m.PINGREQ, 0x00, b"x", m.Rc.MALFORMED),
        (m.CONNECT, 0x00, b"", m.Rc.PROTOCOL_ERROR),  # a second CONNECT
        (m.CONNACK, 0x00, b"\x00\x00", m.Rc.PROTOCOL_ERROR),  # a server's packet from a client
    ],
)
def test_packet_refusals_311(kind: int, flags: int, body: bytes, code: int) -> None:
    with pytest.raises(m.MqttError) as refused:
        m.decode(kind, flags, body, 4)
    assert refused.value.code == code


def test_property_rules_5() -> None:
    flood = b"".join(b"\x26\x00\x01k\x00\x01v" for _ in range(m.MAX_USER_PROPERTIES + 1))
    cases = [
        (bytes((len(flood),)) if len(flood) < 128 else bytes((len(flood) & 0x7F | 0x80, len(flood) >> 7))) + flood,
        b"\x0a\x02\x00\x00\x00\x01\x02\x00\x00\x00\x02",  # expiry twice
        b"\x02\x11\x00",  # session expiry is not a PUBLISH property
    ]
    codes = []
    for props in cases:
        with pytest.raises(m.MqttError) as refused:
            m.decode(m.PUBLISH, 0, _publish_body("a/b", props, b"x"), 5)
        codes.append(refused.value.code)
    assert codes == [m.Rc.IMPLEMENTATION_SPECIFIC, m.Rc.PROTOCOL_ERROR, m.Rc.MALFORMED]


def test_server_packets() -> None:
    assert m.encode_connack(4, True, 0) == b"\x20\x02\x01\x00"
    assert m.encode_ack(m.PUBACK, 5, 4) == b"\x40\x02\x00\x05"
    assert m.encode_ack(m.PUBACK, 5, 5, m.Rc.NOT_AUTHORIZED) == b"\x40\x03\x00\x05\x87"
    assert m.encode_ack(m.PUBREL, 1, 4) == b"\x62\x02\x00\x01"
    assert m.encode_suback(3, [0, 1, 0x80], 4) == b"\x90\x05\x00\x03\x00\x01\x80"
    assert m.encode_unsuback(3, [0], 4) == b"\xb0\x02\x00\x03"
    assert m.encode_disconnect(m.Rc.SESSION_TAKEN_OVER) == b"\xe0\x02\x8e\x00"


def test_topics_and_subjects() -> None:
    assert topic_to_subject("a/b/c") == "/a/b/c" and subject_to_topic("/a/b/c") == "a/b/c"
    assert topic_to_subject("a") == "/~/~a" and topic_to_subject("a//b") == "/~/~a/~/~b"
    for bad in ("", "a/+", "a/#", "$SYS/x", "$SYS"):
        with pytest.raises(TopicError):
            topic_to_subject(bad)
    assert topic_to_subject("$app/x") == "/$app/x" and topic_to_subject("$app") == "/~/~$app"  # as Mosquitto
    for bad in ("a/#/b", "a/b#", "a+/b", "$share/g/a/b", ""):  # (a shared filter has parse_shared)
        with pytest.raises(TopicError):
            parse_filter(bad)
    assert parse_filter("$other/#").pattern == ("$other", "#")
    exact = parse_filter("a/b")
    assert (exact.subject, exact.pattern, exact.key) == ("/a/b", None, "/a/b")
    wild = parse_filter("a/+/c/#")
    assert wild.pattern == ("a", "+", "c", "#") and wild.key == "\x00/a/+/c/#"
    assert wild.entitlement_subject() == "/a/*/c/**"
    assert wild.entitlement_subjects() == ("/a/*/c/**", "/~/~a/*/~c/**")
    assert parse_filter("+").entitlement_subjects() == (None, "/~/*")
    assert parse_filter("a/b/#").parent() == "/a/b" and parse_filter("a/#").parent() == "/~/~a"
    assert parse_filter("#").parent() is None
    assert parse_filter("a/b/#").children_only().key == parse_filter("a/b/#").key  # unsubscribe finds it


@pytest.mark.parametrize(
    ("pattern", "subject", "matches"),
    [
        (("a", "#"), "/a/b", True),
        (("a", "b", "#"), "/a/b", True),  # "#" matches its parent level too
        (("a", "b", "**"), "/a/b", False),  # children only
        (("a", "b", "**"), "/a/b/c/d", True),
        (("a", "+"), "/a/b", True),
        (("a", "+"), "/a/b/c", False),
        (("+", "b"), "/$x/b", False),  # wildcards in the first level never match $-topics
        (("#",), "/x/y", True),
        (("#",), "/~/~x", True),  # a one-level topic, escaped
        (("+",), "/~/~x", True),
        (("+",), "/x/y", False),
        (("", "+"), "/~/~/~x", True),  # "/x"
        (("a", "+", "b"), "/~/~a/~/~b", True),  # "+" matches an empty level
        (("#",), "/migratory/stats/node", False),  # the server's own subjects
        (("+", "stats", "node"), "/migratory/stats/node", False),
        (("migratory", "stats", "+"), "/migratory/stats/node", True),  # named, they are readable
    ],
)
def test_pattern_matching(pattern: tuple[str, ...], subject: str, matches: bool) -> None:
    assert subject_matches(pattern, subject) is matches
