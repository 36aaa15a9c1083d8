"""Sessions: concurrency over time, how long sessions last and why they end,
reconnect storms from one address, clients per listener, TLS against plain.
"""

from __future__ import annotations

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

__all__ = [
    "DURATION_BUCKETS",
    "clients_per_listener",
    "concurrency",
    "disconnect_reasons",
    "duration_distribution",
    "duration_percentiles",
    "reconnect_storms",
    "tls_share",
]

# (label, lowest ms, highest ms exclusive); None = no upper bound
DURATION_BUCKETS: tuple[tuple[str, int, int | None], ...] = (
    ("<1s", 0, 1_000),
    ("1-10s", 1_000, 10_000),
    ("10s-1m", 10_000, 60_000),
    ("1-10m", 60_000, 600_000),
    ("10m-1h", 600_000, 3_600_000),
    ("1h-1d", 3_600_000, 86_400_000),
    (">=1d", 86_400_000, None),
)


def _share(frame: DataFrame, count: str) -> DataFrame:
    total = frame.agg(F.sum(count).alias("all"))
    return frame.crossJoin(F.broadcast(total)).withColumn("share", F.col(count) / F.col("all")).drop("all")


def concurrency(per_second: DataFrame) -> DataFrame:
    """Connected clients per minute (max, min, average of the per-second counts)."""
    return (
        per_second.groupBy(F.date_trunc("minute", "time").alias("start"))
        .agg(
            F.max("connected_clients").alias("max"),
            F.min("connected_clients").alias("min"),
            F.avg("connected_clients").alias("avg"),
        )
        .withColumn("date", F.to_date("start"))
        .orderBy("start")
    )


def duration_distribution(access: DataFrame) -> DataFrame:
    """Ended sessions per duration bucket, in bucket order."""
    label = F.lit(None).cast("string")
    order = F.lit(None).cast("int")
    duration = F.col("duration_ms")
    for index, (name, low, high) in reversed(list(enumerate(DURATION_BUCKETS))):
        inside = duration >= low if high is None else (duration >= low) & (duration < high)
        label = F.when(inside, F.lit(name)).otherwise(label)
        order = F.when(inside, F.lit(index)).otherwise(order)
    ended = access.where((F.col("event") == "disconnect") & duration.isNotNull())
    counted = ended.groupBy(order.alias("bucket_order"), label.alias("duration")).agg(
        F.count(F.lit(1)).alias("sessions")
    )
    return _share(counted, "sessions").orderBy("bucket_order")


def duration_percentiles(access: DataFrame) -> DataFrame:
    """p50/p90/p99 and max of session duration in milliseconds (one row)."""
    ended = access.where((F.col("event") == "disconnect") & F.col("duration_ms").isNotNull())
    quantiles = F.percentile_approx("duration_ms", [0.5, 0.9, 0.99], 10000)
    return ended.agg(
        F.count(F.lit(1)).alias("sessions"),
        quantiles.alias("q"),
        F.max("duration_ms").alias("max_ms"),
        F.avg("duration_ms").alias("avg_ms"),
    ).select(
        "sessions",
        F.col("q")[0].alias("p50_ms"),
        F.col("q")[1].alias("p90_ms"),
        F.col("q")[2].alias("p99_ms"),
        "max_ms",
        "avg_ms",
    )


def disconnect_reasons(access: DataFrame) -> DataFrame:
    """Disconnects per reason with their share, most frequent first."""
    counted = (
        access.where(F.col("event") == "disconnect")
        .groupBy(F.coalesce("reason", F.lit("unknown")).alias("reason"))
        .agg(F.count(F.lit(1)).alias("disconnects"))
    )
    return _share(counted, "disconnects").orderBy(F.desc("disconnects"), "reason")


def reconnect_storms(access: DataFrame, window_seconds: int = 60, threshold: int = 20) -> DataFrame:
    """Addresses that connected at least ``threshold`` times within ``window_seconds``.

    Windows slide by half their length, so any burst shorter than half a window
    falls whole into one of them. One row per address: the worst window's count
    and start, and the first and last storm window.
    """
    length = f"{window_seconds} seconds"
    slide = f"{max(1, window_seconds // 2)} seconds"
    connects = access.where(F.col("event") == "connect")
    windows = (
        connects.groupBy("addr", F.window("time", length, slide).alias("w"))
        .agg(F.count(F.lit(1)).alias("connects"))
        .where(F.col("connects") >= threshold)
    )
    return (
        windows.groupBy("addr")
        .agg(
            F.max(F.struct("connects", F.col("w.start").alias("start"))).alias("worst"),
            F.min("w.start").alias("first_window"),
            F.max("w.end").alias("last_window_end"),
            F.count(F.lit(1)).alias("storm_windows"),
        )
        .select(
            "addr",
            F.col("worst.connects").alias("peak_connects"),
            F.col("worst.start").alias("peak_window_start"),
            "first_window",
            "last_window_end",
            "storm_windows",
            F.lit(window_seconds).alias("window_seconds"),
        )
        .orderBy(F.desc("peak_connects"), "addr")
    )


def clients_per_listener(access: DataFrame) -> DataFrame:
    """Per listener and protocol: sessions opened and distinct client addresses."""
    return (
        access.where(F.col("event") == "connect")
        .groupBy("listener", "protocol")
        .agg(F.count(F.lit(1)).alias("sessions"), F.countDistinct("addr").alias("addresses"))
        .orderBy(F.desc("sessions"), "listener")
    )


def tls_share(access: DataFrame) -> DataFrame:
    """Sessions opened over TLS and in plain text, with their share."""
    counted = (
        access.where(F.col("event") == "connect")
        .groupBy(F.when(F.coalesce("tls", F.lit(False)), "tls").otherwise("plain").alias("transport"))
        .agg(F.count(F.lit(1)).alias("sessions"))
    )
    return _share(counted, "sessions").orderBy("transport")
