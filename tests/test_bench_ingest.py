"""``migratory bench ingest``: acknowledged publications, checked at their subscribers, side by side.

Each target runs for real (this server, a 3-member Guaranteed cluster, nats-server JetStream and
Mosquitto), briefly, with a few subjects: every acknowledged publication must be found at its
subscriber, none refused, and the CPU meter must have seen the server work. The speeds themselves
are benchmark results (bench/ingest.md), never asserted here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from migratory import protocol as p
from migratory.bench.ingest import IngestConfig, IngestResult, NativePublisher, run_ingest
from migratory.bench.servers import peer_binary


def _brief(target: str, tmp: Path, window: int = 8) -> IngestResult:
    config = IngestConfig(
        target=target, window=window, publishers=2, subjects=12, duration=1.5, warmup=0.5, folder=tmp / "runs"
    )
    return run_ingest(config)


def _check(result: IngestResult) -> None:
    assert result.errors == [], result.errors
    assert result.acked > 0 and result.acked_total >= result.acked
    # every acknowledged publication reached its subscriber, once
    assert result.missing == 0 and result.delivered >= result.acked_total and result.duplicates == 0
    assert result.refused == {}
    assert result.server_cpu_us_per_ack > 0 and result.ack_p99_ms >= result.ack_p50_ms > 0


def _server_frame(payload: bytes) -> bytes:
    return bytes([0x82, len(payload)]) + payload  # unmasked binary frame, short


def test_native_publisher_counts_acknowledged_and_refused_answers_by_number() -> None:
    codec = NativePublisher(guaranteed=True)
    assert codec.hello("127.0.0.1").startswith(b"GET / HTTP/1.1")
    upgrade = b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n"
    ok = _server_frame(p.encode_publish_status(p.Status.OK, "7"))
    failed = _server_frame(p.encode_publish_status(p.Status.FAILED, "9", "no quorum"))
    acked, refused, _ = codec.feed(upgrade + ok + failed[:3])  # the second answer split across reads
    assert acked == [7] and refused == []
    acked, refused, _ = codec.feed(failed[3:])
    assert acked == [] and refused == [(9, "FAILED: no quorum")]


@pytest.mark.parametrize(
    "target",
    [
        "migratory",
        pytest.param("mosquitto", marks=pytest.mark.slow),
        pytest.param("jetstream-r1", marks=pytest.mark.slow),
    ],
)
def test_every_acknowledged_publication_reaches_its_subscriber(target: str, tmp_path: Path) -> None:
    if target != "migratory" and peer_binary("nats" if target.startswith("jetstream") else "mqtt") is None:
        pytest.skip(f"{target}: its server is not installed")
    _check(_brief(target, tmp_path))


@pytest.mark.slow
def test_a_guaranteed_cluster_acknowledges_only_what_every_subscriber_gets(tmp_path: Path) -> None:
    _check(_brief("migratory-guaranteed", tmp_path, window=16))


def test_bad_options_exit_2_with_one_line() -> None:
    for options in (["--targets", "redis"], ["--windows", "0"], ["--windows", "a,b"]):
        done = subprocess.run(
            [sys.executable, "-m", "migratory_cli.main", "bench", "ingest", *options],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 2, (options, done.stdout, done.stderr)
        assert "Traceback" not in done.stdout + done.stderr
        assert "bench ingest:" in done.stdout


def test_the_json_report_lists_every_run(tmp_path: Path) -> None:
    out = tmp_path / "ingest.json"
    done = subprocess.run(
        [sys.executable, "-m", "migratory_cli.main", "bench", "ingest", "--targets", "migratory", "--windows", "1,4",
         "--publishers", "1", "--subjects", "4", "--duration", "1", "--warmup", "0.3", "--json", str(out)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    runs = json.loads(out.read_text())
    assert [(r["target"], r["window"]) for r in runs] == [("migratory", 1), ("migratory", 4)]
    assert all(r["missing"] == 0 and r["acked_total"] > 0 for r in runs)
