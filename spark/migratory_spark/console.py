"""The report on a terminal, as Rich tables (used by the CLI and the spark-submit entry point).

Subjects, paths, addresses and corrupt lines are user data: every value reaches
Rich as a ``Text`` (never parsed as markup or emoji codes), and the few lines
that mix markup with data escape the data (``rich.markup.escape``), so a subject
such as ``/t/[/red]`` or ``/x/:smile:`` prints as itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

__all__ = ["NOT_ENOUGH_HISTORY", "STATS_NODE_COLUMNS", "indicator_rows", "render", "stats_node_rows"]

NOT_ENOUGH_HISTORY = "not enough history"


def _fmt(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{int(value):,}" if value == int(value) else f"{value:,.2f}"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, list):
        return ", ".join(str(v) for v in value)
    return str(value)


def _table(title: str, rows: Sequence[dict[str, Any]], columns: Sequence[str] | None = None) -> Table:
    table = Table(title=Text(title), title_justify="left", show_lines=False)
    names = list(columns or (rows[0].keys() if rows and rows[0] else ["(none)"]))
    for index, name in enumerate(names):
        table.add_column(Text(name), justify="left" if index == 0 else "right")
    for row in rows:
        table.add_row(*[Text(_fmt(row.get(name))) for name in names])
    return table


def _line(text: str, out: Console) -> None:
    """A line of plain text: no markup, no emoji codes."""
    out.print(Text(text))


def indicator_rows(summary: dict[str, Any], windows: Sequence[str]) -> list[dict[str, Any]]:
    """Per indicator: one row per window the logs cover whole, then one row for all the longer ones
    (``not enough history``: their figures would only repeat the longest covered window's)."""
    rows = []
    for indicator, stats in summary["traffic"]["indicators"].items():
        longer = []
        for name in windows:
            if name not in stats:
                continue
            if stats[name].get("full_history", True):
                rows.append({"indicator": indicator, "window": name, **stats[name]})
            else:
                longer.append(name)
        if longer:
            span = longer[0] if len(longer) == 1 else f"{longer[0]} … {longer[-1]}"
            rows.append({"indicator": indicator, "window": span, "max": NOT_ENOUGH_HISTORY})
    return rows


# the stats.log table per node: its lines and, of every indicator, the largest and average value logged
STATS_NODE_COLUMNS = (
    "node",
    "server",
    "lines",
    "first",
    "last",
    "epochs",
    "connected_clients_max",
    "connections_per_second_max",
    "messages_in_per_second_avg",
    "messages_out_per_second_avg",
    "bytes_in_per_second_avg",
    "bytes_out_per_second_avg",
)


def stats_node_rows(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """The stats.log rows per node (an empty list for a summary without them)."""
    return list((summary.get("stats") or {}).get("nodes") or [])


def _endpoint(row: dict[str, Any]) -> dict[str, Any]:
    return {**row, "method": row.get("method") or "", "path": row.get("path") or "(unparsed)"}


def render(summary: dict[str, Any], console: Console | None = None, top: int = 10) -> None:
    """Print every section of the summary."""
    out = console or Console()
    period = summary["period"]
    out.rule("[bold]MigratoryData log report")
    out.print(f"[bold]logs:[/] {escape(', '.join(summary['inputs']))}", emoji=False)
    if summary.get("skipped_files"):
        _line(f"not read (not a log or its rotation): {', '.join(summary['skipped_files'])}", out)
    _line(f"period (UTC): {_fmt(period['first'])} .. {_fmt(period['last'])}", out)
    lines = summary["lines"]
    out.print(
        f"access lines: {lines['access']:,}  message lines: {lines['message']:,}  "
        f"stats lines: {lines.get('stats', 0):,}  corrupt lines (skipped): {lines['corrupt']:,}"
    )
    if summary["corrupt"]:
        out.print(_table("Corrupt lines", summary["corrupt"], ["kind", "node", "lines", "example"]))
    out.print(_table("Traffic totals", [summary["traffic"]["totals"]]))
    stats = summary.get("stats")
    if stats is not None:
        if stats.get("note"):
            _line(f"stats.log: {stats['note']}", out)
        else:
            out.print(
                _table(
                    f"Server statistics per node (stats.log, {stats['lines']:,} lines)",
                    stats_node_rows(summary),
                    STATS_NODE_COLUMNS,
                )
            )
    out.print(
        _table(
            "Indicators over the last windows",
            indicator_rows(summary, ("1m", "15m", "1h", "1d", "1mo", "15mo")),
            ["indicator", "window", "max", "avg", "stddev"],
        )
    )
    subjects = summary["subjects"]
    columns = ["subject", "publications", "deliveries", "bytes_out", "max_fanout", "subscriptions"]
    out.print(
        _table(
            f"Top subjects by publications (of {subjects['count']:,})", subjects["top_by_publications"][:top], columns
        )
    )
    out.print(_table("Top subjects by deliveries", subjects["top_by_deliveries"][:top], columns))
    out.print(_table("Top subjects by bytes out", subjects["top_by_bytes"][:top], columns))
    out.print(_table("Fan-out distribution", subjects["fanout"]))
    out.print(
        _table(
            f"Published but never subscribed ({subjects['never_subscribed_count']:,})",
            subjects["never_subscribed"][:top],
        )
    )
    sessions = summary["sessions"]
    out.print(_table("Session durations", sessions["durations"]))
    out.print(_table("Session duration percentiles", [sessions["duration_percentiles"]]))
    out.print(_table("Disconnect reasons", sessions["disconnect_reasons"]))
    out.print(
        _table(
            f"Reconnect storms ({sessions['reconnect_storm_addresses']:,} addresses)",
            sessions["reconnect_storms"][:top],
            ["addr", "peak_connects", "peak_window_start", "storm_windows"],
        )
    )
    out.print(_table("Clients per listener", sessions["listeners"]))
    out.print(_table("TLS and plain", sessions["tls"]))
    security = summary["security"]
    out.print(_table(f"Denied requests by reason ({security['denied']:,})", security["by_reason"]))
    out.print(_table("Denied by address", security["by_address"][:top], ["addr", "denied", "reason_codes"]))
    out.print(_table("Denied by subject", security["by_subject"][:top], ["subject", "denied", "reason_codes"]))
    http = summary.get("http")
    if http is not None:
        out.print(
            _table(
                f"HTTP requests by endpoint and status ({http['requests']:,})",
                [_endpoint(row) for row in http["by_endpoint"][:top]],
                ["method", "path", "status", "requests", "bytes_out", "addresses"],
            )
        )
        out.print(_table("HTTP requests by status", http["by_status"], ["status", "requests"]))
    latency = summary["latency"]
    out.print(_table("Fan-out latency (µs)", [latency["overall"]]))
    out.print(_table("Slowest subjects (p99, µs)", latency["by_subject"][:top]))
    empty = [name for name, table in summary.get("tables", {}).items() if table["empty"]]
    if empty:
        _line(f"empty tables (written with their schema): {', '.join(empty)}", out)
    outputs = summary["outputs"]
    _line(f"parquet: {outputs['parquet']}", out)
    for key in ("summary", "html"):
        if key in outputs:
            _line(f"{key}: {outputs[key]}", out)
    for name, path in outputs.get("charts", {}).items():
        _line(f"chart {name}: {path}", out)
