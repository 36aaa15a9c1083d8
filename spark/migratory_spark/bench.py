"""The log-analytics benchmark: generate N bytes of realistic logs, run the whole report, time it.

Rows/s counts every input line (access, message and corrupt) over the wall time
of the full job (parse, every analysis, Parquet, summary, charts, HTML), which
is what a user waits for.
"""

from __future__ import annotations

import os
import platform
import shutil
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from migratory_spark.generate import generate
from migratory_spark.report import Options, run
from migratory_spark.session import build_session

__all__ = ["run_bench"]


def run_bench(
    size_bytes: int,
    workdir: str,
    nodes: int = 2,
    master: str = "local[*]",
    driver_memory: str = "4g",
    keep: bool = False,
    step: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    """Generate, analyse, and return the measurements (the logs are removed unless ``keep``)."""
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
    spark = build_session(master, app_name="migratory-logs-bench", conf={"spark.driver.memory": driver_memory})
    started_s = time.perf_counter() - began
    try:
        began = time.perf_counter()
        summary = run(spark, Options(dirs=made.folders, out=out), step)
        analysed_s = time.perf_counter() - began
        version = spark.version
    finally:
        spark.stop()
    assert summary["lines"]["message"] == made.message_lines  # the run read everything it was given
    if not keep:
        shutil.rmtree(logs, ignore_errors=True)
    return {
        "benchmark": "log analytics (migratory logs analyze, whole report)",
        "date": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "system": platform.platform()},
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
        "rows_per_second": round(rows / analysed_s),
        "megabytes_per_second": round(made.bytes / 1e6 / analysed_s, 2),
    }
