"""The monitoring service (``MonitorHTTP.Listen`` / ``ListenEncrypted``): one node, one history.

Every process of the node adds its cumulative counters, once per second, into its
slot of a small shared memory area; the supervisor counts worker restarts in a slot of
its own; and the windowed statistics (migratory/stats.py) live in the same shared
memory. Worker 0, the *keeper*, samples the node-wide totals into the windows once a
second, saves them under ``StateFolder`` (so months of history survive a restart of
the server), writes stats.log every ``Stats.LogInterval`` seconds and publishes the
statistics on ``/migratory/stats/...`` every ``MonitorPushInterval`` seconds. Whichever
worker answers a request reports the whole node, and a restarted worker (the keeper
too) finds everything where it was: a restarted worker's slot starts from what its
predecessor had counted.

Endpoints: ``/stats`` (JSON), ``/metrics`` (Prometheus text, migratory/metrics.py),
``/health``, ``/cluster`` (a cluster member), ``/dashboard`` (a live page). Optional
HTTP Basic authentication, compared in constant time.
"""

from __future__ import annotations

import asyncio
import base64
import hmac
import json
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from migratory import __version__, metrics, web
from migratory.http import HttpError, json_response, parse_request_head, response
from migratory.logs import JsonLineWriter
from migratory.server.node.counters import (
    COUNTERS,
    DENIAL_REASONS,
    GAUGES,
    SAVE_EVERY,
    TLS_FIELDS,
    SharedCounters,
    tls_values,
)
from migratory.stats import INDICATORS

if TYPE_CHECKING:
    from migratory.config import Config
    from migratory.server.engine.core import Engine

__all__ = [
    "COUNTERS",
    "DENIAL_REASONS",
    "META_PREFIX",
    "TLS_FIELDS",
    "Monitor",
    "MonitorConnection",
    "SharedCounters",
    "cluster_document",
]

log = logging.getLogger("migratory.server")

META_PREFIX = "/migratory/stats/"
SYS_PREFIX = "/$SYS/broker/"
"""The subjects of MQTT's ``$SYS/broker/...`` topics (docs/mqtt.md): no client publishes under ``/$``."""


def _process_tree(root: int) -> list[int]:
    out = [root]
    try:
        children = Path(f"/proc/{root}/task/{root}/children").read_text().split()
    except OSError:
        return out
    for child in children:
        out.extend(_process_tree(int(child)))
    return out


def process_figures(root: int) -> dict[str, float]:
    """CPU seconds and resident memory of the server's processes, from /proc."""
    ticks = os.sysconf("SC_CLK_TCK")
    page = os.sysconf("SC_PAGE_SIZE")
    cpu = 0.0
    rss = 0.0
    pids = _process_tree(root)
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        cpu += (int(fields[11]) + int(fields[12])) / ticks
        rss += int(fields[21]) * page
    return {"cpu_seconds": round(cpu, 2), "rss_bytes": rss, "processes": len(pids)}


class Monitor:
    """This worker's part of monitoring; worker 0 also keeps the node's history."""

    def __init__(self, engine: Engine, shared: SharedCounters) -> None:
        self.engine = engine
        self.shared = shared
        self.node = shared.stats
        self.keeper = engine.worker == 0
        self.started = time.time()
        self.base = shared.read(engine.worker)  # what this worker's predecessors counted: totals never go down
        for i, name in enumerate(COUNTERS):
            if name in GAUGES:
                self.base[i] = 0
        offset = len(COUNTERS) + len(DENIAL_REASONS)
        for i in range(len(shared.listeners)):
            self.base[offset + i] = 0
        self.base[offset + len(shared.listeners) + TLS_FIELDS.index("record_layer")] = 0  # a state: this process's
        config = engine.config
        self.stats_log: JsonLineWriter | None = None
        if self.keeper and config.stats_log_interval:
            self.stats_log = JsonLineWriter(
                config.log_folder, "stats.log", config.log_max_file_size, config.log_max_files
            )
        self._last_save = self._last_log = self._last_push = time.monotonic()
        self._last_sys = self._last_push
        self.tick()

    def own_values(self) -> list[int]:
        stats = self.engine.stats.as_dict()
        values = [stats.get(name, 0) for name in COUNTERS]
        values += [self.engine.denied_reasons.get(reason, 0) for reason in DENIAL_REASONS]
        values += [self.engine.listener_connections.get(name, 0) for name in self.shared.listeners]
        values += tls_values()
        return [v + b for v, b in zip(values, self.base, strict=True)]

    def tick(self) -> None:
        self.engine.count_replica()
        self.shared.write(self.engine.worker, self.own_values())
        if not self.keeper:
            return
        totals = self.shared.totals()
        self.node.sample(int(time.time()), totals["connections"], totals)
        now = time.monotonic()
        config = self.engine.config
        if now - self._last_save >= SAVE_EVERY:
            self._last_save = now
            self.save()
        if self.stats_log is not None and now - self._last_log >= config.stats_log_interval:
            self._last_log = now
            self.write_stats_log()
        if config.monitor_push_interval and now - self._last_push >= config.monitor_push_interval:
            self._last_push = now
            self.push()
        if config.sys_interval and now - self._last_sys >= config.sys_interval:
            self._last_sys = now
            self.push_sys()

    def save(self) -> None:
        try:
            self.shared.save()
        except OSError as exc:
            log.error("cannot save the statistics history: %s", exc)

    def close(self) -> None:
        if self.keeper:
            self.save()
            if self.stats_log is not None:
                self.stats_log.close()

    def meta_subject(self) -> str:
        config = self.engine.config
        return f"{META_PREFIX}member-{config.member_index + 1}" if config.clustered else f"{META_PREFIX}node"

    def snapshot(self) -> dict[str, Any]:
        """What stats.log and the meta-subject carry: every indicator now and over the short windows."""
        now = int(time.time())
        report = self.node.report(now)
        totals, denied, _ = self.shared.node()
        document: dict[str, Any] = {
            "node": self.meta_subject().rsplit("/", 1)[1],
            "epoch": self.engine.epoch,
            "uptime_s": int(time.time() - self.shared.supervisor()[2]),
            "history_s": self.node.history_seconds,
        }
        for name in INDICATORS:
            indicator = report[name]
            assert isinstance(indicator, dict)
            windows = indicator["windows"]
            document[name] = {
                "current": indicator["current"],
                **{f"{w}_{k}": round(windows[w][k], 3) for w in ("1m", "5m", "15m") for k in ("max", "avg")},
            }
        document["totals"] = {k: v for k, v in totals.items()}
        document["denied"] = {k: v for k, v in denied.items() if v}
        return document

    def write_stats_log(self) -> None:
        assert self.stats_log is not None
        self.stats_log.write({"event": "stats", **self.snapshot()})
        try:
            self.stats_log.flush()
        except OSError as exc:
            log.error("cannot write stats.log: %s", exc)

    def push(self) -> None:
        """PUSH monitoring: the statistics as a message any entitled client may subscribe to."""
        body = json.dumps(self.snapshot(), separators=(",", ":")).encode()
        self.engine.publish_internal(self.meta_subject(), body, {"kind": "stats"})

    def sys_prefix(self) -> str:
        config = self.engine.config
        return f"{SYS_PREFIX}member-{config.member_index + 1}/" if config.clustered else SYS_PREFIX

    def sys_values(self) -> dict[str, str]:
        """``$SYS/broker/...`` as Mosquitto names them, from the node's indicators (every client of the node,
        native and MQTT; the load figures are per minute, averaged over each window, as Mosquitto's)."""
        totals, _, _ = self.shared.node()
        report = self.node.report(int(time.time()))
        values = {
            "version": f"migratory {__version__}",
            "uptime": f"{int(time.time() - self.shared.supervisor()[2])} seconds",
            "clients/connected": totals["connections"],
            "clients/total": totals["connections"],
            "clients/maximum": int(cast(dict[str, Any], report["connected_clients"])["windows"]["15m"]["max"]),
            "messages/received": totals["messages_in"],
            "messages/sent": totals["messages_out"],
            "bytes/received": totals["bytes_in"],
            "bytes/sent": totals["bytes_out"],
            "subscriptions/count": totals["subscriptions"],
            "retained messages/count": totals["snapshots"],
            "publish/messages/dropped": totals["messages_dropped"],
        }
        for name, indicator in (
            ("messages/received", "messages_in_per_second"),
            ("messages/sent", "messages_out_per_second"),
            ("bytes/received", "bytes_in_per_second"),
            ("bytes/sent", "bytes_out_per_second"),
            ("connections", "connections_per_second"),
        ):
            windows = cast(dict[str, Any], report[indicator])["windows"]
            for window, label in (("1m", "1min"), ("5m", "5min"), ("15m", "15min")):
                values[f"load/{name}/{label}"] = f"{windows[window]['avg'] * 60:.2f}"
        return {f"{self.sys_prefix()}{name}": str(value) for name, value in values.items()}

    def push_sys(self) -> None:
        """The ``$SYS`` topics: one retained message each (a subject's snapshot), no entitlement to write them."""
        for subject, value in self.sys_values().items():
            self.engine.publish_internal(subject, value.encode(), {})

    def stats(self) -> dict[str, Any]:
        now = int(time.time())
        totals, denied, listeners = self.shared.node()
        restarts, _, started = self.shared.supervisor()
        document: dict[str, Any] = {
            "uptime_s": int(time.time() - started),
            "history_s": self.node.history_seconds,
            "workers": self.engine.workers,
            "worker_restarts": restarts,
            "epoch": self.engine.epoch,
            "totals": totals,
            "denied": denied,
            "listeners": listeners,
            "tls": self.shared.tls(),
            "indicators": self.node.report(now),
        }
        if self.engine.cluster:
            document["cluster"] = cluster_document(self.engine)
        return document

    def history(self, seconds: int = 3600) -> dict[str, Any]:
        """``/stats/history``: the last hour of every indicator, ``[unix second, average]`` points, oldest first."""
        now = int(time.time())
        return {"now": now, "seconds": seconds, "indicators": self.node.series(now, seconds)}

    def metrics(self) -> bytes:
        totals, denied, listeners = self.shared.node()
        restarts, root, started = self.shared.supervisor()
        process = process_figures(root if root and Path(f"/proc/{root}").exists() else os.getpid())
        process["start"] = started
        families = metrics.node_families(
            totals,
            denied,
            listeners,
            self.node.current(),
            process,
            restarts,
            cluster_document(self.engine) if self.engine.cluster else None,
            self.shared.tls(),
        )
        return metrics.exposition(families)


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
        for key in ("groups", "subjects", "snapshots", "clients", "indicators"):
            row[key] = stats.get(key)
        rows.append(row)
    return {
        "member": me,
        "mode": config.cluster_delivery_mode.value,
        "ready": bool(info.get("ready")),
        "quorum": bool(info.get("quorum", True)),
        "healthy": bool(info.get("healthy", info.get("ready"))),
        "reason": str(info.get("reason", "")),
        "leader": info.get("leader_index", -1),
        "term": info.get("term", 0),
        "table_version": info.get("table_version", 0),
        "counters": info.get("counters", {}),
        "members": rows,
    }


def dashboard(config: Config) -> bytes:
    """The live page, told where the client listeners are and which meta-subjects to follow."""
    listeners = [
        {"host": "" if e.host in ("*", "0.0.0.0", "::") else e.host, "port": e.port, "tls": tls}
        for endpoints, tls in ((config.listen, False), (config.listen_encrypted, True))
        for e in endpoints
    ]
    if config.clustered:
        subjects = [f"{META_PREFIX}member-{i + 1}" for i in range(len(config.cluster_members))]
    else:
        subjects = [f"{META_PREFIX}node"]
    html = web.asset("dashboard.html").decode()
    html = html.replace("/*LISTENERS*/[]", json.dumps(listeners)).replace("/*SUBJECTS*/[]", json.dumps(subjects))
    return response(200, html.encode(), "text/html; charset=utf-8", keep_alive=False, cache="no-cache")


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
        elif path == "/stats/history":
            self._send(json_response(200, self.monitor.history(), keep_alive=False))
        elif path == "/metrics":
            self._send(response(200, self.monitor.metrics(), metrics.CONTENT_TYPE, keep_alive=False))
        elif path == "/health":
            code = 200 if self.monitor.engine.healthy else 503
            self._send(json_response(code, self.monitor.engine.health(), keep_alive=False))
        elif path == "/dashboard":
            self._send(dashboard(self.monitor.engine.config))
        elif path == "/migratory.js":
            self._send(web.page("/migratory.js", keep_alive=False, table=web.DASHBOARD)[1])
        elif path == "/cluster":
            if not self.monitor.engine.cluster:
                self._answer(404, b"this server is not a cluster member (ClusterMembers is not set)\n")
            else:
                self._send(json_response(200, cluster_document(self.monitor.engine), keep_alive=False))
        else:
            self._answer(404, b"try /dashboard, /stats, /stats/history, /metrics, /health or /cluster\n")

    def _answer(self, status: int, body: bytes) -> None:
        self._send(response(status, body, keep_alive=False))

    def _send(self, data: bytes) -> None:
        if self.transport is not None:
            self.transport.write(data)
            self.transport.close()
