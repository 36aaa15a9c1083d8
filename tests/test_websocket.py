"""RFC 6455 server-side parser and builder."""

from __future__ import annotations

import base64
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
    assert ws.valid_key("dGhlIHNhbXBsZSBub25jZQ==")
    assert ws.accept_key("dGhlIHNhbXBsZSBub25jZQ==") == "s3pPLMBiTxaQ9kYGzzhZRbK+xOo="


@pytest.mark.parametrize(
    "key",
    [
        "",
        "é" * 24,  # non-ASCII: accept_key() used to raise UnicodeEncodeError
        "dGhlIHNhbXBsZSBub25jZQ=\u00e9",
        "dGhlIHNhbXBsZSBub25jZQ",  # no padding
        "dGhlIHNhbXBsZSBub25jZQ==dGhl",
        "AAAAAAAAAAAAAAAAAAAAAAA=",  # 17 bytes
        base64.b64encode(b"x" * 15).decode() + "AAAA",  # 24 characters, not 16 bytes
        "dGhlIHNhbXBsZSBub25j*Q==",  # not base64
        "dGhlIHNhbXBsZSBub25j ZQ=",
        "x" * 24,
    ],
)
def test_malformed_keys_are_invalid(key: str) -> None:
    assert not ws.valid_key(key)


@given(st.binary(min_size=16, max_size=16))
def test_every_16_byte_key_is_valid(raw: bytes) -> None:
    key = base64.b64encode(raw).decode()
    assert ws.valid_key(key) and len(ws.accept_key(key)) == 28


@given(st.text(max_size=40))
def test_valid_key_never_raises(key: str) -> None:
    ws.valid_key(key)


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


_FORBIDDEN_CLOSE_CODES = [0, 1, 999, 1004, 1005, 1006, 1015, 1016, 1100, 2000, 2999, 5000, 65535]
_ALLOWED_CLOSE_CODES = [1000, 1001, 1002, 1003, 1007, 1008, 1009, 1010, 1011, 1012, 1013, 1014, 3000, 4000, 4999]


@pytest.mark.parametrize("code", _FORBIDDEN_CLOSE_CODES)
def test_forbidden_close_codes_are_protocol_errors(code: int) -> None:
    """RFC 6455 section 7.4: these never travel in a close frame; receiving one is a 1002."""
    with pytest.raises(ws.WebSocketError) as info:
        ws.parse_close(struct.pack("!H", code) + b"bye")
    assert info.value.code == ws.CLOSE_PROTOCOL_ERROR and str(code) in info.value.reason


@pytest.mark.parametrize("code", _ALLOWED_CLOSE_CODES)
def test_allowed_close_codes_parse(code: int) -> None:
    assert ws.parse_close(struct.pack("!H", code) + "é".encode()) == (code, "é")


@given(st.integers(min_value=0, max_value=65535))
def test_close_code_rule(code: int) -> None:
    expected = code in (1000, 1001, 1002, 1003) or 1007 <= code <= 1014 or 3000 <= code <= 4999
    assert ws.close_code_allowed(code) is expected


def test_close_reason_must_be_utf8() -> None:
    with pytest.raises(ws.WebSocketError) as info:
        ws.parse_close(struct.pack("!H", 1000) + b"\xff\xfe")
    assert info.value.code == ws.CLOSE_PROTOCOL_ERROR


@given(st.binary(max_size=125))
def test_parse_close_raises_only_websocket_error(payload: bytes) -> None:
    with contextlib.suppress(ws.WebSocketError):
        code, reason = ws.parse_close(payload)
        assert code == 1005 or ws.close_code_allowed(code)
        assert isinstance(reason, str)
