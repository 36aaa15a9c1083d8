"""Monitoring statistics: the seven indicators and their windows, without I/O.

The Architecture Guide's monitoring lists seven indicators (connected clients,
connections/s, disconnections/s, messages in/s, messages out/s, bytes in/s,
bytes out/s) and, for each, the maximum, average and standard deviation over the
last 1/5/15 minutes, hours, days and months. Samples are taken once per second;
to cover 15 months without keeping 39 million samples, each resolution (second,
minute, hour, day) keeps a ring of aggregates (count, sum, sum of squares, max) of
the per-second values, so every window's statistics are exact.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

__all__ = ["INDICATORS", "WINDOWS", "Aggregate", "IndicatorWindows", "NodeStats"]

INDICATORS = (
    "connected_clients",
    "connections_per_second",
    "disconnections_per_second",
    "messages_in_per_second",
    "messages_out_per_second",
    "bytes_in_per_second",
    "bytes_out_per_second",
)

MINUTE = 60
HOUR = 3600
DAY = 86400
MONTH = 30 * DAY

# window name -> seconds
WINDOWS: dict[str, int] = {
    "1m": MINUTE,
    "5m": 5 * MINUTE,
    "15m": 15 * MINUTE,
    "1h": HOUR,
    "5h": 5 * HOUR,
    "15h": 15 * HOUR,
    "1d": DAY,
    "5d": 5 * DAY,
    "15d": 15 * DAY,
    "1mo": MONTH,
    "5mo": 5 * MONTH,
    "15mo": 15 * MONTH,
}

# resolution (seconds per bucket) -> buckets kept; each window uses the finest ring that spans it
_RINGS = ((1, 15 * MINUTE), (MINUTE, 15 * HOUR // MINUTE), (HOUR, 15 * DAY // HOUR), (DAY, 15 * MONTH // DAY))


@dataclass(slots=True)
class Aggregate:
    """Count, sum, sum of squares and max of per-second values."""

    n: int = 0
    total: float = 0.0
    squares: float = 0.0
    peak: float = 0.0

    def add(self, value: float) -> None:
        self.n += 1
        self.total += value
        self.squares += value * value
        self.peak = value if self.n == 1 else max(self.peak, value)

    def merge(self, other: Aggregate) -> None:
        if not other.n:
            return
        self.peak = other.peak if not self.n else max(self.peak, other.peak)
        self.n += other.n
        self.total += other.total
        self.squares += other.squares

    def summary(self) -> dict[str, float]:
        if not self.n:
            return {"max": 0.0, "avg": 0.0, "stddev": 0.0, "samples": 0}
        mean = self.total / self.n
        variance = max(0.0, self.squares / self.n - mean * mean)
        return {"max": self.peak, "avg": mean, "stddev": math.sqrt(variance), "samples": self.n}


@dataclass(slots=True)
class _Ring:
    width: int
    size: int
    buckets: deque[tuple[int, Aggregate]] = field(default_factory=deque)

    def add(self, second: int, value: float) -> None:
        start = second - second % self.width
        if not self.buckets or self.buckets[-1][0] != start:
            self.buckets.append((start, Aggregate()))
            while len(self.buckets) > self.size:
                self.buckets.popleft()
        self.buckets[-1][1].add(value)

    def window(self, now: int, seconds: int) -> Aggregate:
        out = Aggregate()
        for start, agg in reversed(self.buckets):
            if start + self.width <= now - seconds:
                break
            out.merge(agg)
        return out


class IndicatorWindows:
    """Per-second samples of one indicator, summarised over every window."""

    __slots__ = ("_rings", "current")

    def __init__(self) -> None:
        self._rings = [_Ring(width, size) for width, size in _RINGS]
        self.current = 0.0

    def add(self, second: int, value: float) -> None:
        self.current = value
        for ring in self._rings:
            ring.add(second, value)

    def summary(self, now: int) -> dict[str, dict[str, float]]:
        out = {}
        for name, seconds in WINDOWS.items():
            ring = next(r for r in self._rings if r.width * r.size >= seconds)
            out[name] = ring.window(now, seconds).summary()
        return out


class NodeStats:
    """The seven indicators from cumulative counters sampled once per second.

    ``sample`` takes the node-wide cumulative counters (summed over workers by the
    caller) and turns them into per-second rates; a counter that went down (a
    worker restarted from zero) counts from zero again instead of going negative.
    """

    __slots__ = ("_last", "indicators")

    def __init__(self) -> None:
        self.indicators = {name: IndicatorWindows() for name in INDICATORS}
        self._last: dict[str, int] | None = None

    def sample(self, second: int, connected: int, counters: dict[str, int]) -> None:
        last = self._last or counters
        rate = {k: (v - last.get(k, 0)) if v >= last.get(k, 0) else v for k, v in counters.items()}
        self._last = dict(counters)
        values = {
            "connected_clients": connected,
            "connections_per_second": rate.get("connections_total", 0),
            "disconnections_per_second": rate.get("disconnections_total", 0),
            "messages_in_per_second": rate.get("messages_in", 0),
            "messages_out_per_second": rate.get("messages_out", 0),
            "bytes_in_per_second": rate.get("bytes_in", 0),
            "bytes_out_per_second": rate.get("bytes_out", 0),
        }
        for name, value in values.items():
            self.indicators[name].add(second, float(value))

    def report(self, now: int) -> dict[str, object]:
        return {
            name: {"current": windows.current, "windows": windows.summary(now)}
            for name, windows in self.indicators.items()
        }
