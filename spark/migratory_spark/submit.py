"""spark-submit entry point: the same job as ``migratory logs analyze``, on any master.

    spark-submit --master spark://host:7077 spark/migratory_spark/submit.py \\
        /var/log/migratorydata --out /data/report

The master comes from spark-submit (``--master``); the jobs use no Python UDFs,
so executors need only the JVM and the driver needs this package importable.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

if __package__ in (None, ""):  # run as a file by spark-submit: make the package importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from migratory_spark.times import parse_time

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="submit.py", description="Analyse MigratoryData access and message logs.")
    parser.add_argument("logdirs", nargs="+", help="log folders, one per server node (local paths or hdfs://, s3a://)")
    parser.add_argument("--out", required=True, help="output folder (Parquet, summary.json, charts, report.html)")
    parser.add_argument("--since", type=parse_time, help="first instant to include (ISO 8601, UTC by default)")
    parser.add_argument("--until", type=parse_time, help="first instant to exclude (ISO 8601, UTC by default)")
    parser.add_argument("--top", type=int, default=20, help="rows in top-N tables (default 20)")
    parser.add_argument("--no-charts", action="store_true", help="skip PNG charts and the HTML report")
    parser.add_argument("--quiet", action="store_true", help="do not print the report")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from migratory_spark.console import render
    from migratory_spark.report import Options, run
    from migratory_spark.session import build_session

    spark = build_session(master=None, app_name="migratory-logs")
    try:
        options = Options(
            dirs=args.logdirs,
            out=args.out,
            since=args.since,
            until=args.until,
            top=args.top,
            charts=not args.no_charts,
        )
        summary = run(spark, options)
    finally:
        spark.stop()
    if not args.quiet:
        render(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
