"""PNG charts of the summary (matplotlib, Agg backend: no display needed).

Subjects, reasons and paths are user data: every label drawn goes through
:func:`plain`, which escapes ``$`` so that matplotlib never reads a subject such
as ``/m/$x^$`` as mathtext. Time series mark their partial first and last
periods (a bucket the logs do not cover whole) with a grey band.
"""

from __future__ import annotations

import os
from datetime import datetime
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.dates as mdates
import matplotlib.pyplot as plt
from matplotlib.axes import Axes

__all__ = ["draw_all", "plain"]

_UNIT_DAYS = {"second": 1 / 86400, "minute": 1 / 1440, "hour": 1 / 24, "day": 1.0}


def plain(text: Any) -> str:
    """A label drawn as written: ``$`` escaped (no mathtext)."""
    return str(text).replace("$", r"\$")


def _times(rows: list[dict[str, Any]]) -> Any:
    """Matplotlib date numbers of the rows' UTC ``start`` (the axes format them back as dates)."""
    stamps = [datetime.strptime(row["start"], "%Y-%m-%dT%H:%M:%SZ") for row in rows]
    return mdates.date2num(stamps)  # type: ignore[no-untyped-call]


def _marker(rows: list[dict[str, Any]]) -> str | None:
    """Dots where the series is short enough that a line alone could be invisible."""
    return "o" if len(rows) < 40 else None


def _partial(ax: Axes, rows: list[dict[str, Any]], unit: str) -> None:
    """Grey bands over the buckets the logs cover only in part (first and last)."""
    times = _times(rows)
    labelled = False
    for when, row in zip(times, rows, strict=True):
        if row.get("partial"):
            ax.axvspan(
                when,
                when + _UNIT_DAYS.get(unit, 1 / 1440),
                color="grey",
                alpha=0.15,
                label=None if labelled else f"partial {unit}",
            )
            labelled = True


def _time_axis(ax: Axes) -> None:
    ax.xaxis_date()
    locator = mdates.AutoDateLocator()  # type: ignore[no-untyped-call]
    ax.xaxis.set_major_locator(locator)
    ax.xaxis.set_major_formatter(mdates.ConciseDateFormatter(locator))  # type: ignore[no-untyped-call]
    ax.grid(alpha=0.3)


def _save(fig: Any, path: str) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=100, metadata={"Software": None})
    plt.close(fig)
    return path


def _traffic(summary: dict[str, Any], path: str) -> str | None:
    rows = summary["traffic"]["series"]
    if not rows or not summary["lines"]["message"]:
        return None
    unit = summary["period"]["series_unit"]
    times = _times(rows)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    top.plot(times, [r["messages_in"] for r in rows], label="messages in", marker=_marker(rows), color="tab:blue")
    top.plot(times, [r["messages_out"] for r in rows], label="messages out", marker=_marker(rows), color="tab:orange")
    top.set_yscale("symlog", linthresh=1)  # deliveries outnumber publications by the fan-out; 0 stays drawable
    top.set_ylabel(f"messages per {unit}")
    _partial(top, rows, unit)
    top.legend(loc="upper left")
    top.set_title(f"Traffic per {unit} (UTC)")
    bottom.plot(times, [r["bytes_in"] for r in rows], label="bytes in", marker=_marker(rows), color="tab:green")
    bottom.plot(times, [r["bytes_out"] for r in rows], label="bytes out", marker=_marker(rows), color="tab:red")
    bottom.set_yscale("symlog", linthresh=1)
    bottom.set_ylabel(f"bytes per {unit}")
    _partial(bottom, rows, unit)
    bottom.legend(loc="upper left")
    _time_axis(top)
    _time_axis(bottom)
    return _save(fig, path)


def _concurrency(summary: dict[str, Any], path: str) -> str | None:
    rows = summary["sessions"]["concurrency"]
    if not rows:
        return None
    times = _times(rows)
    fig, ax = plt.subplots(figsize=(10, 3.5))
    ax.fill_between(times, [r["min"] for r in rows], [r["max"] for r in rows], alpha=0.3, label="min-max")
    ax.plot(times, [r["avg"] for r in rows], label="average", marker=_marker(rows))
    ax.set_ylabel("connected clients")
    ax.set_title(f"Concurrent connections per {summary['period']['series_unit']} (UTC)")
    _partial(ax, rows, summary["period"]["series_unit"])
    ax.legend(loc="upper left")
    _time_axis(ax)
    return _save(fig, path)


def _latency(summary: dict[str, Any], path: str) -> str | None:
    rows = [r for r in summary["latency"]["series"] if r["p50_us"] is not None]
    if not rows:
        return None
    times = _times(rows)
    fig, ax = plt.subplots(figsize=(10, 3.5))
    ax.plot(times, [r["p50_us"] for r in rows], label="p50", marker=_marker(rows))
    ax.plot(times, [r["p99_us"] for r in rows], label="p99", marker=_marker(rows))
    ax.plot(times, [r["max_us"] for r in rows], label="max", marker=_marker(rows), alpha=0.5)
    ax.set_yscale("symlog", linthresh=1)
    ax.set_ylabel("fan-out latency (µs)")
    ax.set_title(f"Publish-to-fan-out latency per {summary['period']['series_unit']} (UTC)")
    _partial(ax, rows, summary["period"]["series_unit"])
    ax.legend(loc="upper left")
    _time_axis(ax)
    return _save(fig, path)


# the stats chart's panels: (title, the indicators drawn, the log-derived series drawn beside them)
_STATS_PANELS = (
    ("connected clients", ("connected_clients",), (("concurrency", "avg", "clients (access log)"),)),
    ("connections per second", ("connections_per_second", "disconnections_per_second"), ()),
    (
        "messages per second",
        ("messages_in_per_second", "messages_out_per_second"),
        (("traffic", "messages_in", "in (message log)"), ("traffic", "messages_out", "out (message log)")),
    ),
    (
        "bytes per second",
        ("bytes_in_per_second", "bytes_out_per_second"),
        (("traffic", "bytes_in", "in (message log)"), ("traffic", "bytes_out", "out (message log)")),
    ),
)
_UNIT_SECONDS = {"second": 1, "minute": 60, "hour": 3600, "day": 86400}


def _stats(summary: dict[str, Any], path: str) -> str | None:
    """stats.log: each indicator per node (solid), beside the same figure rebuilt from the access and
    message logs over all nodes (dashed, black; per second)."""
    stats = summary.get("stats") or {}
    rows = stats.get("series") or []
    if not rows:
        return None
    nodes: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for row in rows:
        nodes.setdefault((row["node"], row["server"]), []).append(row)
    several = len({node for node, _ in nodes}) > 1
    unit = summary["period"]["series_unit"]
    per = _UNIT_SECONDS.get(unit, 60)
    logs = {
        "traffic": summary["traffic"]["series"] if summary["lines"]["message"] else [],
        "concurrency": summary["sessions"]["concurrency"],
    }
    fig, axes = plt.subplots(len(_STATS_PANELS), 1, figsize=(10, 2.6 * len(_STATS_PANELS)), sharex=True)
    for ax, (title, indicators, beside) in zip(axes, _STATS_PANELS, strict=True):
        for (node, server), series in nodes.items():
            times = _times(series)
            name = f"{os.path.basename(node.rstrip('/')) or node} {server}" if several else server
            for indicator in indicators:
                short = indicator.removesuffix("_per_second").replace("_", " ")
                label = plain(f"{name}: {short}") if len(indicators) > 1 or several else plain(name)
                ax.plot(times, [r[indicator] for r in series], label=label, marker=_marker(series))
        for source, column, label in beside:
            log_rows = [r for r in logs[source] if r.get(column) is not None]
            if not log_rows:
                continue
            scale = 1.0 if source == "concurrency" else 1.0 / per
            ax.plot(
                _times(log_rows),
                [r[column] * scale for r in log_rows],
                label=label,
                color="black",
                linestyle="--" if column.endswith("in") or source == "concurrency" else ":",
                linewidth=1,
            )
        if "bytes" in title or "messages" in title:
            ax.set_yscale("symlog", linthresh=1)
        ax.set_ylabel(title)
        ax.legend(loc="upper left", fontsize="small")
        _time_axis(ax)
    axes[0].set_title(f"Server statistics (stats.log, per {stats.get('series_unit', 'minute')}) beside the logs (UTC)")
    return _save(fig, path)


def _bars(rows: list[dict[str, Any]], label: str, value: str, title: str, path: str, horizontal: bool) -> str | None:
    if not rows:
        return None
    merged: dict[str, float] = {}  # rows may repeat a label (e.g. one reason for several request kinds)
    for row in rows:
        name = plain(row[label])
        merged[name] = merged.get(name, 0.0) + float(row[value] or 0)
    labels = list(merged)
    values = list(merged.values())
    fig, ax = plt.subplots(figsize=(10, max(3.0, 0.3 * len(labels) + 1) if horizontal else 3.5))
    if horizontal:
        ax.barh(labels[::-1], values[::-1], color="tab:blue")
        ax.set_xlabel(value)
    else:
        ax.bar(labels, values, color="tab:blue")
        ax.set_ylabel(value)
    ax.set_title(title)
    ax.grid(alpha=0.3, axis="x" if horizontal else "y")
    return _save(fig, path)


_STATUS_COLOURS = {"2xx": "tab:green", "3xx": "tab:blue", "4xx": "tab:orange", "5xx": "tab:red"}


def _http(summary: dict[str, Any], path: str) -> str | None:
    """Requests per endpoint (method and path), stacked by status class."""
    rows = summary.get("http", {}).get("by_endpoint", [])[:15]
    if not rows:
        return None
    endpoints: dict[str, dict[str, float]] = {}
    for row in rows:
        name = plain(f"{row.get('method') or '?'} {row.get('path') or '(unparsed)'}")
        status = row.get("status")
        kind = "unknown" if status is None else f"{int(status) // 100}xx"
        counts = endpoints.setdefault(name, {})
        counts[kind] = counts.get(kind, 0.0) + float(row["requests"] or 0)
    names = list(endpoints)[::-1]
    kinds = sorted({kind for counts in endpoints.values() for kind in counts})
    fig, ax = plt.subplots(figsize=(10, max(3.0, 0.3 * len(names) + 1)))
    left = [0.0] * len(names)
    for kind in kinds:
        widths = [endpoints[name].get(kind, 0.0) for name in names]
        ax.barh(names, widths, left=left, label=kind, color=_STATUS_COLOURS.get(kind, "tab:gray"))
        left = [a + b for a, b in zip(left, widths, strict=True)]
    ax.set_xlabel("requests")
    ax.set_title("HTTP requests by endpoint and status")
    ax.legend(loc="lower right")
    ax.grid(alpha=0.3, axis="x")
    return _save(fig, path)


def draw_all(summary: dict[str, Any], folder: str) -> dict[str, str]:
    """Draw every chart the data allows; returns name -> PNG path."""
    os.makedirs(folder, exist_ok=True)
    subjects = summary["subjects"]
    sessions = summary["sessions"]
    drawn = {
        "traffic": _traffic(summary, os.path.join(folder, "traffic.png")),
        "concurrency": _concurrency(summary, os.path.join(folder, "concurrency.png")),
        "latency": _latency(summary, os.path.join(folder, "latency.png")),
        "stats": _stats(summary, os.path.join(folder, "stats.png")),
        "top_subjects": _bars(
            subjects["top_by_publications"][:15],
            "subject",
            "publications",
            "Top subjects by publications",
            os.path.join(folder, "top_subjects.png"),
            horizontal=True,
        ),
        "fanout": _bars(
            subjects["fanout"],
            "recipients",
            "publications",
            "Fan-out per publication",
            os.path.join(folder, "fanout.png"),
            False,
        ),
        "durations": _bars(
            sessions["durations"],
            "duration",
            "sessions",
            "Session durations",
            os.path.join(folder, "durations.png"),
            False,
        ),
        "denied": _bars(
            summary["security"]["by_reason"],
            "reason_code",
            "denied",
            "Denied requests by reason",
            os.path.join(folder, "denied.png"),
            horizontal=True,
        ),
        "http": _http(summary, os.path.join(folder, "http.png")),
    }
    return {name: path for name, path in drawn.items() if path is not None}
