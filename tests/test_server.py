"""End to end against a real `migratory serve` process over real sockets.

The seed's tables (snapshots, conflation, invalid subjects) are reproduced through
the WebSocket client library and through HTTP; hostile input (malformed frames,
oversized messages, garbage HTTP, slow consumers, silent peers) gets a clear error
and leaves the server serving everyone else.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import socket
import struct
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest

from migratory import protocol as p
from migratory.client import ClientMessage, EventKind, MigratoryClient, StatusEvent
from migratory.message import MessageType
from migratory.protocol import Status
from tests.conftest import ServerProcess

IBM = "/Stocks/NYSE/IBM"


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 60))


def http(
    server: ServerProcess,
    method: str,
    path: str,
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, bytes, dict[str, str]]:
    request = urllib.request.Request(server.http_url + path, data=body, headers=headers or {}, method=method)
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return answer.status, answer.read(), dict(answer.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(), dict(exc.headers)


def snapshot_json(server: ServerProcess, subject: str) -> dict[str, Any]:
    status, body, _ = http(server, "GET", f"/snapshot?subject={subject}", headers={"Accept": "application/json"})
    assert status == 200, body
    return dict(json.loads(body))


# --- raw WebSocket client, to send what a well-behaved library never would ------------


class RawWs:
    """A minimal blocking WebSocket client over a plain socket."""

    def __init__(self, server: ServerProcess) -> None:
        self.sock = socket.create_connection((server.host, server.port), timeout=10)
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall(
            (
                f"GET / HTTP/1.1\r\nHost: {server.host}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
            ).encode()
        )
        self.buf = b""
        while b"\r\n\r\n" not in self.buf:
            self.buf += self.sock.recv(4096)
        head, _, self.buf = self.buf.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 101"), head

    def send_frame(self, opcode: int, payload: bytes, masked: bool = True) -> None:
        n = len(payload)
        first = 0x80 | opcode
        if n < 126:
            header = bytes((first, (0x80 if masked else 0) | n))
        elif n < 65536:
            header = struct.pack("!BBH", first, (0x80 if masked else 0) | 126, n)
        else:
            header = struct.pack("!BBQ", first, (0x80 if masked else 0) | 127, n)
        if masked:
            mask = os.urandom(4)
            payload = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
            header += mask
        self.sock.sendall(header + payload)

    def recv_frame(self) -> tuple[int, bytes]:
        while True:
            if len(self.buf) >= 2:
                n = self.buf[1] & 0x7F
                offset = 2
                if n == 126 and len(self.buf) >= 4:
                    n = struct.unpack("!H", self.buf[2:4])[0]
                    offset = 4
                elif n == 127 and len(self.buf) >= 10:
                    n = struct.unpack("!Q", self.buf[2:10])[0]
                    offset = 10
                if (n < 126 or offset > 2) and len(self.buf) >= offset + n:
                    opcode = self.buf[0] & 0x0F
                    payload = self.buf[offset : offset + n]
                    self.buf = self.buf[offset + n :]
                    return opcode, payload
            data = self.sock.recv(65536)
            if not data:
                raise ConnectionError("closed")
            self.buf += data

    def recv_native(self) -> p.ServerFrame:
        while True:
            opcode, payload = self.recv_frame()
            if opcode == 0x2:
                return p.decode_server(payload)
            if opcode == 0x8:
                raise ConnectionError(f"close frame {payload!r}")

    def close(self) -> None:
        self.sock.close()


# --- seed tables ------------------------------------------------------------------


def test_seed_snapshot_table_over_websocket_and_http(server: ServerProcess) -> None:
    rows = [
        ({"volume": "6.62M"}, b"193", {"volume": "6.62M"}),
        ({}, b"192", {"volume": "6.62M"}),
        ({"ask": "190"}, b"195", {"ask": "190", "volume": "6.62M"}),
        ({"bid": "194", "ask": "191"}, b"193", {"bid": "194", "ask": "191", "volume": "6.62M"}),
    ]

    async def scenario() -> None:
        async with MigratoryClient([server.ws_url]) as publisher:
            for seq, (fields, content, snapshot_fields) in enumerate(rows, 1):
                assert await publisher.publish(IBM, content, fields=fields) == Status.NO_SUBSCRIBER
                # a new subscriber gets the snapshot first, as a SNAPSHOT message
                async with MigratoryClient([server.ws_url]) as subscriber:
                    assert await subscriber.subscribe([IBM]) == {IBM: Status.OK}
                    message = await subscriber.next_message(5)
                    assert message.type is MessageType.SNAPSHOT
                    assert (message.content, dict(message.fields), message.seq) == (content, snapshot_fields, seq)
                # and the same snapshot is served over HTTP
                document = snapshot_json(server, IBM)
                assert document["content"] == content.decode()
                assert document["fields"] == snapshot_fields
                assert document["seq"] == seq
                status, body, headers = http(server, "GET", f"/snapshot?subject={IBM}")
                assert (status, body) == (200, content)
                assert headers["X-Migratory-Seq"] == str(seq)

    run(scenario())


def test_seed_conflation_table(server: ServerProcess) -> None:
    """Table 5.1 with a 547 ms request (used as 500 ms, clock-aligned periods)."""

    async def scenario() -> None:
        async with MigratoryClient([server.ws_url]) as publisher, MigratoryClient([server.ws_url]) as subscriber:
            await publisher.publish(IBM, b"193", fields={"volume": "6.62M"})
            await publisher.publish(IBM, b"192", fields={"bid": "194"})
            assert await subscriber.subscribe([IBM], conflation_ms=547) == {IBM: Status.OK}
            snapshot = await subscriber.next_message(5)
            assert snapshot.type is MessageType.SNAPSHOT
            assert (snapshot.content, dict(snapshot.fields)) == (b"192", {"volume": "6.62M", "bid": "194"})
            # publish twice just after a period boundary so both fall in one period
            now = time.time()
            await asyncio.sleep(0.5 - (now % 0.5) + 0.05)
            await publisher.publish(IBM, b"195", fields={"ask": "192"})
            await publisher.publish(IBM, b"196", fields={"bid": "197"})
            conflated = await subscriber.next_message(5)
            assert conflated.type is MessageType.UPDATE
            assert (conflated.content, dict(conflated.fields)) == (b"196", {"ask": "192", "bid": "197"})
            # nothing new: nothing is sent in the next periods
            with pytest.raises(TimeoutError):
                await subscriber.next_message(1.2)

    run(scenario())


def test_plain_subscriber_gets_every_update_in_order(server: ServerProcess) -> None:
    async def scenario() -> None:
        async with MigratoryClient([server.ws_url]) as publisher, MigratoryClient([server.ws_url]) as subscriber:
            await subscriber.subscribe(["/a/b"])
            for i in range(200):
                status = await publisher.publish("/a/b", str(i).encode(), fields={"i": str(i)})
                assert status == Status.OK
            got = [await subscriber.next_message(5) for _ in range(200)]
            assert [m.content for m in got] == [str(i).encode() for i in range(200)]
            assert [m.seq for m in got] == list(range(1, 201))
            assert all(m.type is MessageType.UPDATE for m in got)

    run(scenario())


@pytest.mark.parametrize("subject", ["/Stocks//IBM/BID", "Stocks/IBM/BID", "/Stocks/IBM/BID/", "/", "/Stocks"])
def test_seed_invalid_subjects_refused_on_every_interface(server: ServerProcess, subject: str) -> None:
    async def scenario() -> None:
        events: list[StatusEvent] = []
        async with MigratoryClient([server.ws_url], on_status=events.append) as client:
            assert await client.subscribe([subject]) == {subject: Status.INVALID_SUBJECT}
            assert await client.publish(subject, b"x") == Status.INVALID_SUBJECT
            deny = [e for e in events if e.kind is EventKind.SUBSCRIBE_DENY]
            assert deny and deny[0].detail

    run(scenario())
    quoted = urllib.request.quote(subject, safe="")
    status, body, _ = http(server, "GET", f"/snapshot?subject={quoted}")
    assert status == 400 and b"invalid subject" in body
    status, body, _ = http(server, "POST", f"/publish?subject={quoted}", b"x")
    assert status == 400 and json.loads(body)["status"] == "INVALID_SUBJECT"


def test_publish_snapshot_message_false(server_factory: Callable[..., ServerProcess]) -> None:
    server = server_factory({"PublishSnapshotMessage": "false"})

    async def scenario() -> None:
        async with MigratoryClient([server.ws_url]) as client:
            await client.publish("/a/b", b"old")
            await client.subscribe(["/a/b"])
            await client.publish("/a/b", b"new")
            message = await client.next_message(5)
            assert (message.type, message.content) == (MessageType.UPDATE, b"new")

    run(scenario())


# --- HTTP endpoints -----------------------------------------------------------------


def test_http_publish_forms_and_errors(server_factory: Callable[..., ServerProcess]) -> None:
    server = server_factory({"MessageSizeLimit": "1K"})
    status, body, _ = http(server, "POST", "/publish?subject=/h/t", b"\x00\xffbin")
    assert (status, json.loads(body)) == (200, {"status": "NO_SUBSCRIBER"})
    document = snapshot_json(server, "/h/t")
    assert document["content"] is None and base64.b64decode(document["content_base64"]) == b"\x00\xffbin"
    payload = json.dumps({"subject": "/h/t", "content": "héllo", "fields": {"f": "1"}}).encode()
    status, body, _ = http(server, "POST", "/publish", payload, {"Content-Type": "application/json"})
    assert status == 200
    assert snapshot_json(server, "/h/t")["content"] == "héllo"
    # retained=false is delivered live but leaves the snapshot alone
    status, _, _ = http(server, "POST", "/publish?subject=/h/t&retained=false", b"transient")
    assert status == 200 and snapshot_json(server, "/h/t")["content"] == "héllo"
    # errors
    assert http(server, "POST", "/publish?subject=/h/t", b"x" * 2000)[0] == 413
    assert http(server, "POST", "/publish", b"{not json", {"Content-Type": "application/json"})[0] == 400
    assert http(server, "GET", "/publish?subject=/h/t")[0] == 405
    assert http(server, "GET", "/snapshot?subject=/none/here")[0] == 404
    assert http(server, "GET", "/snapshot")[0] == 400
    assert http(server, "GET", "/nothing")[0] == 404
    health = json.loads(http(server, "GET", "/health")[1])
    assert health["status"] == "ok" and health["denied"] >= 1


def test_http_publish_reaches_websocket_subscriber(server: ServerProcess) -> None:
    async def scenario() -> None:
        async with MigratoryClient([server.ws_url]) as client:
            await client.subscribe(["/h/live"])
            loop = asyncio.get_running_loop()
            status, body, _ = await loop.run_in_executor(
                None, lambda: http(server, "POST", "/publish?subject=/h/live", b"from-http")
            )
            assert (status, json.loads(body)) == (200, {"status": "OK"})
            message = await client.next_message(5)
            assert message.content == b"from-http"

    run(scenario())


def test_garbage_http_gets_400_and_server_keeps_serving(server: ServerProcess) -> None:
    for garbage in [b"\x16\x03\x01\x00\xa5garbage\r\n\r\n", b"GET / HTTP/9\r\n\r\n", b"NOT A REQUEST\r\n\r\n"]:
        with socket.create_connection((server.host, server.port), timeout=5) as sock:
            sock.sendall(garbage)
            answer = sock.recv(4096)
            assert answer.split(b" ")[1] in (b"400", b"505"), answer
    with socket.create_connection((server.host, server.port), timeout=5) as sock:
        sock.sendall(b"GET /x HTTP/1.1\r\n" + b"X-Long: " + b"a" * 20000)
        assert b" 431 " in sock.recv(4096)
    assert http(server, "GET", "/health")[0] == 200


# --- hostile WebSocket input --------------------------------------------------------


def test_malformed_frame_closes_only_that_client(server: ServerProcess) -> None:
    async def scenario() -> None:
        async with MigratoryClient([server.ws_url]) as good, MigratoryClient([server.ws_url]) as publisher:
            await good.subscribe(["/m/f"])
            loop = asyncio.get_running_loop()

            def bad_client() -> tuple[p.ServerFrame, int]:
                raw = RawWs(server)
                raw.send_frame(0x2, p.encode_connect(), masked=False)  # servers must refuse unmasked frames
                notice = raw.recv_native()
                opcode, payload = raw.recv_frame()
                raw.close()
                return notice, struct.unpack("!H", payload[:2])[0] if opcode == 0x8 else -1

            notice, code = await loop.run_in_executor(None, bad_client)
            assert isinstance(notice, p.ErrorNotice) and "masked" in notice.reason
            assert code == 1002

            def bad_native() -> p.ServerFrame:
                raw = RawWs(server)
                raw.send_frame(0x2, b"\x04\x00\x09abc")  # truncated PUBLISH
                notice = raw.recv_native()
                raw.close()
                return notice

            notice = await loop.run_in_executor(None, bad_native)
            assert isinstance(notice, p.ErrorNotice) and "truncated" in notice.reason
            assert await publisher.publish("/m/f", b"still-here") == Status.OK
            assert (await good.next_message(5)).content == b"still-here"

    run(scenario())


def test_oversized_message_is_refused_and_connection_survives(server_factory: Callable[..., ServerProcess]) -> None:
    server = server_factory({"MessageSizeLimit": "4K"})
    raw = RawWs(server)
    raw.send_frame(0x2, p.encode_connect())
    assert isinstance(raw.recv_native(), p.Connected)
    raw.send_frame(0x2, p.encode_publish("/o/s", b"x" * 10000, closure="big"))
    notice = raw.recv_native()
    assert isinstance(notice, p.ErrorNotice) and notice.status == Status.TOO_LARGE
    assert "MessageSizeLimit" in notice.reason
    raw.send_frame(0x2, p.encode_publish("/o/s", b"small", closure="small"))
    answer = raw.recv_native()
    assert answer == p.PublishStatus(Status.NO_SUBSCRIBER, "small", "")
    raw.close()


def test_requests_before_connect_are_refused(server: ServerProcess) -> None:
    raw = RawWs(server)
    raw.send_frame(0x2, p.encode_subscribe(["/a/b"]))
    notice = raw.recv_native()
    assert isinstance(notice, p.ErrorNotice) and notice.status == Status.NOT_CONNECTED
    raw.close()


def test_text_frames_are_refused_with_1003(server: ServerProcess) -> None:
    raw = RawWs(server)
    raw.send_frame(0x1, b"hello")
    assert isinstance(raw.recv_native(), p.ErrorNotice)
    opcode, payload = raw.recv_frame()
    assert opcode == 0x8 and struct.unpack("!H", payload[:2])[0] == 1003
    raw.close()


def test_silent_peer_is_disconnected_but_live_one_stays(server_factory: Callable[..., ServerProcess]) -> None:
    server = server_factory({"KeepAliveInterval": "1000", "KeepAliveTimeout": "1000"})
    raw = RawWs(server)
    raw.send_frame(0x2, p.encode_connect())
    assert isinstance(raw.recv_native(), p.Connected)
    opcode, _ = raw.recv_frame()
    assert opcode == 0x9  # the server pings a silent client ...
    with pytest.raises((ConnectionError, OSError)):
        for _ in range(10):  # ... and drops it when no pong comes back
            raw.recv_frame()
    raw.close()

    async def live() -> None:
        async with MigratoryClient([server.ws_url]) as client:  # answers pings automatically
            await asyncio.sleep(4)
            assert client.connected
            assert await client.publish("/k/a", b"x") == Status.NO_SUBSCRIBER

    run(live())
    access = (server.log_folder / "access.log").read_text()
    time.sleep(1.5)  # the access log is flushed once per second
    access = (server.log_folder / "access.log").read_text()
    assert '"reason":"keepalive_timeout"' in access


def test_slow_consumer_is_disconnected_and_counted(server_factory: Callable[..., ServerProcess]) -> None:
    server = server_factory({"MaxPendingOutput": "64K"})
    slow = RawWs(server)
    slow.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    slow.send_frame(0x2, p.encode_connect())
    slow.send_frame(0x2, p.encode_subscribe(["/s/c"]))

    async def flood() -> None:
        async with MigratoryClient([server.ws_url]) as publisher, MigratoryClient([server.ws_url]) as fast:
            await fast.subscribe(["/s/c"])
            await asyncio.sleep(0.2)
            for i in range(400):
                await publisher.publish("/s/c", b"%05d" % i + b"x" * 10000)
            got = [await fast.next_message(10) for _ in range(400)]
            assert [int(m.content[:5]) for m in got] == list(range(400))

    run(flood())
    health = json.loads(http(server, "GET", "/health")[1])
    assert health["slow_consumers_disconnected"] == 1
    slow.close()


def test_batching_time_groups_output(server_factory: Callable[..., ServerProcess]) -> None:
    server = server_factory({"BatchingTime": "500"})
    raw = RawWs(server)
    raw.send_frame(0x2, p.encode_connect())
    raw.send_frame(0x2, p.encode_subscribe(["/b/t"]))
    assert isinstance(raw.recv_native(), p.Connected)
    assert isinstance(raw.recv_native(), p.SubscribeStatus)
    for i in range(5):
        status, _, _ = http(server, "POST", "/publish?subject=/b/t", str(i).encode())
        assert status == 200
    raw.sock.settimeout(5)
    chunk = raw.sock.recv(65536)  # everything published within the batch arrives in one write
    assert chunk.count(b"/b/t") == 5, chunk
    raw.close()


# --- client library behaviour ---------------------------------------------------------


def test_client_reconnects_and_resubscribes(server_factory: Callable[..., ServerProcess]) -> None:
    server = server_factory()

    async def scenario() -> None:
        events: list[StatusEvent] = []
        received: list[ClientMessage] = []
        client = MigratoryClient(
            [server.ws_url], on_status=events.append, on_message=received.append, backoff_initial=0.05
        )
        await client.connect()
        await client.subscribe(["/r/c"])
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, lambda: server.stop(9))
        await asyncio.sleep(0.3)
        assert not client.connected
        from tests.conftest import start_server

        restarted = await loop.run_in_executor(None, lambda: start_server(server.folder, None, port=server.port))
        try:
            await asyncio.wait_for(_until(lambda: client.connected), 15)
            await asyncio.sleep(0.3)
            async with MigratoryClient([server.ws_url]) as publisher:
                assert await publisher.publish("/r/c", b"after-restart") == Status.OK
            await asyncio.wait_for(_until(lambda: bool(received)), 5)
            assert received[-1].content == b"after-restart"
            kinds = [e.kind for e in events]
            assert kinds.count(EventKind.NOTIFY_SERVER_UP) == 2 and EventKind.NOTIFY_SERVER_DOWN in kinds
            assert received[-1].epoch == 2  # a restart starts a new epoch
        finally:
            await client.close()
            restarted.stop()

    run(scenario())


async def _until(predicate: Callable[[], bool]) -> None:
    while not predicate():
        await asyncio.sleep(0.02)


def test_weighted_server_choice_skips_dead_server(server: ServerProcess) -> None:
    from tests.conftest import free_port

    dead = f"ws://127.0.0.1:{free_port()}"

    async def scenario() -> None:
        client = MigratoryClient([(dead, 100.0), (server.ws_url, 1.0)], backoff_initial=0.01)
        await client.connect(timeout=15)
        assert client.server == server.ws_url
        await client.close()

    run(scenario())


def test_access_and_message_logs(server: ServerProcess) -> None:
    async def scenario() -> None:
        async with MigratoryClient([server.ws_url]) as client:
            await client.subscribe(["/l/g"])
            await client.publish("/l/g", b"12345", fields={"a": "1"})
            await client.next_message(5)
            await client.subscribe(["/bad"])

    run(scenario())
    assert server.stop() == 0  # SIGTERM: clean shutdown, logs flushed
    access = [json.loads(line) for line in (server.log_folder / "access.log").read_text().splitlines()]
    access = [a for a in access if not (a["event"] == "http" and a.get("path") == "/health")]  # readiness probe
    events = [a["event"] for a in access]
    assert events[:2] == ["connect", "subscribe"]
    assert "disconnect" in events and "denied" in events
    denied = next(a for a in access if a["event"] == "denied")
    assert denied["reason_code"] == "invalid_subject" and denied["subject"] == "/bad"
    disconnect = next(a for a in access if a["event"] == "disconnect")
    assert disconnect["duration_ms"] >= 0 and disconnect["addr"] == "127.0.0.1"
    (publish,) = [json.loads(line) for line in (server.log_folder / "message.log").read_text().splitlines()]
    assert publish["subject"] == "/l/g" and publish["size"] == 5 and publish["fields"] == 1
    assert publish["recipients"] == 1 and publish["status"] == "OK" and publish["latency_us"] >= 0


def test_unsubscribe_and_subscription_limit(server_factory: Callable[..., ServerProcess]) -> None:
    server = server_factory({"MaxSubscriptionsPerClient": "2"})

    async def scenario() -> None:
        async with MigratoryClient([server.ws_url]) as client, MigratoryClient([server.ws_url]) as publisher:
            assert await client.subscribe(["/u/a", "/u/b", "/u/c"]) == {
                "/u/a": Status.OK,
                "/u/b": Status.OK,
                "/u/c": Status.LIMIT_EXCEEDED,
            }
            await client.unsubscribe(["/u/a"])
            await asyncio.sleep(0.2)
            assert await publisher.publish("/u/a", b"nobody") == Status.NO_SUBSCRIBER
            assert await client.subscribe(["/u/c"]) == {"/u/c": Status.OK}  # room again
            binary = bytes(range(256)) * 4
            assert await publisher.publish("/u/c", binary, fields={"k": "é"}) == Status.OK
            message = await client.next_message(5)
            assert (message.subject, message.content, dict(message.fields)) == ("/u/c", binary, {"k": "é"})
            with pytest.raises(TimeoutError):
                await client.next_message(0.5)  # nothing was delivered for /u/a

    run(scenario())


def test_slow_consumer_drop_policy_keeps_the_connection(server_factory: Callable[..., ServerProcess]) -> None:
    server = server_factory({"MaxPendingOutput": "64K", "SlowConsumerPolicy": "Drop", "KeepAliveInterval": "3600000"})
    slow = RawWs(server)
    slow.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    slow.send_frame(0x2, p.encode_connect())
    slow.send_frame(0x2, p.encode_subscribe(["/s/d"]))

    async def flood() -> None:
        async with MigratoryClient([server.ws_url]) as publisher:
            await asyncio.sleep(0.2)
            for i in range(1500):  # 15 MB: more than the kernel buffers plus MaxPendingOutput
                await publisher.publish("/s/d", b"%05d" % i + b"x" * 10000)

    run(flood())
    health = json.loads(http(server, "GET", "/health")[1])
    assert health["messages_dropped"] > 0
    assert health["slow_consumers_disconnected"] == 0
    assert health["connections"] == 1  # the slow client is still connected ...
    slow.sock.settimeout(10)
    first = [slow.recv_native() for _ in range(4)]  # ... and what it gets is in order
    numbers = [int(f.content[:5]) for f in first if isinstance(f, p.Delivery)]
    assert numbers == sorted(numbers) and numbers
    slow.close()


def test_slowloris_head_is_cut_at_handshake_timeout(server_factory: Callable[..., ServerProcess]) -> None:
    server = server_factory({"HandshakeTimeout": "1000"})
    slow = socket.create_connection((server.host, server.port), timeout=10)
    started = time.monotonic()
    closed = False
    for _ in range(20):  # one header byte every 0.25 s never completes a request
        try:
            slow.sendall(b"X")
            time.sleep(0.25)
        except OSError:
            closed = True
            break
        assert http(server, "GET", "/health")[0] == 200  # everyone else is served meanwhile
    if not closed:
        slow.settimeout(5)
        try:
            closed = slow.recv(100) == b""
        except OSError:
            closed = True
    assert closed and time.monotonic() - started < 6
    slow.close()


def test_silent_connection_is_dropped_before_any_request(server_factory: Callable[..., ServerProcess]) -> None:
    server = server_factory({"HandshakeTimeout": "1000"})
    silent = socket.create_connection((server.host, server.port), timeout=6)
    started = time.monotonic()
    with contextlib.suppress(ConnectionResetError):
        assert silent.recv(100) == b""  # closed by the server, having sent nothing
    assert time.monotonic() - started < 5
    silent.close()
    assert http(server, "GET", "/health")[0] == 200
