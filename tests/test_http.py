"""HTTP request-head parser and response builder.

The hostile heads here are the unit-level half of the corpus in
tests/test_adversarial.py, which sends the same kinds of heads to a live server.
"""

from __future__ import annotations

import contextlib
import re
import socket
from collections.abc import Callable
from typing import Any
from unittest.mock import MagicMock

import pytest
from hypothesis import given
from hypothesis import strategies as st

from migratory.http import HttpError, json_response, parse_request_head, response
from tests.conftest import ServerProcess


def test_parse_get_with_query() -> None:
    req = parse_request_head(
        b"GET /snapshot?subject=%2FStocks%2FIBM&token=U HTTP/1.1\r\nHost: x\r\nAccept: application/json"
    )
    assert req.method == "GET"
    assert req.path == "/snapshot"
    assert req.query == {"subject": "/Stocks/IBM", "token": "U"}
    assert req.headers["accept"] == "application/json"
    assert req.keep_alive
    assert req.content_length == 0


def test_upgrade_detection_and_http10() -> None:
    req = parse_request_head(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: keep-alive, Upgrade\r\nUpgrade: WebSocket")
    assert req.is_websocket_upgrade
    assert not parse_request_head(b"GET / HTTP/1.0").keep_alive
    assert parse_request_head(b"GET / HTTP/1.0\r\nConnection: Keep-Alive").keep_alive


def test_connection_and_upgrade_are_token_lists() -> None:
    """Tokens, not substrings: 'noupgrade' is not 'upgrade', 'closed' is not 'close'."""
    req = parse_request_head(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: noupgrade, closed\r\nUpgrade: websocketz")
    assert not req.is_websocket_upgrade
    assert req.keep_alive
    # a repeated list field is joined (RFC 9110 section 5.3), not replaced by its last line
    req = parse_request_head(
        b"GET / HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nConnection: keep-alive\r\nUpgrade: websocket"
    )
    assert req.headers["connection"] == "Upgrade, keep-alive"
    assert req.is_websocket_upgrade


def test_path_is_not_taken_for_an_authority() -> None:
    req = parse_request_head(b"GET //snapshot?subject=/a/b HTTP/1.1\r\nHost: x")
    assert req.path == "//snapshot" and req.query == {"subject": "/a/b"}


@pytest.mark.parametrize("value", ["0", "5", "0005", "131072", "9" * 18])
def test_content_length_ascii_digits(value: str) -> None:
    req = parse_request_head(b"POST /publish HTTP/1.1\r\nHost: x\r\nContent-Length: " + value.encode())
    assert req.content_length == int(value)


@pytest.mark.parametrize(
    "value",
    [
        "²".encode(),  # int() and str.isdigit() take Unicode digits
        "²".encode("latin-1"),
        "٣".encode(),
        "\uff11\uff12".encode(),  # fullwidth 12
        b"+5",
        b"-1",
        b"0x10",
        b"1e3",
        b"5 5",
        b"5,5",
        b"5, 5",
        b"",
        b"5\x00",
        b"1_000",
    ],
)
def test_content_length_must_be_ascii_digits(value: bytes) -> None:
    with pytest.raises(HttpError) as info:
        parse_request_head(b"POST /publish HTTP/1.1\r\nHost: x\r\nContent-Length: " + value)
    assert info.value.status == 400


@pytest.mark.parametrize(("first", "second"), [(b"5", b"6"), (b"0", b"100"), (b"5", b"5")])
def test_repeated_content_length_is_refused(first: bytes, second: bytes) -> None:
    """RFC 9112 section 6.3: different values must be refused; equal ones are refused too (documented)."""
    head = b"POST /publish HTTP/1.1\r\nHost: x\r\nContent-Length: " + first + b"\r\ncontent-length: " + second
    with pytest.raises(HttpError) as info:
        parse_request_head(head)
    assert info.value.status == 400 and "repeated" in info.value.reason


def test_huge_content_length_is_413_not_a_crash() -> None:
    for digits in (19, 5000):  # int() refuses over 4300 digits with ValueError
        with pytest.raises(HttpError) as info:
            parse_request_head(b"POST /publish HTTP/1.1\r\nHost: x\r\nContent-Length: " + b"9" * digits)
        assert info.value.status == 413
    assert parse_request_head(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: " + b"0" * 100 + b"7").content_length == 7


def test_transfer_encoding_is_reported() -> None:
    req = parse_request_head(b"POST /publish HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked")
    assert req.has_transfer_encoding


@pytest.mark.parametrize(
    ("head", "status"),
    [
        (b"garbage", 400),
        (b"GET /x HTTP/2.0", 505),
        (b"GET /x HTTP/9", 400),
        (b"GET /x http/1.1", 400),
        (b"GET http://x/ HTTP/1.1\r\nHost: x", 400),
        (b"GET * HTTP/1.1\r\nHost: x", 400),
        (b"GET / HTTP/1.1\r\nbad header", 400),
        (b"G(T / HTTP/1.1\r\nHost: x", 400),
        (b"GET /?a=%ff HTTP/1.1\r\nHost: x", 400),
        (b"GET  / HTTP/1.1\r\nHost: x", 400),  # two spaces
        (b"GET / HTTP/1.1 \r\nHost: x", 400),
        (b"GET /\tx HTTP/1.1\r\nHost: x", 400),
        (b"GET /\xe9 HTTP/1.1\r\nHost: x", 400),  # non-ASCII must be percent-encoded
        (b"GET /a\x00b HTTP/1.1\r\nHost: x", 400),
        (b"GET /#frag HTTP/1.1\r\nHost: x", 400),
        (b"GET / HTTP/1.1", 400),  # HTTP/1.1 without Host
        (b"GET / HTTP/1.1\r\nHost: a\r\nHost: b", 400),
        (b"GET / HTTP/1.1\r\nHost: a b", 400),
        (b"GET / HTTP/1.1\r\nHost: a/b", 400),
        (b"GET / HTTP/1.1\r\nHost: user@a", 400),
        (b"GET / HTTP/1.1\r\nHost : x", 400),  # whitespace before the colon (RFC 9112 section 5.1)
        (b"GET / HTTP/1.1\r\nHost: x\r\n folded", 400),  # obs-fold
        (b"GET / HTTP/1.1\r\nHost: x\r\n\tfolded: y", 400),
        (b"GET / HTTP/1.1\r\nHost: x\r\nX: a\rb", 400),  # bare CR
        (b"GET / HTTP/1.1\r\nHost: x\r\nX: a\nb", 400),  # bare LF
        (b"GET / HTTP/1.1\r\nHost: x\r\nX: a\x00b", 400),
        (b"GET / HTTP/1.1\r\nHost: x\r\nX: \x7f", 400),
        (b"GET / HTTP/1.1\r\nHost: x\r\n: empty name", 400),
        (b"GET / HTTP/1.1\r\nHost: x\r\nX\xe9: y", 400),
        (b"GET / HTTP/1.1\r\nHost: x\r\nSec-WebSocket-Key: a\r\nSec-WebSocket-Key: b", 400),
    ],
)
def test_bad_requests(head: bytes, status: int) -> None:
    with pytest.raises(HttpError) as info:
        parse_request_head(head)
    assert info.value.status == status


def test_lenient_where_the_rfc_allows() -> None:
    req = parse_request_head(b"GET / HTTP/1.1\r\nHost: [::1]:8800\r\nX-Tab:\tv\t\r\nX-Latin: caf\xe9\r\nX-Empty:")
    assert req.headers["x-tab"] == "v" and req.headers["x-latin"] == "caf\xe9" and req.headers["x-empty"] == ""
    assert parse_request_head(b"GET / HTTP/1.0").headers == {}  # HTTP/1.0 needs no Host
    assert parse_request_head(b"GET / HTTP/1.1\r\nHost:").headers["host"] == ""  # empty Host is allowed


@given(st.binary(max_size=200))
def test_parser_raises_only_http_error(data: bytes) -> None:
    with contextlib.suppress(HttpError):
        parse_request_head(data)


_header_name = st.text(st.characters(codec="latin-1"), min_size=0, max_size=12)
_header_value = st.text(st.characters(codec="latin-1"), max_size=30)


@given(
    st.sampled_from(["GET", "POST", "HEAD", "G T", ""]),
    st.text(st.characters(codec="latin-1"), max_size=30),
    st.lists(st.tuples(_header_name, _header_value), max_size=8),
)
def test_structured_heads_raise_only_http_error(method: str, target: str, fields: list[tuple[str, str]]) -> None:
    """Heads that look almost right: anything accepted is within the grammar, anything else is an HttpError."""
    lines = [f"{method} /{target} HTTP/1.1", "Host: x", *(f"{name}: {value}" for name, value in fields)]
    try:
        req = parse_request_head("\r\n".join(lines).encode("latin-1"))
    except HttpError as exc:
        assert exc.status in (400, 413)
        return
    assert req.target.isascii() and req.target.isprintable() and " " not in req.target
    assert "host" in req.headers
    assert all(name.isascii() and name == name.lower() for name in req.headers)
    assert all("\r" not in v and "\n" not in v and "\x00" not in v for v in req.headers.values())
    assert req.content_length >= 0


def test_responses() -> None:
    raw = response(404, b"no", keep_alive=False)
    assert raw.startswith(b"HTTP/1.1 404 Not Found\r\n")
    assert b"Content-Length: 2\r\n" in raw and b"Connection: close" in raw
    assert json_response(200, {"a": "é"}).endswith('{"a":"é"}'.encode())
    assert b"\r\nSec-WebSocket-Version: 13\r\n" in json_response(426, {}, extra={"Sec-WebSocket-Version": "13"})


# --- the connection's HTTP answering, without sockets -------------------------------------------------


class _Loop:
    """Enough of an event loop for a Connection: a clock and a call_soon queue run by hand."""

    def __init__(self) -> None:
        self.soon: list[Callable[[], None]] = []

    def time(self) -> float:
        return 0.0

    def call_soon(self, callback: Callable[[], None]) -> None:
        self.soon.append(callback)

    def run(self) -> int:
        turns = 0
        while self.soon:
            turns += 1
            callbacks, self.soon = self.soon, []
            for callback in callbacks:
                callback()
        return turns


class _Transport:
    def __init__(self) -> None:
        self.out = bytearray()
        self.closed = False

    def get_extra_info(self, name: str) -> object:
        return ("127.0.0.1", 40000) if name == "peername" else None

    def write(self, data: bytes) -> None:
        self.out += data

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.closed = True


def _connection(ready: bool = True) -> tuple[Any, MagicMock, _Transport, _Loop]:
    from migratory.server.sessions.connection import Connection

    engine = MagicMock()
    engine.loop = loop = _Loop()
    engine.config.handshake_timeout = 10000
    engine.config.max_header_size = 16384
    engine.config.keep_alive_interval = 30000
    engine.max_message_size = 131072
    engine.max_pending = 1 << 40
    engine.batching_time = 1.0  # output waits for flush(), called by hand below
    engine.batching_size = 0
    engine.ready = ready
    engine.async_entitlement = False
    engine.admit.return_value = True
    engine.health.return_value = {"status": "ok"}
    engine.session_name.return_value = "1-0-1"
    conn = Connection(engine, "127.0.0.1:8800", "ws")
    transport = _Transport()
    conn.connection_made(transport)  # type: ignore[arg-type]
    return conn, engine, transport, loop


def _statuses(out: bytes) -> list[int]:
    return [int(status) for status in re.findall(rb"HTTP/1\.1 (\d{3}) ", out)]


def test_pipelining_is_a_bounded_loop_not_a_recursion() -> None:
    """4000 pipelined requests in one read (about 330 used to raise RecursionError), 64 per loop turn."""
    conn, _, transport, loop = _connection()
    count = 4000  # 140 KB: within MaxHeaderSize + MessageSizeLimit, the most one read may bring
    conn.data_received(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n" * count)
    conn.flush()
    assert len(_statuses(transport.out)) == 64  # one batch, then the event loop gets its turn
    turns = loop.run()
    conn.flush()
    assert _statuses(transport.out) == [200] * count and turns == -(-count // 64) - 1
    assert not transport.closed and not conn.inbuf


def test_too_much_pipelined_input_at_once_is_413() -> None:
    conn, engine, transport, _ = _connection()
    conn.data_received(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n" * 5000)  # 175 KB
    assert _statuses(transport.out) == [413] and transport.closed
    (line,) = [c for c in engine.access.call_args_list if c.args[0] == "http"]
    assert (line.kwargs["method"], line.kwargs["path"], line.kwargs["status"]) == (None, None, 413)


def test_an_upgrade_to_a_member_that_is_not_ready_is_503_and_an_http_line() -> None:
    conn, engine, transport, _ = _connection(ready=False)
    key = "dGhlIHNhbXBsZSBub25jZQ=="
    conn.data_received(
        b"GET /x?y=1 HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        b"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: " + key.encode() + b"\r\n\r\n"
    )
    assert _statuses(transport.out) == [503] and transport.closed
    (line,) = [c for c in engine.access.call_args_list if c.args[0] == "http"]
    assert line.kwargs == {
        "method": "GET",
        "path": "/x",
        "status": 503,
        "subject": None,
        "bytes_out": len(transport.out),
    }
    assert engine.deny.call_args.args[2] == "not_ready"


def test_the_client_script_carries_one_cache_control_header(server_factory: Callable[..., ServerProcess]) -> None:
    with socket.create_connection(("127.0.0.1", server_factory({}).port), timeout=10) as sock:
        sock.sendall(b"GET /migratory.js HTTP/1.1\r\nHost: x\r\nOrigin: http://www.example.com\r\n\r\n")
        head = b""
        while b"\r\n\r\n" not in head:
            head += sock.recv(65536)
    lines = head.split(b"\r\n\r\n")[0].decode("latin-1").lower().split("\r\n")
    assert [line for line in lines if line.startswith("cache-control:")] == ["cache-control: no-cache"]
    assert "access-control-allow-origin: *" in lines
