"""Log analytics end to end: the real server's logs, the CLI report, and spark-submit on a standalone cluster."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import re
import signal
import struct
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import migratory_spark
import pyarrow.parquet as pq
import pytest
from migratory_spark import report, security, sessions, subjects, traffic
from migratory_spark.console import render
from migratory_spark.generate import GenerateResult, generate
from migratory_spark.reader import read_logs
from migratory_spark.schema import STATS_INDICATORS, STATS_WINDOWS
from migratory_spark.session import JAR
from pyspark.sql import SparkSession
from rich.console import Console

from migratory.client import MigratoryClient
from tests.conftest import ServerProcess, free_port, wait_for_port

pytestmark = pytest.mark.slow

MIGRATORY = [sys.executable, "-m", "migratory_cli.main"]
SPARK_HOME = Path(os.path.dirname(__import__("pyspark").__file__))
SUBMIT_PY = Path(migratory_spark.__file__).parent / "submit.py"


@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory) -> GenerateResult:
    # two nodes, almost an hour each: one reconnect storm per node, and one corrupt line in each stats.log
    return generate(str(tmp_path_factory.mktemp("gen")), 4_000_000, nodes=2, publish_rate=5, clients=100)


def test_the_servers_own_logs(
    server_factory: Callable[..., ServerProcess], spark: SparkSession, tmp_path: Path
) -> None:
    """What the server writes is what the jobs read: one session of real traffic, analysed, and the stats.log
    it wrote meanwhile (Stats.LogInterval 1) in the report's table, summary and chart."""
    server = server_factory({"MessageSizeLimit": "1K", "Stats.LogInterval": "1", "MonitorPushInterval": "0"})

    async def traffic_() -> None:
        async with MigratoryClient([server.ws_url]) as reader, MigratoryClient([server.ws_url]) as writer:
            assert (await reader.subscribe(["/live/a", "bad subject"]))["/live/a"].name == "OK"
            for i in range(5):
                await writer.publish("/live/a", f"v{i}")
            for _ in range(5):
                await reader.next_message(timeout=5)
            await writer.publish("/live/nobody", "x")
            writer.max_message_size = 0  # past the client's own check: the server denies and logs it
            await writer.publish("/live/a", b"x" * 4096)  # over MessageSizeLimit
            # connected over a second's end (the per-second count is the one at the end of each second), and
            # until stats.log holds two lines, one of them counting both clients
            await asyncio.sleep(1.1)
            await _stats_logged(server.log_folder / "stats.log", clients=2)

    asyncio.run(traffic_())
    assert server.stop() == 0
    frames = read_logs(spark, [str(server.log_folder)], persist=False)
    assert frames.corrupt.count() == 0
    stats = {r["subject"]: r for r in subjects.subject_stats(frames.access, frames.messages).collect()}
    assert (stats["/live/a"]["publications"], stats["/live/a"]["deliveries"]) == (5, 5)
    assert stats["/live/nobody"]["no_subscriber"] == 1
    denied = {r["reason_code"]: r["denied"] for r in security.denied_by_reason(frames.access).collect()}
    assert denied == {"invalid_subject": 1, "message_too_big": 1}
    reasons = {r["reason"]: r["disconnects"] for r in sessions.disconnect_reasons(frames.access).collect()}
    assert reasons == {"client_closed": 2}
    series = traffic.indicators_per_second(frames.access, frames.messages, spark)
    assert series.agg({"connected_clients": "max"}).first()[0] == 2  # type: ignore[index]
    assert series.orderBy("second", ascending=False).first()["connected_clients"] == 0  # type: ignore[index]
    _stats_log_in_the_report(server, spark, tmp_path)


async def _stats_logged(path: Path, clients: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        records = []
        with contextlib.suppress(FileNotFoundError):
            for line in path.read_text().splitlines():
                with contextlib.suppress(ValueError):  # a line being written
                    records.append(json.loads(line))
        if len(records) >= 2 and any(r["connected_clients"]["current"] == clients for r in records):
            return
        await asyncio.sleep(0.2)
    raise AssertionError(f"{path}: not two lines, one with {clients} clients, within {timeout} s")


def _stats_log_in_the_report(server: ServerProcess, spark: SparkSession, tmp_path: Path) -> None:
    """Every line the server wrote to stats.log is in the report: Parquet, summary, chart, HTML, terminal."""
    written = [json.loads(line) for line in (server.log_folder / "stats.log").read_text().splitlines()]
    assert len(written) >= 2 and max(r["connected_clients"]["current"] for r in written) == 2
    out = tmp_path / "report"
    summary = report.run(spark, report.Options(dirs=[str(server.log_folder)], out=str(out)))
    assert summary["lines"]["stats"] == len(written) and summary["lines"]["corrupt"] == 0
    stats = summary["stats"]
    assert stats["note"] is None
    assert [(n["server"], n["lines"], n["connected_clients_max"]) for n in stats["nodes"]] == [
        ("node", len(written), 2.0)
    ]
    table = sorted(pq.read_table(out / "parquet" / "stats_per_node").to_pylist(), key=lambda r: r["second"])
    assert len(table) == len(written)
    for row, record in zip(table, written, strict=True):
        assert row["time"].strftime("%Y-%m-%dT%H:%M:%S") == record["ts"][:19]
        assert (row["server"], row["epoch"], row["uptime_s"]) == ("node", record["epoch"], record["uptime_s"])
        for name in STATS_INDICATORS:
            assert row[name] == record[name]["current"], name
            for window in STATS_WINDOWS:
                assert row[f"{name}_{window}"] == record[name][window], (name, window)
        assert dict(row["totals"]) == record["totals"]
    # the chart is drawn from the series: per second of the lines, the server's figures
    by_second: dict[str, list[dict[str, Any]]] = {}
    for record in written:
        by_second.setdefault(record["ts"][:19] + "Z", []).append(record)
    assert stats["series_unit"] == "second"
    assert [p["start"] for p in stats["series"]] == sorted(by_second)
    for point in stats["series"]:
        records = by_second[point["start"]]
        for name in STATS_INDICATORS:
            assert point[name] == pytest.approx(sum(r[name]["current"] for r in records) / len(records)), name
    chart = Path(summary["outputs"]["charts"]["stats"])
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = (out / "report.html").read_text()
    assert "Server statistics (stats.log)" in page and 'alt="stats"' in page
    text = io.StringIO()
    render(summary, Console(file=text, width=300, color_system=None))
    assert f"Server statistics per node (stats.log, {len(written)} lines)" in text.getvalue()


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", path
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def test_cli_report(generated: GenerateResult, tmp_path: Path) -> None:
    out = tmp_path / "report"
    result = subprocess.run(
        [*MIGRATORY, "logs", "analyze", *generated.folders, "--out", str(out), "--top", "5"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    for title in (
        "Traffic totals",
        "Top subjects by publications",
        "Reconnect storms",
        "Denied requests by reason",
        "HTTP requests by endpoint and status",
        f"Server statistics per node (stats.log, {generated.stats_lines} lines)",
    ):
        assert title in result.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["spark"]["parser"] == "jvm"  # the package's jar, loaded by the CLI's local session
    assert summary["lines"] == {
        "access": generated.access_lines,
        "message": generated.message_lines,
        "stats": generated.stats_lines,
        "corrupt": generated.corrupt_lines,
    }
    assert [(r["kind"], r["lines"]) for r in summary["corrupt"]] == [("stats", 1), ("stats", 1)]
    # stats.log: every generated line, per node, in the table and the summary
    nodes = {n["node"]: n for n in summary["stats"]["nodes"]}
    assert set(nodes) == {os.path.abspath(f) for f in generated.folders}
    assert {n["server"] for n in nodes.values()} == {"member-1", "member-2"}
    assert sum(n["lines"] for n in nodes.values()) == generated.stats_lines
    table = pq.read_table(out / "parquet" / "stats_per_node").to_pylist()
    logged = {(r["folder"], r["ts"][:19]): r for r in generated.stats}
    assert len(table) == len(logged) == generated.stats_lines
    for row in table:
        record = logged[(row["node"], row["time"].strftime("%Y-%m-%dT%H:%M:%S"))]
        assert row["messages_in_per_second_5m_avg"] == record["messages_in_per_second"]["5m_avg"]  # type: ignore[index]
        assert row["connected_clients"] == record["connected_clients"]["current"]  # type: ignore[index]
    assert summary["traffic"]["totals"]["messages_in"] == generated.message_lines
    assert summary["sessions"]["reconnect_storm_addresses"] == 2  # one storm per node, each from its own address
    assert len(summary["subjects"]["top_by_publications"]) == 5
    assert set(summary["traffic"]["indicators"]) == set(traffic.INDICATORS)
    assert set(summary["traffic"]["indicators"]["connected_clients"]) == set(traffic.WINDOWS)
    # Parquet: time series partitioned by date, every table readable
    assert list((out / "parquet" / "traffic_per_minute").glob("date=2026-11-02/*.parquet"))
    assert list((out / "parquet" / "subject_stats").glob("*.parquet"))
    charts = summary["outputs"]["charts"]
    assert set(charts) == {
        "traffic",
        "concurrency",
        "latency",
        "stats",
        "top_subjects",
        "fanout",
        "durations",
        "denied",
        "http",
    }
    assert summary["http"]["requests"] > 0 and {r["status"] for r in summary["http"]["by_status"]} >= {200, 400}
    tables = summary["tables"]
    assert not any(tables[name]["empty"] for name in ("http_requests", "denied_over_time", "indicator_history"))
    for path in charts.values():
        width, height = _png_size(Path(path))
        assert width >= 800 and height >= 300
    html = (out / "report.html").read_text()
    assert html.count("data:image/png;base64,") == len(charts)
    assert "http://" not in html and "https://" not in html  # self-contained


def test_cli_rejects_bad_input(tmp_path: Path) -> None:
    missing = subprocess.run(
        [*MIGRATORY, "logs", "analyze", str(tmp_path / "nope"), "--out", str(tmp_path / "o")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert missing.returncode == 2 and "nope: not a directory" in missing.stderr
    bad_time = subprocess.run(
        [*MIGRATORY, "logs", "analyze", str(tmp_path), "--since", "yesterday"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad_time.returncode == 2 and "ISO 8601" in bad_time.stderr


def _spark_class(*args: str, log: Path) -> subprocess.Popen[bytes]:
    env = dict(os.environ, SPARK_HOME=str(SPARK_HOME), SPARK_NO_DAEMONIZE="1", SPARK_LOCAL_IP="127.0.0.1")
    with log.open("wb") as sink:
        return subprocess.Popen(
            [str(SPARK_HOME / "bin" / "spark-class"), *args],
            stdout=sink,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )


@pytest.fixture
def standalone(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A Spark standalone master and one worker on 127.0.0.1; yields the master URL and the worker's work dir."""
    port, ui = free_port(), free_port()
    work = tmp_path / "worker"
    work.mkdir()
    procs = [
        _spark_class(
            "org.apache.spark.deploy.master.Master",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--webui-port",
            str(ui),
            log=tmp_path / "master.log",
        )
    ]
    try:
        wait_for_port("127.0.0.1", port, timeout=60)
        url = f"spark://127.0.0.1:{port}"
        procs.append(
            _spark_class(
                "org.apache.spark.deploy.worker.Worker",
                "--host",
                "127.0.0.1",
                "--webui-port",
                str(free_port()),
                "--cores",
                "2",
                "--memory",
                "1g",
                "--work-dir",
                str(work),
                url,
                log=tmp_path / "worker.log",
            )
        )
        deadline = time.monotonic() + 60
        while True:
            with (
                contextlib.suppress(OSError, ValueError),
                urllib.request.urlopen(f"http://127.0.0.1:{ui}/json/", timeout=2) as reply,
            ):
                if json.load(reply).get("aliveworkers", 0) >= 1:
                    break
            assert time.monotonic() < deadline, (tmp_path / "worker.log").read_text()[-2000:]
            time.sleep(0.5)
        yield url, work
    finally:
        for proc in reversed(procs):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def test_spark_submit_on_a_standalone_cluster(
    standalone: tuple[str, Path], generated: GenerateResult, tmp_path: Path
) -> None:
    url, work = standalone
    out = tmp_path / "cluster-report"
    python = sys.executable  # the driver imports migratory_spark; executors run no Python
    env = dict(
        os.environ,
        SPARK_HOME=str(SPARK_HOME),
        SPARK_LOCAL_IP="127.0.0.1",  # driver, master, worker and executor all on loopback
        PYSPARK_PYTHON=python,
        PYSPARK_DRIVER_PYTHON=python,
    )
    result = subprocess.run(
        [
            str(SPARK_HOME / "bin" / "spark-submit"),
            "--master",
            url,
            "--conf",
            "spark.executor.memory=512m",
            "--conf",
            "spark.sql.shuffle.partitions=4",
            "--jars",  # the JVM line parser: the driver loads it, the executor fetches it from the driver
            str(JAR),
            str(SUBMIT_PY),
            *generated.folders,
            "--out",
            str(out),
            "--no-charts",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["spark"]["master"] == url
    assert summary["spark"]["parser"] == "jvm"  # run in the executor: the jar reached it
    assert summary["lines"]["message"] == generated.message_lines
    assert summary["lines"]["corrupt"] == generated.corrupt_lines
    assert summary["sessions"]["reconnect_storm_addresses"] == 2
    assert "Traffic totals" in result.stdout
    # the work ran in the worker's executor, not in the driver
    assert list(work.glob("app-*/*/stderr"))


def test_cli_generate_writes_parseable_logs(tmp_path: Path) -> None:
    result = subprocess.run(
        [*MIGRATORY, "logs", "generate", str(tmp_path), "--size", "300K", "--nodes", "2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    lines = 0
    for node in ("node-0", "node-1"):
        for name in ("access.log", "message.log"):
            for line in (tmp_path / node / name).read_text().splitlines():
                record = json.loads(line)
                assert record["v"] == 1 and record["ts"].endswith("Z")
                lines += 1
    found = re.search(r"([\d,]+) access, ([\d,]+) message", result.stdout)
    assert found is not None, result.stdout
    access, message = (int(n.replace(",", "")) for n in found.groups())
    assert lines == access + message
