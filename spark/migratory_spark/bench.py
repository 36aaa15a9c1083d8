"""The log-analytics benchmark: generate N bytes of realistic logs, run the whole report, time it.

Rows/s counts every input line (access, message and corrupt) over the wall time
of the full job (parse, every analysis, Parquet, summary, charts, HTML), which
is what a user waits for; ``total_seconds`` adds the start of Spark (the JVM) to
it. In the same run, on the same files, DuckDB computes the traffic and subject
tables (the single-machine tool a user might reach for instead) as a reference.
With ``against``, an earlier commit's report and this one's then run in turn on
the same files (:mod:`migratory_spark.against`), for goals stated against it.
"""

from __future__ import annotations

import os
import platform
import shutil
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any

from migratory_spark.against import run_against
from migratory_spark.generate import generate
from migratory_spark.reader import log_files
from migratory_spark.report import Options, run, timed_steps
from migratory_spark.session import build_session, input_bytes

__all__ = ["duckdb_reference", "run_bench"]

# the columns DuckDB reads: what the traffic and subject tables need
_MESSAGE_COLUMNS = {
    "v": "INTEGER",
    "ts": "VARCHAR",
    "event": "VARCHAR",
    "subject": "VARCHAR",
    "size": "BIGINT",
    "recipients": "BIGINT",
    "bytes_out": "BIGINT",
    "status": "VARCHAR",
    "sampling": "DOUBLE",
}
_ACCESS_COLUMNS = {"v": "INTEGER", "ts": "VARCHAR", "event": "VARCHAR", "session": "VARCHAR", "subject": "VARCHAR"}


def _columns(spec: dict[str, str]) -> str:
    return "{" + ", ".join(f"{name}: '{kind}'" for name, kind in spec.items()) + "}"


def _files(folders: Sequence[str], name: str) -> list[str]:
    return [p.removeprefix("file://") for paths in log_files(folders, name)[0].values() for p in paths]


def duckdb_reference(folders: Sequence[str], out: str) -> dict[str, Any]:
    """DuckDB on the same files: traffic per minute, hour and day and the subject table, written as Parquet."""
    import duckdb

    os.makedirs(out, exist_ok=True)
    began = time.perf_counter()
    con = duckdb.connect()
    con.execute("SET TimeZone = 'UTC'")
    good = "v = 1 AND event IS NOT NULL AND time IS NOT NULL"
    for table, name, spec in (("m", "message.log", _MESSAGE_COLUMNS), ("a", "access.log", _ACCESS_COLUMNS)):
        files = _files(folders, name)
        con.execute(
            f"CREATE TEMP TABLE {table} AS SELECT *, try_cast(ts AS TIMESTAMPTZ) AS time "
            f"FROM read_json(?, format = 'newline_delimited', columns = {_columns(spec)}, ignore_errors = true)",
            [files],
        )
        con.execute(f"DELETE FROM {table} WHERE NOT ({good}) OR ({good}) IS NULL")
    weight = "CASE WHEN sampling IS NULL OR sampling <= 0 OR sampling >= 1 THEN 1.0 ELSE 1.0 / sampling END"
    sums = (
        f"sum({weight}) AS messages_in, sum(coalesce(recipients, 0) * {weight}) AS messages_out, "
        f"sum(coalesce(size, 0) * {weight}) AS bytes_in, sum(coalesce(bytes_out, 0) * {weight}) AS bytes_out, "
        "count(*) AS lines"
    )
    queries = {
        unit: f"SELECT date_trunc('{unit}', time) AS start, {sums} FROM m GROUP BY 1 ORDER BY 1"
        for unit in ("minute", "hour", "day")
    }
    queries["subject_stats"] = (
        "WITH p AS (SELECT subject, "
        f"sum({weight}) AS publications, sum(coalesce(recipients, 0) * {weight}) AS deliveries, "
        f"sum(coalesce(size, 0) * {weight}) AS bytes_in, sum(coalesce(bytes_out, 0) * {weight}) AS bytes_out, "
        "max(recipients) AS max_fanout, "
        f"sum(CASE WHEN status = 'NO_SUBSCRIBER' THEN {weight} ELSE 0 END) AS no_subscriber "
        "FROM m GROUP BY subject), "
        "s AS (SELECT subject, count(*) AS subscriptions, count(DISTINCT session) AS subscriber_sessions "
        "FROM a WHERE event = 'subscribe' GROUP BY subject) "
        "SELECT coalesce(p.subject, s.subject) AS subject, coalesce(publications, 0) AS publications, "
        "coalesce(deliveries, 0) AS deliveries, coalesce(bytes_in, 0) AS bytes_in, "
        "coalesce(bytes_out, 0) AS bytes_out, coalesce(max_fanout, 0) AS max_fanout, "
        "coalesce(no_subscriber, 0) AS no_subscriber, coalesce(subscriptions, 0) AS subscriptions, "
        "coalesce(subscriber_sessions, 0) AS subscriber_sessions "
        "FROM p FULL OUTER JOIN s ON p.subject = s.subject WHERE coalesce(p.subject, s.subject) IS NOT NULL"
    )
    rows: dict[str, int] = {}
    for name, query in queries.items():
        table = name if name == "subject_stats" else f"traffic_per_{name}"
        target = os.path.join(out, f"{table}.parquet")
        con.execute(f"COPY ({query}) TO '{target}' (FORMAT parquet)")
        found = con.execute(f"SELECT count(*) FROM '{target}'").fetchone()
        rows[table] = int(found[0]) if found else 0
    seconds = time.perf_counter() - began
    totals = con.execute(f"SELECT sum({weight}), count(*) FROM m").fetchone()
    subjects = rows["subject_stats"]
    con.close()
    return {
        "version": duckdb.__version__,
        "seconds": round(seconds, 2),
        "tables": rows,
        "messages_in": float(totals[0] or 0) if totals else 0.0,
        "subjects": subjects,
    }


def run_bench(
    size_bytes: int,
    workdir: str,
    nodes: int = 2,
    master: str = "local[*]",
    driver_memory: str = "4g",
    keep: bool = False,
    step: Callable[[str], None] = lambda _: None,
    duckdb: bool = True,
    against: str | None = None,
    rounds: int = 3,
) -> dict[str, Any]:
    """Generate, analyse (Spark, then DuckDB), and return the measurements (logs removed unless ``keep``)."""
    load_before = _load()
    logs = os.path.join(workdir, "logs")
    out = os.path.join(workdir, "report")
    shutil.rmtree(workdir, ignore_errors=True)
    step("generating logs")
    began = time.perf_counter()
    made = generate(logs, size_bytes, nodes=nodes)
    generated_s = time.perf_counter() - began
    rows = made.access_lines + made.message_lines + made.corrupt_lines
    step("starting Spark")
    began = time.perf_counter()
    spark = build_session(
        master,
        app_name="migratory-logs-bench",
        conf={"spark.driver.memory": driver_memory},
        input_size=input_bytes(made.folders),
    )
    started_s = time.perf_counter() - began
    phases: list[dict[str, Any]] = []  # each step: seconds into the report, Spark jobs so far
    try:
        began = time.perf_counter()
        summary = run(spark, Options(dirs=made.folders, out=out), timed_steps(spark, step, phases, show=False))
        analysed_s = time.perf_counter() - began
        jobs = len(spark.sparkContext.statusTracker().getJobIdsForGroup())
        phases.append({"step": "done", "seconds": round(analysed_s, 2), "jobs": jobs})
        version = spark.version
    finally:
        spark.stop()
    assert summary["lines"]["message"] == made.message_lines  # the run read everything it was given
    reference: dict[str, Any] | None = None
    if duckdb:
        step("DuckDB: traffic and subject tables")
        reference = duckdb_reference(made.folders, os.path.join(workdir, "duckdb"))
        # the same answers, or the comparison means nothing
        assert abs(reference["messages_in"] - summary["traffic"]["totals"]["messages_in"]) < 1e-6 * max(
            1.0, reference["messages_in"]
        ), (reference["messages_in"], summary["traffic"]["totals"]["messages_in"])
        assert reference["subjects"] == summary["subjects"]["count"], (reference["subjects"], summary["subjects"])
    side_by_side: dict[str, Any] | None = None
    if against is not None:
        side_by_side = run_against(
            against, made.folders, os.path.join(workdir, "against"), rounds, master, driver_memory, step
        )
    if not keep:
        shutil.rmtree(logs, ignore_errors=True)
    result: dict[str, Any] = {
        "benchmark": "log analytics (migratory logs analyze, whole report)",
        "date": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "system": platform.platform(),
            "load_average_before": load_before,  # 1, 5, 15 minutes: a busy machine shows here
            "load_average_after": _load(),
        },
        "spark": {"version": version, "master": master, "driver_memory": driver_memory},
        "input": {
            "bytes": made.bytes,
            "nodes": nodes,
            "access_lines": made.access_lines,
            "message_lines": made.message_lines,
            "corrupt_lines": made.corrupt_lines,
            "period": [made.first.isoformat(), made.last.isoformat()],
        },
        "generate_seconds": round(generated_s, 2),
        "spark_start_seconds": round(started_s, 2),
        "analyze_seconds": round(analysed_s, 2),
        "total_seconds": round(started_s + analysed_s, 2),
        "rows_per_second": round(rows / analysed_s),
        "megabytes_per_second": round(made.bytes / 1e6 / analysed_s, 2),
        "spark_jobs": phases[-1]["jobs"] if phases else None,
        "phases": phases,
    }
    if reference is not None:
        result["duckdb"] = reference
    if side_by_side is not None:
        result["against"] = side_by_side
    return result


def _load() -> list[float] | None:
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except OSError:
        return None
