"""HTTP request-head parser and response builder."""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from migratory.http import HttpError, json_response, parse_request_head, response


def test_parse_get_with_query() -> None:
    req = parse_request_head(
        b"GET /snapshot?subject=%2FStocks%2FIBM&token=U HTTP/1.1\r\nHost: x\r\nAccept: application/json"
    )
    assert req.method == "GET"
    assert req.path == "/snapshot"
    assert req.query == {"subject": "/Stocks/IBM", "token": "U"}
    assert req.headers["accept"] == "application/json"
    assert req.keep_alive


def test_upgrade_detection_and_http10() -> None:
    req = parse_request_head(b"GET / HTTP/1.1\r\nConnection: keep-alive, Upgrade\r\nUpgrade: WebSocket")
    assert req.is_websocket_upgrade
    assert not parse_request_head(b"GET / HTTP/1.0").keep_alive


@pytest.mark.parametrize(
    ("head", "status"),
    [
        (b"garbage", 400),
        (b"GET /x HTTP/2.0", 505),
        (b"GET http://x/ HTTP/1.1", 400),
        (b"GET / HTTP/1.1\r\nbad header", 400),
        (b"G(T / HTTP/1.1", 400),
        (b"GET /?a=%ff HTTP/1.1", 400),
    ],
)
def test_bad_requests(head: bytes, status: int) -> None:
    with pytest.raises(HttpError) as info:
        parse_request_head(head)
    assert info.value.status == status


@given(st.binary(max_size=200))
def test_parser_raises_only_http_error(data: bytes) -> None:
    with contextlib.suppress(HttpError):
        parse_request_head(data)


def test_responses() -> None:
    raw = response(404, b"no", keep_alive=False)
    assert raw.startswith(b"HTTP/1.1 404 Not Found\r\n")
    assert b"Content-Length: 2\r\n" in raw and b"Connection: close" in raw
    assert json_response(200, {"a": "é"}).endswith('{"a":"é"}'.encode())
