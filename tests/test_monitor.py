"""Monitoring: node-wide windows that survive restarts, Prometheus text, TLS and auth, PUSH, stats log, `status`."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import signal
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from migratory.client import MigratoryClient
from migratory.protocol import Status
from migratory.stats import INDICATORS, WINDOWS
from tests.conftest import ServerProcess, free_port, start_server


def get(url: str, auth: tuple[str, str] | None = None, context: ssl.SSLContext | None = None) -> tuple[int, bytes]:
    headers = {}
    if auth:
        headers["Authorization"] = "Basic " + base64.b64encode(f"{auth[0]}:{auth[1]}".encode()).decode()
    try:
        request = urllib.request.Request(url, headers=headers)
        with urllib.request.urlopen(request, timeout=5, context=context) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def stats_of(base: str, auth: tuple[str, str] | None = None) -> dict[str, Any]:
    status, body = get(base + "/stats", auth)
    assert status == 200, body
    return dict(json.loads(body))


async def traffic(url: str, clients: int = 8, messages: int = 25, subject: str = "/mon/a") -> None:
    peers = [MigratoryClient([url]) for _ in range(clients)]
    for client in peers:
        await client.connect()
        await client.subscribe([subject])
    for i in range(messages):
        assert await peers[i % clients].publish(subject, b"x" * 10) == Status.OK
    for client in peers:
        for _ in range(messages):
            await client.next_message(5)
    await asyncio.sleep(2.5)  # counters are shared and sampled once per second
    for client in peers:
        await client.close()


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
    asyncio.run(asyncio.wait_for(traffic(server.ws_url), 60))
    answers = [stats_of(base, auth) for _ in range(6)]  # whichever worker answers, the same node
    for stats in answers:
        assert stats["workers"] == 2
        assert stats["totals"]["messages_in"] == 25
        assert stats["totals"]["messages_out"] == 25 * 8
        assert stats["totals"]["connections_total"] >= 8
        assert set(stats["indicators"]) == set(INDICATORS)
        windows = stats["indicators"]["messages_out_per_second"]["windows"]
        assert set(windows) == set(WINDOWS)
        assert windows["1m"]["max"] >= 1 and windows["15mo"]["samples"] >= 1
        assert stats["indicators"]["connected_clients"]["windows"]["15m"]["max"] == 8
    status, body = get(base + "/metrics", auth)
    assert status == 200
    families = {f.name: f for f in text_string_to_metric_families(body.decode())}
    assert families["migratory_messages_in"].type == "counter"
    assert families["migratory_messages_in"].samples[0].value == 25
    assert families["migratory_connected_clients"].type == "gauge"
    assert {s.labels["indicator"] for s in families["migratory_indicator"].samples} == set(INDICATORS)
    for name in ("migratory_subscriptions", "migratory_snapshots", "migratory_denials", "migratory_worker_restarts"):
        assert name in families, name
    assert families["migratory_process_resident_memory_bytes"].samples[0].value > 10e6
    assert families["migratory_process_cpu_seconds"].samples[0].value > 0
    assert families["migratory_listener_connections"].samples[0].labels["listener"] == f"127.0.0.1:{server.port}"


def test_windows_are_node_wide_and_survive_worker_and_server_restarts(tmp_path: Path) -> None:
    port = free_port()
    extra = {"Workers": "2", "MonitorHTTP.Listen": f"127.0.0.1:{port}", "Stats.LogInterval": "1"}
    server = start_server(tmp_path / "srv", extra)
    base = f"http://127.0.0.1:{port}"
    try:
        asyncio.run(asyncio.wait_for(traffic(server.ws_url, clients=6), 60))
        samples_before = stats_of(base)["indicators"]["messages_in_per_second"]["windows"]["15m"]["samples"]
        workers = [int(p) for p in Path(f"/proc/{server.proc.pid}/task/{server.proc.pid}/children").read_text().split()]
        for pid in workers:  # both workers, the keeper of the history among them
            os.kill(pid, signal.SIGKILL)
            time.sleep(1.5)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                answers = [stats_of(base) for _ in range(6)]
                if all(a["worker_restarts"] >= 2 for a in answers):
                    break
            except (OSError, AssertionError):
                pass
            time.sleep(0.3)
        for stats in answers:
            assert stats["indicators"]["connected_clients"]["windows"]["15m"]["max"] == 6
            assert stats["indicators"]["messages_in_per_second"]["windows"]["15m"]["samples"] > samples_before
            assert stats["totals"]["messages_in"] == 25  # a restarted worker goes on from its predecessor's count
        history = stats_of(base)["history_s"]
    finally:
        assert server.stop() == 0  # SIGTERM: the keeper saves the history
    assert (tmp_path / "srv" / "state" / "stats-history.bin").exists()
    server = start_server(tmp_path / "srv", extra, port=server.port)
    try:
        time.sleep(2.5)
        stats = stats_of(base)
        assert stats["history_s"] >= history  # months-long windows mean nothing without this
        assert stats["indicators"]["connected_clients"]["windows"]["15m"]["max"] == 6
        lines = [json.loads(line) for line in (tmp_path / "srv" / "logs" / "stats.log").read_text().splitlines()]
        assert len(lines) >= 3 and all(line["v"] == 1 and line["event"] == "stats" for line in lines)
        assert {"connected_clients", "messages_in_per_second", "totals", "history_s"} <= set(lines[-1])
        assert max(line["connected_clients"]["current"] for line in lines) == 6
    finally:
        server.stop()


def test_monitor_over_tls_with_authentication_and_certificate_reload(tmp_path: Path) -> None:
    from migratory.certs import create_ca, issue_server_cert

    pki = tmp_path / "pki"
    ca, ca_key = create_ca(pki)
    cert, key = issue_server_cert(ca, ca_key, ["localhost", "127.0.0.1"], pki)
    port = free_port()
    server = start_server(
        tmp_path / "srv",
        {
            "Workers": "2",
            "MonitorHTTP.ListenEncrypted": f"127.0.0.1:{port}",
            "MonitorHTTP.Username": "ops",
            "MonitorHTTP.Password": "s3cret",
            "TLSCertificate": str(cert),
            "TLSKey": str(key),
        },
    )
    try:
        context = ssl.create_default_context(cafile=str(ca))
        base = f"https://127.0.0.1:{port}"
        assert get(base + "/stats", context=context)[0] == 401
        assert get(base + "/stats", ("ops", "s3cret"), context)[0] == 200
        with pytest.raises((urllib.error.URLError, OSError)):  # plain HTTP on the TLS port gets nowhere
            urllib.request.urlopen(f"http://127.0.0.1:{port}/stats", timeout=3)
        from tests.test_tls import peer_serial

        before = peer_serial(port, ca)
        issue_server_cert(ca, ca_key, ["localhost", "127.0.0.1"], pki)
        server.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and peer_serial(port, ca) == before:
            time.sleep(0.2)
        assert peer_serial(port, ca) != before
    finally:
        server.stop()


def test_push_monitoring_on_a_meta_subject_that_clients_cannot_publish_on(
    server_factory: Callable[..., ServerProcess],
) -> None:
    server = server_factory({"Workers": "2", "MonitorPushInterval": "1"})

    async def scenario() -> None:
        async with MigratoryClient([server.ws_url]) as client:
            assert (await client.subscribe(["/migratory/stats/node"]))["/migratory/stats/node"] is Status.OK
            await traffic(server.ws_url, clients=3, messages=6, subject="/mon/push")
            documents = []
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and len(documents) < 3:
                message = await client.next_message(5)
                documents.append(json.loads(message.content))
            assert set(INDICATORS) <= set(documents[-1])
            assert max(d["totals"]["messages_in"] for d in documents) >= 6
            assert await client.publish("/migratory/stats/node", b"forged") is Status.DENIED

    asyncio.run(asyncio.wait_for(scenario(), 60))
    import urllib.request as request

    status, body = get(server.http_url + "/snapshot?subject=/migratory/stats/node")
    assert status == 200 and b"forged" not in body
    answer = request.Request(server.http_url + "/publish?subject=/migratory/stats/node", data=b"forged")
    with pytest.raises(urllib.error.HTTPError) as info:
        request.urlopen(answer, timeout=5)
    assert info.value.code == 403


def test_migratory_status_shows_the_indicators(server_factory: Callable[..., ServerProcess]) -> None:
    port = free_port()
    server_factory({"MonitorHTTP.Listen": f"127.0.0.1:{port}"})
    time.sleep(1.5)
    cli = [sys.executable, "-m", "migratory_cli.main", "status"]
    table = subprocess.run([*cli, f"http://127.0.0.1:{port}"], capture_output=True, text=True, timeout=60)
    assert table.returncode == 0, table.stderr
    assert "connected_clients" in table.stdout and "15m" in table.stdout
    as_json = subprocess.run([*cli, f"http://127.0.0.1:{port}", "--json"], capture_output=True, text=True, timeout=60)
    assert set(json.loads(as_json.stdout)["indicators"]) == set(INDICATORS)
    down = subprocess.run([*cli, f"http://127.0.0.1:{free_port()}"], capture_output=True, text=True, timeout=60)
    assert down.returncode == 3 and "Traceback" not in down.stderr and "cannot reach" in down.stderr


def test_username_without_password_is_a_config_error() -> None:
    from migratory.config import Config, ConfigError

    with pytest.raises(ConfigError) as info:
        Config.from_text("MonitorHTTP.Username = ops\n", "m.conf")
    assert info.value.errors[0].startswith("m.conf:1: MonitorHTTP.Password:")  # the line of the key that was set


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Debian's prometheus package) is not installed")
def test_promtool_accepts_the_metrics(server_factory: Callable[..., ServerProcess]) -> None:
    port = free_port()
    server_factory({"MonitorHTTP.Listen": f"127.0.0.1:{port}"})
    time.sleep(1.5)
    _, body = get(f"http://127.0.0.1:{port}/metrics")
    check = subprocess.run(["promtool", "check", "metrics"], input=body, capture_output=True, timeout=30)
    assert check.returncode == 0, check.stderr
