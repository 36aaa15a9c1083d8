"""Latency: publish-to-fan-out percentiles (message.log ``latency_us``) per subject and over time.

Percentiles are ``percentile_approx`` with a high accuracy setting: exact
percentiles would need every value of a group on one executor.
"""

from __future__ import annotations

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

__all__ = ["ACCURACY", "PERCENTILES", "latency_by_subject", "latency_over_time", "latency_overall"]

PERCENTILES = (0.5, 0.9, 0.99, 0.999)
ACCURACY = 10000
_NAMES = ("p50_us", "p90_us", "p99_us", "p999_us")


def _columns() -> list[Column]:
    quantiles = F.percentile_approx("latency_us", list(PERCENTILES), ACCURACY)
    return [F.count(F.lit(1)).alias("messages"), quantiles.alias("q"), F.max("latency_us").alias("max_us")]


def _spread(frame: DataFrame, keys: list[str]) -> DataFrame:
    return frame.select(*keys, "messages", *[F.col("q")[i].alias(n) for i, n in enumerate(_NAMES)], "max_us")


def _timed(messages: DataFrame) -> DataFrame:
    return messages.where(F.col("latency_us").isNotNull())


def latency_overall(messages: DataFrame) -> DataFrame:
    """One row: percentiles over every logged publication."""
    return _spread(_timed(messages).agg(*_columns()), [])


def latency_by_subject(messages: DataFrame, totals: DataFrame | None = None) -> DataFrame:
    """Percentiles per subject, slowest p99 first (from ``subjects.subject_totals`` when given)."""
    if totals is not None:
        grouped = totals.where(F.col("timed") > 0).withColumnRenamed("timed", "messages")
    else:
        grouped = _timed(messages).groupBy("subject").agg(*_columns())
    return _spread(grouped, ["subject"]).orderBy(F.desc("p99_us"), "subject")


def latency_over_time(messages: DataFrame, unit: str = "minute") -> DataFrame:
    """Percentiles per ``second``, ``minute``, ``hour`` or ``day``."""
    bucket = F.timestamp_seconds("second") if unit == "second" else F.date_trunc(unit, "time")
    grouped = _timed(messages).groupBy(bucket.alias("start")).agg(*_columns())
    return _spread(grouped, ["start"]).withColumn("date", F.to_date("start")).orderBy("start")
