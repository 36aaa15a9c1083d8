"""Run every analysis once, write its Parquet table, and summarise from what was computed.

The logs are parsed once and persisted (:func:`migratory_spark.reader.read_logs`);
one collect of the reader's overview reads them and answers every count (lines,
corrupt lines, the period, which events occur). The analyses then run as a small
graph of Spark jobs submitted from a few threads at once, so that the fixed cost
of a job (planning, scheduling, committing) overlaps instead of adding up:

* one aggregation per grouping of the raw rows (per second, per subject, per
  minute for latency, ...), and the tables that are projections or roll-ups of
  it are computed from that aggregation, kept in memory, never from the raw rows
  again (traffic per hour from per minute, the subject tables from one subject
  pass, the indicator windows, history and concurrency from one pass over the
  per-second series);
* a table of at most ``Options.local_rows`` rows (every table, unless the logs
  span months or hold millions of subjects) is collected once as Arrow and
  written by the driver as one Parquet file (one per ``date`` for time series):
  the summary then reads those rows, not the files. A larger table is written
  by Spark in parallel and the summary queries it in Spark (top-N, counts);
  nothing raw is ever collected to the driver.

An empty table is written with its schema (one Parquet file without rows, never
a folder without files) and reported as empty.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from datetime import UTC, date, datetime
from functools import cmp_to_key
from typing import Any

import pyarrow as pa  # type: ignore[import-untyped]
import pyarrow.parquet as pq  # type: ignore[import-untyped]
from pyspark import StorageLevel
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from migratory_spark import SCHEMA_VERSION, http, latency, security, sessions, subjects, traffic
from migratory_spark import stats as server_stats
from migratory_spark.reader import LogFrames, corrupt_rows, jvm_parser, read_logs

__all__ = [
    "NO_STATS",
    "TABLES",
    "TIMING_ENV",
    "UNIT_SECONDS",
    "Options",
    "Overview",
    "Step",
    "Table",
    "analyze",
    "run",
    "summarize",
    "timed_steps",
]

Step = Callable[[str], None]

# MIGRATORY_SPARK_TIMING=1: each step's time and the Spark jobs run so far, on standard error
TIMING_ENV = "MIGRATORY_SPARK_TIMING"


def timed_steps(
    spark: SparkSession, step: Step, record: list[dict[str, Any]] | None = None, show: bool | None = None
) -> Step:
    """``step``, and each call's time since the first and Spark's job count kept in ``record`` (and printed
    on standard error with ``show``, by default under ``MIGRATORY_SPARK_TIMING=1``). A step names what
    starts or what just ended; the last, ``done``, is only timed, not passed on."""
    if show is None:
        show = os.environ.get(TIMING_ENV, "") not in ("", "0")
    if record is None and not show:
        return step
    tracker = spark.sparkContext.statusTracker()
    began = time.monotonic()
    last = [began]

    def timed(name: str) -> None:
        now = time.monotonic()
        jobs = len(tracker.getJobIdsForGroup())
        if record is not None:
            record.append({"step": name, "seconds": round(now - began, 2), "jobs": jobs})
        if show:
            print(f"[report] {now - began:7.2f} s  +{now - last[0]:6.2f} s  {jobs:3d} jobs  {name}", file=sys.stderr)
        last[0] = now
        if name != "done":
            step(name)

    return timed


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
    local_rows: int = 200_000  # a table up to this many rows is collected and written by the driver
    threads: int = 4  # Spark jobs submitted at once


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
    "http_requests": ("http", False),
    "latency_overall": ("latency", False),
    "latency_by_subject": ("latency", False),
    "latency_per_minute": ("latency", True),
    "stats_per_node": ("stats", True),
    "stats_nodes": ("stats", False),
}

UNIT_SECONDS = {"second": 1, "minute": 60, "hour": 3600, "day": 86400}

# tables whose rows are bounded by categories (windows, buckets, reasons, listeners), never by the logs
BOUNDED = frozenset(
    {
        "indicator_windows",
        "fanout_distribution",
        "session_durations",
        "session_duration_percentiles",
        "disconnect_reasons",
        "clients_per_listener",
        "tls_share",
        "denied_by_reason",
        "latency_overall",
        "stats_nodes",
    }
)

# the summary's word for a report without stats.log lines
NO_STATS = "no stats.log lines: servers older than the stats log, or Stats.LogInterval 0"


# --- values and rows -----------------------------------------------------------------------


def _iso(second: int | None) -> str | None:
    return None if second is None else datetime.fromtimestamp(second, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _plain(value: Any) -> Any:
    """Spark or Arrow row values -> JSON values (timestamps as UTC ISO strings)."""
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


Order = Sequence[tuple[str, bool]]  # (column, descending)


def _compare(a: dict[str, Any], b: dict[str, Any], order: Order) -> int:
    """Spark's ordering: ascending puts nulls first, descending puts them last."""
    for name, descending in order:
        x, y = a.get(name), b.get(name)
        if x == y:
            continue
        if x is None:
            return 1 if descending else -1
        if y is None:
            return -1 if descending else 1
        before = x < y
        return (1 if before else -1) if descending else (-1 if before else 1)
    return 0


def _sorted(rows: list[dict[str, Any]], order: Order) -> list[dict[str, Any]]:
    def compare(a: dict[str, Any], b: dict[str, Any]) -> int:
        return _compare(a, b, order)

    return sorted(rows, key=cmp_to_key(compare)) if order else rows


@dataclass
class Table:
    """A written table: its rows on the driver when small (``local``), else its persisted Spark frame."""

    name: str
    path: str
    partitioned: bool
    rows: int
    frame: DataFrame | None
    local: list[dict[str, Any]] | None

    @property
    def written_by(self) -> str:
        return "driver" if self.local is not None else "spark"

    def records(self, order: Order = (), limit: int | None = None, drop: Sequence[str] = ()) -> list[dict[str, Any]]:
        """Rows as JSON values, in ``order``, at most ``limit``, without the ``drop`` columns."""
        if self.local is not None:
            rows = _sorted(self.local, order)
            rows = rows if limit is None else rows[:limit]
            return [{k: _plain(v) for k, v in row.items() if k not in drop} for row in rows]
        assert self.frame is not None
        frame = self.frame.drop(*drop) if drop else self.frame
        if order:
            frame = frame.orderBy(*[F.desc(c) if d else F.asc(c) for c, d in order])
        return _rows(frame, limit)

    def first(self) -> dict[str, Any]:
        rows = self.records(limit=1)
        return rows[0] if rows else {}

    def total(self, column: str) -> Any:
        if self.local is not None:
            values = [row[column] for row in self.local if row.get(column) is not None]
            return sum(values) if values else 0
        assert self.frame is not None
        found = self.frame.agg(F.sum(column)).first()
        return _plain(found[0]) if found is not None and found[0] is not None else 0


def _write_arrow(table: pa.Table, path: str, partitioned: bool) -> None:
    """One Parquet file (one per ``date`` folder when partitioned and not empty), replacing what was there."""
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    if partitioned and table.num_rows:
        pq.write_to_dataset(
            table,
            path,
            partition_cols=["date"],
            basename_template="part-{i}.parquet",
            existing_data_behavior="overwrite_or_ignore",
        )
    else:  # an empty table keeps its schema (with ``date``) in one file, readable by Spark, pandas, pyarrow
        pq.write_table(table, os.path.join(path, "part-0.parquet"))


# --- what the overview says ------------------------------------------------------------------


@dataclass(frozen=True)
class Overview:
    """Everything one pass over the parsed logs counts (see ``LogFrames.overview``)."""

    lines: dict[str, int]  # access, message, stats (in the period), corrupt
    outside: int  # good lines outside --since/--until
    corrupt: list[dict[str, Any]]  # kind, node, lines, example (escaped)
    events: dict[str, int]  # access events in the period
    first: int | None  # first and last second of access and message lines in the period
    last: int | None
    skipped: list[str]
    stats_first: int | None = None  # first and last second of stats.log lines in the period
    stats_last: int | None = None

    @classmethod
    def from_rows(cls, rows: Sequence[Any], skipped: Sequence[str] = ()) -> Overview:
        lines = {"access": 0, "message": 0, "stats": 0, "corrupt": 0}
        events: dict[str, int] = {}
        outside = 0
        first: int | None = None
        last: int | None = None
        stats_first: int | None = None
        stats_last: int | None = None
        bad: dict[tuple[str, str], dict[str, Any]] = {}
        for row in rows:
            count = int(row["lines"] or 0)
            if row["state"] == "corrupt":
                lines["corrupt"] += count
                key = (row["kind"], row["node"])
                seen = bad.setdefault(key, {"kind": row["kind"], "node": row["node"], "lines": 0, "example": None})
                seen["lines"] += count
                if row["example"] is not None and (seen["example"] is None or row["example"] < seen["example"]):
                    seen["example"] = row["example"]
            elif row["state"] == "outside":
                outside += count
            elif row["kind"] == "stats":  # its own period: the server logs its figures when idle too
                lines["stats"] += count
                stats_first = row["first"] if stats_first is None else min(stats_first, row["first"])
                stats_last = row["last"] if stats_last is None else max(stats_last, row["last"])
            else:
                lines[row["kind"]] += count
                if row["kind"] == "access":
                    events[row["event"]] = events.get(row["event"], 0) + count
                first = row["first"] if first is None else min(first, row["first"])
                last = row["last"] if last is None else max(last, row["last"])
        return cls(
            lines,
            outside,
            corrupt_rows(list(bad.values())),
            events,
            first,
            last,
            list(skipped),
            stats_first,
            stats_last,
        )


def series_unit(first: int | None, last: int | None) -> str:
    """The bucket of the charts: seconds for minutes of logs, then minutes, hours, days (at most ~3000 points)."""
    if first is None or last is None:
        return "minute"
    span = last - first
    if span <= 15 * 60:
        return "second"
    if span <= 2 * 86400:
        return "minute"
    if span <= 120 * 86400:
        return "hour"
    return "day"


# --- the job graph ----------------------------------------------------------------------------


class _Graph:
    """Tasks submitted in dependency order to a thread pool; each waits for the results it needs."""

    def __init__(self, threads: int) -> None:
        self.pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="migratory-report")
        self.futures: dict[str, Future[Any]] = {}

    def add(self, name: str, task: Callable[..., Any], *needs: str) -> None:
        inputs = [self.futures[need] for need in needs]  # submitted earlier: no deadlock in FIFO order
        self.futures[name] = self.pool.submit(lambda: task(*[f.result() for f in inputs]))

    def results(self, spark: SparkSession) -> dict[str, Any]:
        done, _ = wait(list(self.futures.values()), return_when=FIRST_EXCEPTION)
        failed = [f for f in done if f.exception() is not None]
        if failed:
            for future in self.futures.values():
                future.cancel()
            spark.sparkContext.cancelAllJobs()
            self.pool.shutdown(wait=True)
            error = failed[0].exception()
            assert error is not None
            raise error
        self.pool.shutdown(wait=True)
        return {name: future.result() for name, future in self.futures.items()}


class _Tables:
    """Computes, writes and keeps the tables; remembers what it persisted."""

    def __init__(self, options: Options, step: Step) -> None:
        self.base = os.path.join(options.out, "parquet")
        self.limit = options.local_rows
        self.step = step
        self.kept: list[DataFrame] = []
        self.lock = threading.Lock()

    def keep(self, frame: DataFrame) -> DataFrame:
        """Persisted; computed by the first job that reads it (jobs reading it at once share the work)."""
        frame = frame.persist(StorageLevel.MEMORY_AND_DISK)
        with self.lock:
            self.kept.append(frame)
        return frame

    def write(self, name: str, frame: DataFrame, keep: bool = False) -> Table:
        partitioned = TABLES[name][1]
        path = os.path.join(self.base, name)
        if keep:
            frame = self.keep(frame)
        # a table bounded by its categories, not by the logs, is collected as it is
        arrow = frame.toArrow() if name in BOUNDED else frame.limit(self.limit + 1).toArrow()
        if arrow.num_rows <= self.limit:
            _write_arrow(arrow, path, partitioned)
            table = Table(name, path, partitioned, arrow.num_rows, frame, arrow.to_pylist())
        else:  # big: Spark writes it where it is, in parallel
            if not keep:
                frame = self.keep(frame)
            writer = frame.write.mode("overwrite")
            if partitioned:
                writer = writer.partitionBy("date")
            writer.parquet(path)
            table = Table(name, path, partitioned, frame.count(), frame, None)
        self.step(name)
        return table

    def write_rows(self, name: str, rows: list[dict[str, Any]], schema: pa.Schema) -> Table:
        path = os.path.join(self.base, name)
        _write_arrow(pa.Table.from_pylist(rows, schema=schema), path, TABLES[name][1])
        self.step(name)
        return Table(name, path, TABLES[name][1], len(rows), None, rows)

    def release(self) -> None:
        for frame in self.kept:
            frame.unpersist()


_CORRUPT_SCHEMA = pa.schema(
    [("kind", pa.string()), ("node", pa.string()), ("lines", pa.int64()), ("example", pa.string())]
)


@dataclass
class Analysis:
    """The tables, the chart series and the overview they came from."""

    tables: dict[str, Table]
    series: dict[str, list[dict[str, Any]]]
    overview: Overview
    unit: str
    end: int | None
    store: _Tables
    stats_series: list[dict[str, Any]] = field(default_factory=list)  # per node and stats_unit
    stats_unit: str = "minute"

    def release(self) -> None:
        """Unpersist the frames the analysis kept (the summary may query them until then)."""
        self.store.release()


def analyze(
    spark: SparkSession, frames: LogFrames, options: Options, overview: Overview, step: Step = lambda _: None
) -> Analysis:
    """Compute and write every table under ``<out>/parquet``, and the chart series."""
    out = _Tables(options, step)
    access, messages = frames.access, frames.messages
    first, last = overview.first, overview.last
    end = int(options.until.timestamp()) - 1 if options.until is not None else last
    bounds = (first, last) if first is not None and last is not None else None
    unit = series_unit(first, last)
    stats_unit = series_unit(overview.stats_first, overview.stats_last)
    rollup = unit in ("hour", "day")
    graph = _Graph(options.threads)
    add = graph.add
    try:
        # traffic: one pass per second over the messages; the rest from it
        add("rates", lambda: out.keep(traffic.rates_per_second(messages)))
        add(
            "indicators_per_second",
            lambda rates: out.write(
                "indicators_per_second",
                traffic.indicators_per_second(access, messages, spark, rates=rates, bounds=bounds),
                keep=True,
            ),
            "rates",
        )
        add(
            "traffic_per_minute",
            lambda rates: out.write("traffic_per_minute", traffic.traffic_from_rates(rates, "minute"), keep=True),
            "rates",
        )
        add(
            "traffic_per_hour",
            lambda t: out.write("traffic_per_hour", traffic.traffic_from_rates(_frame(t), "hour"), keep=True),
            "traffic_per_minute",
        )
        add(
            "traffic_per_day",
            lambda t: out.write("traffic_per_day", traffic.traffic_from_rates(_frame(t), "day")),
            "traffic_per_hour",
        )
        add(
            "partials",
            lambda t: out.keep(traffic.minute_partials(_frame(t), end)),
            "indicators_per_second",
        )
        add(
            "indicator_windows",
            lambda t, parts: out.write(
                "indicator_windows", traffic.indicator_windows(_frame(t), end, partials=parts, first_second=first)
            ),
            "indicators_per_second",
            "partials",
        )
        add(
            "indicator_history",
            lambda t, parts: out.write("indicator_history", traffic.indicator_history(_frame(t), partials=parts)),
            "indicators_per_second",
            "partials",
        )
        add(
            "concurrency_per_minute",
            lambda parts: out.write("concurrency_per_minute", traffic.concurrency_from_partials(parts)),
            "partials",
        )
        # subjects and their latency: one pass per subject
        add("subject_totals", lambda: out.keep(subjects.subject_totals(access, messages)))
        add(
            "subject_stats",
            lambda totals: out.write("subject_stats", subjects.subject_stats(access, messages, totals)),
            "subject_totals",
        )
        add(
            "unsubscribed_subjects",
            lambda totals: out.write("unsubscribed_subjects", subjects.unsubscribed_subjects(access, messages, totals)),
            "subject_totals",
        )
        add(
            "latency_by_subject",
            lambda totals: out.write("latency_by_subject", latency.latency_by_subject(messages, totals)),
            "subject_totals",
        )
        add(
            "fanout_distribution",
            lambda totals: out.write("fanout_distribution", subjects.fanout_distribution(messages, totals)),
            "subject_totals",
        )
        add("latency_overall", lambda: out.write("latency_overall", latency.latency_overall(messages)))
        add(
            "latency_per_minute",
            lambda: out.write("latency_per_minute", latency.latency_over_time(messages, "minute"), keep=rollup),
        )
        # sessions, security, HTTP: the access lines, a small share of the logs
        add("session_durations", lambda: out.write("session_durations", sessions.duration_distribution(access)))
        add(
            "session_duration_percentiles",
            lambda: out.write("session_duration_percentiles", sessions.duration_percentiles(access)),
        )
        add("disconnect_reasons", lambda: out.write("disconnect_reasons", sessions.disconnect_reasons(access)))
        add(
            "reconnect_storms",
            lambda: out.write(
                "reconnect_storms",
                sessions.reconnect_storms(access, options.storm_window, options.storm_threshold),
            ),
        )
        add("clients_per_listener", lambda: out.write("clients_per_listener", sessions.clients_per_listener(access)))
        add("tls_share", lambda: out.write("tls_share", sessions.tls_share(access)))
        add("denied_by_reason", lambda: out.write("denied_by_reason", security.denied_by_reason(access)))
        add("denied_by_address", lambda: out.write("denied_by_address", security.denied_by_address(access)))
        add("denied_by_subject", lambda: out.write("denied_by_subject", security.denied_by_subject(access)))
        add("denied_over_time", lambda: out.write("denied_over_time", security.denied_over_time(access)))
        add("http_requests", lambda: out.write("http_requests", http.http_requests(access)))
        add("corrupt_lines", lambda: out.write_rows("corrupt_lines", overview.corrupt, _CORRUPT_SCHEMA))
        # stats.log: the server's own figures, per node
        add(
            "stats_per_node",
            lambda: out.write("stats_per_node", server_stats.stats_per_node(frames.stats), keep=True),
        )
        add("stats_nodes", lambda t: out.write("stats_nodes", server_stats.stats_nodes(_frame(t))), "stats_per_node")
        add("stats_series", lambda t: _rows(server_stats.stats_series(_frame(t), stats_unit)), "stats_per_node")
        # the chart series, in the unit the span of the logs asks for
        if unit == "second":
            add("traffic_series", lambda t: _second_traffic(t), "indicators_per_second")
            add("concurrency_series", lambda t: _second_concurrency(t), "indicators_per_second")
            add(
                "latency_series",
                lambda: _rows(latency.latency_over_time(messages, "second").drop("date").orderBy("start")),
            )
        else:
            add(
                "traffic_series",
                lambda t: t.records(order=[("start", False)], drop=("date",)),
                f"traffic_per_{unit}",
            )
            if rollup:
                add("concurrency_series", lambda parts: _rollup_concurrency(parts, unit), "partials")
                add("latency_series", lambda t: _rollup_latency(_frame(t), unit), "latency_per_minute")
            else:
                add(
                    "concurrency_series",
                    lambda t: t.records(order=[("start", False)], drop=("date",)),
                    "concurrency_per_minute",
                )
                add(
                    "latency_series",
                    lambda t: t.records(order=[("start", False)], drop=("date",)),
                    "latency_per_minute",
                )
        results = graph.results(spark)
    except BaseException:
        out.release()
        raise
    tables = {name: results[name] for name in TABLES}
    series = {name: results[f"{name}_series"] for name in ("traffic", "concurrency", "latency")}
    length = UNIT_SECONDS[unit]
    if first is not None and last is not None:
        for rows in series.values():
            for row in rows:
                start = int(datetime.strptime(row["start"], "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC).timestamp())
                row["partial"] = start < first or start + length > last + 1
    return Analysis(tables, series, overview, unit, end, out, results["stats_series"], stats_unit)


def _frame(table: Table) -> DataFrame:
    assert table.frame is not None
    return table.frame


def _second_traffic(table: Table) -> list[dict[str, Any]]:
    rows = table.records(order=[("second", False)])
    return [
        {
            "start": row["time"],
            "messages_in": row["messages_in_per_second"],
            "messages_out": row["messages_out_per_second"],
            "bytes_in": row["bytes_in_per_second"],
            "bytes_out": row["bytes_out_per_second"],
        }
        for row in rows
    ]


def _second_concurrency(table: Table) -> list[dict[str, Any]]:
    rows = table.records(order=[("second", False)])
    return [{"start": row["time"], **dict.fromkeys(("max", "min", "avg"), row["connected_clients"])} for row in rows]


def _rollup_concurrency(partials: DataFrame, unit: str) -> list[dict[str, Any]]:
    grouped = (
        partials.where(F.col("indicator") == "connected_clients")
        .groupBy(F.date_trunc(unit, F.timestamp_seconds("minute")).alias("start"))
        .agg(
            F.max("peak").alias("max"),
            F.min("low").alias("min"),
            (F.sum("total") / F.sum("n")).alias("avg"),
        )
    )
    return _rows(grouped.orderBy("start").select("start", "max", "min", "avg"))


def _rollup_latency(per_minute: DataFrame, unit: str) -> list[dict[str, Any]]:
    # percentiles do not merge: the chart shows the worst minute of each bucket
    grouped = per_minute.groupBy(F.date_trunc(unit, "start").alias("start")).agg(
        F.sum("messages").alias("messages"),
        F.max("p50_us").alias("p50_us"),
        F.max("p99_us").alias("p99_us"),
        F.max("max_us").alias("max_us"),
    )
    return _rows(grouped.orderBy("start").select("start", "messages", "p50_us", "p99_us", "max_us"))


# --- the summary --------------------------------------------------------------------------------


def summarize(spark: SparkSession, analysis: Analysis, options: Options) -> dict[str, Any]:
    """The JSON summary: totals, windows, top-N tables and chart series, from the computed tables."""
    t = analysis.tables
    overview = analysis.overview
    top = options.top
    totals = {c: t["traffic_per_minute"].total(c) for c in ("messages_in", "messages_out", "bytes_in", "bytes_out")}
    totals["lines"] = t["traffic_per_minute"].total("lines")
    windows: dict[str, dict[str, dict[str, Any]]] = {}
    for row in t["indicator_windows"].records(order=[("indicator", False), ("seconds", False)]):
        windows.setdefault(row["indicator"], {})[row["window"]] = {
            k: row[k] for k in ("max", "avg", "stddev", "samples", "full_history")
        }
    stats = t["subject_stats"]
    http_table = t["http_requests"]
    by_status: dict[Any, int] = {}
    if http_table.local is not None:
        for row in http_table.local:
            by_status[row["status"]] = by_status.get(row["status"], 0) + int(row["requests"])
        status_rows = [{"status": k, "requests": v} for k, v in by_status.items()]
    else:
        frame = _frame(http_table).groupBy("status").agg(F.sum("requests").alias("requests"))
        status_rows = _rows(frame)
    status_rows.sort(key=lambda r: (r["status"] is None, r["status"] or 0))
    endpoint_order = [("requests", True), ("path", False), ("method", False), ("status", False)]
    span = None if overview.first is None or overview.last is None else overview.last - overview.first + 1
    summary: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "generated": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "inputs": list(options.dirs),
        "skipped_files": overview.skipped,
        "since": _plain(options.since),
        "until": _plain(options.until),
        # which line parser read the logs: the package's JVM one, or from_json without its jar
        "spark": {
            "version": spark.version,
            "master": spark.sparkContext.master,
            "parser": "jvm" if jvm_parser(spark) is not None else "from_json",
        },
        "period": {
            "first": _iso(overview.first),
            "last": _iso(overview.last),
            "seconds": span,
            "end": _iso(analysis.end),
            "series_unit": analysis.unit,
        },
        "lines": dict(overview.lines),
        "lines_outside_period": overview.outside,
        "corrupt": overview.corrupt,
        "traffic": {
            "totals": totals,
            "indicators": windows,
            "series": analysis.series["traffic"],
        },
        "subjects": {
            "count": stats.rows,
            "top_by_publications": stats.records([("publications", True), ("subject", False)], top),
            "top_by_deliveries": stats.records([("deliveries", True), ("subject", False)], top),
            "top_by_bytes": stats.records([("bytes_out", True), ("subject", False)], top),
            "fanout": t["fanout_distribution"].records([("bucket_order", False)], drop=("bucket_order",)),
            "never_subscribed": t["unsubscribed_subjects"].records([("publications", True), ("subject", False)], top),
            "never_subscribed_count": t["unsubscribed_subjects"].rows,
        },
        "sessions": {
            "concurrency": analysis.series["concurrency"],
            "durations": t["session_durations"].records([("bucket_order", False)], drop=("bucket_order",)),
            "duration_percentiles": t["session_duration_percentiles"].first(),
            "disconnect_reasons": t["disconnect_reasons"].records([("disconnects", True), ("reason", False)]),
            "reconnect_storms": t["reconnect_storms"].records([("peak_connects", True), ("addr", False)], top),
            "reconnect_storm_addresses": t["reconnect_storms"].rows,
            "listeners": t["clients_per_listener"].records([("sessions", True), ("listener", False)]),
            "tls": t["tls_share"].records([("transport", False)]),
        },
        "security": {
            "denied": t["denied_by_reason"].total("denied"),
            "by_reason": t["denied_by_reason"].records([("denied", True), ("reason_code", False), ("request", False)]),
            "by_address": t["denied_by_address"].records([("denied", True), ("addr", False)], top),
            "by_subject": t["denied_by_subject"].records([("denied", True), ("subject", False)], top),
        },
        "http": {
            "requests": http_table.total("requests"),
            "endpoints": http_table.rows,
            "by_status": status_rows,
            "by_endpoint": http_table.records(endpoint_order, top),
        },
        "latency": {
            "overall": t["latency_overall"].first(),
            "by_subject": t["latency_by_subject"].records([("p99_us", True), ("subject", False)], top),
            "series": analysis.series["latency"],
        },
        "stats": {
            "lines": overview.lines["stats"],
            "note": None if overview.lines["stats"] else NO_STATS,
            "period": {"first": _iso(overview.stats_first), "last": _iso(overview.stats_last)},
            "series_unit": analysis.stats_unit,
            "nodes": t["stats_nodes"].records([("node", False), ("server", False)]),
            "series": analysis.stats_series,
        },
        "tables": {
            name: {
                "rows": table.rows,
                "empty": table.rows == 0,
                "partitioned": table.partitioned,
                "written_by": table.written_by,
            }
            for name, table in t.items()
        },
        "outputs": {"parquet": os.path.join(options.out, "parquet")},
    }
    return summary


def _warm_charts() -> threading.Thread:
    """Import matplotlib while Spark works (the import takes a second; the driver mostly waits meanwhile)."""

    def load() -> None:
        from migratory_spark import charts  # noqa: F401

    thread = threading.Thread(target=load, name="migratory-charts-import", daemon=True)
    thread.start()
    return thread


def run(spark: SparkSession, options: Options, step: Step = lambda _: None) -> dict[str, Any]:
    """Read, analyse, write Parquet, summary.json, charts and report.html; return the summary."""
    os.makedirs(options.out, exist_ok=True)
    step = timed_steps(spark, step)
    warming = _warm_charts() if options.charts else None
    step("reading logs")
    frames = read_logs(spark, options.dirs, options.since, options.until)
    analysis: Analysis | None = None
    try:
        step("counting lines")
        overview = Overview.from_rows(frames.overview.collect(), frames.skipped)
        analysis = analyze(spark, frames, options, overview, step)
        step("summary")
        summary = summarize(spark, analysis, options)
    finally:
        if analysis is not None:
            analysis.release()
        frames.unpersist()
    outputs = summary["outputs"]
    if options.charts:
        from migratory_spark import charts, html

        if warming is not None:
            warming.join()
        step("charts")
        outputs["charts"] = charts.draw_all(summary, os.path.join(options.out, "charts"))
        step("html report")
        outputs["html"] = html.write_report(summary, os.path.join(options.out, "report.html"))
    outputs["summary"] = os.path.join(options.out, "summary.json")
    with open(outputs["summary"], "w", encoding="utf-8") as handle:
        json.dump(summary, handle, indent=2, sort_keys=False)
        handle.write("\n")
    step("done")
    return summary
