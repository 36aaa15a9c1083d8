"""Print the markdown tables of bench/peers.md from the JSON reports in bench/results/."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def _load(name: str) -> list[dict[str, Any]]:
    data = json.loads((RESULTS / name).read_text())
    return data if isinstance(data, list) else [data]


def _table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + " --- |" * len(headers)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def idle() -> str:
    rows = [
        [
            r["target"],
            f"{r['connected']:,}",
            f"{r['server_bytes_per_connection'] / 1024:.2f} KB",
            f"{r['connect_rate']:,.0f}",
        ]
        for r in _load("a-idle-16k.json")
    ]
    return _table(["server", "connections", "memory per idle connection", "connect rate (conn/s)"], rows)


def fanout(name: str) -> str:
    rows = []
    for r in _load(name):
        per = r["server_cpu_us_per_delivery"]
        rows.append(
            [
                r["target"],
                f"{r['delivered']:,} / {r['expected_deliveries']:,}",
                f"{per:.3f} us",
                f"{1e6 / per:,.0f}" if per else "-",
                f"{r['latency_ms']['p50']:g} / {r['latency_ms']['p99']:g} ms",
            ]
        )
    return _table(
        ["server", "delivered / expected", "CPU per delivery", "deliveries per CPU-second", "latency p50 / p99"], rows
    )


def mqtt_idle() -> str:
    """The MQTT comparison's idle table: RSS and PSS per connection (bench/run_mqtt.sh)."""
    rows = []
    for r in _load("mqtt-a-idle-16k.json"):
        rss = (r["server_rss_mb_connected"] - r["server_rss_mb_before"]) * 2**20 / max(r["connected"], 1)
        rows.append(
            [
                r["target"],
                f"{r['connected']:,}",
                f"{rss:,.0f} B",
                f"{r['server_pss_bytes_per_connection']:,.0f} B",
                f"{r['connect_rate']:,.0f}",
            ]
        )
    headers = ["server", "connections", "RSS per idle connection", "PSS per idle connection", "connect rate (conn/s)"]
    return _table(headers, rows)


def single(name: str) -> str:
    (r,) = _load(name)
    keys = [
        "clients",
        "connected",
        "connect_rate",
        "published",
        "expected_deliveries",
        "delivered",
        "deliveries_per_second",
        "server_cpu_us_per_delivery",
        "server_bytes_per_connection",
        "server_rss_mb_before",
        "server_rss_mb_connected",
        "server_rss_mb_after_disconnect",
        "latency_ms",
        "errors",
    ]
    return _table(["measure", "value"], [[k, json.dumps(r[k]) if not isinstance(r[k], str) else r[k]] for k in keys])


def _waits(r: dict[str, Any]) -> str:
    """The deliberate waits of a run: the server's BusBatchingTime and the load generators' read interval."""
    if "settings" not in r:
        return "0 / 0 (before both existed)"
    return f"{r['settings'].get('BusBatchingTime', '0')} ms / {r.get('loader_poll', 0) * 1000:.0f} ms"


def million() -> str:
    """bench/million.md's scaling table: one row per results/million-<N>.json, slopes between rows."""
    runs = sorted((_load(f.name)[0] for f in RESULTS.glob("million-*.json")), key=lambda r: r["clients"])
    rows = []
    previous: dict[str, Any] | None = None
    for r in runs:
        grown = (r["server_pss_mb_connected"] - r["server_pss_mb_before"]) * 2**20
        slope = "-"
        if previous is not None:
            before = (previous["server_pss_mb_connected"] - previous["server_pss_mb_before"]) * 2**20
            slope = f"{(grown - before) / (r['connected'] - previous['connected']):,.0f} B"
        inuse = r.get("sockstat_connected", {}).get("inuse", 0)
        lat = r["latency_ms"]
        rows.append(
            [
                f"{r['clients']:,}",
                f"{r['connected']:,}",
                str(r["server_processes"]),
                f"{r['server_pss_mb_per_process_before']:.1f} MB",
                f"{grown / max(r['connected'], 1):,.0f} B",
                slope,
                f"{r['connect_rate']:,.0f}",
                f"{r['delivered']:,} / {r['expected_deliveries']:,}",
                f"{r['server_cpu_us_per_delivery']:.1f} us",
                f"{r['loader_cpu_us_per_delivery']:.1f} us" if "loader_cpu_us_per_delivery" in r else "-",
                _waits(r),
                f"{lat.get('mean', 0):.1f} / {lat['p50']:.1f} / {lat['p99']:.1f} / {lat['max']:.0f}",
                f"{inuse:,}",
                " / ".join(f"{v:.1f}" for v in r["load_average"]),
            ]
        )
        previous = r
    headers = [
        "clients",
        "connected",
        "server processes",
        "PSS per process before",
        "PSS per connection",
        "slope from the row above",
        "connect rate (conn/s)",
        "delivered",
        "server CPU per delivery",
        "load-generator CPU per delivery",
        "BusBatchingTime / loader poll",
        "latency mean / p50 / p99 / max (ms)",
        "kernel TCP sockets",
        "load at start",
    ]
    return _table(headers, rows)


if __name__ == "__main__":
    if sys.argv[1:] == ["million"]:
        sys.stdout.write(million() + "\n")
        raise SystemExit(0)
    if sys.argv[1:] == ["mqtt"]:
        for title, text in [
            ("(a) idle", mqtt_idle()),
            ("(b) saturation", fanout("mqtt-b-fanout-16k-saturation.json")),
            ("(b) 2 msg/s", fanout("mqtt-b-fanout-16k-2hz.json")),
            ("(c) the seeds' workload", fanout("mqtt-c-seed-16k.json")),
        ]:
            sys.stdout.write(f"### {title}\n\n{text}\n\n")
        raise SystemExit(0)
    for title, text in [
        ("(a) idle", idle()),
        ("(b) saturation", fanout("b-fanout-16k-saturation.json")),
        ("(b) 2 msg/s", fanout("b-fanout-16k-2hz.json")),
        ("(c) market", single("c-market-100k.json")),
        ("(d) storm", single("d-storm-16k.json")),
    ]:
        sys.stdout.write(f"### {title}\n\n{text}\n\n")
