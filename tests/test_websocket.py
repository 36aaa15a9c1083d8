"""RFC 6455 server-side parser and builder."""

from __future__ import annotations

import contextlib
import os
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from migratory import websocket as ws


def client_frame(opcode: int, payload: bytes, fin: bool = True, mask: bytes | None = None, rsv: int = 0) -> bytes:
    mask = os.urandom(4) if mask is None else mask
    first = (0x80 if fin else 0) | rsv | opcode
    n = len(payload)
    if n < 126:
        header = bytes((first, 0x80 | n))
    elif n < 65536:
        header = struct.pack("!BBH", first, 0x80 | 126, n)
    else:
        header = struct.pack("!BBQ", first, 0x80 | 127, n)
    masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
    return header + mask + masked


def test_accept_key_rfc_example() -> None:
    assert ws.accept_key("dGhlIHNhbXBsZSBub25jZQ==") == "s3pPLMBiTxaQ9kYGzzhZRbK+xOo="


@given(st.binary(max_size=70000), st.integers(min_value=1, max_value=9))
def test_masked_frames_parse_in_any_chunking(payload: bytes, pieces: int) -> None:
    data = client_frame(ws.OP_BINARY, payload) + client_frame(ws.OP_PING, b"hi")
    parser = ws.FrameParser(max_size=1 << 20)
    out: list[ws.Frame] = []
    step = max(1, len(data) // pieces)
    for i in range(0, len(data), step):
        out.extend(parser.feed(data[i : i + step]))
    assert out == [ws.Frame(ws.OP_BINARY, payload), ws.Frame(ws.OP_PING, b"hi")]
    assert parser.buffered == 0


def test_fragmented_message_is_reassembled_with_control_frame_between() -> None:
    data = (
        client_frame(ws.OP_BINARY, b"ab", fin=False)
        + client_frame(ws.OP_PING, b"")
        + client_frame(ws.OP_CONT, b"cd", fin=False)
        + client_frame(ws.OP_CONT, b"ef")
    )
    assert ws.FrameParser(100).feed(data) == [ws.Frame(ws.OP_PING, b""), ws.Frame(ws.OP_BINARY, b"abcdef")]


def test_oversized_message_is_skipped_and_reported_once() -> None:
    parser = ws.FrameParser(max_size=10)
    big = client_frame(ws.OP_BINARY, b"x" * 5000)
    frames = []
    for i in range(0, len(big), 700):  # arrives in pieces
        frames += parser.feed(big[i : i + 700])
    frames += parser.feed(client_frame(ws.OP_BINARY, b"ok"))
    assert frames == [ws.Frame(ws.OP_TOO_BIG, b"5000"), ws.Frame(ws.OP_BINARY, b"ok")]


def test_oversized_fragmented_message_skips_all_fragments() -> None:
    parser = ws.FrameParser(max_size=10)
    data = (
        client_frame(ws.OP_BINARY, b"x" * 8, fin=False)
        + client_frame(ws.OP_CONT, b"y" * 8, fin=False)
        + client_frame(ws.OP_CONT, b"z" * 8)
        + client_frame(ws.OP_BINARY, b"next")
    )
    assert parser.feed(data) == [ws.Frame(ws.OP_TOO_BIG, b"16"), ws.Frame(ws.OP_BINARY, b"next")]


@pytest.mark.parametrize(
    ("data", "code", "words"),
    [
        (bytes((0x82, 0x01)) + b"x", ws.CLOSE_PROTOCOL_ERROR, "masked"),
        (client_frame(ws.OP_BINARY, b"x", rsv=0x40), ws.CLOSE_PROTOCOL_ERROR, "reserved bits"),
        (client_frame(ws.OP_PING, b"x", fin=False), ws.CLOSE_PROTOCOL_ERROR, "fragmented control"),
        (client_frame(ws.OP_PING, b"x" * 126), ws.CLOSE_PROTOCOL_ERROR, "longer than 125"),
        (client_frame(0x3, b"x"), ws.CLOSE_PROTOCOL_ERROR, "unknown data opcode"),
        (client_frame(0xB, b"x"), ws.CLOSE_PROTOCOL_ERROR, "unknown control opcode"),
        (client_frame(ws.OP_CONT, b"x"), ws.CLOSE_PROTOCOL_ERROR, "continuation"),
        (
            client_frame(ws.OP_BINARY, b"a", fin=False) + client_frame(ws.OP_TEXT, b"b"),
            ws.CLOSE_PROTOCOL_ERROR,
            "previous",
        ),
    ],
)
def test_protocol_violations(data: bytes, code: int, words: str) -> None:
    with pytest.raises(ws.WebSocketError) as info:
        ws.FrameParser(1000).feed(data)
    assert info.value.code == code
    assert words in info.value.reason


@given(st.binary(max_size=200))
def test_parser_raises_only_websocket_error(data: bytes) -> None:
    with contextlib.suppress(ws.WebSocketError):
        ws.FrameParser(100).feed(data)


def test_build_frame_lengths() -> None:
    assert ws.build_frame(ws.OP_BINARY, b"a")[:2] == b"\x82\x01"
    assert ws.build_frame(ws.OP_BINARY, b"a" * 200)[:4] == b"\x82\x7e\x00\xc8"
    assert ws.build_frame(ws.OP_BINARY, b"a" * 70000)[:2] == b"\x82\x7f"


def test_close_frames() -> None:
    frame = ws.build_close(1009, "é" * 100)
    assert len(frame) <= 127
    assert ws.parse_close(frame[2:])[0] == 1009
    assert ws.parse_close(b"") == (1005, "")
    with pytest.raises(ws.WebSocketError):
        ws.parse_close(b"\x03")
