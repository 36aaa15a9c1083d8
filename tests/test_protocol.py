"""Native protocol codec: round trips, constant overhead, and malformed input."""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from migratory import protocol as p
from migratory.websocket import OP_BINARY, build_frame

texts = st.text(max_size=40)
fields = st.dictionaries(texts, texts, max_size=5)


@given(texts, st.binary(max_size=300), fields, texts, st.booleans(), st.booleans())
def test_publish_round_trip(
    subject: str, content: bytes, flds: dict[str, str], closure: str, ret: bool, g: bool
) -> None:
    frame = p.decode_client(p.encode_publish(subject, content, flds, closure, ret, g))
    assert frame == p.Publish(subject, content, flds, closure, ret, g)


@given(st.lists(texts, min_size=1, max_size=5), st.integers(min_value=0, max_value=10**6))
def test_subscribe_round_trip(subjects: list[str], conflation: int) -> None:
    assert p.decode_client(p.encode_subscribe(subjects, conflation)) == p.Subscribe(tuple(subjects), conflation)
    assert p.decode_client(p.encode_unsubscribe(subjects)) == p.Unsubscribe(tuple(subjects))


@given(texts, st.binary(max_size=300), fields, st.integers(0, 2**40), st.integers(0, 2**20), st.booleans())
def test_delivery_round_trip(
    subject: str, content: bytes, flds: dict[str, str], seq: int, epoch: int, snap: bool
) -> None:
    frame = p.decode_server(p.encode_delivery(subject, content, flds, seq, epoch, snapshot=snap))
    assert isinstance(frame, p.Delivery)
    assert (frame.subject, frame.content, dict(frame.fields), frame.seq, frame.epoch, frame.snapshot) == (
        subject,
        content,
        flds,
        seq,
        epoch,
        snap,
    )


def test_status_frames_round_trip() -> None:
    assert p.decode_server(p.encode_connected("1-2", 3, max_message_size=9, keepalive_ms=3000)) == p.Connected(
        3, "1-2", 3, 9, 3000
    )
    assert p.decode_server(p.encode_connected("1-2", 3, version=2, max_message_size=9, keepalive_ms=3000)) == (
        p.Connected(2, "1-2", 3, 9)  # a version 2 session hears of no keep-alive
    )
    assert p.decode_server(p.encode_connected("1-2", 3, version=1)) == p.Connected(1, "1-2", 3)
    assert p.decode_server(p.encode_subscribe_status(p.Status.DENIED, "/a/b", "no")) == p.SubscribeStatus(
        p.Status.DENIED, "/a/b", "no"
    )
    assert p.decode_server(p.encode_publish_status(p.Status.NO_SUBSCRIBER, "c1")) == p.PublishStatus(
        p.Status.NO_SUBSCRIBER, "c1", ""
    )
    assert p.decode_server(p.encode_error(p.Status.TOO_LARGE, "big")) == p.ErrorNotice(p.Status.TOO_LARGE, "big")
    assert p.decode_client(p.encode_connect("tok")) == p.Connect(3, "tok")
    assert p.decode_server(p.encode_notify(p.NotifyCode.KEEPALIVE, "")) == p.Notify(p.NotifyCode.KEEPALIVE, "")
    assert p.decode_server(p.encode_notify(p.NotifyCode.DATA_RESYNC, "/a/b")) == p.Notify(
        p.NotifyCode.DATA_RESYNC, "/a/b"
    )


@given(
    st.lists(st.tuples(texts, st.integers(0, 2**40), st.integers(0, 2**40)), min_size=1, max_size=5),
    st.integers(0, 10**6),
)
def test_subscribe_with_recovery_positions_round_trip(items: list[tuple[str, int, int]], conflation: int) -> None:
    subjects = [s for s, _, _ in items]
    positions = [(e, q) for _, e, q in items]
    frame = p.decode_client(p.encode_subscribe(subjects, conflation, positions))
    assert frame == p.Subscribe(tuple(subjects), conflation, tuple(positions))


@given(texts, texts, st.binary(max_size=50))
def test_publish_id_and_recovered_flag_round_trip(subject: str, publish_id: str, content: bytes) -> None:
    frame = p.decode_client(p.encode_publish(subject, content, {}, "c", True, True, publish_id))
    assert frame == p.Publish(subject, content, {}, "c", True, True, publish_id)
    delivery = p.decode_server(p.encode_delivery(subject, content, {}, 5, 6, recovered=True))
    assert isinstance(delivery, p.Delivery) and delivery.recovered and not delivery.snapshot


def test_wire_overhead_is_small_and_constant() -> None:
    """docs/protocol.md: under 16 bytes plus subject and fields, for messages under 64 KiB."""
    subject = "/Stocks/NYSE/IBM"
    for size in (0, 64, 1000, 65000):
        content = b"x" * size
        # worst realistic numbering: seq near 2**28, epoch under 2**14
        wire = build_frame(OP_BINARY, p.encode_delivery(subject, content, {}, 2**28 - 1, 2**14 - 1))
        overhead = len(wire) - len(content) - len(subject)
        assert overhead < 16, (size, overhead)


@pytest.mark.parametrize(
    ("data", "words"),
    [
        (b"", "empty"),
        (b"\x7f", "unknown opcode"),
        (b"\x04\x00\x05ab", "truncated"),
        (b"\x02\x00\x00\x00", "no subject"),
        (b"\x02\x09\x00\x01\x01a", "unknown subscribe flags"),
        (b"\x02\x01\x00\x01\x01a\x01", "truncated"),
        (b"\x04\x80\x00\x01a\x00", "unknown publish flags"),
        (b"\x04\x01\x00\x02\xff\xfe\x00", "not valid UTF-8"),
        (b"\x01\x01\x00extra", "trailing"),
        (b"\x01" + b"\xff" * 12, "varint"),
    ],
)
def test_malformed_client_messages(data: bytes, words: str) -> None:
    with pytest.raises(p.DecodeError) as info:
        p.decode_client(data)
    assert words in str(info.value)


@given(st.binary(max_size=64))
def test_decoders_raise_only_decode_error(data: bytes) -> None:
    for decode in (p.decode_client, p.decode_server):
        with contextlib.suppress(p.DecodeError):
            decode(data)
