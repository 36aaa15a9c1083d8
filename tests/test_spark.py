"""The PySpark jobs on logs with known answers (a session-scoped local SparkSession)."""

from __future__ import annotations

import gzip
import html
import io
import json
import math
import os
import statistics
import sys
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow.parquet as pq
import pytest
from migratory_spark import bench, charts, latency, report, security, sessions, subjects, traffic
from migratory_spark import stats as server_stats
from migratory_spark.console import NOT_ENOUGH_HISTORY, render
from migratory_spark.reader import EXAMPLE_CHARS, LogFrames, parse_lines, read_logs
from migratory_spark.schema import ACCESS_SCHEMA, STATS_INDICATORS, STATS_WINDOWS
from migratory_spark.session import SMALL_INPUT, session_settings
from pyspark.sql import DataFrame, SparkSession
from rich.console import Console

from tests.spark_fixtures import (
    HOSTILE_SUBJECTS,
    INDICATORS,
    NOT_ONE_OBJECT,
    NOT_ONE_OBJECT_EITHER,
    ONE_OBJECT,
    T0,
    Logs,
    broken_utf8_logs,
    hostile_logs,
    known_logs,
    quiet_logs,
    reference_series,
    stamp,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def known(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[str], Logs, Logs]:
    return known_logs(tmp_path_factory.mktemp("known"))


@pytest.fixture(scope="module")
def frames(spark: SparkSession, known: tuple[list[str], Logs, Logs]) -> LogFrames:
    return read_logs(spark, known[0])


@pytest.fixture(scope="module")
def per_second(spark: SparkSession, frames: LogFrames) -> DataFrame:
    return traffic.indicators_per_second(frames.access, frames.messages, spark).cache()


def rows(frame: DataFrame) -> list[dict[str, Any]]:
    return [row.asDict() for row in frame.collect()]


def by(frame: DataFrame, key: str) -> dict[Any, dict[str, Any]]:
    return {row[key]: row for row in rows(frame)}


# --- reading ----------------------------------------------------------------------------


def test_corrupt_lines_are_counted_per_node_and_skipped(frames: LogFrames, known: tuple[list[str], Logs, Logs]) -> None:
    dirs, a, b = known
    corrupt = rows(frames.corrupt)
    assert [(r["kind"], r["node"], r["lines"]) for r in corrupt] == [("access", dirs[0], 4)]
    # every good line of both nodes, from access.log and access.log.1, none from access.log.bak
    assert frames.access.count() == len(a.access) + len(b.access)
    assert frames.messages.count() == len(a.messages)
    nodes = {r["node"] for r in rows(frames.access.select("node").distinct())}
    assert nodes == set(dirs)


def test_session_ids_are_keyed_by_node(frames: LogFrames) -> None:
    keys = {r["session_key"] for r in rows(frames.access.where("session = '1-0-1'").select("session_key").distinct())}
    assert len(keys) == 2


def test_since_until_select_by_event_time(spark: SparkSession, known: tuple[list[str], Logs, Logs]) -> None:
    since = datetime.fromtimestamp(T0 + 3600, UTC)
    until = datetime.fromtimestamp(T0 + 86_400, UTC)
    window = read_logs(spark, known[0], since=since, until=until, persist=False)
    assert window.messages.count() == 10  # only /b: /a is before, /c after
    assert window.access.count() == 0
    assert rows(window.corrupt)[0]["lines"] == 4  # corrupt lines have no time: always reported


def test_missing_folder_is_a_clear_error(spark: SparkSession, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="not a directory"):
        read_logs(spark, [str(tmp_path / "nope")])


def test_session_runs_in_utc_with_ansi_mode(spark: SparkSession) -> None:
    assert spark.conf.get("spark.sql.session.timeZone") == "UTC"
    assert spark.conf.get("spark.sql.ansi.enabled") == "true"


# --- stats.log ----------------------------------------------------------------------------


def _stats_line(second: int, server: str, epoch: int, clients: float, messages: float) -> dict[str, Any]:
    record: dict[str, Any] = {
        "v": 1,
        "ts": stamp(second, 3),
        "event": "stats",
        "node": server,
        "epoch": epoch,
        "uptime_s": second - T0,
        "history_s": second - T0,
    }
    for n, name in enumerate(STATS_INDICATORS):
        value = clients if name == "connected_clients" else messages * (n + 1)
        record[name] = {"current": value, **{w: value + i for i, w in enumerate(STATS_WINDOWS)}}
    record["totals"] = {"connections": int(clients), "messages_in": int(messages) * 60}
    record["denied"] = {"entitlement": 2} if clients > 3 else {}
    return record


def _write(path: Path, lines: list[str]) -> None:
    data = "".join(line + "\n" for line in lines).encode()
    if path.suffix == ".gz":
        path.write_bytes(gzip.compress(data))
    else:
        path.write_bytes(data)


def test_stats_log_rotations_and_corrupt_lines_per_node(spark: SparkSession, tmp_path: Path) -> None:
    """stats.log and its rotations (.gz too) per node; a corrupt line is counted like the others', never fatal;
    a node without stats.log (an older server) has none and is still read."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    older = [_stats_line(T0 + 60 * i, "member-1", 7, i, 10.5) for i in range(1, 3)]
    newer = [_stats_line(T0 + 60 * i, "member-1", 8, i, 20.0) for i in range(3, 6)]
    _write(a / "stats.log.1.gz", [json.dumps(r) for r in older])
    corrupt = [
        '{"v":1,"ts":"' + stamp(T0 + 400) + '","event":"stats","node":',  # cut short
        '{"v":1,"ts":"' + stamp(T0 + 401) + '","event":"stats","connected_clients":{"current":"many"}}',
        '{"v":2,"ts":"' + stamp(T0 + 402) + '","event":"stats"}',  # a schema this reader does not know
    ]
    _write(a / "stats.log", [json.dumps(newer[0]), *corrupt, "", json.dumps(newer[1]), json.dumps(newer[2])])
    (a / "stats.log.bak").write_text("not read\n")
    (b / "access.log").write_text(
        json.dumps({"v": 1, "ts": stamp(T0 + 5), "event": "connect", "session": "1-0-1", "addr": "10.0.0.1"}) + "\n"
    )
    frames = read_logs(spark, [str(a), str(b)], persist=False)
    assert [(r["kind"], r["lines"]) for r in frames.corrupt.collect()] == [("stats", 3)]
    assert frames.skipped == [str(a / "stats.log.bak")]
    got = sorted(rows(server_stats.stats_per_node(frames.stats)), key=lambda r: r["second"])
    expected = older + newer
    assert [r["second"] for r in got] == [T0 + 60 * i for i in range(1, 6)]
    for row, record in zip(got, expected, strict=True):
        assert (row["node"], row["server"], row["epoch"]) == (str(a), "member-1", record["epoch"])
        for name in STATS_INDICATORS:
            assert row[name] == record[name]["current"]
            assert row[f"{name}_15m_avg"] == record[name]["15m_avg"]
        assert row["totals"] == record["totals"] and row["denied"] == record["denied"]
        assert str(row["date"]) == "2026-11-02"
    nodes = server_stats.stats_nodes(server_stats.stats_per_node(frames.stats)).collect()
    assert len(nodes) == 1
    node = nodes[0]
    assert (node["lines"], node["epochs"], node["connected_clients_max"]) == (5, 2, 5.0)
    assert node["messages_in_per_second_avg"] == pytest.approx((2 * 10.5 * 4 + 3 * 20.0 * 4) / 5)
    series = server_stats.stats_series(server_stats.stats_per_node(frames.stats), "minute").collect()
    assert [r["connected_clients"] for r in series] == [1.0, 2.0, 3.0, 4.0, 5.0]
    # the period applies as to the other logs
    since = read_logs(spark, [str(a)], since=datetime.fromtimestamp(T0 + 180, UTC), persist=False)
    assert since.stats.count() == 3


# --- traffic ----------------------------------------------------------------------------


def test_traffic_per_minute_hour_day(frames: LogFrames) -> None:
    minute = {r["start"].replace(tzinfo=UTC).timestamp(): r for r in rows(traffic.traffic(frames.messages, "minute"))}
    assert minute[T0]["messages_in"] == 30  # /a at seconds 30..59
    assert minute[T0 + 60]["messages_in"] == 60
    assert minute[T0 + 120]["messages_in"] == 10
    assert minute[T0 + 3600]["messages_in"] == 2  # one /b line sampled at 0.5
    hour = {r["start"].replace(tzinfo=UTC).timestamp(): r for r in rows(traffic.traffic(frames.messages, "hour"))}
    assert (hour[T0]["messages_in"], hour[T0]["messages_out"]) == (100, 200)
    assert (hour[T0]["bytes_in"], hour[T0]["bytes_out"]) == (1000, 200 * 50)
    assert (hour[T0 + 3600]["messages_in"], hour[T0 + 3600]["messages_out"]) == (20, 20)
    assert (hour[T0 + 3600]["bytes_in"], hour[T0 + 3600]["bytes_out"]) == (400, 20 * 60)
    day = {str(r["date"]): r for r in rows(traffic.traffic(frames.messages, "day"))}
    assert day["2026-11-02"]["messages_in"] == 120 and day["2026-11-03"]["messages_in"] == 5


def test_indicators_per_second_match_the_reference(per_second: DataFrame, known: tuple[list[str], Logs, Logs]) -> None:
    expected = reference_series([known[1], known[2]])
    got = {r["second"]: r for r in rows(per_second)}
    assert set(got) == set(expected)
    for second, values in expected.items():
        for name in INDICATORS:
            assert got[second][name] == pytest.approx(values[name]), (second, name)
    # by hand: the session that predates the logs lifts the count; node b's client counts too
    assert got[T0 + 5]["connected_clients"] == 0
    assert got[T0 + 20]["connected_clients"] == 3
    assert got[T0 + 60]["connected_clients"] == 4
    assert got[T0 + 250]["connected_clients"] == 2


def _window_stats(series: dict[int, dict[str, float]], end: int, length: int, name: str) -> tuple[float, float, float]:
    values = [v[name] for s, v in series.items() if 0 <= end - s < length]
    return max(values), statistics.fmean(values), statistics.pstdev(values)


@pytest.mark.parametrize("until", [None, T0 + 3600 + 300])
def test_indicator_windows(per_second: DataFrame, known: tuple[list[str], Logs, Logs], until: int | None) -> None:
    expected = reference_series([known[1], known[2]])
    end = until - 1 if until is not None else max(expected)
    got = {(r["indicator"], r["window"]): r for r in rows(traffic.indicator_windows(per_second, end))}
    assert {w for _, w in got} == set(traffic.WINDOWS)
    for name in INDICATORS:
        for window, length in traffic.WINDOWS.items():
            peak, mean, spread = _window_stats(expected, end, length, name)
            row = got[(name, window)]
            assert row["max"] == pytest.approx(peak), (name, window)
            assert row["avg"] == pytest.approx(mean), (name, window)
            assert row["stddev"] == pytest.approx(spread, abs=1e-6), (name, window)
            assert row["samples"] == sum(1 for s in expected if 0 <= end - s < length)


def test_indicator_history_tumbling_windows(per_second: DataFrame, known: tuple[list[str], Logs, Logs]) -> None:
    expected = reference_series([known[1], known[2]])
    got = {
        (r["window"], int(r["start"].replace(tzinfo=UTC).timestamp()), r["indicator"]): r
        for r in rows(traffic.indicator_history(per_second))
    }
    for window in ("1m", "5m", "1h", "1d"):
        length = traffic.WINDOWS[window]
        for name in ("messages_in_per_second", "connected_clients"):
            buckets: dict[int, list[float]] = {}
            for second, values in expected.items():
                buckets.setdefault(second - second % length, []).append(values[name])
            for start, values_ in buckets.items():
                row = got[(window, start, name)]
                assert row["samples"] == len(values_)
                assert row["max"] == pytest.approx(max(values_))
                assert row["avg"] == pytest.approx(statistics.fmean(values_))
                assert row["stddev"] == pytest.approx(statistics.pstdev(values_), abs=1e-6)


# --- subjects ---------------------------------------------------------------------------


def test_subject_stats(frames: LogFrames) -> None:
    stats = by(subjects.subject_stats(frames.access, frames.messages), "subject")
    assert set(stats) == {"/a", "/b", "/c"}
    a, b, c = stats["/a"], stats["/b"], stats["/c"]
    assert (a["publications"], a["deliveries"], a["bytes_out"]) == (100, 200, 10000)
    assert (a["subscriptions"], a["max_fanout"]) == (2, 2)
    assert (b["publications"], b["deliveries"], b["bytes_in"], b["subscriptions"]) == (20, 20, 400, 1)
    assert (c["publications"], c["deliveries"], c["no_subscriber"], c["subscriptions"]) == (5, 0, 5, 0)


def test_fanout_distribution(frames: LogFrames) -> None:
    got = {r["recipients"]: r for r in rows(subjects.fanout_distribution(frames.messages))}
    assert {k: v["publications"] for k, v in got.items()} == {"0": 5, "1": 20, "2-10": 100}
    assert got["2-10"]["share"] == pytest.approx(100 / 125)


def test_subjects_published_but_never_subscribed(frames: LogFrames) -> None:
    never = rows(subjects.unsubscribed_subjects(frames.access, frames.messages))
    assert [(r["subject"], r["publications"]) for r in never] == [("/c", 5)]


# --- sessions ---------------------------------------------------------------------------


def test_concurrency_per_minute(per_second: DataFrame) -> None:
    got = {int(r["start"].replace(tzinfo=UTC).timestamp()): r for r in rows(sessions.concurrency(per_second))}
    assert (got[T0]["min"], got[T0]["max"]) == (0, 4)
    assert got[T0 + 240]["max"] == 2


def test_session_durations_and_reasons(frames: LogFrames) -> None:
    dist = {r["duration"]: r["sessions"] for r in rows(sessions.duration_distribution(frames.access))}
    assert dist == {"<1s": 25, "1-10m": 2, "1h-1d": 1}
    pct = rows(sessions.duration_percentiles(frames.access))[0]
    assert pct["sessions"] == 28 and pct["max_ms"] == 3_600_000 and pct["p50_ms"] == 500
    reasons = {r["reason"]: r["disconnects"] for r in rows(sessions.disconnect_reasons(frames.access))}
    assert reasons == {"connection_lost": 25, "client_closed": 2, "slow_consumer": 1}


def test_reconnect_storms(frames: LogFrames) -> None:
    storms = rows(sessions.reconnect_storms(frames.access, window_seconds=60, threshold=20))
    assert [(r["addr"], r["peak_connects"]) for r in storms] == [("192.0.2.9", 25)]
    assert rows(sessions.reconnect_storms(frames.access, window_seconds=60, threshold=26)) == []
    # a 10 s window never holds more than 10 of the one-per-second connects
    tight = rows(sessions.reconnect_storms(frames.access, window_seconds=10, threshold=2))
    assert tight[0]["peak_connects"] == 10


def test_listeners_and_tls_share(frames: LogFrames) -> None:
    listeners = {(r["listener"], r["protocol"]): r for r in rows(sessions.clients_per_listener(frames.access))}
    assert listeners[("127.0.0.1:443", "wss")]["sessions"] == 1
    assert listeners[("127.0.0.1:80", "ws")]["sessions"] == 28
    assert listeners[("127.0.0.1:80", "ws")]["addresses"] == 4
    share = {r["transport"]: r for r in rows(sessions.tls_share(frames.access))}
    assert (share["tls"]["sessions"], share["plain"]["sessions"]) == (1, 28)
    assert share["tls"]["share"] == pytest.approx(1 / 29)


# --- security ---------------------------------------------------------------------------


def test_denied_by_reason_address_subject(frames: LogFrames) -> None:
    reasons = {(r["reason_code"], r["request"]): r["denied"] for r in rows(security.denied_by_reason(frames.access))}
    assert reasons == {
        ("invalid_subject", "subscribe"): 3,
        ("entitlement", "publish"): 2,
        ("address_not_allowed", "publish"): 1,
        ("message_too_big", "publish"): 1,
    }
    addresses = by(security.denied_by_address(frames.access), "addr")
    assert addresses["203.0.113.6"]["denied"] == 3
    assert addresses["203.0.113.6"]["reason_codes"] == ["address_not_allowed", "entitlement"]
    subjects_ = by(security.denied_by_subject(frames.access), "subject")
    assert {k: v["denied"] for k, v in subjects_.items()} == {"bad": 3, "/secret": 2, "/a": 2}
    hourly = rows(security.denied_over_time(frames.access))
    assert sum(r["denied"] for r in hourly) == 7


# --- latency ----------------------------------------------------------------------------


def test_latency_percentiles(frames: LogFrames) -> None:
    per_subject = by(latency.latency_by_subject(frames.messages), "subject")
    a = per_subject["/a"]  # latencies 1..100 us
    assert a["messages"] == 100 and a["max_us"] == 100
    assert a["p50_us"] == pytest.approx(50, abs=1)
    assert a["p90_us"] == pytest.approx(90, abs=1)
    assert a["p99_us"] == pytest.approx(99, abs=1)
    assert per_subject["/b"]["p50_us"] == 1000
    overall = rows(latency.latency_overall(frames.messages))[0]
    values = sorted([i + 1 for i in range(100)] + [1000] * 10 + [5] * 5)
    assert overall["messages"] == len(values) and overall["max_us"] == 1000
    assert overall["p50_us"] == pytest.approx(values[math.ceil(0.5 * len(values)) - 1], abs=1)
    timeline = {
        int(r["start"].replace(tzinfo=UTC).timestamp()): r for r in rows(latency.latency_over_time(frames.messages))
    }
    assert timeline[T0]["messages"] == 30 and timeline[T0]["max_us"] == 30


# --- the whole report on logs that used to break it ----------------------------------------------


@pytest.fixture(scope="module")
def hostile(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[str], Logs]:
    return hostile_logs(tmp_path_factory.mktemp("hostile"))


@pytest.fixture(scope="module")
def hostile_report(
    spark: SparkSession, hostile: tuple[list[str], Logs], tmp_path_factory: pytest.TempPathFactory
) -> tuple[dict[str, Any], Path]:
    out = tmp_path_factory.mktemp("hostile-report")
    return report.run(spark, report.Options(dirs=hostile[0], out=str(out))), out


def _render(summary: dict[str, Any]) -> str:
    buffer = io.StringIO()
    render(summary, Console(file=buffer, width=300, color_system=None))
    return buffer.getvalue()


def test_logs_without_denials_or_message_log_give_a_full_report(spark: SparkSession, tmp_path: Path) -> None:
    """Empty tables (no denied line, MessageLog off) are written with their schema and reported as empty."""
    out = tmp_path / "report"
    summary = report.run(spark, report.Options(dirs=quiet_logs(tmp_path), out=str(out)))
    assert (out / "summary.json").is_file() and (out / "report.html").is_file()
    assert summary["lines"] == {"access": 3, "message": 0, "stats": 0, "corrupt": 0}
    tables = summary["tables"]
    assert set(tables) == set(report.TABLES)
    empty = {name for name, info in tables.items() if info["empty"]}
    assert {
        "denied_over_time",
        "denied_by_reason",
        "latency_per_minute",
        "traffic_per_minute",
        "http_requests",
        "stats_per_node",  # no stats.log: an older server, or Stats.LogInterval 0
        "stats_nodes",
    } <= empty
    assert not tables["indicators_per_second"]["empty"] and not tables["subject_stats"]["empty"]
    for name in empty:  # every reader gets the schema back, partitioned or not
        path = out / "parquet" / name
        assert spark.read.parquet(str(path)).count() == 0
        arrow = pq.read_table(path)
        assert arrow.num_rows == 0 and arrow.num_columns > 0
        if report.TABLES[name][1]:
            assert "date" in arrow.column_names
    assert set(spark.read.parquet(str(out / "parquet" / "denied_over_time")).columns) == {
        "start",
        "reason_code",
        "denied",
        "date",
    }
    stats_columns = spark.read.parquet(str(out / "parquet" / "stats_per_node")).columns
    assert {"node", "server", "time", "epoch", "connected_clients", "bytes_out_per_second_15m_avg", "totals"} <= set(
        stats_columns
    )
    assert summary["stats"]["note"] == report.NO_STATS and summary["stats"]["series"] == []
    assert "stats" not in summary["outputs"]["charts"]
    assert summary["security"]["denied"] == 0 and summary["http"]["requests"] == 0
    text = _render(summary)
    assert "empty tables" in text and f"stats.log: {report.NO_STATS}" in text
    page = (out / "report.html").read_text()
    assert "empty (schema only)" in page and html.escape(report.NO_STATS) in page


def test_terminal_report_prints_subjects_as_written(hostile_report: tuple[dict[str, Any], Path]) -> None:
    text = _render(hostile_report[0])
    for subject in HOSTILE_SUBJECTS:
        assert subject in text, subject
    assert "/$x^$/[/red]" in text  # an HTTP path


def test_charts_and_html_show_subjects_as_written(hostile_report: tuple[dict[str, Any], Path]) -> None:
    summary, out = hostile_report
    assert {"top_subjects", "denied", "http", "latency", "concurrency"} <= set(summary["outputs"]["charts"])
    assert charts.plain("/px/$USD/$EUR") == r"/px/\$USD/\$EUR"
    page = (out / "report.html").read_text()
    assert "<script>" not in page and html.escape("/h/<script>alert(1)</script>") in page
    for subject in ("/t/[/red]", "/m/$x^$", "/px/$USD/$EUR"):
        assert html.escape(subject) in page


def test_a_dollar_subject_no_longer_reads_as_mathtext(tmp_path: Path) -> None:
    summary: dict[str, Any] = {
        "traffic": {"series": []},
        "lines": {"message": 0},
        "period": {"series_unit": "second"},
        "sessions": {"concurrency": [], "durations": []},
        "latency": {"series": []},
        "subjects": {"top_by_publications": [{"subject": "/m/$x^$", "publications": 3.0}], "fanout": []},
        "security": {"by_reason": []},
        "http": {"by_endpoint": [{"method": "GET", "path": "/$", "status": 200, "requests": 1}]},
    }
    drawn = charts.draw_all(summary, str(tmp_path))
    assert set(drawn) == {"top_subjects", "http"}


def test_corrupt_example_is_readable_by_any_parquet_reader(spark: SparkSession, tmp_path: Path) -> None:
    out = tmp_path / "report"
    summary = report.run(spark, report.Options(dirs=broken_utf8_logs(tmp_path), out=str(out), charts=False))
    path = out / "parquet" / "corrupt_lines"
    table = pq.read_table(path).to_pylist()
    frame = pd.read_parquet(path)
    assert len(frame) == len(table) == 1
    assert spark.read.parquet(str(path)).count() == 1
    message = table[0]
    assert (message["kind"], message["lines"]) == ("message", 1)
    assert message["example"].startswith('{"v":1,') and "\\xff\\xfe" in message["example"]
    assert len(message["example"]) <= EXAMPLE_CHARS  # cut: the line is over 400 characters
    assert {row["kind"]: row["example"] for row in summary["corrupt"]}["message"] == message["example"]


def test_every_line_that_is_not_one_object_is_one_corrupt_line(
    spark: SparkSession, hostile: tuple[list[str], Logs]
) -> None:
    dirs, logs = hostile
    frames = read_logs(spark, dirs, persist=False)
    corrupt = {r["kind"]: r["lines"] for r in rows(frames.corrupt)}
    assert corrupt == {"access": len(NOT_ONE_OBJECT)}
    # every good line, the gzipped rotation's included; no event from the corrupt ones
    events = Counter(r["event"] for r in rows(frames.access.select("event")))
    assert events == Counter(r["event"] for r in logs.access)
    assert events["connect"] == len(HOSTILE_SUBJECTS)
    assert frames.messages.count() == len(logs.messages)
    assert frames.skipped == [str(Path(dirs[0]) / "access.log.3.zst")]


def test_parse_lines_accepts_exactly_one_object_per_line(spark: SparkSession) -> None:
    good = ONE_OBJECT
    bad = [*NOT_ONE_OBJECT, *NOT_ONE_OBJECT_EITHER]
    everything = [*good, *bad, "", "  \r"]
    lines = spark.createDataFrame(list(enumerate(everything)), "id INT, value STRING")
    result = parse_lines(lines, ACCESS_SCHEMA).select("id", "bad", "blank").collect()
    assert sorted(everything[r["id"]] for r in result if r["blank"]) == ["", "  \r"]  # ignored, never corrupt
    parsed = {everything[r["id"]]: r["bad"] for r in result if not r["blank"]}
    assert len(parsed) == len(good) + len(bad)
    assert [line for line in good if parsed[line]] == []
    assert [line for line in bad if not parsed[line]] == []


def test_time_must_be_written_exactly_as_the_server_writes_it(spark: SparkSession) -> None:
    """Spark's cast reads many ISO 8601 forms; a line's ``ts`` must be ``yyyy-MM-ddTHH:mm:ss.SSSZ``."""

    def line(ts: str) -> str:
        return json.dumps({"v": 1, "ts": ts, "event": "connect"}, ensure_ascii=False)

    good = ["2026-11-02T00:00:01.000Z", "2026-11-02T23:59:59.999Z"]
    bad = [
        "2026-11-02 00:00:01.000Z",  # a space for the T
        "2026-11-02T00:00:01.0000",  # no Z
        "2026-11-02T00:00:01.000z",
        "2026-11-02T00:00:01Z",
        "2026-11-02T00:00:01.00Z",
        "2026-11-02T00:00:01.000+00:00",
        "2026-11-02T00:00:01,000Z",
        "2026-11-02T24:00:01.000Z",
        "2026-11-02T00:00:01.0éZ",  # 24 bytes, 23 characters
        "2026-11-0\uff12T00:00:01.0Z",  # 24 bytes, a full-width digit
        "2026-11-02",
    ]
    everything = [line(ts) for ts in [*good, *bad]]
    lines = spark.createDataFrame(list(enumerate(everything)), "id INT, value STRING")
    result = {everything[r["id"]]: (r["bad"], r["second"]) for r in parse_lines(lines, ACCESS_SCHEMA).collect()}
    assert [result[line(ts)] for ts in good] == [(False, T0 + 1), (False, T0 + 86399)]
    assert [ts for ts in bad if not result[line(ts)][0]] == []


def test_unread_string_fields_are_skipped_but_typed_ones_still_checked(spark: SparkSession, tmp_path: Path) -> None:
    """Any JSON value is a string to Spark, so the parse leaves out the strings no analysis reads; a
    wrongly typed field makes its line corrupt whether an analysis reads it or not."""
    base = {"v": 1, "ts": stamp(T0 + 1, 5), "event": "publish", "subject": "/a", "size": 10, "recipients": 2}
    good = [
        base,
        {**base, "session": {"id": [1, 2]}, "addr": 7, "protocol": None, "qos": True},
    ]
    bad = [
        {**base, "port": "eighty"},
        {**base, "seq": "x"},
        {**base, "fields": 1.5},
        {**base, "retained": "yes"},
        {**base, "epoch": {"n": 1}},
        {**base, "size": "10"},
    ]
    (tmp_path / "message.log").write_text("".join(json.dumps(r) + "\n" for r in [*good, *bad]))
    frames = read_logs(spark, [str(tmp_path)], persist=False)
    assert {r["kind"]: r["lines"] for r in rows(frames.corrupt)} == {"message": len(bad)}
    assert [(r["subject"], r["size"], r["recipients"]) for r in rows(frames.messages)] == [("/a", 10, 2)] * 2


def test_session_settings_size_the_local_jvm() -> None:
    small = session_settings("local[*]", SMALL_INPUT - 1)
    large = session_settings("local[*]", SMALL_INPUT)
    assert "-XX:TieredStopAtLevel=1" in small["spark.driver.extraJavaOptions"]
    assert small["spark.sql.codegen.factoryMode"] == "NO_CODEGEN"
    options = large["spark.driver.extraJavaOptions"].split()
    for option in ("-XX:+UseParallelGC", "-XX:CompileThresholdScaling=4", "-XX:FreqInlineSize=100"):
        assert option in options
    assert "-XX:InlineSmallCode=1000" in options and "-XX:TieredStopAtLevel=1" not in options
    assert "spark.sql.codegen.factoryMode" not in large
    assert large["spark.sql.objectHashAggregate.sortBased.fallbackThreshold"] == "65536"
    # on a cluster the executors keep Spark's own sizing
    cluster = session_settings("spark://127.0.0.1:7077", SMALL_INPUT * 100)
    assert cluster["spark.driver.extraJavaOptions"] == "-Duser.timezone=UTC"
    assert "spark.sql.objectHashAggregate.sortBased.fallbackThreshold" not in cluster


def test_http_requests_by_endpoint_and_status(spark: SparkSession, hostile_report: tuple[dict[str, Any], Path]) -> None:
    summary, out = hostile_report
    table = {
        (r["method"], r["path"], r["status"]): r["requests"]
        for r in spark.read.parquet(str(out / "parquet" / "http_requests")).collect()
    }
    assert table == {
        ("GET", "/health", 200): 2,
        ("POST", "/publish", 200): 3,
        ("POST", "/publish", 403): 1,
        ("GET", "/$x^$/[/red]", 404): 1,
        (None, None, 400): 2,
        (None, None, 413): 1,
    }
    http_summary = summary["http"]
    assert http_summary["requests"] == 10 and http_summary["endpoints"] == 6
    assert {r["status"]: r["requests"] for r in http_summary["by_status"]} == {200: 5, 400: 2, 403: 1, 404: 1, 413: 1}
    assert http_summary["by_endpoint"][0] == {
        "method": "POST",
        "path": "/publish",
        "status": 200,
        "requests": 3,
        "bytes_out": 300,
        "addresses": 1,
        "first": "2026-11-02T00:00:30Z",
        "last": "2026-11-02T00:00:32Z",
    }
    text = _render(summary)
    assert "HTTP requests by endpoint and status (10)" in text and "(unparsed)" in text
    assert "<h2>HTTP requests</h2>" in (out / "report.html").read_text()


def test_spark_written_tables_match_the_driver_written_ones(
    spark: SparkSession, known: tuple[list[str], Logs], tmp_path: Path
) -> None:
    """A table too big to collect is written by Spark and summarised in Spark: the same answers."""
    small = report.run(spark, report.Options(dirs=known[0], out=str(tmp_path / "driver"), charts=False))
    big = report.run(spark, report.Options(dirs=known[0], out=str(tmp_path / "spark"), charts=False, local_rows=0))
    assert {info["written_by"] for name, info in big["tables"].items() if not info["empty"]} - {"driver"} == {"spark"}
    assert big["tables"]["corrupt_lines"]["written_by"] == "driver"
    for summary in (small, big):
        for key in ("generated", "outputs"):
            summary.pop(key)
        for info in summary["tables"].values():
            info.pop("written_by")
    assert big == small
    for name in ("traffic_per_minute", "subject_stats", "indicator_history", "denied_by_address"):
        driver = sorted(map(str, spark.read.parquet(str(tmp_path / "driver" / "parquet" / name)).collect()))
        written = sorted(map(str, spark.read.parquet(str(tmp_path / "spark" / "parquet" / name)).collect()))
        assert driver == written, name


def test_duckdb_reference_computes_the_same_tables(
    spark: SparkSession, known: tuple[list[str], Logs], tmp_path: Path
) -> None:
    pytest.importorskip("duckdb")
    reference = bench.duckdb_reference(known[0], str(tmp_path / "duckdb"))
    assert reference["messages_in"] == 125 and reference["subjects"] == 3
    assert reference["tables"]["traffic_per_hour"] == len(
        rows(traffic.traffic(read_logs(spark, known[0]).messages, "hour"))
    )
    duck = {r["subject"]: r for r in pq.read_table(tmp_path / "duckdb" / "subject_stats.parquet").to_pylist()}
    assert (duck["/a"]["publications"], duck["/a"]["deliveries"], duck["/a"]["subscriptions"]) == (100, 200, 2)


# --- short and partial captures -------------------------------------------------------------------


def test_series_unit_follows_the_span_of_the_logs() -> None:
    assert report.series_unit(T0, T0 + 300) == "second"
    assert report.series_unit(T0, T0 + 3 * 3600) == "minute"
    assert report.series_unit(T0, T0 + 30 * 86400) == "hour"
    assert report.series_unit(T0, T0 + 400 * 86400) == "day"


def test_partial_first_and_last_periods_are_marked(
    spark: SparkSession, known: tuple[list[str], Logs], tmp_path: Path
) -> None:
    summary = report.run(spark, report.Options(dirs=known[0], out=str(tmp_path)))
    assert summary["period"]["series_unit"] == "minute"  # a day and an hour of logs
    series = summary["traffic"]["series"]
    # the logs run from T0+5 s to T0+90000 s: the first minute lacks 5 s, the last one 59 s
    assert summary["period"]["first"] == "2026-11-02T00:00:05Z"
    assert series[0]["start"] == "2026-11-02T00:00:00Z" and series[0]["partial"]
    assert not any(row["partial"] for row in series[1:-1])
    assert series[-1]["start"] == "2026-11-03T01:00:00Z" and series[-1]["partial"]
    assert summary["sessions"]["concurrency"][0]["partial"]
    assert "grey bands" in (tmp_path / "report.html").read_text()


def test_windows_longer_than_the_logs_say_not_enough_history(
    hostile_report: tuple[dict[str, Any], Path], known: tuple[list[str], Logs], per_second: DataFrame
) -> None:
    summary = hostile_report[0]  # 33 seconds of logs: no window is covered whole
    assert summary["period"]["seconds"] == 33 and summary["period"]["series_unit"] == "second"
    assert len(summary["traffic"]["series"]) == 33 and not any(r["partial"] for r in summary["traffic"]["series"])
    windows = summary["traffic"]["indicators"]["connected_clients"]
    assert not any(stats["full_history"] for stats in windows.values())
    text = _render(summary)
    assert text.count(NOT_ENOUGH_HISTORY) == len(INDICATORS)  # one line per indicator, values never repeated
    assert "1m … 15mo" in text
    # a day and an hour of logs: the day is covered, five days are not
    expected = reference_series([known[1], known[2]])
    end = max(expected)
    got = {
        r["window"]: r["full_history"]
        for r in rows(traffic.indicator_windows(per_second, end).where("indicator = 'connected_clients'"))
    }
    assert got["1d"] and not got["5d"] and not got["15mo"]


def test_class_data_sharing_archive_is_written_once_then_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The JVM's class archive: off on request, written to a temporary name, promoted only once complete."""
    from migratory_spark import session

    monkeypatch.setenv(session.CDS_ENV, "0")
    assert session.cds_options() == ("", None)
    monkeypatch.setenv(session.CDS_ENV, str(tmp_path))
    options, pending = session.cds_options()
    assert pending is not None and f"-XX:ArchiveClassesAtExit={pending}" in options
    assert session.cds_options()[1] is not None  # nothing written yet: this process may write it
    dead = pending.replace(f".{os.getpid()}-", ".999999999-")
    # a half-written archive (no header yet) of a JVM that is gone: removed once old, never used
    Path(dead).write_bytes(b"\0" * 64)
    old = datetime(2020, 1, 1).timestamp()
    os.utime(dead, (old, old))
    options, _ = session.cds_options()
    assert "SharedArchiveFile" not in options and not Path(dead).exists()
    # a complete one (the header, written last, carries the magic): renamed into place and used
    Path(dead).write_bytes(session._CDS_MAGIC.to_bytes(4, sys.byteorder) + b"\0" * 60)
    options, pending = session.cds_options()
    assert pending is None and "-XX:SharedArchiveFile=" in options
    archive = options.split("SharedArchiveFile=")[1].split()[0]
    assert Path(archive).exists() and not Path(dead).exists()
    assert "-Xlog:cds=off" in options

    def refused(*_: object) -> None:
        raise PermissionError("not the owner")

    with monkeypatch.context() as patched:  # a shared, read-only archive: used although it cannot be touched
        patched.setattr(session.os, "utime", refused)
        assert session.cds_options() == (options, None)
    # another installation's archive (another venv sharing the cache): kept while in use, removed once stale
    other, stale = tmp_path / "spark-0123456789abcdef.jsa", tmp_path / "spark-fedcba9876543210.jsa"
    other.write_bytes(b"x")
    stale.write_bytes(b"x")
    os.utime(stale, (old, old))
    Path(archive).unlink()
    session.cds_options()
    assert other.exists() and not stale.exists()
