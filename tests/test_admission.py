"""AdmissionRate: a worker admits so many new sessions a second, and tells the others when to come back.

A reconnect storm must not take the loop from the clients already served (issue 51): beyond the
rate a WebSocket upgrade is answered 503 with a Retry-After that spreads the refused over the
following seconds at the rate, an MQTT CONNECT gets CONNACK 0x89 (3.1.1: 0x03), and the Python
client waits what it was told before its next try.
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import time
from collections.abc import Callable

from migratory.client import MigratoryClient
from tests.conftest import ServerProcess, free_port

UPGRADE = (
    "GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
    "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
)


def _upgrade(port: int) -> tuple[int, dict[str, str], socket.socket]:
    """One raw WebSocket upgrade: its status and headers (the socket stays open, as a client holds it)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    sock.sendall(UPGRADE.encode())
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = sock.recv(4096)
        if not chunk:
            break
        head += chunk
    lines = head.split(b"\r\n\r\n")[0].decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return int(lines[0].split()[1]), headers, sock


def test_a_storm_beyond_the_rate_is_told_to_come_back_spread_over_the_next_seconds(
    server_factory: Callable[..., ServerProcess],
) -> None:
    srv = server_factory({"AdmissionRate": "5", "Workers": "1"})
    start = time.monotonic()
    answers = [_upgrade(srv.port) for _ in range(30)]
    took = time.monotonic() - start
    try:
        admitted = [a for a in answers if a[0] == 101]
        refused = [a for a in answers if a[0] == 503]
        assert len(admitted) + len(refused) == 30, [a[0] for a in answers]
        # a second's worth, and what refilled meanwhile (a loaded machine takes longer over the 30)
        assert 5 <= len(admitted) <= 6 + 5 * took, (len(admitted), took)
        waits = [int(a[1]["retry-after"]) for a in refused]
        assert waits == sorted(waits), waits  # each later refusal is given a later turn
        assert waits[0] <= 2 and waits[-1] >= len(refused) // 5, waits  # spread at the rate: 5 a second
    finally:
        for _, _, sock in answers:
            sock.close()
    deadline = time.monotonic() + 5
    while True:  # the refusals are logged as such
        lines = (json.loads(line) for line in (srv.log_folder / "access.log").read_text().splitlines())
        denied = [e for e in lines if e.get("event") == "denied" and e.get("reason_code") == "admission"]
        if len(denied) >= len(refused) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert len(denied) == len(refused)


def _mqtt_connect(port: int, level: int, client_id: str) -> bytes:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    raw = client_id.encode()
    body = b"\x00\x04MQTT" + bytes((level, 0x02)) + b"\x00\x3c" + (b"\x00" if level == 5 else b"")
    body += struct.pack("!H", len(raw)) + raw
    sock.sendall(bytes((0x10, len(body))) + body)
    reply = sock.recv(4096)
    sock.close()
    return reply


def test_mqtt_connects_beyond_the_rate_get_server_busy_with_the_wait(
    server_factory: Callable[..., ServerProcess],
) -> None:
    port = free_port()
    server_factory({"AdmissionRate": "1", "Workers": "1", "ListenMqtt": f"127.0.0.1:{port}"})
    first = _mqtt_connect(port, 5, "first")
    assert first[0] == 0x20 and first[3] == 0x00, first  # CONNACK, success
    busy = _mqtt_connect(port, 5, "second")
    assert busy[0] == 0x20 and busy[3] == 0x89, busy  # server busy
    assert b"\x13\x00" in busy  # Server Keep Alive: the wait, in seconds
    assert _mqtt_connect(port, 4, "third") == b"\x20\x02\x00\x03"  # 3.1.1: server unavailable


def test_the_python_client_waits_what_the_server_asked_then_connects(
    server_factory: Callable[..., ServerProcess],
) -> None:
    srv = server_factory({"AdmissionRate": "2", "Workers": "1"})
    held = [_upgrade(srv.port) for _ in range(6)]  # the second's worth and more: the next one is refused

    async def scenario() -> float:
        start = time.monotonic()
        async with MigratoryClient([srv.ws_url]) as client:
            await asyncio.wait_for(client.connect(), 30)
        return time.monotonic() - start

    try:
        waits = [int(a[1]["retry-after"]) for a in held if a[0] == 503]
        assert waits, [a[0] for a in held]
        took = asyncio.run(scenario())
    finally:
        for _, _, sock in held:
            sock.close()
    # refused once, told at least the last wait given plus its turn: it did not hammer the server meanwhile
    assert took >= waits[-1], (took, waits)
    lines = (json.loads(line) for line in (srv.log_folder / "access.log").read_text().splitlines())
    denied = [e for e in lines if e.get("event") == "denied" and e.get("reason_code") == "admission"]
    assert len(denied) <= len(waits) + 3, len(denied)  # a few tries at most, not a loop of them


def test_the_bench_loader_waits_what_the_server_asked_and_connects_every_client(
    server_factory: Callable[..., ServerProcess],
) -> None:
    """The load generator of `migratory bench run` comes back after Retry-After, as the Python client does, so a
    measured storm with AdmissionRate set connects everyone (none counted as an error), spread over seconds."""
    from migratory.bench import loader

    srv = server_factory({"AdmissionRate": "10", "Workers": "1"})
    spec = loader.LoaderSpec("migratory", "127.0.0.1", srv.port, "127.0.0.1", [["/adm/s"]] * 40, concurrency=40)

    async def scenario() -> tuple[list[object], loader._State, float]:
        state = loader._State()
        slots = asyncio.Semaphore(spec.concurrency)
        start = time.monotonic()
        opened = await asyncio.gather(*(loader._connect(spec, s, state, "127.0.0.1", slots) for s in spec.subjects))
        took = time.monotonic() - start
        for transport in opened:
            if transport is not None:
                transport.abort()
        return list(opened), state, took

    opened, state, took = asyncio.run(asyncio.wait_for(scenario(), 120))
    assert all(t is not None for t in opened), state.reasons
    assert state.errors == 0 and state.refused >= 20, (state.errors, state.refused)
    assert took >= 2.0  # 40 at 10 a second (a second's worth at once): admitted over about 3 s, not at once
