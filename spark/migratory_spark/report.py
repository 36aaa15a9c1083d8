"""Run every analysis, write its Parquet table, then summarise from what was written.

Each table is computed exactly once, by its Parquet write (time series
partitioned by ``date``); the per-second indicator series is written first and
read back, so the windows, the history and the concurrency all start from it
instead of from the raw lines again. The summary then reads the small
aggregated tables (top-N rows, distributions, the chart series) back from
Parquet: nothing raw is collected to the driver.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, date, datetime
from typing import Any

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from migratory_spark import SCHEMA_VERSION, latency, security, sessions, subjects, traffic
from migratory_spark.reader import LogFrames, read_logs

__all__ = ["Options", "Step", "analyze", "run"]

Step = Callable[[str], None]


@dataclass(frozen=True)
class Options:
    """What to read and how to judge it."""

    dirs: Sequence[str]
    out: str
    since: datetime | None = None
    until: datetime | None = None
    top: int = 20
    storm_window: int = 60
    storm_threshold: int = 20
    charts: bool = True
    extra: dict[str, Any] = field(default_factory=dict)


def _write(frame: DataFrame, path: str, partitioned: bool) -> None:
    writer = frame.write.mode("overwrite")
    if partitioned:
        writer = writer.partitionBy("date")
    writer.parquet(path)


def _plain(value: Any) -> Any:
    """Spark row values -> JSON values (timestamps as UTC ISO strings)."""
    if isinstance(value, datetime):
        stamp = value if value.tzinfo else value.replace(tzinfo=UTC)
        return stamp.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    if isinstance(value, date):
        return value.isoformat()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _rows(frame: DataFrame, limit: int | None = None) -> list[dict[str, Any]]:
    # timestamps leave Spark as UTC strings: the driver's local time zone never applies
    columns = []
    for name, kind in frame.dtypes:
        if kind.startswith("timestamp"):
            columns.append(F.date_format(name, "yyyy-MM-dd'T'HH:mm:ss'Z'").alias(name))
        elif kind == "date":
            columns.append(F.col(name).cast("string").alias(name))
        else:
            columns.append(F.col(name))
    selected = frame.select(*columns)
    if limit is not None:
        selected = selected.limit(limit)
    return [{k: _plain(v) for k, v in row.asDict().items()} for row in selected.collect()]


# name -> (section, partitioned by date)
TABLES: dict[str, tuple[str, bool]] = {
    "corrupt_lines": ("input", False),
    "indicators_per_second": ("traffic", True),
    "traffic_per_minute": ("traffic", True),
    "traffic_per_hour": ("traffic", True),
    "traffic_per_day": ("traffic", True),
    "indicator_windows": ("traffic", False),
    "indicator_history": ("traffic", True),
    "subject_stats": ("subjects", False),
    "fanout_distribution": ("subjects", False),
    "unsubscribed_subjects": ("subjects", False),
    "concurrency_per_minute": ("sessions", True),
    "session_durations": ("sessions", False),
    "session_duration_percentiles": ("sessions", False),
    "disconnect_reasons": ("sessions", False),
    "reconnect_storms": ("sessions", False),
    "clients_per_listener": ("sessions", False),
    "tls_share": ("sessions", False),
    "denied_by_reason": ("security", False),
    "denied_by_address": ("security", False),
    "denied_by_subject": ("security", False),
    "denied_over_time": ("security", True),
    "latency_overall": ("latency", False),
    "latency_by_subject": ("latency", False),
    "latency_per_minute": ("latency", True),
}


def analyze(spark: SparkSession, frames: LogFrames, options: Options, step: Step = lambda _: None) -> str:
    """Compute and write every table under ``<out>/parquet``; returns that folder."""
    base = os.path.join(options.out, "parquet")
    access, messages = frames.access, frames.messages

    def save(name: str, frame: DataFrame) -> DataFrame:
        step(name)
        path = os.path.join(base, name)
        _write(frame, path, TABLES[name][1])
        return spark.read.parquet(path)

    save("corrupt_lines", frames.corrupt)
    per_second = save("indicators_per_second", traffic.indicators_per_second(access, messages, spark))
    for unit in ("minute", "hour", "day"):
        save(f"traffic_per_{unit}", traffic.traffic(messages, unit))
    end = int(options.until.timestamp()) - 1 if options.until is not None else None
    save("indicator_windows", traffic.indicator_windows(per_second, end))
    save("indicator_history", traffic.indicator_history(per_second))
    save("subject_stats", subjects.subject_stats(access, messages))
    save("fanout_distribution", subjects.fanout_distribution(messages))
    save("unsubscribed_subjects", subjects.unsubscribed_subjects(access, messages))
    save("concurrency_per_minute", sessions.concurrency(per_second))
    save("session_durations", sessions.duration_distribution(access))
    save("session_duration_percentiles", sessions.duration_percentiles(access))
    save("disconnect_reasons", sessions.disconnect_reasons(access))
    save("reconnect_storms", sessions.reconnect_storms(access, options.storm_window, options.storm_threshold))
    save("clients_per_listener", sessions.clients_per_listener(access))
    save("tls_share", sessions.tls_share(access))
    save("denied_by_reason", security.denied_by_reason(access))
    save("denied_by_address", security.denied_by_address(access))
    save("denied_by_subject", security.denied_by_subject(access))
    save("denied_over_time", security.denied_over_time(access))
    save("latency_overall", latency.latency_overall(messages))
    save("latency_by_subject", latency.latency_by_subject(messages))
    save("latency_per_minute", latency.latency_over_time(messages, "minute"))
    return base


def _series_unit(first: datetime | None, last: datetime | None) -> str:
    """The coarsest unit that still gives a readable chart (at most ~3000 points)."""
    if first is None or last is None:
        return "minute"
    span = (last - first).total_seconds()
    if span <= 2 * 86400:
        return "minute"
    if span <= 120 * 86400:
        return "hour"
    return "day"


def summarize(spark: SparkSession, parquet: str, options: Options, counts: dict[str, int]) -> dict[str, Any]:
    """The JSON summary: totals, windows, top-N tables and chart series, read back from Parquet."""

    def table(name: str) -> DataFrame:
        return spark.read.parquet(os.path.join(parquet, name))

    top = options.top
    per_second = table("indicators_per_second")
    bounds = per_second.agg(F.min("time").alias("first"), F.max("time").alias("last")).first()
    first = bounds["first"] if bounds else None
    last = bounds["last"] if bounds else None
    unit = _series_unit(first, last)
    minute = table("traffic_per_minute")
    totals = _rows(
        minute.agg(*[F.sum(c).alias(c) for c in ("messages_in", "messages_out", "bytes_in", "bytes_out", "lines")])
    )[0]
    windows: dict[str, dict[str, dict[str, Any]]] = {}
    for row in _rows(table("indicator_windows")):
        windows.setdefault(row["indicator"], {})[row["window"]] = {
            k: row[k] for k in ("max", "avg", "stddev", "samples")
        }
    traffic_series = _rows(table(f"traffic_per_{unit}").drop("date").orderBy("start"))
    concurrency = table("concurrency_per_minute")
    if unit != "minute":
        concurrency = concurrency.groupBy(F.date_trunc(unit, "start").alias("start")).agg(
            F.max("max").alias("max"), F.min("min").alias("min"), F.avg("avg").alias("avg")
        )
    latency_series = table("latency_per_minute")
    if unit != "minute":
        # percentiles do not merge: the chart shows the worst minute of each bucket
        latency_series = latency_series.groupBy(F.date_trunc(unit, "start").alias("start")).agg(
            F.sum("messages").alias("messages"),
            F.max("p50_us").alias("p50_us"),
            F.max("p99_us").alias("p99_us"),
            F.max("max_us").alias("max_us"),
        )
    stats = table("subject_stats")
    subject_count = stats.count()
    summary: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "generated": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "inputs": list(options.dirs),
        "since": _plain(options.since),
        "until": _plain(options.until),
        "spark": {"version": spark.version, "master": spark.sparkContext.master},
        "period": {"first": _plain(first), "last": _plain(last), "series_unit": unit},
        "lines": counts,
        "corrupt": _rows(table("corrupt_lines").orderBy("kind", "node")),
        "traffic": {
            "totals": totals,
            "indicators": windows,
            "series": traffic_series,
        },
        "subjects": {
            "count": subject_count,
            "top_by_publications": _rows(stats.orderBy(F.desc("publications"), "subject"), top),
            "top_by_deliveries": _rows(stats.orderBy(F.desc("deliveries"), "subject"), top),
            "top_by_bytes": _rows(stats.orderBy(F.desc("bytes_out"), "subject"), top),
            "fanout": _rows(table("fanout_distribution").orderBy("bucket_order").drop("bucket_order")),
            "never_subscribed": _rows(table("unsubscribed_subjects").orderBy(F.desc("publications"), "subject"), top),
            "never_subscribed_count": table("unsubscribed_subjects").count(),
        },
        "sessions": {
            "concurrency": _rows(concurrency.orderBy("start").select("start", "max", "min", "avg")),
            "durations": _rows(table("session_durations").orderBy("bucket_order").drop("bucket_order")),
            "duration_percentiles": (_rows(table("session_duration_percentiles")) or [{}])[0],
            "disconnect_reasons": _rows(table("disconnect_reasons").orderBy(F.desc("disconnects"), "reason")),
            "reconnect_storms": _rows(table("reconnect_storms").orderBy(F.desc("peak_connects"), "addr"), top),
            "reconnect_storm_addresses": table("reconnect_storms").count(),
            "listeners": _rows(table("clients_per_listener").orderBy(F.desc("sessions"), "listener")),
            "tls": _rows(table("tls_share").orderBy("transport")),
        },
        "security": {
            "denied": _rows(table("denied_by_reason").agg(F.sum("denied").alias("n")))[0]["n"] or 0,
            "by_reason": _rows(table("denied_by_reason").orderBy(F.desc("denied"), "reason_code", "request")),
            "by_address": _rows(table("denied_by_address").orderBy(F.desc("denied"), "addr"), top),
            "by_subject": _rows(table("denied_by_subject").orderBy(F.desc("denied"), "subject"), top),
        },
        "latency": {
            "overall": (_rows(table("latency_overall")) or [{}])[0],
            "by_subject": _rows(table("latency_by_subject").orderBy(F.desc("p99_us"), "subject"), top),
            "series": _rows(latency_series.orderBy("start").select("start", "messages", "p50_us", "p99_us", "max_us")),
        },
        "outputs": {"parquet": parquet},
    }
    return summary


def run(spark: SparkSession, options: Options, step: Step = lambda _: None) -> dict[str, Any]:
    """Read, analyse, write Parquet, summary.json, charts and report.html; return the summary."""
    os.makedirs(options.out, exist_ok=True)
    step("reading logs")
    frames = read_logs(spark, options.dirs, options.since, options.until)
    step("counting lines")
    counted = (
        frames.access.select(F.lit("access").alias("kind"))
        .unionByName(frames.messages.select(F.lit("message").alias("kind")))
        .groupBy("kind")
        .count()
        .collect()
    )
    counts = {"access": 0, "message": 0}
    counts.update({row["kind"]: int(row["count"]) for row in counted})
    corrupt_total = frames.corrupt.agg(F.sum("lines")).first()
    counts["corrupt"] = int(corrupt_total[0] or 0) if corrupt_total else 0
    parquet = analyze(spark, frames, options, step)
    step("summary")
    summary = summarize(spark, parquet, options, counts)
    outputs = summary["outputs"]
    if options.charts:
        from migratory_spark import charts, html

        step("charts")
        outputs["charts"] = charts.draw_all(summary, os.path.join(options.out, "charts"))
        step("html report")
        outputs["html"] = html.write_report(summary, os.path.join(options.out, "report.html"))
    outputs["summary"] = os.path.join(options.out, "summary.json")
    with open(outputs["summary"], "w", encoding="utf-8") as handle:
        json.dump(summary, handle, indent=2, sort_keys=False)
        handle.write("\n")
    frames.access.unpersist()
    frames.messages.unpersist()
    return summary
