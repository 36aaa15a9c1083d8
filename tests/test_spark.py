"""The PySpark jobs on logs with known answers (a session-scoped local SparkSession)."""

from __future__ import annotations

import math
import statistics
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from migratory_spark import latency, security, sessions, subjects, traffic
from migratory_spark.reader import LogFrames, read_logs
from pyspark.sql import DataFrame, SparkSession

from tests.spark_fixtures import INDICATORS, T0, Logs, known_logs, reference_series

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
