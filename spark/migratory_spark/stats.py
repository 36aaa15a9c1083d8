"""stats.log: the indicators the server itself measured, per node over time.

The server writes every indicator every ``Stats.LogInterval`` seconds
(docs/logs.md): the last one-second sample (``current``) and its maxima and
averages over the last 1, 5 and 15 minutes. The reader parses the lines like
the other logs (rotations, ``.gz``, corrupt lines counted); here they become one
flat row per line (:func:`stats_per_node`), one summary row per node
(:func:`stats_nodes`) and a chart series (:func:`stats_series`).

The server's figures count every publication; the message log may be sampled,
so the two agree only within its ``MessageLogSampling``. A folder without
stats.log (a server older than the stats log, or ``Stats.LogInterval`` 0) is
a normal case: every table is empty and keeps its schema.
"""

from __future__ import annotations

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from migratory_spark.schema import STATS_INDICATORS, STATS_WINDOWS

__all__ = ["STATS_INDICATORS", "stats_nodes", "stats_per_node", "stats_series"]


def stats_per_node(stats: DataFrame) -> DataFrame:
    """One row per stats.log line: ``node`` (the log folder), ``server`` (the line's ``node``: ``node`` or
    ``member-N``), ``time``, ``second``, ``epoch``, ``uptime_s``, ``history_s``, each indicator's ``current``
    value under its own name and its windows as ``<indicator>_1m_max`` ... ``<indicator>_15m_avg``, the
    ``totals`` and ``denied`` maps, and ``date`` to partition by."""
    values: list[Column] = []
    for name in STATS_INDICATORS:
        values.append(F.col(name).getField("current").alias(name))
        values.extend(F.col(name).getField(window).alias(f"{name}_{window}") for window in STATS_WINDOWS)
    return stats.select(
        "node",
        "server",
        "time",
        "second",
        "epoch",
        "uptime_s",
        "history_s",
        *values,
        "totals",
        "denied",
        F.to_date("time").alias("date"),
    )


def stats_nodes(per_node: DataFrame) -> DataFrame:
    """Per node (folder and server name): lines, first and last line, epochs seen (a restart starts a new
    one), and each indicator's largest and average ``current`` value over the lines."""
    values: list[Column] = []
    for name in STATS_INDICATORS:
        values.append(F.max(name).alias(f"{name}_max"))
        values.append(F.avg(name).alias(f"{name}_avg"))
    return per_node.groupBy("node", "server").agg(
        F.count(F.lit(1)).alias("lines"),
        F.min("time").alias("first"),
        F.max("time").alias("last"),
        F.count_distinct("epoch").alias("epochs"),
        *values,
    )


def stats_series(per_node: DataFrame, unit: str) -> DataFrame:
    """The chart series: per node and ``unit`` (``second`` ... ``day``), each indicator's average ``current``
    value (a per-second rate, or clients), ordered by ``start`` and node."""
    if unit not in ("second", "minute", "hour", "day"):
        raise ValueError(f"unit must be second, minute, hour or day, not {unit!r}")
    return (
        per_node.groupBy(F.date_trunc(unit, "time").alias("start"), "node", "server")
        .agg(F.count(F.lit(1)).alias("lines"), *[F.avg(name).alias(name) for name in STATS_INDICATORS])
        .orderBy("start", "node", "server")
    )
