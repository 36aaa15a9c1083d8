"""Monitoring statistics: the seven indicators and their windows, without I/O.

The Architecture Guide's monitoring lists seven indicators (connected clients,
connections/s, disconnections/s, messages in/s, messages out/s, bytes in/s,
bytes out/s) and, for each, the maximum, average and standard deviation over the
last 1/5/15 minutes, hours, days and months. Samples are taken once per second;
to cover 15 months without keeping 39 million samples, each resolution (second,
minute, hour, day) keeps a ring of aggregates (count, sum, sum of squares, max) of
the per-second values, so every window's statistics are exact.

The rings live in one flat buffer (:class:`NodeStats` over any writable buffer): the
server puts it in memory shared by all its processes, so one process samples, any
process answers, a restarted worker changes nothing, and the bytes can be saved to
``StateFolder`` and loaded back so the history survives a restart of the server. A
sequence counter around every update lets readers retry instead of seeing half of one.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["INDICATORS", "WINDOWS", "Aggregate", "NodeStats", "buffer_size"]

INDICATORS = (
    "connected_clients",
    "connections_per_second",
    "disconnections_per_second",
    "messages_in_per_second",
    "messages_out_per_second",
    "bytes_in_per_second",
    "bytes_out_per_second",
)

# the cumulative counters the rates come from (every process adds its own)
RATE_COUNTERS = ("connections_total", "disconnections_total", "messages_in", "messages_out", "bytes_in", "bytes_out")

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

MAGIC = 0x6D675354  # "mgST"
LAYOUT = 2
_HEADER = struct.Struct(f"<IIqqq{len(RATE_COUNTERS)}q{len(INDICATORS)}d")  # magic, layout, generation, last, started
_RING_HEAD = struct.Struct("<qq")  # index of the newest bucket, buckets in use
_BUCKET = struct.Struct("<qqddd")  # start second, n, total, squares, peak


def buffer_size() -> int:
    """Bytes of the buffer a :class:`NodeStats` needs."""
    per_indicator = sum(_RING_HEAD.size + size * _BUCKET.size for _, size in _RINGS)
    return _HEADER.size + len(INDICATORS) * per_indicator


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


class NodeStats:
    """The seven indicators of a node, in a flat buffer (shared memory, a saved file, a bytearray)."""

    __slots__ = ("_buf", "_offsets")

    def __init__(self, buffer: bytearray | memoryview | None = None) -> None:
        self._buf = memoryview(buffer if buffer is not None else bytearray(buffer_size()))
        if len(self._buf) < buffer_size():
            raise ValueError("statistics buffer too small")
        self._offsets: list[list[int]] = []
        offset = _HEADER.size
        for _ in INDICATORS:
            rings = []
            for _, size in _RINGS:
                rings.append(offset)
                offset += _RING_HEAD.size + size * _BUCKET.size
            self._offsets.append(rings)
        magic, layout, *_ = _HEADER.unpack_from(self._buf, 0)
        if magic != MAGIC or layout != LAYOUT:
            self.reset()

    def reset(self) -> None:
        self._buf[: buffer_size()] = bytes(buffer_size())
        _HEADER.pack_into(self._buf, 0, MAGIC, LAYOUT, 0, 0, 0, *([0] * len(RATE_COUNTERS)), *([0.0] * len(INDICATORS)))

    def load(self, data: bytes) -> bool:
        """Adopt saved bytes when their layout matches (otherwise keep the current history)."""
        if len(data) != buffer_size():
            return False
        magic, layout, *_ = _HEADER.unpack_from(data, 0)
        if magic != MAGIC or layout != LAYOUT:
            return False
        self._buf[: buffer_size()] = data
        return True

    def dump(self) -> bytes:
        return bytes(self._buf[: buffer_size()])

    # --- writing (one process, once a second) ----------------------------------------------

    def sample(self, second: int, connected: int, counters: Mapping[str, int]) -> None:
        """Turn node-wide cumulative counters into per-second rates and add one sample of each indicator.

        The first sample after a start (or a counter that went down) is a baseline, not a rate.
        """
        header = list(_HEADER.unpack_from(self._buf, 0))
        generation, last_second, started = header[2], header[3], header[4]
        last = header[5 : 5 + len(RATE_COUNTERS)]
        now = [int(counters.get(name, 0)) for name in RATE_COUNTERS]
        fresh = started == 0 or any(n < p for n, p in zip(now, last, strict=True)) or second <= last_second
        rates = [0 if fresh else n - p for n, p in zip(now, last, strict=True)]
        values = [float(connected), *(float(r) for r in rates)]
        self._set_generation(generation + 1)  # odd: an update is under way
        for index, value in enumerate(values):
            if not fresh or index == 0:
                for ring, (width, size) in zip(self._offsets[index], _RINGS, strict=True):
                    self._add(ring, width, size, second, value)
        _HEADER.pack_into(self._buf, 0, MAGIC, LAYOUT, generation + 2, second, started or second, *now, *values)

    def _set_generation(self, value: int) -> None:
        struct.pack_into("<q", self._buf, 8, value)

    def _add(self, ring: int, width: int, size: int, second: int, value: float) -> None:
        head, used = _RING_HEAD.unpack_from(self._buf, ring)
        start = second - second % width
        slot = ring + _RING_HEAD.size + head * _BUCKET.size
        current_start, n, total, squares, peak = _BUCKET.unpack_from(self._buf, slot)
        if not used or current_start != start:
            head = (head + 1) % size if used else 0
            used = min(size, used + 1)
            slot = ring + _RING_HEAD.size + head * _BUCKET.size
            n, total, squares, peak = 0, 0.0, 0.0, 0.0
            _RING_HEAD.pack_into(self._buf, ring, head, used)
        peak = value if n == 0 else max(peak, value)
        _BUCKET.pack_into(self._buf, slot, start, n + 1, total + value, squares + value * value, peak)

    # --- reading (any process) -------------------------------------------------------------

    def _window(self, ring: int, width: int, size: int, now: int, seconds: int) -> Aggregate:
        head, used = _RING_HEAD.unpack_from(self._buf, ring)
        out = Aggregate()
        for k in range(used):
            index = (head - k) % size
            start, n, total, squares, peak = _BUCKET.unpack_from(
                self._buf, ring + _RING_HEAD.size + index * _BUCKET.size
            )
            if start + width <= now - seconds:
                break
            out.merge(Aggregate(n, total, squares, peak))
        return out

    def report(self, now: int) -> dict[str, object]:
        """Every indicator's current value and its windows (consistent: retried while being written)."""
        for _ in range(100):
            before = struct.unpack_from("<q", self._buf, 8)[0]
            if before % 2:
                continue
            out = self._report(now)
            if struct.unpack_from("<q", self._buf, 8)[0] == before:
                return out
        return self._report(now)

    def _report(self, now: int) -> dict[str, object]:
        header = _HEADER.unpack_from(self._buf, 0)
        current = header[5 + len(RATE_COUNTERS) :]
        out: dict[str, object] = {}
        for index, name in enumerate(INDICATORS):
            windows = {}
            for window, seconds in WINDOWS.items():
                k = next(i for i, (w, size) in enumerate(_RINGS) if w * size >= seconds)
                width, size = _RINGS[k]
                windows[window] = self._window(self._offsets[index][k], width, size, now, seconds).summary()
            out[name] = {"current": current[index], "windows": windows}
        return out

    def series(self, now: int, seconds: int = HOUR) -> dict[str, list[tuple[int, float]]]:
        """Every indicator's averages over the last ``seconds``, oldest first, for a chart that opens with its
        history drawn: one point a second for the last 15 minutes, one a minute before that."""
        for _ in range(100):
            before = struct.unpack_from("<q", self._buf, 8)[0]
            if before % 2:
                continue
            out = self._series(now, seconds)
            if struct.unpack_from("<q", self._buf, 8)[0] == before:
                return out
        return self._series(now, seconds)

    def _series(self, now: int, seconds: int) -> dict[str, list[tuple[int, float]]]:
        (fine_width, fine_size), (coarse_width, coarse_size) = _RINGS[0], _RINGS[1]
        fine_from = now - fine_width * fine_size
        out: dict[str, list[tuple[int, float]]] = {}
        for index, name in enumerate(INDICATORS):
            points: list[tuple[int, float]] = []
            for k, (width, size) in ((1, (coarse_width, coarse_size)), (0, (fine_width, fine_size))):
                ring = self._offsets[index][k]
                head, used = _RING_HEAD.unpack_from(self._buf, ring)
                for back in range(used - 1, -1, -1):  # oldest first
                    start, n, total, _, _ = _BUCKET.unpack_from(
                        self._buf, ring + _RING_HEAD.size + ((head - back) % size) * _BUCKET.size
                    )
                    if not n or start < now - seconds or start > now:
                        continue
                    if k == 1 and start + width > fine_from:
                        continue  # the per-second ring covers it
                    points.append((start, total / n))
            out[name] = sorted(points)
        return out

    def current(self) -> dict[str, float]:
        header = _HEADER.unpack_from(self._buf, 0)
        return dict(zip(INDICATORS, header[5 + len(RATE_COUNTERS) :], strict=True))

    @property
    def history_seconds(self) -> int:
        """How long this history has been sampled (0 before the first sample)."""
        header = _HEADER.unpack_from(self._buf, 0)
        return int(header[3] - header[4]) if header[4] else 0
