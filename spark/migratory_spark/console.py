"""The report on a terminal, as Rich tables (used by the CLI and the spark-submit entry point)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.table import Table

__all__ = ["render"]


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
    table = Table(title=title, title_justify="left", show_lines=False)
    names = list(columns or (rows[0].keys() if rows else ["(none)"]))
    for index, name in enumerate(names):
        table.add_column(name, justify="left" if index == 0 else "right")
    for row in rows:
        table.add_row(*[_fmt(row.get(name)) for name in names])
    return table


def render(summary: dict[str, Any], console: Console | None = None, top: int = 10) -> None:
    """Print every section of the summary."""
    out = console or Console()
    period = summary["period"]
    out.rule("[bold]MigratoryData log report")
    out.print(f"logs: {', '.join(summary['inputs'])}")
    out.print(f"period (UTC): {period['first']} .. {period['last']}")
    lines = summary["lines"]
    out.print(
        f"access lines: {lines['access']:,}  message lines: {lines['message']:,}  "
        f"corrupt lines (skipped): {lines['corrupt']:,}"
    )
    if summary["corrupt"]:
        out.print(_table("Corrupt lines", summary["corrupt"], ["kind", "node", "lines", "example"]))
    out.print(_table("Traffic totals", [summary["traffic"]["totals"]]))
    rows = []
    for indicator, windows in summary["traffic"]["indicators"].items():
        for name in ("1m", "15m", "1h", "1d", "1mo", "15mo"):
            if name in windows:
                rows.append({"indicator": indicator, "window": name, **windows[name]})
    out.print(_table("Indicators over the last windows", rows, ["indicator", "window", "max", "avg", "stddev"]))
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
    latency = summary["latency"]
    out.print(_table("Fan-out latency (µs)", [latency["overall"]]))
    out.print(_table("Slowest subjects (p99, µs)", latency["by_subject"][:top]))
    outputs = summary["outputs"]
    out.print(f"parquet: {outputs['parquet']}")
    for key in ("summary", "html"):
        if key in outputs:
            out.print(f"{key}: {outputs[key]}")
    for name, path in outputs.get("charts", {}).items():
        out.print(f"chart {name}: {path}")
