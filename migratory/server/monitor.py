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

__all__ = ["COUNTERS", "Monitor", "MonitorConnection", "SharedCounters", "cluster_document"]

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
        document: dict[str, Any] = {
            "uptime_s": int(time.time() - self.started),
            "workers": self.engine.workers,
            "epoch": self.engine.epoch,
            "totals": self.shared.totals(),
            "indicators": self.node.report(now),
        }
        if self.engine.cluster:
            document["cluster"] = cluster_document(self.engine)
        return document

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
        if self.engine.cluster:
            lines.extend(self._cluster_metrics())
        return "\n".join(lines) + "\n"

    def _cluster_metrics(self) -> list[str]:
        info = self.engine.cluster_info
        document = cluster_document(self.engine)
        lines = [
            "# HELP migratory_cluster_ready Whether this member is synchronised with the cluster and serving.",
            "# TYPE migratory_cluster_ready gauge",
            f"migratory_cluster_ready {int(bool(info.get('ready')))}",
            "# HELP migratory_cluster_quorum Guaranteed mode: whether the seed members' majority is reachable.",
            "# TYPE migratory_cluster_quorum gauge",
            f"migratory_cluster_quorum {int(bool(info.get('quorum', True)))}",
            "# HELP migratory_cluster_groups_coordinated Subject groups this member coordinates.",
            "# TYPE migratory_cluster_groups_coordinated gauge",
            f"migratory_cluster_groups_coordinated {len(info.get('groups', []))}",
            "# HELP migratory_cluster_link_up Whether the link to each other member is up.",
            "# TYPE migratory_cluster_link_up gauge",
        ]
        rtts = []
        for row in document["members"]:
            if row["index"] == document["member"]:
                continue
            lines.append(f'migratory_cluster_link_up{{member="{row["index"] + 1}"}} {int(row["state"] != "down")}')
            if row["rtt_ms"] is not None and row["rtt_ms"] >= 0:
                rtts.append(
                    f'migratory_cluster_link_rtt_seconds{{member="{row["index"] + 1}"}} {row["rtt_ms"] / 1000:.6f}'
                )
        lines += [
            "# HELP migratory_cluster_link_rtt_seconds Heartbeat round-trip time of each member link.",
            "# TYPE migratory_cluster_link_rtt_seconds gauge",
            *rtts,
        ]
        names = {
            "replicated_in": "Messages received from coordinating members and applied here.",
            "replicated_out": "Messages this member coordinated and sent to other members (one per member).",
            "forwarded": "Publications forwarded to the coordinating member of their subject.",
            "link_up": "Member links that came up.",
            "link_down": "Member links that went down.",
            "resyncs": "Subjects whose history was replaced by a merge (their subscribers were resynced).",
            "syncs_served": "State syncs this member sent to other members.",
            "claims": "Times this member took over subject groups.",
            "publish_failed": "Publications answered FAILED by this member's agent.",
        }
        counters = info.get("counters", {})
        for name, text in names.items():
            lines += [
                f"# HELP migratory_cluster_{name}_total {text}",
                f"# TYPE migratory_cluster_{name}_total counter",
                f"migratory_cluster_{name}_total {int(counters.get(name, 0))}",
            ]
        return lines


def cluster_document(engine: Engine) -> dict[str, Any]:
    """Every member as this one sees it: `/cluster` and `migratory cluster status`."""
    info = engine.cluster_info
    config = engine.config
    me = info.get("member", config.member_index)
    peers = info.get("peers", {})
    rows = []
    for index, address in enumerate(config.cluster_members):
        row: dict[str, Any] = {"index": index, "address": str(address)}
        if index == me:
            stats = info.get("self", {})
            row["state"] = "this member, " + ("ready" if info.get("ready") else "synchronising")
            row["rtt_ms"] = 0.0
        elif str(index) in peers:
            peer = peers[str(index)]
            stats = peer.get("status", {})
            row["state"] = (
                "up, " + ("ready" if peer.get("ready") else "joining") + (", leader" if peer.get("leader") else "")
            )
            row["rtt_ms"] = peer.get("rtt_ms", -1.0)
        else:
            stats = {}
            row["state"] = "down"
            row["rtt_ms"] = None
        for key in ("groups", "subjects", "snapshots", "clients"):
            row[key] = stats.get(key)
        rows.append(row)
    return {
        "member": me,
        "mode": config.cluster_delivery_mode.value,
        "ready": bool(info.get("ready")),
        "quorum": bool(info.get("quorum", True)),
        "table_version": info.get("table_version", 0),
        "counters": info.get("counters", {}),
        "members": rows,
    }


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
            code = 200 if self.monitor.engine.ready else 503
            self._send(json_response(code, self.monitor.engine.health(), keep_alive=False))
        elif path == "/cluster":
            if not self.monitor.engine.cluster:
                self._answer(404, b"this server is not a cluster member (ClusterMembers is not set)\n")
            else:
                self._send(json_response(200, cluster_document(self.monitor.engine), keep_alive=False))
        else:
            self._answer(404, b"try /stats, /metrics, /health or /cluster\n")

    def _answer(self, status: int, body: bytes) -> None:
        self._send(response(status, body, keep_alive=False))

    def _send(self, data: bytes) -> None:
        if self.transport is not None:
            self.transport.write(data)
            self.transport.close()
