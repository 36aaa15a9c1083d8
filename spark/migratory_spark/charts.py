"""PNG charts of the summary (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

import os
from datetime import datetime
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.dates as mdates
import matplotlib.pyplot as plt
from matplotlib.axes import Axes

__all__ = ["draw_all"]


def _times(rows: list[dict[str, Any]]) -> Any:
    """Matplotlib date numbers of the rows' UTC ``start`` (the axes format them back as dates)."""
    stamps = [datetime.strptime(row["start"], "%Y-%m-%dT%H:%M:%SZ") for row in rows]
    return mdates.date2num(stamps)  # type: ignore[no-untyped-call]


def _marker(rows: list[dict[str, Any]]) -> str | None:
    """Dots where the series is short enough that a line alone could be invisible."""
    return "o" if len(rows) < 40 else None


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
    if not rows:
        return None
    unit = summary["period"]["series_unit"]
    times = _times(rows)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    top.plot(times, [r["messages_in"] for r in rows], label="messages in", marker=_marker(rows), color="tab:blue")
    top.plot(times, [r["messages_out"] for r in rows], label="messages out", marker=_marker(rows), color="tab:orange")
    top.set_yscale("log")  # deliveries outnumber publications by the fan-out
    top.set_ylabel(f"messages per {unit}")
    top.legend(loc="upper left")
    top.set_title("Traffic (UTC)")
    bottom.plot(times, [r["bytes_in"] for r in rows], label="bytes in", marker=_marker(rows), color="tab:green")
    bottom.plot(times, [r["bytes_out"] for r in rows], label="bytes out", marker=_marker(rows), color="tab:red")
    bottom.set_yscale("log")
    bottom.set_ylabel(f"bytes per {unit}")
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
    ax.set_title("Concurrent connections (UTC)")
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
    ax.set_yscale("log")
    ax.set_ylabel("fan-out latency (µs)")
    ax.set_title("Publish-to-fan-out latency (UTC)")
    ax.legend(loc="upper left")
    _time_axis(ax)
    return _save(fig, path)


def _bars(rows: list[dict[str, Any]], label: str, value: str, title: str, path: str, horizontal: bool) -> str | None:
    if not rows:
        return None
    merged: dict[str, float] = {}  # rows may repeat a label (e.g. one reason for several request kinds)
    for row in rows:
        merged[str(row[label])] = merged.get(str(row[label]), 0.0) + float(row[value] or 0)
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


def draw_all(summary: dict[str, Any], folder: str) -> dict[str, str]:
    """Draw every chart the data allows; returns name -> PNG path."""
    os.makedirs(folder, exist_ok=True)
    subjects = summary["subjects"]
    sessions = summary["sessions"]
    drawn = {
        "traffic": _traffic(summary, os.path.join(folder, "traffic.png")),
        "concurrency": _concurrency(summary, os.path.join(folder, "concurrency.png")),
        "latency": _latency(summary, os.path.join(folder, "latency.png")),
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
    }
    return {name: path for name, path in drawn.items() if path is not None}
