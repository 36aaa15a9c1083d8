"""Monitoring windows: exact max/avg/stddev over every window, from per-second samples, in a shared buffer."""

from __future__ import annotations

import itertools
import mmap
import statistics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from migratory.stats import DAY, HOUR, WINDOWS, NodeStats, buffer_size


def feed(stats: NodeStats, values: list[float], step: int = 1, start: int = 10 * HOUR) -> int:
    """Sample ``values`` as messages in per second (one sample every ``step`` seconds); return 'now'."""
    total = 0
    stats.sample(start - step, 0, {"messages_in": 0})  # baseline
    for i, value in enumerate(values):
        total += int(value)
        stats.sample(start + i * step, int(value), {"messages_in": total})
    return start + len(values) * step


def test_windows_are_exact_over_mixed_resolutions() -> None:
    stats = NodeStats()
    values = [float((i * 37) % 101) for i in range(3 * HOUR)]
    now = feed(stats, values)
    report = stats.report(now)
    rates = report["messages_in_per_second"]["windows"]  # type: ignore[index]
    clients = report["connected_clients"]["windows"]  # type: ignore[index]
    for name, seconds in (("1m", 60), ("5m", 300), ("15m", 900), ("1h", 3600)):
        expected = values[-seconds:]  # the connected-clients baseline sample (0) is older than every window here
        for got in (rates[name], clients[name]):
            assert got["samples"] == len(expected), name
            assert got["max"] == max(expected)
            assert got["avg"] == pytest.approx(statistics.fmean(expected))
            assert got["stddev"] == pytest.approx(statistics.pstdev(expected), rel=1e-6)


def test_long_windows_use_coarse_rings() -> None:
    stats = NodeStats()
    values = [1.0 if hour % 2 else 3.0 for hour in range(20 * 24)]
    now = feed(stats, values, step=HOUR, start=DAY)
    windows = stats.report(now)["messages_in_per_second"]["windows"]  # type: ignore[index]
    assert windows["15d"]["samples"] == 15 * 24
    assert windows["15d"]["avg"] == pytest.approx(2.0)
    assert windows["1mo"]["samples"] == 20 * 24  # (rates: the baseline is not a sample)
    assert set(windows) == set(WINDOWS)


def test_a_counter_that_goes_down_is_a_new_baseline_not_a_rate() -> None:
    stats = NodeStats()
    stats.sample(10, 5, {"messages_in": 100, "connections_total": 5})
    stats.sample(11, 7, {"messages_in": 130, "connections_total": 7})
    stats.sample(12, 7, {"messages_in": 10, "connections_total": 7})  # the server restarted its counters
    stats.sample(13, 7, {"messages_in": 25, "connections_total": 7})
    report = stats.report(14)
    indicator = report["messages_in_per_second"]
    assert isinstance(indicator, dict)
    assert indicator["current"] == 15
    assert indicator["windows"]["1m"]["max"] == 30
    assert indicator["windows"]["1m"]["samples"] == 2  # the baselines are not samples
    assert report["connected_clients"]["current"] == 7  # type: ignore[index]


def test_the_history_is_shared_saved_and_loaded() -> None:
    shared = mmap.mmap(-1, buffer_size())
    writer = NodeStats(memoryview(shared))
    now = feed(writer, [float(i) for i in range(120)])
    reader = NodeStats(memoryview(shared))  # another process mapping the same pages
    assert reader.report(now) == writer.report(now)
    saved = writer.dump()
    restarted = NodeStats()  # a new server: loads the saved history and goes on from it
    assert restarted.load(saved)
    assert restarted.report(now) == writer.report(now)
    restarted.sample(now, 3, {"messages_in": 0})  # its own counters start from zero: a baseline
    restarted.sample(now + 1, 3, {"messages_in": 50})
    windows = restarted.report(now + 2)["messages_in_per_second"]["windows"]  # type: ignore[index]
    assert windows["5m"]["samples"] == 121 and windows["5m"]["max"] == 119
    assert not NodeStats().load(b"garbage")
    assert restarted.history_seconds == now + 1 - (10 * HOUR - 1)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 1000), min_size=1, max_size=400))
def test_one_minute_window_matches_the_last_sixty_samples(values: list[int]) -> None:
    stats = NodeStats()
    now = feed(stats, [float(v) for v in values])
    got = stats.report(now)["messages_in_per_second"]["windows"]["1m"]  # type: ignore[index]
    expected = values[-60:]
    assert got["samples"] == len(expected)
    assert got["max"] == max(expected)
    assert got["avg"] == pytest.approx(statistics.fmean(expected))


def test_the_last_hour_as_chart_points() -> None:
    """/stats/history: one point a second for the last 15 minutes, one a minute before, oldest first, exact."""
    stats = NodeStats()
    values = [float(i % 50) for i in range(2 * HOUR)]
    now = feed(stats, values)
    series = stats.series(now, HOUR)["messages_in_per_second"]
    times = [t for t, _ in series]
    assert times == sorted(times) and times[0] >= now - HOUR and times[-1] <= now
    fine = [(t, v) for t, v in series if t >= now - 900]
    coarse = [(t, v) for t, v in series if t < now - 900]
    assert len(fine) == 900 and all(t2 - t1 == 1 for (t1, _), (t2, _) in itertools.pairwise(fine))
    assert fine[-1][1] == values[-1]  # the newest second as sampled
    assert 44 <= len(coarse) <= 46 and all(t % 60 == 0 for t, _ in coarse)  # the 45 minutes before, by the minute
    start = 10 * HOUR
    for t, v in coarse:  # each minute's average of what was sampled in it
        minute = [values[s - start] for s in range(t, t + 60) if 0 <= s - start < len(values)]
        assert v == pytest.approx(statistics.fmean(minute))
    short = stats.series(now, 10)
    assert len(short) == 7 and [v for _, v in short["messages_in_per_second"]] == values[-10:]
