"""The adversarial suite: hostile input against a live server, with an honest client beside it.

Each corpus below is sent to a real ``migratory serve`` process over real sockets.
Every test asserts that the server answers by the RFCs (HTTP status codes, WebSocket
close codes, native ERROR messages), stays up, keeps serving an honest client that
is connected the whole time (a subscriber that must receive every check message,
never reconnecting), keeps its timers running, and never prints a ``Traceback``
(stderr, server.log, access.log). The CLI half (a user's terminal) is in
tests/test_cli.py (``CLI_MISTAKES``) and at the end of this file.

The suite grows with the code: a new parser, endpoint or message gets its hostile
cases here. docs/security.md ("Threat model") points at these tests.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import queue
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from migratory import protocol as p
from migratory.client import ClientMessage, EventKind, MigratoryClient, StatusEvent
from migratory.http import HttpError, parse_request_head
from migratory.protocol import Status
from migratory.websocket import close_code_allowed
from tests.conftest import ServerProcess

FEED = "/honest/feed"
KEY = base64.b64encode(b"0123456789abcdef").decode()
UPGRADE = (
    "GET / HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
    f"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: {KEY}\r\n"
)
QUIET = {"KeepAliveInterval": "3600000"}  # the raw test clients never have to answer a ping


# --- the honest client --------------------------------------------------------------------------------


class Honest:
    """A MigratoryClient subscribed to FEED on its own event loop thread, for the whole test.

    ``check(tag)`` publishes ``tag`` over HTTP and waits for the subscriber to receive
    it; the client must never have lost its connection.
    """

    def __init__(self, server: ServerProcess) -> None:
        self.server = server
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.received: queue.Queue[ClientMessage] = queue.Queue()
        self.events: list[StatusEvent] = []
        self.client: MigratoryClient = self._call(self._open())
        self.checks = 0

    def _call(self, coro: Any, timeout: float = 30) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _open(self) -> MigratoryClient:
        client = MigratoryClient([self.server.ws_url], on_message=self.received.put, on_status=self.events.append)
        await client.connect()
        assert await client.subscribe([FEED]) == {FEED: Status.OK}
        return client

    def check(self, tag: str) -> None:
        self.checks += 1
        body = f"{self.checks}:{tag}".encode()
        request = urllib.request.Request(f"{self.server.http_url}/publish?subject={FEED}", data=body, method="POST")
        with urllib.request.urlopen(request, timeout=10) as answer:
            assert json.loads(answer.read()) == {"status": "OK"}, f"honest publish after {tag!r}"
        deadline = time.monotonic() + 10
        while True:
            message = self.received.get(timeout=max(0.1, deadline - time.monotonic()))
            if message.content == body:
                break
        assert self.client.connected, f"the honest client lost its connection after {tag!r}"
        down = [e for e in self.events if e.kind is EventKind.NOTIFY_SERVER_DOWN]
        assert not down, f"the honest client was disconnected after {tag!r}: {down}"

    def close(self) -> None:
        self._call(self.client.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture
def honest_server(server_factory: Callable[..., ServerProcess]) -> Iterator[tuple[ServerProcess, Honest]]:
    server = server_factory(QUIET)
    honest = Honest(server)
    yield server, honest
    honest.check("end of test")
    honest.close()
    assert_clean_stop(server)


def assert_clean_stop(server: ServerProcess) -> None:
    """Stop the server (SIGTERM): it must exit 0 and have printed or logged no traceback."""
    assert server.proc.poll() is None, "the server died"
    assert server.stop(signal.SIGTERM) == 0
    assert server.proc.stderr is not None
    stderr = server.proc.stderr.read().decode("utf-8", "replace")
    assert "Traceback" not in stderr and "Fatal error" not in stderr, stderr[-3000:]
    for name in ("server.log", "access.log", "message.log"):
        path = server.log_folder / name
        text = path.read_text("utf-8", "replace") if path.exists() else ""
        assert "Traceback" not in text, f"{name}: {text[-3000:]}"
        assert '"level":"ERROR"' not in text and '"level":"CRITICAL"' not in text, f"{name}: {text[-3000:]}"


# --- raw HTTP ---------------------------------------------------------------------------------------


class Answer:
    """One HTTP response read off a raw socket."""

    def __init__(self, status: int, headers: dict[str, str], body: bytes, raw: bytes) -> None:
        self.status = status
        self.headers = headers
        self.body = body
        self.raw = raw


def connect(server: ServerProcess, timeout: float = 10) -> socket.socket:
    return socket.create_connection((server.host, server.port), timeout=timeout)


def send(sock: socket.socket, data: bytes) -> None:
    # the server may answer and close before it read everything: what it said is read next
    with contextlib.suppress(OSError):
        sock.sendall(data)


def read_answer(sock: socket.socket, buf: bytearray) -> Answer | None:
    """The next response on ``sock`` (``buf`` keeps bytes read past it); None if the server closed first."""
    while b"\r\n\r\n" not in buf:
        chunk = _recv(sock)
        if not chunk:
            return None
        buf += chunk
    end = buf.index(b"\r\n\r\n")
    head = bytes(buf[:end]).decode("latin-1")
    lines = head.split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    length = int(headers.get("content-length", "0"))
    while len(buf) < end + 4 + length:
        chunk = _recv(sock)
        if not chunk:
            break
        buf += chunk
    raw = bytes(buf[: end + 4 + length])
    del buf[: end + 4 + length]
    return Answer(status, headers, raw[end + 4 :], raw)


def _recv(sock: socket.socket) -> bytes:
    try:
        return sock.recv(65536)
    except ConnectionResetError:
        return b""


def closed_by_server(sock: socket.socket, buf: bytearray, timeout: float = 10) -> bool:
    """True once the server has closed the connection (and sent nothing more)."""
    sock.settimeout(timeout)
    try:
        data = sock.recv(65536)
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    buf += data
    return data == b""


def exchange(server: ServerProcess, data: bytes) -> tuple[Answer | None, bool]:
    """Send ``data`` on a fresh connection: the first answer, and whether the server then closed."""
    with connect(server) as sock:
        send(sock, data)
        buf = bytearray()
        answer = read_answer(sock, buf)
        closed = answer is not None and answer.headers.get("connection") == "close" and closed_by_server(sock, buf)
        return answer, closed


def wait_for_log(server: ServerProcess, name: str, predicate: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    """The first line of a log file matching ``predicate`` (the logs are flushed once a second)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        path = server.log_folder / name
        if path.exists():
            for line in path.read_text().splitlines():
                entry = json.loads(line)
                if predicate(entry):
                    return dict(entry)
        time.sleep(0.2)
    raise AssertionError(f"no such line in {name}")


# --- the corpus of hostile HTTP request heads -----------------------------------------------------------

H = "Host: x\r\n"
HTTP_CORPUS: list[tuple[str, bytes, int]] = [
    # (name, bytes sent, status expected); every error answer closes the connection
    ("TLS hello on a plain port", b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03garbage\r\n\r\n", 400),
    ("binary garbage", bytes(range(256)) + b"\r\n\r\n", 400),
    ("HTTP/2 preface", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", 505),
    ("HTTP/9", b"GET / HTTP/9\r\n" + H.encode() + b"\r\n", 400),
    ("lower-case version", b"GET / http/1.1\r\n" + H.encode() + b"\r\n", 400),
    ("absolute-form target", b"GET http://evil/ HTTP/1.1\r\n" + H.encode() + b"\r\n", 400),
    ("asterisk target", b"OPTIONS * HTTP/1.1\r\n" + H.encode() + b"\r\n", 400),
    ("two spaces in the request line", b"GET  /health HTTP/1.1\r\n" + H.encode() + b"\r\n", 400),
    ("tab in the target", b"GET /hea\tlth HTTP/1.1\r\n" + H.encode() + b"\r\n", 400),
    ("NUL in the target", b"GET /health\x00 HTTP/1.1\r\n" + H.encode() + b"\r\n", 400),
    ("non-ASCII target", "GET /sn\u00e4pshot HTTP/1.1\r\n".encode() + H.encode() + b"\r\n", 400),
    ("fragment in the target", b"GET /health#x HTTP/1.1\r\n" + H.encode() + b"\r\n", 400),
    ("query not UTF-8", b"GET /snapshot?subject=%ff%fe HTTP/1.1\r\n" + H.encode() + b"\r\n", 400),
    ("bad method", b"G(T /health HTTP/1.1\r\n" + H.encode() + b"\r\n", 400),
    ("no Host in HTTP/1.1", b"GET /health HTTP/1.1\r\n\r\n", 400),
    ("two Host headers", b"GET /health HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", 400),
    ("Host with a space", b"GET /health HTTP/1.1\r\nHost: a b\r\n\r\n", 400),
    ("Host with userinfo", b"GET /health HTTP/1.1\r\nHost: u@a\r\n\r\n", 400),
    ("space before the colon", b"GET /health HTTP/1.1\r\nHost : x\r\n\r\n", 400),
    ("obsolete line folding", b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: a\r\n b\r\n\r\n", 400),
    ("header without a colon", b"GET /health HTTP/1.1\r\nHost: x\r\nnocolon\r\n\r\n", 400),
    ("empty header name", b"GET /health HTTP/1.1\r\nHost: x\r\n: v\r\n\r\n", 400),
    ("non-ASCII header name", "GET /health HTTP/1.1\r\nHost: x\r\nX-\u00e9: v\r\n\r\n".encode(), 400),
    ("bare CR in a value", b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: a\rb\r\n\r\n", 400),
    ("bare LF in a value", b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: a\nb\r\n\r\n", 400),
    ("NUL in a value", b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: a\x00b\r\n\r\n", 400),
    (
        "Content-Length \u00b2 (UTF-8)",
        "POST /publish?subject=/a/b HTTP/1.1\r\nHost: x\r\nContent-Length: \u00b2\r\n\r\nx".encode(),
        400,
    ),
    (
        "Content-Length \u00b2 (Latin-1)",
        b"POST /publish?subject=/a/b HTTP/1.1\r\nHost: x\r\nContent-Length: \xb2\r\n\r\nxx",
        400,
    ),
    (
        "Content-Length Arabic-Indic 3",
        "POST /publish?subject=/a/b HTTP/1.1\r\nHost: x\r\nContent-Length: \u0663\r\n\r\nxxx".encode(),
        400,
    ),
    ("Content-Length +1", b"POST /publish?subject=/a/b HTTP/1.1\r\nHost: x\r\nContent-Length: +1\r\n\r\nx", 400),
    ("Content-Length -1", b"POST /publish?subject=/a/b HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n", 400),
    ("Content-Length 0x1", b"POST /publish?subject=/a/b HTTP/1.1\r\nHost: x\r\nContent-Length: 0x1\r\n\r\nx", 400),
    ("Content-Length 1 1", b"POST /publish?subject=/a/b HTTP/1.1\r\nHost: x\r\nContent-Length: 1 1\r\n\r\nx", 400),
    ("Content-Length 1,1", b"POST /publish?subject=/a/b HTTP/1.1\r\nHost: x\r\nContent-Length: 1,1\r\n\r\nx", 400),
    ("Content-Length empty", b"POST /publish?subject=/a/b HTTP/1.1\r\nHost: x\r\nContent-Length:\r\n\r\n", 400),
    (
        "two different Content-Length (smuggling)",
        b"POST /publish?subject=/a/b HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 40\r\n\r\n"
        b"xPOST /publish?subject=/smuggled/x HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n\r\ny",
        400,
    ),
    (
        "two equal Content-Length",
        b"POST /publish?subject=/a/b HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 1\r\n\r\nx",
        400,
    ),
    (
        "Content-Length of 5000 digits",
        b"POST /publish HTTP/1.1\r\nHost: x\r\nContent-Length: " + b"9" * 5000 + b"\r\n\r\n",
        413,
    ),
    (
        "Content-Length over MessageSizeLimit",
        b"POST /publish HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999\r\n\r\n",
        413,
    ),
    (
        "chunked body",
        b"POST /publish?subject=/a/b HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n1\r\nx\r\n0\r\n\r\n",
        411,
    ),
    (
        "Transfer-Encoding and Content-Length (smuggling)",
        b"POST /publish?subject=/a/b HTTP/1.1\r\nHost: x\r\nContent-Length: 6\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"0\r\n\r\nX",
        411,
    ),
    (
        "obfuscated Transfer-Encoding",
        b"POST /publish?subject=/a/b HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: xchunked\r\n\r\n",
        411,
    ),
    ("head over MaxHeaderSize", b"GET /health HTTP/1.1\r\nHost: x\r\nX-Long: " + b"a" * 20000 + b"\r\n\r\n", 431),
    ("endless head", b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"X-A: b\r\n" * 3000, 431),
    # WebSocket handshakes
    ("upgrade by POST", b"POST / HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n", 405),
    ("upgrade in HTTP/1.0", UPGRADE.replace("HTTP/1.1", "HTTP/1.0").encode() + b"\r\n", 400),
    ("upgrade, version 8", UPGRADE.replace("Version: 13", "Version: 8").encode() + b"\r\n", 426),
    ("upgrade, no version", UPGRADE.replace("Sec-WebSocket-Version: 13\r\n", "").encode() + b"\r\n", 426),
    ("upgrade, no key", UPGRADE.replace(f"Sec-WebSocket-Key: {KEY}\r\n", "").encode() + b"\r\n", 400),
    ("upgrade, non-ASCII key", UPGRADE.replace(KEY, "\u00e9" * 24).encode("latin-1") + b"\r\n", 400),
    ("upgrade, non-ASCII key (UTF-8)", UPGRADE.replace(KEY, "\u00e9" * 12).encode() + b"\r\n", 400),
    (
        "upgrade, key of 15 bytes",
        UPGRADE.replace(KEY, base64.b64encode(b"x" * 15).decode() + "AAAA").encode() + b"\r\n",
        400,
    ),
    ("upgrade, key of 17 bytes", UPGRADE.replace(KEY, base64.b64encode(b"x" * 17).decode()).encode() + b"\r\n", 400),
    ("upgrade, key not base64", UPGRADE.replace(KEY, "*" * 22 + "==").encode() + b"\r\n", 400),
    ("upgrade, two keys", UPGRADE.encode() + f"Sec-WebSocket-Key: {KEY}\r\n\r\n".encode(), 400),
    ("upgrade with a body", UPGRADE.encode() + b"Content-Length: 4\r\n\r\n\x88\x80abcd", 400),
    ("upgrade, chunked", UPGRADE.encode() + b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 400),
    # answered normally (the connection stays open)
    ("unknown method", b"BREW /pot HTTP/1.1\r\nHost: x\r\n\r\n", 404),
    ("unknown path", b"GET /../../etc/passwd HTTP/1.1\r\nHost: x\r\n\r\n", 404),
    ("HTTP/1.0 without Host", b"GET /health HTTP/1.0\r\n\r\n", 200),
    ("empty lines before the request", b"\r\n\r\n\r\nGET /health HTTP/1.1\r\nHost: x\r\n\r\n", 200),
    ("valid upgrade", UPGRADE.encode() + b"\r\n", 101),
]


def test_hostile_http_heads(honest_server: tuple[ServerProcess, Honest]) -> None:
    """Every head of HTTP_CORPUS gets its status; an error answer says Connection: close and closes."""
    server, honest = honest_server
    wrong: list[str] = []
    for name, data, expected in HTTP_CORPUS:
        answer, closed = exchange(server, data)
        if answer is None:
            wrong.append(f"{name}: no answer")
        elif answer.status != expected:
            wrong.append(f"{name}: {answer.status} instead of {expected}: {answer.raw[:300]!r}")
        elif expected >= 400 and expected != 404 and not closed:
            wrong.append(f"{name}: {expected} but the connection was left open")
        elif expected >= 400 and not answer.raw.startswith(b"HTTP/1.1 "):
            wrong.append(f"{name}: not an HTTP/1.1 answer")
        elif expected == 426 and answer.headers.get("sec-websocket-version") != "13":
            wrong.append(f"{name}: 426 without Sec-WebSocket-Version: 13")
        elif expected >= 400 and expected != 404 and "error" not in json.loads(answer.body):
            wrong.append(f"{name}: no JSON error")
        honest.check(name)
    assert not wrong, "\n".join(wrong)
    # nothing of a refused request was ever executed: no publication reached any subject
    status = urllib.request.urlopen(f"{server.http_url}/health", timeout=10).status
    assert status == 200
    for subject in ("/a/b", "/smuggled/x"):
        request = urllib.request.Request(f"{server.http_url}/snapshot?subject={subject}")
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(request, timeout=10)
        assert info.value.code == 404


def test_every_refused_http_request_is_an_http_line_in_access_log(honest_server: tuple[ServerProcess, Honest]) -> None:
    """Each error answer writes an ``http`` line (method and path, or null when the head was not parsed)."""
    server, honest = honest_server
    cases = [
        (
            b"POST /publish?subject=/a/b HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n",
            "POST",
            "/publish",
            411,
        ),
        (b"\x16\x03\x01garbage\r\n\r\n", None, None, 400),
        (b"POST /p HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999\r\n\r\n", "POST", "/p", 413),
        (b"GET / HTTP/1.1\r\nHost: x\r\nX: " + b"a" * 20000 + b"\r\n\r\n", None, None, 431),
        (b"POST / HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n", "POST", "/", 405),
        (UPGRADE.replace("Version: 13", "Version: 8").encode() + b"\r\n", "GET", "/", 426),
        (UPGRADE.replace(KEY, "\u00e9" * 24).encode("latin-1") + b"\r\n", "GET", "/", 400),
    ]
    sizes = []
    for data, _, _, status in cases:
        answer, closed = exchange(server, data)
        assert answer is not None and answer.status == status and closed
        sizes.append(len(answer.raw))
    honest.check("access log")
    deadline = time.monotonic() + 10
    while True:  # the access log is flushed once a second
        entries = [json.loads(line) for line in (server.log_folder / "access.log").read_text().splitlines()]
        refused = [e for e in entries if e["event"] == "http" and e["status"] >= 400]
        if len(refused) >= len(cases) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    got = [(e["method"], e["path"], e["status"], e["subject"], e["bytes_out"]) for e in refused]
    assert got == [(m, path, status, None, size) for (_, m, path, status), size in zip(cases, sizes, strict=True)]
    assert all(e["protocol"] == "http" and e["addr"] == "127.0.0.1" for e in refused)
    denied = {e["session"] for e in entries if e["event"] == "denied"}
    assert {e["session"] for e in refused} <= denied  # and each is a denied line too, as before


# --- pipelining ---------------------------------------------------------------------------------------


def test_hundreds_of_pipelined_requests_in_one_read(honest_server: tuple[ServerProcess, Honest]) -> None:
    """About 330 pipelined requests used to end in RecursionError: now a loop answers each, in order."""
    server, honest = honest_server
    count = 1000
    with connect(server, timeout=20) as sock:
        send(sock, b"".join(f"GET /snapshot?subject=/p/{i} HTTP/1.1\r\nHost: x\r\n\r\n".encode() for i in range(count)))
        buf = bytearray()
        answers = [read_answer(sock, buf) for _ in range(count)]
        assert all(a is not None and a.status == 404 for a in answers)
        assert [json.loads(a.body)["error"] for a in answers if a is not None] == [
            f"no snapshot for /p/{i}" for i in range(count)
        ]
        send(sock, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")  # and the connection is still usable
        last = read_answer(sock, buf)
        assert last is not None and last.status == 200
    honest.check("pipelining")


def test_pipelined_requests_keep_their_order_across_a_waiting_publish(
    honest_server: tuple[ServerProcess, Honest],
) -> None:
    """A publish is answered later (by its coordinator); what was pipelined behind it waits for it."""
    server, honest = honest_server
    with connect(server) as sock:
        requests = b""
        for i in range(50):
            body = str(i).encode()
            requests += b"POST /publish?subject=/o/r HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (
                len(body),
                body,
            )
            requests += b"GET /snapshot?subject=/o/r HTTP/1.1\r\nHost: x\r\n\r\n"
        send(sock, requests)
        buf = bytearray()
        for i in range(50):
            published = read_answer(sock, buf)
            assert published is not None and published.status == 200
            snap = read_answer(sock, buf)
            assert snap is not None and (snap.status, snap.body) == (200, str(i).encode())
    honest.check("ordered pipelining")


def test_pipelining_stops_at_connection_close_and_at_a_bad_request(honest_server: tuple[ServerProcess, Honest]) -> None:
    server, honest = honest_server
    ok = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    with connect(server) as sock:
        send(sock, ok + ok + b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n" + ok)
        buf = bytearray()
        assert [a.status if a else None for a in (read_answer(sock, buf) for _ in range(3))] == [200, 200, 200]
        assert closed_by_server(sock, buf) and not buf  # the fourth was never answered
    with connect(server) as sock:
        send(sock, ok + b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: \xb2\r\n\r\n" + ok)
        buf = bytearray()
        assert [a.status if a else None for a in (read_answer(sock, buf) for _ in range(2))] == [200, 400]
        assert closed_by_server(sock, buf) and not buf
    honest.check("pipelining stops")


# --- WebSocket frames ---------------------------------------------------------------------------------


def frame(opcode: int, payload: bytes, *, fin: bool = True, masked: bool = True, rsv: int = 0) -> bytes:
    first = (0x80 if fin else 0) | rsv | opcode
    n = len(payload)
    bit = 0x80 if masked else 0
    if n < 126:
        header = bytes((first, bit | n))
    elif n < 65536:
        header = struct.pack("!BBH", first, bit | 126, n)
    else:
        header = struct.pack("!BBQ", first, bit | 127, n)
    if not masked:
        return header + payload
    mask = os.urandom(4)
    return header + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


class RawWs:
    """A WebSocket client over a plain socket that sends whatever it is told to."""

    def __init__(self, server: ServerProcess, *, hello: bool = True, extra: str = "") -> None:
        self.sock = connect(server)
        self.sock.sendall(UPGRADE.encode() + extra.encode() + b"\r\n")
        self.buf = bytearray()
        answer = read_answer(self.sock, self.buf)
        assert answer is not None and answer.status == 101
        if hello:
            self.sock.sendall(frame(0x2, p.encode_connect()))
            assert isinstance(self.native(), p.Connected)

    def recv_frame(self) -> tuple[int, bytes] | None:
        """The next frame (opcode, payload), or None when the server closed the connection."""
        while True:
            if len(self.buf) >= 2:
                n = self.buf[1] & 0x7F
                offset = 2
                if n == 126:
                    offset = 4
                elif n == 127:
                    offset = 10
                if len(self.buf) >= offset:
                    if n == 126:
                        n = struct.unpack("!H", self.buf[2:4])[0]
                    elif n == 127:
                        n = struct.unpack("!Q", self.buf[2:10])[0]
                    if len(self.buf) >= offset + n:
                        opcode = self.buf[0] & 0x0F
                        payload = bytes(self.buf[offset : offset + n])
                        del self.buf[: offset + n]
                        return opcode, payload
            chunk = _recv(self.sock)
            if not chunk:
                return None
            self.buf += chunk

    def native(self) -> p.ServerFrame:
        got = self.recv_frame()
        assert got is not None and got[0] == 0x2, got
        return p.decode_server(got[1])

    def outcome(self) -> tuple[list[p.ServerFrame], int | None, bool]:
        """Read to the end: native messages received, the close code (None: none), and whether the server closed."""
        messages: list[p.ServerFrame] = []
        code: int | None = None
        while True:
            got = self.recv_frame()
            if got is None:
                return messages, code, True
            opcode, payload = got
            if opcode == 0x2:
                messages.append(p.decode_server(payload))
            elif opcode == 0x8:
                code = struct.unpack("!H", payload[:2])[0] if len(payload) >= 2 else 1005
                return messages, code, closed_by_server(self.sock, self.buf)

    def close(self) -> None:
        self.sock.close()


FRAME_CORPUS: list[tuple[str, bytes, int, bool]] = [
    # (name, bytes sent after CONNECT, close code expected, whether a native ERROR comes first)
    ("unmasked frame", frame(0x2, p.encode_subscribe(["/a/b"]), masked=False), 1002, True),
    ("reserved bit 1", frame(0x2, b"x", rsv=0x40), 1002, True),
    ("reserved bits 2 and 3", frame(0x2, b"x", rsv=0x30), 1002, True),
    ("fragmented ping", frame(0x9, b"x", fin=False), 1002, True),
    ("ping of 126 bytes", frame(0x9, b"x" * 126), 1002, True),
    ("close of 126 bytes", frame(0x8, b"\x03\xe8" + b"x" * 124), 1002, True),
    ("data opcode 0x3", frame(0x3, b"x"), 1002, True),
    ("data opcode 0x7", frame(0x7, b"x"), 1002, True),
    ("control opcode 0xB", frame(0xB, b"x"), 1002, True),
    ("control opcode 0xF", frame(0xF, b""), 1002, True),
    ("continuation without a message", frame(0x0, b"x"), 1002, True),
    ("new message inside a fragmented one", frame(0x2, b"a", fin=False) + frame(0x2, b"b"), 1002, True),
    ("text inside a fragmented binary", frame(0x2, b"a", fin=False) + frame(0x1, b"b"), 1002, True),
    ("64-bit length with its top bit set", bytes((0x82, 0xFF)) + b"\x80" + b"\x00" * 7 + b"mask", 1002, True),
    ("text message", frame(0x1, b"hello"), 1003, True),
    ("text message, invalid UTF-8", frame(0x1, b"\xff\xfe"), 1003, True),
    ("close with a 1-byte payload", frame(0x8, b"\x03"), 1002, False),
    ("close with a reason not UTF-8", frame(0x8, b"\x03\xe8\xff\xfe"), 1002, False),
    *(
        (f"close with code {code}", frame(0x8, struct.pack("!H", code) + b"bye"), 1002, False)
        for code in (0, 1, 999, 1004, 1005, 1006, 1015, 1016, 1100, 2000, 2999, 5000, 65535)
    ),
    # allowed close codes are echoed (RFC 6455 section 5.5.1); an empty close is answered 1000
    *(
        (f"close with code {code}", frame(0x8, struct.pack("!H", code) + b"bye"), code, False)
        for code in (1000, 1001, 1002, 1003, 1007, 1008, 1011, 1012, 1014, 3000, 4000, 4999)
    ),
    ("close without a code", frame(0x8, b""), 1000, False),
    # native messages
    ("empty binary message", frame(0x2, b""), 1008, True),
    ("unknown native opcode", frame(0x2, b"\x7f"), 1008, True),
    ("server opcode from a client", frame(0x2, b"\x81\x02\x00\x00"), 1008, True),
    ("CONNECT of version 99", frame(0x2, p.encode_connect(version=99)), 1008, True),
    ("CONNECT of version 0", frame(0x2, p.encode_connect(version=0)), 1008, True),
    ("varint of 11 bytes", frame(0x2, b"\x02\x00" + b"\xff" * 11), 1008, True),
    ("truncated varint", frame(0x2, b"\x02\x00\xff"), 1008, True),
    ("string past the end", frame(0x2, b"\x02\x00\x00\x01\x7fabc"), 1008, True),
    ("subject not UTF-8", frame(0x2, b"\x02\x00\x00\x01\x02\xff\xfe"), 1008, True),
    ("subscribe count 2^60", frame(0x2, b"\x02\x00\x00" + b"\x80" * 8 + b"\x10"), 1008, True),
    ("unknown subscribe flags", frame(0x2, b"\x02\x80\x00\x00"), 1008, True),
    ("unknown publish flags", frame(0x2, b"\x04\xf0\x00\x00\x00"), 1008, True),
    ("trailing bytes after CONNECT", frame(0x2, p.encode_connect() + b"junk"), 1008, True),
    ("truncated PUBLISH", frame(0x2, b"\x04\x00\x09abc"), 1008, True),
    ("1025 fields", frame(0x2, b"\x04\x01\x00\x04/a/b\x81\x08" + b"\x01a\x01b" * 1025), 1008, True),
]


def test_hostile_frames_and_native_messages(honest_server: tuple[ServerProcess, Honest]) -> None:
    server, honest = honest_server
    wrong: list[str] = []
    for name, data, code, notice in FRAME_CORPUS:
        raw = RawWs(server)
        raw.sock.sendall(data)
        messages, got, closed = raw.outcome()
        raw.close()
        errors = [m for m in messages if isinstance(m, p.ErrorNotice)]
        if got != code:
            wrong.append(f"{name}: close code {got} instead of {code} ({messages})")
        elif not closed:
            wrong.append(f"{name}: the server did not close the connection")
        elif notice and not errors:
            wrong.append(f"{name}: no ERROR message before the close")
        elif not notice and errors:
            wrong.append(f"{name}: an ERROR message after the client began to close: {errors}")
        honest.check(name)
    assert not wrong, "\n".join(wrong)


def test_requests_before_connect_and_survivable_mistakes(honest_server: tuple[ServerProcess, Honest]) -> None:
    server, honest = honest_server
    before = RawWs(server, hello=False)
    before.sock.sendall(frame(0x2, p.encode_subscribe(["/a/b"])))
    messages, code, closed = before.outcome()
    assert code == 1008 and closed
    assert [m.status for m in messages if isinstance(m, p.ErrorNotice)] == [Status.NOT_CONNECTED]
    before.close()
    honest.check("before CONNECT")
    # these are answered, and the connection stays
    raw = RawWs(server)
    raw.sock.sendall(frame(0x9, b"are you there"))
    assert raw.recv_frame() == (0xA, b"are you there")
    raw.sock.sendall(frame(0x2, p.encode_subscribe(["/a//b", "x", "/" + "y" * 70000])))
    statuses = [raw.native() for _ in range(3)]
    assert all(isinstance(s, p.SubscribeStatus) and s.status == Status.INVALID_SUBJECT for s in statuses)
    raw.sock.sendall(frame(0x2, p.encode_subscribe(["/c/d"], conflation_ms=2**64 - 1)))
    answer = raw.native()
    assert isinstance(answer, p.SubscribeStatus) and answer.subject == "/c/d"
    raw.sock.sendall(frame(0x2, p.encode_publish("/c/d", b"x" * 200_000, closure="big")))  # over MessageSizeLimit
    notice = raw.native()
    assert isinstance(notice, p.ErrorNotice) and notice.status == Status.TOO_LARGE
    raw.sock.sendall(frame(0x2, p.encode_unsubscribe(["/never/subscribed", "%%%"])))
    raw.sock.sendall(frame(0x2, p.encode_publish("/c/d", b"small", closure="small")))
    answer = raw.native()
    while not isinstance(answer, p.PublishStatus):  # the subscriber's own delivery may come first
        answer = raw.native()
    assert answer == p.PublishStatus(Status.OK, "small", "")
    raw.close()
    honest.check("survivable mistakes")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=300))
def test_arbitrary_native_messages(honest_server: tuple[ServerProcess, Honest], payload: bytes) -> None:
    """Any binary message after CONNECT is answered (a status, or ERROR and close 1008), never a crash."""
    server, honest = honest_server
    raw = RawWs(server)
    raw.sock.sendall(frame(0x2, payload) + frame(0x9, b"sync"))
    while True:
        got = raw.recv_frame()
        if got is None or got[0] == 0xA:  # the pong: everything before it was handled
            break
        if got[0] == 0x8:
            assert struct.unpack("!H", got[1][:2])[0] == 1008
            break
        assert got[0] == 0x2
        p.decode_server(got[1])
    raw.close()
    honest.check(f"native {payload[:20]!r}")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(min_size=1, max_size=200))
def test_arbitrary_bytes_after_the_handshake(honest_server: tuple[ServerProcess, Honest], data: bytes) -> None:
    """Any bytes on an open WebSocket: frames are answered by RFC 6455 or the connection is closed with a code."""
    server, honest = honest_server
    raw = RawWs(server)
    raw.sock.sendall(data)
    raw.sock.settimeout(1.0)
    try:
        while (got := raw.recv_frame()) is not None:
            if got[0] == 0x8:  # the server never sends a code RFC 6455 forbids on the wire
                assert len(got[1]) >= 2 and close_code_allowed(struct.unpack("!H", got[1][:2])[0]), got
                break
    except TimeoutError:
        pass  # an incomplete frame: the server waits for the rest (keepalive and timeouts bound it)
    raw.close()
    honest.check(f"bytes {data[:20]!r}")


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=400))
def test_arbitrary_bytes_as_an_http_head(honest_server: tuple[ServerProcess, Honest], data: bytes) -> None:
    """Any bytes ending a head: a status code by the RFC or a connection held open for more, never a crash."""
    server, honest = honest_server
    with connect(server, timeout=2) as sock:
        send(sock, data + b"\r\n\r\n")
        buf = bytearray()
        try:
            answer = read_answer(sock, buf)
        except TimeoutError:
            answer = None  # a body announced and not sent: the server waits (HandshakeTimeout bounds it)
        if answer is not None:
            assert answer.status in (101, 200, 400, 404, 405, 411, 413, 426, 431, 503, 505), answer.raw[:200]
    honest.check(f"head {data[:20]!r}")


# --- timers after the storm -----------------------------------------------------------------------------


def test_housekeeping_still_cuts_silent_peers_after_the_corpus(server_factory: Callable[..., ServerProcess]) -> None:
    """After the whole hostile corpus, HandshakeTimeout and keepalive still cut silent connections."""
    server = server_factory({"HandshakeTimeout": "1500", "KeepAliveInterval": "1000", "KeepAliveTimeout": "1000"})
    honest = Honest(server)  # the library answers pings: it must survive the keepalive that cuts the silent ones
    try:
        for _, data, _ in HTTP_CORPUS:
            exchange(server, data)
        for _, data, _, _ in FRAME_CORPUS:
            raw = RawWs(server)
            raw.sock.sendall(data)
            raw.outcome()
            raw.close()
        honest.check("after the corpus")
        started = time.monotonic()
        silent = connect(server)
        half = connect(server)
        half.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # a head that never ends
        ws_silent = RawWs(server)  # connected, then never answers a ping
        assert ws_silent.recv_frame() == (0x9, b"ka")  # pinged after KeepAliveInterval ...
        assert ws_silent.recv_frame() is None  # ... and dropped after KeepAliveTimeout
        for sock in (silent, half):  # cut at HandshakeTimeout (1.5 s, on a 1 s timer) meanwhile
            assert closed_by_server(sock, bytearray(), timeout=15)
            sock.close()
        assert time.monotonic() - started < 12
        ws_silent.close()
        honest.check("after the timeouts")
        wait_for_log(server, "access.log", lambda e: e.get("reason") == "keepalive_timeout")
        wait_for_log(server, "access.log", lambda e: e.get("reason") == "request not completed within HandshakeTimeout")
    finally:
        honest.close()
    assert_clean_stop(server)


# --- the CLI user's terminal ------------------------------------------------------------------------------


def test_cli_prints_no_traceback_for_any_bad_input(server_factory: Callable[..., ServerProcess]) -> None:
    """Mistakes against a live server (and without one): one line, an exit code, no traceback."""
    from tests.test_cli import CLI_MISTAKES

    server = server_factory()
    cli = [sys.executable, "-m", "migratory_cli.main"]
    big = b"x" * 200_000  # over MessageSizeLimit; through stdin ('-'), too long for an argument
    runs: list[tuple[list[str], bytes]] = [(args, b"") for _, args, _, _ in CLI_MISTAKES]
    runs += [
        (["publish", server.ws_url, "/bad", "x"], b""),
        (["publish", server.http_url, "bad", "x"], b""),
        (["publish", server.ws_url, "/a/b", "-"], big),
        (["publish", server.http_url, "/a/b", "-"], big),
        (["publish", server.http_url, "/a/b", "-", "--field", "k=v"], b"\xff" * 10),
        (["subscribe", server.ws_url, "/bad//subject", "--count", "1"], b""),
        (["snapshot", server.http_url, "no-slash"], b""),
        (["snapshot", server.http_url, "/\u00e9\u00e9/\x01"], b""),
        (["snapshot", server.ws_url + "/nothing", "/a/b"], b""),
        (["publish", server.ws_url + "?token=%ff", "/a/b", "x"], b""),
        (["snapshot", server.http_url, "/a/b", "--token", "\u00e9"], b""),
    ]
    for args, stdin in runs:
        result = subprocess.run([*cli, *args], input=stdin, capture_output=True, timeout=60)
        stderr = result.stderr.decode("utf-8", "replace")
        assert b"Traceback" not in result.stderr + result.stdout, (args, stderr[-2000:])
        assert result.returncode in (0, 1, 2, 3, 4), (args, result.returncode, stderr)
        assert len(stderr.splitlines()) <= 1, (args, stderr)
    assert_clean_stop(server)


# --- the monitoring port (LAN side) ---------------------------------------------------------------------


def test_hostile_heads_on_the_monitoring_port(server_factory: Callable[..., ServerProcess]) -> None:
    """MonitorHTTP shares the request parser: the same corpus gets 4xx/5xx answers, the port keeps serving."""
    from tests.conftest import free_port

    port = free_port()
    server = server_factory(
        {
            **QUIET,
            "MonitorHTTP.Listen": f"127.0.0.1:{port}",
            "MonitorHTTP.Username": "ops",
            "MonitorHTTP.Password": "pw",
        }
    )
    monitor = ServerProcess(server.proc, server.host, port, server.folder, server.conf)
    honest = Honest(server)
    try:
        wrong: list[str] = []
        for name, data, _ in HTTP_CORPUS:
            head, sep, _ = data.partition(b"\r\n\r\n")
            try:  # the monitor asks for credentials first, of any request that parses (it serves only GETs)
                parse_request_head(head)
                expected = 401
            except HttpError as exc:
                expected = exc.status
            if not sep:
                expected = 431  # a head that never ends, past the monitor's 16 KB
            with connect(monitor) as sock:
                send(sock, data)
                answer = read_answer(sock, bytearray())
            if answer is None or answer.status != expected:
                wrong.append(f"{name}: {answer.status if answer else None} instead of {expected}")
            honest.check(f"monitor: {name}")
        assert not wrong, "\n".join(wrong)
        auth = base64.b64encode(b"ops:pw").decode()
        with connect(monitor) as sock:
            send(sock, f"GET /health HTTP/1.1\r\nHost: x\r\nAuthorization: Basic {auth}\r\n\r\n".encode())
            answer = read_answer(sock, bytearray())
            assert answer is not None and answer.status == 200
    finally:
        honest.close()
    assert_clean_stop(server)


def test_forwarding_headers_are_not_trusted(server_factory: Callable[..., ServerProcess]) -> None:
    """The publishing address is the TCP peer's: spoofed X-Forwarded-For, X-Real-IP or Forwarded change nothing."""
    server = server_factory({**QUIET, "PublishAllowFromAddressList": "10.0.0.0/8"})
    spoofed = "X-Forwarded-For: 10.0.0.7\r\nX-Real-IP: 10.0.0.7\r\nForwarded: for=10.0.0.7\r\n"
    answer, _ = exchange(
        server,
        f"POST /publish?subject=/f/w HTTP/1.1\r\nHost: x\r\n{spoofed}Content-Length: 1\r\n\r\nx".encode(),
    )
    assert answer is not None and answer.status == 403
    raw = RawWs(server, hello=False, extra=spoofed)
    raw.sock.sendall(frame(0x2, p.encode_connect()) + frame(0x2, p.encode_publish("/f/w", b"x", closure="c")))
    assert isinstance(raw.native(), p.Connected)
    status = raw.native()
    assert isinstance(status, p.PublishStatus) and (status.status, status.closure) == (Status.DENIED, "c")
    raw.close()
    wait_for_log(server, "access.log", lambda e: e.get("reason_code") == "address_not_allowed")
    assert_clean_stop(server)
