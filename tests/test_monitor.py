"""The HTTP monitoring service: node-wide indicators across workers, Prometheus text, auth."""

from __future__ import annotations

import asyncio
import base64
import json
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest

from migratory.client import MigratoryClient
from migratory.protocol import Status
from migratory.stats import INDICATORS, WINDOWS
from tests.conftest import ServerProcess, free_port


def get(url: str, auth: tuple[str, str] | None = None) -> tuple[int, bytes]:
    headers = {}
    if auth:
        headers["Authorization"] = "Basic " + base64.b64encode(f"{auth[0]}:{auth[1]}".encode()).decode()
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=5) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_monitoring_reports_the_whole_node(server_factory: Callable[..., ServerProcess]) -> None:
    port = free_port()
    server = server_factory(
        {
            "Workers": "2",
            "MonitorHTTP.Listen": f"127.0.0.1:{port}",
            "MonitorHTTP.Username": "ops",
            "MonitorHTTP.Password": "s3cret",
        }
    )
    base = f"http://127.0.0.1:{port}"
    auth = ("ops", "s3cret")
    assert get(base + "/stats")[0] == 401
    assert get(base + "/stats", ("ops", "wrong"))[0] == 401

    async def traffic() -> None:
        clients = [MigratoryClient([server.ws_url]) for _ in range(8)]
        for client in clients:
            await client.connect()
            await client.subscribe(["/mon/a"])
        await asyncio.sleep(0.3)
        for i in range(25):
            assert await clients[i % 8].publish("/mon/a", b"x" * 10) == Status.OK
        for client in clients:
            for _ in range(25):
                await client.next_message(5)
        await asyncio.sleep(2.5)  # counters are shared once per second
        for client in clients:
            await client.close()

    asyncio.run(asyncio.wait_for(traffic(), 60))
    # whichever worker answers, the totals cover the node
    for _ in range(6):
        status, body = get(base + "/stats", auth)
        assert status == 200
        stats: dict[str, Any] = json.loads(body)
        assert stats["workers"] == 2
        assert stats["totals"]["messages_in"] == 25
        assert stats["totals"]["messages_out"] == 25 * 8
        assert stats["totals"]["connections_total"] >= 8
        assert set(stats["indicators"]) == set(INDICATORS)
        windows = stats["indicators"]["messages_out_per_second"]["windows"]
        assert set(windows) == set(WINDOWS)
        assert windows["1m"]["max"] >= 1 and windows["15mo"]["samples"] >= 1
    status, body = get(base + "/metrics", auth)
    assert status == 200
    text = body.decode()
    assert "migratory_messages_in_total 25" in text
    assert "# TYPE migratory_connections gauge" in text
    assert get(base + "/nothing", auth)[0] == 404
    # the monitoring port is not a client port, and the client port has no /stats
    assert get(server.http_url + "/stats")[0] == 404


def test_username_without_password_is_a_config_error() -> None:
    from migratory.config import Config, ConfigError

    with pytest.raises(ConfigError) as info:
        Config.from_text("MonitorHTTP.Username = ops\n", "m.conf")
    assert info.value.errors[0].startswith("m.conf:1: MonitorHTTP.Password:")  # the line of the key that was set
