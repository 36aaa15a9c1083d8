"""Monitoring windows: exact max/avg/stddev over every window, from per-second samples."""

from __future__ import annotations

import statistics

import pytest

from migratory.stats import DAY, HOUR, WINDOWS, IndicatorWindows, NodeStats


def test_windows_are_exact_over_mixed_resolutions() -> None:
    windows = IndicatorWindows()
    values = [float((i * 37) % 101) for i in range(3 * HOUR)]
    for second, value in enumerate(values):
        windows.add(second, value)
    now = len(values)
    summary = windows.summary(now)
    for name, seconds in (("1m", 60), ("5m", 300), ("15m", 900), ("1h", 3600), ("5h", 5 * 3600)):
        expected = values[-seconds:]
        got = summary[name]
        assert got["samples"] == len(expected), name
        assert got["max"] == max(expected)
        assert got["avg"] == pytest.approx(statistics.fmean(expected))
        assert got["stddev"] == pytest.approx(statistics.pstdev(expected), rel=1e-6)


def test_long_windows_use_coarse_rings() -> None:
    windows = IndicatorWindows()
    # one sample every hour for 20 days: the day ring covers the month windows
    for hour in range(20 * 24):
        windows.add(hour * HOUR, 1.0 if hour % 2 else 3.0)
    summary = windows.summary(20 * DAY)
    assert summary["15d"]["samples"] == 15 * 24
    assert summary["15d"]["avg"] == pytest.approx(2.0)
    assert summary["1mo"]["samples"] == 20 * 24
    assert set(summary) == set(WINDOWS)


def test_rates_from_counters_survive_a_worker_restart() -> None:
    stats = NodeStats()
    stats.sample(0, 5, {"messages_in": 100, "connections_total": 5})
    stats.sample(1, 7, {"messages_in": 130, "connections_total": 7})
    stats.sample(2, 7, {"messages_in": 10, "connections_total": 7})  # counters restarted
    report = stats.report(3)
    indicator = report["messages_in_per_second"]
    assert isinstance(indicator, dict)
    assert indicator["current"] == 10
    assert indicator["windows"]["1m"]["max"] == 30
    assert report["connected_clients"]["current"] == 7  # type: ignore[index]
