"""The HTTP monitoring service (``MonitorHTTP.Listen``): node-wide indicators.

Every worker publishes its cumulative counters once per second into its slot of a
small shared memory area, and reads every slot, so whichever worker answers a
monitoring request reports the whole node. Endpoints: ``/stats`` (the seven
indicators with max/avg/stddev over 1/5/15 minutes ... months, JSON), ``/metrics``
(Prometheus text), ``/health``. Optional HTTP Basic authentication.
"""

from __future__ import annotations

import asyncio
import base64
import hmac
import mmap
import struct
import time
from typing import TYPE_CHECKING, Any, cast

from migratory.http import HttpError, json_response, parse_request_head, response
from migratory.stats import NodeStats

if TYPE_CHECKING:
    from migratory.server.engine import Engine

__all__ = ["COUNTERS", "Monitor", "MonitorConnection", "SharedCounters"]

COUNTERS = (
    "connections",
    "connections_total",
    "disconnections_total",
    "messages_in",
    "messages_out",
    "bytes_in",
    "bytes_out",
    "slow_consumers_disconnected",
    "messages_dropped",
    "denied",
)
_SLOT = struct.Struct(f"!{len(COUNTERS)}q")


class SharedCounters:
    """One slot of counters per worker in anonymous shared memory.

    The supervisor creates it before forking, so every worker (a restarted one
    too) maps the same pages; nothing is left on disk.
    """

    def __init__(self, workers: int) -> None:
        self.workers = workers
        size = _SLOT.size * workers
        self._map: mmap.mmap | bytearray = mmap.mmap(-1, size) if workers > 1 else bytearray(size)

    def write(self, worker: int, values: dict[str, int]) -> None:
        _SLOT.pack_into(self._map, worker * _SLOT.size, *(values.get(name, 0) for name in COUNTERS))

    def totals(self) -> dict[str, int]:
        sums = [0] * len(COUNTERS)
        for worker in range(self.workers):
            for i, value in enumerate(_SLOT.unpack_from(self._map, worker * _SLOT.size)):
                sums[i] += value
        return dict(zip(COUNTERS, sums, strict=True))


class Monitor:
    """Samples the node's counters every second (driven by the engine's tick)."""

    def __init__(self, engine: Engine, shared: SharedCounters) -> None:
        self.engine = engine
        self.shared = shared
        self.node = NodeStats()
        self.started = time.time()
        self.tick()  # the baseline: rates count from now, not from the node's whole history

    def tick(self) -> None:
        self.shared.write(self.engine.worker, self.engine.stats.as_dict())
        totals = self.shared.totals()
        self.node.sample(int(time.time()), totals["connections"], totals)

    def stats(self) -> dict[str, Any]:
        now = int(time.time())
        return {
            "uptime_s": int(time.time() - self.started),
            "workers": self.engine.workers,
            "epoch": self.engine.epoch,
            "totals": self.shared.totals(),
            "indicators": self.node.report(now),
        }

    def metrics(self) -> str:
        lines = []
        totals = self.shared.totals()
        for name in COUNTERS:
            kind = "gauge" if name == "connections" else "counter"
            metric = (
                f"migratory_{name}" if kind == "gauge" else f"migratory_{name}_total".replace("_total_total", "_total")
            )
            lines.append(f"# TYPE {metric} {kind}")
            lines.append(f"{metric} {totals[name]}")
        for name, windows in self.node.indicators.items():
            lines.append(f"# TYPE migratory_{name} gauge")
            lines.append(f"migratory_{name} {windows.current}")
        return "\n".join(lines) + "\n"


class MonitorConnection(asyncio.Protocol):
    """One monitoring request per connection (answered, then closed)."""

    __slots__ = ("buf", "monitor", "transport")

    def __init__(self, monitor: Monitor) -> None:
        self.monitor = monitor
        self.buf = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        asyncio.get_running_loop().call_later(10.0, self._timeout)

    def _timeout(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.abort()

    def data_received(self, data: bytes) -> None:
        self.buf += data
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            if len(self.buf) > 16384:
                self._answer(431, b"request head too large\n")
            return
        try:
            request = parse_request_head(self.buf[:end])
        except HttpError as exc:
            self._answer(exc.status, exc.reason.encode() + b"\n")
            return
        config = self.monitor.engine.config
        if config.monitor_username:
            expected = base64.b64encode(f"{config.monitor_username}:{config.monitor_password}".encode()).decode()
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Basic {expected}".encode()):
                assert self.transport is not None
                self.transport.write(
                    response(
                        401,
                        b"authentication required\n",
                        keep_alive=False,
                        extra={"WWW-Authenticate": 'Basic realm="migratory"'},
                    )
                )
                self.transport.close()
                return
        path = request.path.rstrip("/") or "/"
        if request.method != "GET":
            self._answer(405, b"use GET\n")
        elif path == "/stats":
            self._send(json_response(200, self.monitor.stats(), keep_alive=False))
        elif path == "/metrics":
            self._send(response(200, self.monitor.metrics().encode(), "text/plain; version=0.0.4", keep_alive=False))
        elif path == "/health":
            self._send(json_response(200, self.monitor.engine.health(), keep_alive=False))
        else:
            self._answer(404, b"try /stats, /metrics or /health\n")

    def _answer(self, status: int, body: bytes) -> None:
        self._send(response(status, body, keep_alive=False))

    def _send(self, data: bytes) -> None:
        if self.transport is not None:
            self.transport.write(data)
            self.transport.close()
