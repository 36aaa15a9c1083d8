"""The Prometheus exposition of the node's indicators, without I/O.

The text is produced by the official client library (``prometheus_client``) from
metric families built here, so names, ``# HELP``/``# TYPE`` lines, ``_total`` suffixes
of counters, label escaping and number formatting follow the exposition format
exactly; tests parse the result back with the same library's parser.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import Collector, CollectorRegistry

__all__ = ["CONTENT_TYPE", "exposition", "node_families", "tls_families"]

CONTENT_TYPE = CONTENT_TYPE_LATEST

# counter name in the node's totals -> (metric name without _total, help)
COUNTERS = {
    "connections_total": ("migratory_connections", "WebSocket connections accepted."),
    "disconnections_total": ("migratory_disconnections", "WebSocket connections closed."),
    "messages_in": ("migratory_messages_in", "Messages received from publishers."),
    "messages_out": ("migratory_messages_out", "Messages handed to subscribers (one per subscriber)."),
    "bytes_in": ("migratory_in_bytes", "Message content bytes received from publishers."),
    "bytes_out": ("migratory_out_bytes", "Bytes queued for subscribers."),
    "slow_consumers_disconnected": (
        "migratory_slow_consumers_disconnected",
        "Clients disconnected for exceeding MaxPendingOutput.",
    ),
    "messages_dropped": (
        "migratory_messages_dropped",
        "Messages dropped for slow consumers (SlowConsumerPolicy = Drop).",
    ),
    "messages_recovered": ("migratory_messages_recovered", "Missed messages resent to clients after a failover."),
    "recoveries_shared": (
        "migratory_recoveries_shared",
        "Subscriptions whose snapshot or recovery was built once for several clients in one loop turn.",
    ),
    "resyncs": ("migratory_resyncs", "Subscriptions resynchronised with the snapshot."),
    "timer_errors": ("migratory_housekeeping_errors", "Failures of a housekeeping duty (logged, retried)."),
}
GAUGES = {
    "connections": ("migratory_connected_clients", "WebSocket clients connected now."),
    "subscriptions": ("migratory_subscriptions", "Subscriptions (client, subject) now."),
    "subjects": ("migratory_subjects", "Subjects with a sequence number (published at least once)."),
    "snapshots": ("migratory_snapshots", "Subjects with a snapshot."),
}


class _Families(Collector):
    def __init__(self, families: Iterable[Metric]) -> None:
        self.families = list(families)

    def collect(self) -> Iterator[Metric]:
        yield from self.families


def exposition(families: Iterable[Metric]) -> bytes:
    """The text format (version 0.0.4) of ``families``."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(families))
    return generate_latest(registry)


def node_families(
    totals: Mapping[str, int],
    denied: Mapping[str, int],
    listeners: Mapping[str, int],
    indicators: Mapping[str, float],
    process: Mapping[str, float],
    worker_restarts: int,
    cluster: Mapping[str, Any] | None = None,
    tls: Mapping[str, Any] | None = None,
) -> list[Metric]:
    """Every metric of the node, from its totals and the other figures the monitor gathers."""
    out: list[Metric] = []
    for key, (name, text) in COUNTERS.items():
        counter = CounterMetricFamily(name, text)
        counter.add_metric([], totals.get(key, 0))
        out.append(counter)
    for key, (name, text) in GAUGES.items():
        out.append(GaugeMetricFamily(name, text, value=totals.get(key, 0)))
    denials = CounterMetricFamily(
        "migratory_denials", "Requests refused, by reason code (docs/logs.md).", labels=["reason"]
    )
    for reason, count in sorted(denied.items()):
        denials.add_metric([reason], count)
    out.append(denials)
    per_listener = GaugeMetricFamily(
        "migratory_listener_connections", "WebSocket clients connected now, per listener.", labels=["listener"]
    )
    for listener, count in sorted(listeners.items()):
        per_listener.add_metric([listener], count)
    out.append(per_listener)
    rates = GaugeMetricFamily(
        "migratory_indicator",
        "The seven indicators of the Architecture Guide, last one-second sample (rates per second).",
        labels=["indicator"],
    )
    for indicator, value in indicators.items():
        rates.add_metric([indicator], value)
    out.append(rates)
    restarts = CounterMetricFamily("migratory_worker_restarts", "Worker processes the supervisor restarted.")
    restarts.add_metric([], worker_restarts)
    out.append(restarts)
    cpu = CounterMetricFamily(
        "migratory_process_cpu_seconds", "CPU time (user + system) of all the server's processes."
    )
    cpu.add_metric([], process.get("cpu_seconds", 0.0))
    out.append(cpu)
    out.append(
        GaugeMetricFamily(
            "migratory_process_resident_memory_bytes",
            "Resident memory of all the server's processes (summed RSS).",
            value=process.get("rss_bytes", 0.0),
        )
    )
    out.append(GaugeMetricFamily("migratory_processes", "Processes of the server.", value=process.get("processes", 0)))
    out.append(
        GaugeMetricFamily(
            "migratory_start_time_seconds",
            "Start time of the server, seconds since the epoch.",
            value=process.get("start", 0),
        )
    )
    if cluster is not None:
        out.extend(_cluster_families(cluster))
    out.extend(tls_families(tls or {}))
    return out


TLS_COUNTERS = {
    "lean_connections": (
        "migratory_tls_lean_connections",
        "TLS connections whose records the lean TLS 1.3 record layer took over after the handshake.",
    ),
    "bad_record_mac": (
        "migratory_tls_bad_record_mac",
        "Records from TLS peers whose AEAD tag did not verify (answered with a bad_record_mac alert).",
    ),
    "handshake_failures": (
        "migratory_tls_handshake_failures",
        "TLS handshakes that failed or did not complete within HandshakeTimeout.",
    ),
    "selftest_failures": (
        "migratory_tls_lean_selftest_failures",
        "Worker processes whose start-up self-test of the lean TLS record layer failed (it then stays off).",
    ),
}
TLS_ALERTS_ALWAYS = (
    "close_notify",
    "unexpected_message",
    "bad_record_mac",
    "record_overflow",
    "illegal_parameter",
    "decode_error",
    "user_canceled",
)
"""Alert names exposed even at zero (what the lean record layer sends, and the warning); others once counted."""


def tls_families(tls: Mapping[str, Any]) -> list[Metric]:
    """The TLS counters of the node (``SharedCounters.tls``), all of them even before any TLS connection."""
    out: list[Metric] = []
    for key, (name, text) in TLS_COUNTERS.items():
        counter = CounterMetricFamily(name, text)
        counter.add_metric([], int(tls.get(key, 0)))
        out.append(counter)
    layer = GaugeMetricFamily(
        "migratory_tls_record_layer",
        "What carries each worker's TLS records after the handshake (1 for the layer in use): lean, openssl "
        "(TLSLeanTransport = false), openssl: outside the supported matrix, openssl: a self-test failed, none.",
        labels=["worker", "layer"],
    )
    for worker, name in sorted(tls.get("record_layer", {}).items(), key=lambda item: int(item[0])):
        layer.add_metric([worker, name], 1)
    out.append(layer)
    out.append(
        GaugeMetricFamily(
            "migratory_tls_lean_fallback",
            "Workers whose TLS records OpenSSL carries although the lean record layer was asked for (alert on > 0).",
            value=int(tls.get("lean_fallback_workers", 0)),
        )
    )
    openssl = CounterMetricFamily(
        "migratory_tls_openssl_connections",
        "TLS connections of lean listeners left on OpenSSL's record layer, by reason (docs/security.md).",
        labels=["reason"],
    )
    for reason, count in sorted(tls.get("openssl", {}).items()):
        openssl.add_metric([reason], int(count))
    out.append(openssl)
    for key, name, text in (
        (
            "alerts_sent",
            "migratory_tls_alerts_sent",
            "TLS alerts the lean record layer sent, by alert (RFC 8446 name).",
        ),
        (
            "alerts_received",
            "migratory_tls_alerts_received",
            "TLS alerts the lean record layer received, by alert (RFC 8446 name, or other).",
        ),
    ):
        alerts = CounterMetricFamily(name, text, labels=["alert"])
        counts = tls.get(key, {})
        for alert in sorted(counts):
            if counts[alert] or alert in TLS_ALERTS_ALWAYS:
                alerts.add_metric([alert], int(counts[alert]))
        out.append(alerts)
    return out


def _cluster_families(document: Mapping[str, Any]) -> list[Metric]:
    out: list[Metric] = [
        GaugeMetricFamily(
            "migratory_cluster_ready",
            "Whether this member is synchronised with the cluster and serving.",
            value=int(bool(document.get("ready"))),
        ),
        GaugeMetricFamily(
            "migratory_cluster_quorum",
            "Guaranteed mode: whether the seed members' majority is reachable (always 1 in Standard mode).",
            value=int(bool(document.get("quorum", True))),
        ),
        GaugeMetricFamily(
            "migratory_cluster_healthy",
            "Whether this member's /health answers 200 (ready, and in Guaranteed mode with quorum and admitted).",
            value=int(bool(document.get("healthy", document.get("ready")))),
        ),
        GaugeMetricFamily(
            "migratory_cluster_leader",
            "Guaranteed mode: the member (1-based) this one knows as the seed members' Raft leader, 0 if none.",
            value=int(document.get("leader", -1)) + 1,
        ),
        GaugeMetricFamily(
            "migratory_cluster_raft_term",
            "Guaranteed mode, on a seed member: the Raft term of the seed members' consensus.",
            value=int(document.get("term", 0)),
        ),
    ]
    groups = GaugeMetricFamily(
        "migratory_cluster_groups_coordinated", "Subject groups each member coordinates.", labels=["member"]
    )
    link_up = GaugeMetricFamily(
        "migratory_cluster_link_up", "Whether the link to each other member is up.", labels=["member"]
    )
    rtt = GaugeMetricFamily(
        "migratory_cluster_link_rtt_seconds", "Heartbeat round-trip time of each member link.", labels=["member"]
    )
    for row in document.get("members", []):
        member = str(row["index"] + 1)
        if row.get("groups") is not None:
            groups.add_metric([member], row["groups"])
        if row["index"] == document.get("member"):
            continue
        link_up.add_metric([member], int(row["state"] != "down"))
        if row.get("rtt_ms") is not None and row["rtt_ms"] >= 0:
            rtt.add_metric([member], row["rtt_ms"] / 1000)
    out += [groups, link_up, rtt]
    names = {
        "replicated_in": "Messages received from coordinating members and applied here.",
        "replicated_out": "Messages this member coordinated and sent to other members (one per member).",
        "forwarded": "Publications forwarded to the coordinating member of their subject.",
        "link_up": "Member links that came up.",
        "link_down": "Member links that went down.",
        "resyncs": "Subjects whose history was replaced by a merge (their subscribers were resynced).",
        "syncs_served": "State syncs this member sent to other members.",
        "joins": "Full state syncs this member took from a ready member before serving.",
        "paused": "Times this member had not run for a while and gave its peers a fresh heartbeat timeout.",
        "claims": "Times this member took over subject groups.",
        "stale_dropped": "Frames of an older epoch (a fenced coordinator's) this member dropped.",
        "readmitted": "Times this member was taken back into the Guaranteed-mode table.",
        "conflicts": "Guaranteed mode: copies held under another epoch that made this member start over.",
        "acks_in": "Guaranteed mode: acknowledgements of second copies this member received.",
        "publish_failed": "Publications answered FAILED by this member's agent.",
        "resumed": "Standard mode: times this member resumed after a pause longer than the heartbeat timeout and "
        "rejoined (its peers had given it up).",
        "holes": "Guaranteed mode: live messages that came past a hole in this member's history, filled from the "
        "coordinator's state.",
    }
    counters = document.get("counters", {})
    for key, text in names.items():
        counter = CounterMetricFamily(f"migratory_cluster_{key}", text)
        counter.add_metric([], int(counters.get(key, 0)))
        out.append(counter)
    return out
