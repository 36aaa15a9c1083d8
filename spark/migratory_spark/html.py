"""One self-contained HTML report: tables and the PNG charts inlined as data URIs.

Every value from the logs (subjects, paths, addresses, corrupt lines) is
HTML-escaped; corrupt-line examples arrive escaped and cut by the reader.
"""

from __future__ import annotations

import base64
import html
from collections.abc import Sequence
from typing import Any

__all__ = ["write_report"]

_STYLE = """
body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1100px;color:#222}
h1{font-size:1.6em}h2{border-bottom:1px solid #ccc;padding-bottom:.2em;margin-top:2em}
table{border-collapse:collapse;margin:.5em 0 1.5em}td,th{border:1px solid #ddd;padding:.25em .6em;text-align:right}
th{background:#f4f4f4}td:first-child,th:first-child{text-align:left}img{max-width:100%}
.muted{color:#777}
"""


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.3f}".rstrip("0").rstrip(".") if value != int(value) else f"{int(value):,}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    if isinstance(value, list):
        return html.escape(", ".join(str(v) for v in value))
    return html.escape("" if value is None else str(value))


def _table(rows: Sequence[dict[str, Any]], columns: Sequence[str] | None = None) -> str:
    if not rows:
        return '<p class="muted">none</p>'
    names = list(columns or rows[0].keys())
    head = "".join(f"<th>{html.escape(n)}</th>" for n in names)
    body = "".join("<tr>" + "".join(f"<td>{_cell(r.get(n))}</td>" for n in names) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _image(charts: dict[str, str], name: str) -> str:
    path = charts.get(name)
    if not path:
        return ""
    with open(path, "rb") as handle:
        data = base64.b64encode(handle.read()).decode("ascii")
    return f'<p><img alt="{html.escape(name)}" src="data:image/png;base64,{data}"></p>'


def _indicators(summary: dict[str, Any]) -> str:
    from migratory_spark.console import indicator_rows

    order = ["1m", "5m", "15m", "1h", "5h", "15h", "1d", "5d", "15d", "1mo", "5mo", "15mo"]
    return _table(indicator_rows(summary, order), ["indicator", "window", "max", "avg", "stddev", "samples"])


def _partial_note(summary: dict[str, Any]) -> str:
    unit = summary["period"]["series_unit"]
    series = summary["traffic"]["series"] + summary["sessions"]["concurrency"] + summary["latency"]["series"]
    if not any(row.get("partial") for row in series):
        return ""
    unit = html.escape(unit)
    return f'<p class="muted">Charts per {unit}; grey bands: a first or last {unit} the logs cover only in part.</p>'


def _stats(summary: dict[str, Any], charts: dict[str, str]) -> str:
    from migratory_spark.console import STATS_NODE_COLUMNS, stats_node_rows

    stats = summary.get("stats")
    if stats is None:
        return ""
    head = "<h3>Server statistics (stats.log)</h3>"
    if stats.get("note"):
        return f'{head}<p class="muted">{html.escape(stats["note"])}</p>'
    unit = html.escape(stats.get("series_unit", "minute"))
    text = (
        f"<p>{_cell(stats['lines'])} lines, per node; charted per {unit} beside the same figures rebuilt from "
        "the access and message logs (black, all nodes).</p>"
    )
    return head + text + _image(charts, "stats") + _table(stats_node_rows(summary), STATS_NODE_COLUMNS)


def _endpoints(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{**r, "method": r.get("method") or "", "path": r.get("path") or "(unparsed)"} for r in rows]


def _tables(summary: dict[str, Any]) -> str:
    rows = [
        {"table": name, "rows": info["rows"], "state": "empty (schema only)" if info["empty"] else ""}
        for name, info in summary.get("tables", {}).items()
    ]
    return _table(rows, ["table", "rows", "state"])


def write_report(summary: dict[str, Any], path: str) -> str:
    """Render ``summary`` (and the charts it lists) into one HTML file."""
    charts: dict[str, str] = summary["outputs"].get("charts", {})
    period = summary["period"]
    subjects, sessions, security, latency = (
        summary["subjects"],
        summary["sessions"],
        summary["security"],
        summary["latency"],
    )
    http_summary: dict[str, Any] = summary.get("http", {})
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>MigratoryData log report</title>",
        f"<style>{_STYLE}</style></head><body>",
        "<h1>MigratoryData log report</h1>",
        f"<p>Logs: {html.escape(', '.join(summary['inputs']))}<br>Period (UTC): {_cell(period['first'])} to "
        f"{_cell(period['last'])}<br>"
        f"Spark {html.escape(summary['spark']['version'])} on {html.escape(summary['spark']['master'])}</p>",
        "<h2>Input</h2>",
        _table([summary["lines"]]),
        (
            f"<p>Not read (not a log or its rotation): {html.escape(', '.join(summary['skipped_files']))}</p>"
            if summary.get("skipped_files")
            else ""
        ),
        "<h3>Corrupt lines (skipped)</h3>",
        _table(summary["corrupt"]),
        "<h2>Traffic</h2>",
        _table([summary["traffic"]["totals"]]),
        _partial_note(summary),
        _image(charts, "traffic"),
        _stats(summary, charts),
        "<h3>Monitoring indicators over the last windows</h3>",
        _indicators(summary),
        "<h2>Subjects</h2>",
        f"<p>{_cell(subjects['count'])} subjects</p>",
        _image(charts, "top_subjects"),
        "<h3>Top by publications</h3>",
        _table(subjects["top_by_publications"]),
        "<h3>Top by deliveries</h3>",
        _table(subjects["top_by_deliveries"]),
        "<h3>Top by bytes out</h3>",
        _table(subjects["top_by_bytes"]),
        "<h3>Fan-out distribution</h3>",
        _image(charts, "fanout"),
        _table(subjects["fanout"]),
        f"<h3>Published but never subscribed ({_cell(subjects['never_subscribed_count'])})</h3>",
        _table(subjects["never_subscribed"]),
        "<h2>Sessions</h2>",
        _image(charts, "concurrency"),
        "<h3>Session durations</h3>",
        _image(charts, "durations"),
        _table(sessions["durations"]),
        _table([sessions["duration_percentiles"]]),
        "<h3>Disconnect reasons</h3>",
        _table(sessions["disconnect_reasons"]),
        f"<h3>Reconnect storms ({_cell(sessions['reconnect_storm_addresses'])} addresses)</h3>",
        _table(sessions["reconnect_storms"]),
        "<h3>Clients per listener</h3>",
        _table(sessions["listeners"]),
        "<h3>TLS and plain</h3>",
        _table(sessions["tls"]),
        "<h2>Security audit</h2>",
        f"<p>{_cell(security['denied'])} denied requests</p>",
        _image(charts, "denied"),
        _table(security["by_reason"]),
        "<h3>By address</h3>",
        _table(security["by_address"]),
        "<h3>By subject</h3>",
        _table(security["by_subject"]),
        "<h2>HTTP requests</h2>",
        f"<p>{_cell(http_summary.get('requests', 0))} requests</p>",
        _image(charts, "http"),
        _table(http_summary.get("by_status", []), ["status", "requests"]),
        "<h3>By endpoint and status</h3>",
        _table(
            _endpoints(http_summary.get("by_endpoint", [])),
            ["method", "path", "status", "requests", "bytes_out", "addresses"],
        ),
        "<h2>Latency</h2>",
        _table([latency["overall"]]),
        _image(charts, "latency"),
        "<h3>Slowest subjects (p99)</h3>",
        _table(latency["by_subject"]),
        "<h2>Tables (Parquet)</h2>",
        f"<p>{html.escape(summary['outputs']['parquet'])}</p>",
        _tables(summary),
        "</body></html>",
    ]
    with open(path, "w", encoding="utf-8") as handle:
        handle.write("\n".join(parts))
    return path
