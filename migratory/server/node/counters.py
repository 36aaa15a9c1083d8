"""The node's counters in shared memory: one slot per worker, the supervisor's slot, and the
windowed statistics (migratory/stats.py). The supervisor maps them before forking, so every
worker and the member agent read and write the same pages; the monitor listener
(migratory/server/process/monitor.py) reports them.
"""

from __future__ import annotations

import logging
import mmap
import os
import struct
import time
from pathlib import Path
from typing import Any

from migratory.server.transport.tls import stats as tlsstats
from migratory.stats import NodeStats, buffer_size

__all__ = [
    "COUNTERS",
    "DENIAL_REASONS",
    "GAUGES",
    "HISTORY_FILE",
    "NODE_WIDE_GAUGES",
    "SAVE_EVERY",
    "TLS_FIELDS",
    "SharedCounters",
    "tls_values",
]

log = logging.getLogger("migratory.server")

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
    "subscriptions",
    "subjects",
    "snapshots",
    "messages_recovered",
    "recoveries_shared",
    "resyncs",
    "timer_errors",
)
GAUGES = frozenset({"connections", "subscriptions", "subjects", "snapshots"})
NODE_WIDE_GAUGES = frozenset({"subjects", "snapshots"})  # every worker holds all of them: the node's is the largest
DENIAL_REASONS = (
    "invalid_subject",
    "message_too_big",
    "entitlement",
    "address_not_allowed",
    "subscription_limit",
    "malformed",
    "rate_limited",
    "not_connected",
    "slow_consumer",
    "bad_request",
    "not_ready",
    "reserved_subject",
)
TLS_COUNTERS = ("lean_connections", "bad_record_mac", "handshake_failures", "selftest_failures")
TLS_FIELDS = (
    *TLS_COUNTERS,
    "record_layer",  # a state, not a count: the index of tlsstats.RECORD_LAYERS this worker uses
    *(f"openssl:{reason}" for reason in tlsstats.FALLBACK_REASONS),
    *(f"alerts_sent:{alert}" for alert in tlsstats.ALERT_LABELS),
    *(f"alerts_received:{alert}" for alert in tlsstats.ALERT_LABELS),
)
"""The TLS counters of a worker's slot (after its listeners): the module-level tallies of tls/stats.py."""
HISTORY_FILE = "stats-history.bin"
SAVE_EVERY = 60.0
_SUPERVISOR = struct.Struct("<qqq")  # worker restarts, supervisor pid, start time


class SharedCounters:
    """Counter slots per worker, the supervisor's slot and the node's statistics, in anonymous shared memory.

    The supervisor creates it before forking, so every worker (a restarted one too)
    maps the same pages; nothing is left on disk but the saved statistics history.
    """

    def __init__(self, workers: int, listeners: tuple[str, ...] = (), state_folder: str | None = None) -> None:
        self.workers = workers
        self.listeners = listeners
        self._slot = struct.Struct(f"<{len(COUNTERS) + len(DENIAL_REASONS) + len(listeners) + len(TLS_FIELDS)}q")
        self._stats_at = _SUPERVISOR.size + self._slot.size * workers
        size = self._stats_at + buffer_size()
        self._map: mmap.mmap | bytearray = mmap.mmap(-1, size) if workers > 1 else bytearray(size)
        self.stats = NodeStats(memoryview(self._map)[self._stats_at :])
        self.history = Path(state_folder) / HISTORY_FILE if state_folder else None
        if self.history is not None:
            try:
                if not self.stats.load(self.history.read_bytes()):
                    log.warning("%s: not a statistics history of this version; starting a new one", self.history)
            except FileNotFoundError:
                pass
            except OSError as exc:
                log.warning("cannot read the statistics history %s: %s", self.history, exc)
        _SUPERVISOR.pack_into(self._map, 0, 0, os.getpid(), int(time.time()))

    # --- slots ------------------------------------------------------------------------------

    def read(self, worker: int) -> list[int]:
        return list(self._slot.unpack_from(self._map, _SUPERVISOR.size + worker * self._slot.size))

    def write(self, worker: int, values: list[int]) -> None:
        self._slot.pack_into(self._map, _SUPERVISOR.size + worker * self._slot.size, *values)

    def count_restart(self) -> None:
        restarts, pid, started = _SUPERVISOR.unpack_from(self._map, 0)
        _SUPERVISOR.pack_into(self._map, 0, restarts + 1, pid, started)

    def supervisor(self) -> tuple[int, int, int]:
        restarts, pid, started = _SUPERVISOR.unpack_from(self._map, 0)
        return int(restarts), int(pid), int(started)

    def node(self) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
        """Node-wide (totals, denials by reason, connections per listener)."""
        columns = [self.read(w) for w in range(self.workers)]
        sums = [sum(values) for values in zip(*columns, strict=True)] if columns else []
        peaks = [max(values) for values in zip(*columns, strict=True)] if columns else []
        totals = {name: (peaks[i] if name in NODE_WIDE_GAUGES else sums[i]) for i, name in enumerate(COUNTERS)}
        offset = len(COUNTERS)
        denied = {r: sums[offset + i] for i, r in enumerate(DENIAL_REASONS)}
        offset += len(DENIAL_REASONS)
        listeners = {name: sums[offset + i] for i, name in enumerate(self.listeners)}
        return totals, denied, listeners

    def totals(self) -> dict[str, int]:
        return self.node()[0]

    def tls(self) -> dict[str, Any]:
        """Node-wide TLS counters: ``lean_connections``, ``bad_record_mac``, ``handshake_failures``,
        and ``openssl`` (by reason), ``alerts_sent`` and ``alerts_received`` (by alert name)."""
        offset = len(COUNTERS) + len(DENIAL_REASONS) + len(self.listeners)
        sums = [0] * len(TLS_FIELDS)
        for w in range(self.workers):
            for i, value in enumerate(self.read(w)[offset:]):
                sums[i] += value
        out: dict[str, Any] = {"openssl": {}, "alerts_sent": {}, "alerts_received": {}}
        for field, value in zip(TLS_FIELDS, sums, strict=True):
            family, _, key = field.partition(":")
            if key:
                out[family][key] = value
            elif field != "record_layer":
                out[family] = value
        at = offset + TLS_FIELDS.index("record_layer")
        layers = [self.read(w)[at] for w in range(self.workers)]
        names = tlsstats.RECORD_LAYERS
        out["record_layer"] = {str(w): names[v] if 0 <= v < len(names) else "none" for w, v in enumerate(layers)}
        # workers whose TLS records OpenSSL carries although the lean layer was asked for: alert on it
        out["lean_fallback_workers"] = sum(1 for v in layers if v >= 3)
        return out

    def save(self) -> None:
        """Write the statistics history to StateFolder (atomically)."""
        if self.history is None:
            return
        tmp = self.history.with_suffix(".tmp")
        tmp.write_bytes(self.stats.dump())
        os.replace(tmp, self.history)


def tls_values() -> list[int]:
    """This process's TLS counters (migratory/server/transport/tls/stats.py), in the order of :data:`TLS_FIELDS`."""
    tables = {
        "openssl": tlsstats.fallbacks,
        "alerts_sent": tlsstats.alerts_sent,
        "alerts_received": tlsstats.alerts_received,
    }
    values = []
    for field in TLS_FIELDS:
        family, _, key = field.partition(":")
        if field == "record_layer":
            values.append(tlsstats.record_layer[0])
        else:
            values.append(tables[family].get(key, 0) if key else tlsstats.counters.get(family, 0))
    return values
