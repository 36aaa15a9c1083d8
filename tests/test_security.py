"""Entitlement, publish address list and connection floods against a real server."""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import time
from collections.abc import Callable
from pathlib import Path

import jwt
import pytest

from migratory.client import EventKind, MigratoryClient, StatusEvent
from migratory.protocol import Status
from tests.conftest import ServerProcess

SECRET = "a-long-enough-hs256-secret-for-tests"


def run(coro: object) -> object:
    return asyncio.run(asyncio.wait_for(coro, 60))  # type: ignore[arg-type]


def post(server: ServerProcess, path: str, body: bytes, source: str = "127.0.0.1") -> tuple[int, dict[str, str]]:
    conn = http.client.HTTPConnection(server.host, server.port, timeout=10, source_address=(source, 0))
    conn.request("POST", path, body)
    answer = conn.getresponse()
    status, payload = answer.status, json.loads(answer.read())
    conn.close()
    return status, payload


def get(server: ServerProcess, path: str) -> int:
    conn = http.client.HTTPConnection(server.host, server.port, timeout=10)
    conn.request("GET", path)
    status = conn.getresponse().status
    conn.close()
    return status


def test_basic_entitlement_everywhere(server_factory: Callable[..., ServerProcess]) -> None:
    server = server_factory({"Entitlement": "Basic", "EntitlementAllowToken": "pub-token"})

    async def scenario() -> None:
        async with (
            MigratoryClient([server.ws_url]) as reader,
            MigratoryClient([server.ws_url], token="pub-token") as writer,
        ):
            assert await reader.subscribe(["/b/x"]) == {"/b/x": Status.OK}
            assert await reader.publish("/b/x", b"no") == Status.DENIED
            assert await writer.publish("/b/x", b"yes") == Status.OK
            assert (await reader.next_message(5)).content == b"yes"

    run(scenario())
    assert post(server, "/publish?subject=/b/x", b"x")[0] == 403
    assert post(server, "/publish?subject=/b/x&token=pub-token", b"x") == (200, {"status": "NO_SUBSCRIBER"})


def test_jwt_permissions_and_expiry_while_connected(server_factory: Callable[..., ServerProcess]) -> None:
    server = server_factory({"Entitlement": "JWT", "EntitlementJwtSecret": SECRET})
    reader_token = jwt.encode({"permissions": {"sub": ["/Stocks/*/IBM"]}}, SECRET, algorithm="HS256")
    writer_token = jwt.encode({"permissions": {"pub": ["/Stocks/**"], "sub": []}}, SECRET, algorithm="HS256")
    short_token = jwt.encode(
        {"exp": int(time.time()) + 3, "permissions": {"sub": ["/Stocks/**"]}}, SECRET, algorithm="HS256"
    )

    async def scenario() -> None:
        events: list[StatusEvent] = []
        async with (
            MigratoryClient([server.ws_url], token=reader_token) as reader,
            MigratoryClient([server.ws_url], token=writer_token) as writer,
            MigratoryClient([server.ws_url], token=short_token, on_status=events.append) as short,
        ):
            assert await reader.subscribe(["/Stocks/NYSE/IBM", "/Stocks/NYSE/MSFT"]) == {
                "/Stocks/NYSE/IBM": Status.OK,
                "/Stocks/NYSE/MSFT": Status.DENIED,
            }
            assert await reader.publish("/Stocks/NYSE/IBM", b"x") == Status.DENIED
            assert await short.subscribe(["/Stocks/NYSE/IBM"]) == {"/Stocks/NYSE/IBM": Status.OK}
            assert await writer.publish("/Stocks/NYSE/IBM", b"193") == Status.OK
            assert (await reader.next_message(5)).content == b"193"
            assert (await short.next_message(5)).content == b"193"
            # the short token expires: its subscription is withdrawn, with a notice
            for _ in range(100):
                if any(e.kind is EventKind.SUBSCRIBE_DENY and e.status == Status.REVOKED for e in events):
                    break
                await asyncio.sleep(0.1)
            else:
                raise AssertionError("no REVOKED notice after the token expired")
            await writer.publish("/Stocks/NYSE/IBM", b"194")
            assert (await reader.next_message(5)).content == b"194"
            with pytest.raises(TimeoutError):
                await short.next_message(1.0)

    run(scenario())
    assert get(server, f"/snapshot?subject=/Stocks/NYSE/IBM&token={reader_token}") == 200
    assert get(server, f"/snapshot?subject=/Stocks/NYSE/MSFT&token={reader_token}") == 403
    assert get(server, "/snapshot?subject=/Stocks/NYSE/IBM") == 403
    assert get(server, "/snapshot?subject=/Stocks/NYSE/IBM&token=forged.token.here") == 403


def test_custom_entitlement_class(
    server_factory: Callable[..., ServerProcess], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "site_rules.py").write_text(
        "class Rules:\n"
        "    def authorize_subscribe(self, token, subject, address):\n"
        "        return token == 'vip' or subject.startswith('/free/')\n"
        "    def authorize_publish(self, token, subject, address):\n"
        "        raise RuntimeError('the rules backend is down')\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    server = server_factory({"Entitlement": "Custom", "EntitlementCustomClass": "site_rules:Rules"})

    async def scenario() -> None:
        async with MigratoryClient([server.ws_url]) as client:
            assert await client.subscribe(["/free/a", "/paid/a"]) == {"/free/a": Status.OK, "/paid/a": Status.DENIED}
            assert await client.publish("/free/a", b"x") == Status.DENIED  # the class crashed: denied, server fine

    run(scenario())
    assert get(server, "/health") == 200


def test_publish_address_list(server_factory: Callable[..., ServerProcess]) -> None:
    server = server_factory({"PublishAllowFromAddressList": "127.0.0.5/32, ::1"})
    status, payload = post(server, "/publish?subject=/p/a", b"x", source="127.0.0.1")
    assert status == 403 and "PublishAllowFromAddressList" in payload["error"]
    assert post(server, "/publish?subject=/p/a", b"x", source="127.0.0.5") == (200, {"status": "NO_SUBSCRIBER"})

    async def ws_publisher() -> None:
        async with MigratoryClient([server.ws_url]) as client:  # from 127.0.0.1
            assert await client.publish("/p/a", b"x") == Status.DENIED

    run(ws_publisher())
    server.stop()
    access = [json.loads(line) for line in (server.log_folder / "access.log").read_text().splitlines()]
    assert sum(1 for a in access if a.get("reason_code") == "address_not_allowed") == 2


def test_connection_flood_from_one_address_is_limited(server_factory: Callable[..., ServerProcess]) -> None:
    server = server_factory({"MaxConnectionsPerSecondPerAddress": "5"})
    accepted = refused = 0
    for _ in range(60):
        with socket.create_connection((server.host, server.port), timeout=5) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            try:
                answer = sock.recv(100)
            except ConnectionResetError:
                answer = b""
            if answer.startswith(b"HTTP/1.1 200"):
                accepted += 1
            else:
                refused += 1
    assert accepted >= 5 and refused >= 10  # a burst of 10, then 5 per second
    # another address is not affected
    conn = http.client.HTTPConnection(server.host, server.port, timeout=5, source_address=("127.0.0.9", 0))
    conn.request("GET", "/health")
    assert conn.getresponse().status == 200
    server.stop()
    access = (server.log_folder / "access.log").read_text()
    assert access.count('"reason_code":"rate_limited"') == refused


def test_async_custom_entitlement_keeps_each_clients_order(
    server_factory: Callable[..., ServerProcess], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "async_rules.py").write_text(
        "import asyncio\n"
        "class Rules:\n"
        "    async def authorize_subscribe(self, token, subject, address):\n"
        "        await asyncio.sleep(0.05)  # e.g. a call to the entitlement backend\n"
        "        return token == 'member'\n"
        "    async def authorize_publish(self, token, subject, address):\n"
        "        if subject == '/x/boom':\n"
        "            raise RuntimeError('backend down')\n"
        "        await asyncio.sleep(0.3 if subject.endswith('slow') else 0.0)\n"
        "        return token == 'member'\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    server = server_factory({"Entitlement": "Custom", "EntitlementCustomClass": "async_rules:Rules"})

    async def scenario() -> None:
        async with (
            MigratoryClient([server.ws_url], token="member") as member,
            MigratoryClient([server.ws_url]) as guest,
        ):
            assert await member.subscribe(["/x/slow", "/x/fast"]) == {"/x/slow": Status.OK, "/x/fast": Status.OK}
            assert await guest.subscribe(["/x/fast"]) == {"/x/fast": Status.DENIED}
            # a slow decision first, a fast one second: they are published in the order sent
            results = await asyncio.gather(member.publish("/x/slow", b"1"), member.publish("/x/fast", b"2"))
            assert list(results) == [Status.OK, Status.OK]
            got = [await member.next_message(5), await member.next_message(5)]
            assert [m.content for m in got] == [b"1", b"2"]
            assert await member.publish("/x/boom", b"x") == Status.DENIED
            assert await guest.publish("/x/fast", b"x") == Status.DENIED

    run(scenario())
    assert get(server, "/snapshot?subject=/x/fast&token=member") == 200
    assert get(server, "/snapshot?subject=/x/fast") == 403
