"""The kit's MQTT servers side by side: this server's ListenMqtt, Mosquitto and nats-server's MQTT listener.

The three targets (``migratory-mqtt``, ``mqtt``, ``nats-mqtt``) are driven by the same
MQTT 3.1.1 QoS 0 clients (migratory/bench/wire.py's MqttCodec) on the same workloads: a
fan-out (one subject, every client subscribed) and idle connections (memory per
connection). A target is skipped only when its server's binary is not installed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from migratory.bench.servers import peer_binary
from migratory.bench.wire import MQTT_TARGETS, TARGETS, MqttCodec, base_target, codec_for, mqtt_topic

CLIENTS = 50
MESSAGES = 6
COMPARED = ("migratory-mqtt", "mqtt", "nats-mqtt")


def _skip_unless_installed(target: str) -> None:
    if target != "migratory-mqtt" and peer_binary(target) is None:
        server = "nats-server" if target.startswith("nats") else "mosquitto"
        pytest.skip(f"{target}: {server} is not installed (neither on the PATH nor in /usr/sbin)")


def test_the_mqtt_targets_speak_the_same_mqtt() -> None:
    assert MQTT_TARGETS == ("mqtt", "migratory-mqtt", "nats-mqtt")
    assert all(t in TARGETS and base_target(t) == "mqtt" for t in MQTT_TARGETS)
    assert all(type(codec_for(t)) is MqttCodec for t in MQTT_TARGETS)
    # the kit's subjects are two levels deep, as this server's topics must be; Mosquitto's topics are unchanged
    assert mqtt_topic("/bench/s1") == "bench/s1"
    assert mqtt_topic("/s1") == "bench/s1"


def test_mqtt_codec_reports_a_refused_subscription() -> None:
    codec = MqttCodec()
    codec.hello("127.0.0.1", ["/bench/s0"])
    assert codec.feed(b"\x20\x02\x00\x00") == ([], b"")  # CONNACK accepted: not ready before the SUBACK
    assert not codec.ready
    with pytest.raises(ConnectionError, match="SUBACK"):
        codec.feed(b"\x90\x03\x00\x01\x80")
    refused = MqttCodec()
    refused.hello("127.0.0.1", [])
    with pytest.raises(ConnectionError, match="CONNACK"):
        refused.feed(b"\x20\x02\x00\x05")


def _peers(tmp: Path, *options: str) -> dict[str, dict[str, Any]]:
    """``migratory bench peers --targets migratory-mqtt,mqtt,nats-mqtt`` (those installed): each target's report."""
    targets = [t for t in COMPARED if t == "migratory-mqtt" or peer_binary(t)]
    out = tmp / "peers.json"
    command = [sys.executable, "-m", "migratory_cli.main", "bench", "peers", "--targets", ",".join(targets)]
    command += ["--clients", str(CLIENTS), "--processes", "2", "--workers", "2", *options, "--json", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr
    reports: list[dict[str, Any]] = json.loads(out.read_text())
    assert [r["target"] for r in reports] == targets  # one run, the servers in the order asked
    for target in targets:
        assert target in result.stdout  # the side-by-side table has a column each
    return {r["target"]: r for r in reports}


@pytest.fixture(scope="module")
def fan_out(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """One subject, every client subscribed, a few closed-loop bursts."""
    return _peers(tmp_path_factory.mktemp("fan-out"), "--subjects", "1", "--messages", str(MESSAGES), "--burst", "3")


@pytest.fixture(scope="module")
def idle(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Connected and subscribed clients, no traffic: the servers' memory per connection."""
    return _peers(tmp_path_factory.mktemp("idle"), "--messages", "0")


@pytest.mark.parametrize("target", COMPARED)
def test_fan_out_delivers_every_message(target: str, fan_out: dict[str, dict[str, Any]]) -> None:
    _skip_unless_installed(target)
    report = fan_out[target]
    assert report["errors"] == []
    assert report["connected"] == CLIENTS and report["published"] == MESSAGES
    assert report["delivered"] == report["expected_deliveries"] == CLIENTS * MESSAGES
    assert 0 < report["latency_ms"]["p50"] <= report["latency_ms"]["max"]
    assert report["server_cpu_seconds"] >= 0


@pytest.mark.parametrize("target", COMPARED)
def test_idle_connections_are_measured(target: str, idle: dict[str, dict[str, Any]]) -> None:
    _skip_unless_installed(target)
    report = idle[target]
    assert report["errors"] == []
    assert report["connected"] == CLIENTS and report["delivered"] == report["published"] == 0
    assert report["server_rss_mb_connected"] > 0 and report["server_processes"] >= 1
    if target == "migratory-mqtt":  # like the migratory target: a supervisor and --workers workers
        assert report["server_processes"] == 3
