"""Traffic: messages and bytes in/out per minute, hour and day, and the seven
monitoring indicators (docs/logs.md; the seed's monitoring list) rebuilt from
the logs per second, summarised with max/avg/stddev over the last 1/5/15
minutes ... months and, as history, over every tumbling window of those sizes.

Everything is computed from per-second rows, never from raw lines on the
driver. The message log may be sampled: each logged publication stands for
``1/sampling`` publications, so message and byte counts are weighted.
"""

from __future__ import annotations

from pyspark.sql import Column, DataFrame, SparkSession, Window
from pyspark.sql import functions as F

__all__ = [
    "INDICATORS",
    "WINDOWS",
    "indicator_history",
    "indicator_windows",
    "indicators_per_second",
    "message_rates",
    "traffic",
    "weight",
]

INDICATORS = (
    "connected_clients",
    "connections_per_second",
    "disconnections_per_second",
    "messages_in_per_second",
    "messages_out_per_second",
    "bytes_in_per_second",
    "bytes_out_per_second",
)

_MINUTE, _HOUR, _DAY = 60, 3600, 86400
_MONTH = 30 * _DAY
# the same names and lengths as the server's /stats (migratory/stats.py)
WINDOWS: dict[str, int] = {
    "1m": _MINUTE,
    "5m": 5 * _MINUTE,
    "15m": 15 * _MINUTE,
    "1h": _HOUR,
    "5h": 5 * _HOUR,
    "15h": 15 * _HOUR,
    "1d": _DAY,
    "5d": 5 * _DAY,
    "15d": 15 * _DAY,
    "1mo": _MONTH,
    "5mo": 5 * _MONTH,
    "15mo": 15 * _MONTH,
}


def weight() -> Column:
    """How many publications one message.log line stands for."""
    sampling = F.col("sampling")
    return F.when(sampling.isNull() | (sampling <= 0) | (sampling >= 1), F.lit(1.0)).otherwise(1.0 / sampling)


def message_rates(messages: DataFrame, bucket: Column) -> DataFrame:
    """Weighted messages and bytes in/out grouped by ``bucket``."""
    w = weight()
    return messages.groupBy(bucket.alias("bucket")).agg(
        F.sum(w).alias("messages_in"),
        F.sum(F.coalesce(F.col("recipients"), F.lit(0)) * w).alias("messages_out"),
        F.sum(F.coalesce(F.col("size"), F.lit(0)) * w).alias("bytes_in"),
        F.sum(F.coalesce(F.col("bytes_out"), F.lit(0)) * w).alias("bytes_out"),
        F.count(F.lit(1)).alias("lines"),
    )


def traffic(messages: DataFrame, unit: str) -> DataFrame:
    """Messages and bytes in/out per ``minute``, ``hour`` or ``day`` (UTC), with a ``date`` to partition by."""
    if unit not in ("minute", "hour", "day"):
        raise ValueError(f"unit must be minute, hour or day, not {unit!r}")
    rates = message_rates(messages, F.date_trunc(unit, F.col("time")))
    return rates.withColumnRenamed("bucket", "start").withColumn("date", F.to_date("start")).orderBy("start")


def indicators_per_second(access: DataFrame, messages: DataFrame, spark: SparkSession) -> DataFrame:
    """One row per second from the first to the last logged second, the seven indicators as columns.

    Connected clients is the running sum of connects minus disconnects. Sessions
    that were already connected when the logs begin show up as disconnects
    without a connect; the count is lifted by the deepest deficit so it never
    goes below zero. The running sum is computed per day and offset by the days
    before it, so no step moves every second into one partition.
    """
    events = access.where(F.col("event").isin("connect", "disconnect"))
    per_event = events.groupBy("second").agg(
        F.sum(F.when(F.col("event") == "connect", 1).otherwise(0)).alias("connections_per_second"),
        F.sum(F.when(F.col("event") == "disconnect", 1).otherwise(0)).alias("disconnections_per_second"),
    )
    rates = message_rates(messages, F.col("second")).select(
        F.col("bucket").alias("second"),
        F.col("messages_in").alias("messages_in_per_second"),
        F.col("messages_out").alias("messages_out_per_second"),
        F.col("bytes_in").alias("bytes_in_per_second"),
        F.col("bytes_out").alias("bytes_out_per_second"),
    )
    bounds = (
        access.select("second").unionByName(messages.select("second")).agg(F.min("second"), F.max("second")).first()
    )
    if bounds is None or bounds[0] is None:
        schema = "second BIGINT, time TIMESTAMP, date DATE, " + ", ".join(f"{name} DOUBLE" for name in INDICATORS)
        return spark.createDataFrame([], schema)
    first, last = int(bounds[0]), int(bounds[1])
    seconds = spark.range(first, last + 1).withColumnRenamed("id", "second")
    series = (
        seconds.join(per_event, "second", "left")
        .join(rates, "second", "left")
        .fillna(0)
        .withColumn("day", F.floor(F.col("second") / _DAY))
        .withColumn("delta", F.col("connections_per_second") - F.col("disconnections_per_second"))
    )
    in_day = Window.partitionBy("day").orderBy("second").rowsBetween(Window.unboundedPreceding, Window.currentRow)
    series = series.withColumn("running", F.sum("delta").over(in_day))
    days = series.groupBy("day").agg(F.sum("delta").alias("day_delta"))
    before = Window.orderBy("day").rowsBetween(Window.unboundedPreceding, -1)
    offsets = days.withColumn("offset", F.coalesce(F.sum("day_delta").over(before), F.lit(0))).select("day", "offset")
    series = series.join(F.broadcast(offsets), "day").withColumn("level", F.col("running") + F.col("offset"))
    deficit = series.agg(F.greatest(F.lit(0), -F.min("level")).alias("lift"))
    series = series.crossJoin(F.broadcast(deficit)).withColumn(
        "connected_clients", (F.col("level") + F.col("lift")).cast("double")
    )
    time = F.timestamp_seconds("second")
    return series.select(
        "second",
        time.alias("time"),
        F.to_date(time).alias("date"),
        *[F.col(name).cast("double").alias(name) for name in INDICATORS],
    )


def _stack(frame: DataFrame, keys: list[str]) -> DataFrame:
    """Wide indicator columns -> one row per (keys, indicator, value)."""
    pairs = ", ".join(f"'{name}', `{name}`" for name in INDICATORS)
    return frame.select(*keys, F.expr(f"stack({len(INDICATORS)}, {pairs}) as (indicator, value)"))


def _finish(grouped: DataFrame) -> DataFrame:
    """n/total/squares/peak -> max, avg, population stddev (as the server's /stats)."""
    mean = F.col("total") / F.col("n")
    variance = F.greatest(F.lit(0.0), F.col("squares") / F.col("n") - mean * mean)
    return grouped.withColumn("avg", mean).withColumn("stddev", F.sqrt(variance)).withColumnRenamed("peak", "max")


def indicator_windows(per_second: DataFrame, end_second: int | None = None) -> DataFrame:
    """Max/avg/stddev of each indicator over the last 1/5/15 minutes ... months before ``end_second``.

    Windows nest, so each second is aggregated once into the smallest window that
    holds it and the windows are then merged cumulatively: exact, one pass.
    """
    ordered = sorted(WINDOWS.items(), key=lambda item: item[1])
    smallest = F.lit(None).cast("string")
    for name, seconds in reversed(ordered):
        smallest = F.when(F.col("age") < seconds, F.lit(name)).otherwise(smallest)
    if end_second is None:
        last = per_second.agg(F.max("second").alias("end"))
        aged = per_second.crossJoin(F.broadcast(last)).withColumn("age", F.col("end") - F.col("second"))
    else:
        aged = per_second.withColumn("age", F.lit(end_second) - F.col("second"))
    aged = aged.where(F.col("age") >= 0).withColumn("window", smallest).where(F.col("window").isNotNull())
    long = _stack(aged, ["window"])
    parts = long.groupBy("window", "indicator").agg(
        F.count(F.lit(1)).alias("n"),
        F.sum("value").alias("total"),
        F.sum(F.col("value") * F.col("value")).alias("squares"),
        F.max("value").alias("peak"),
    )
    spark = per_second.sparkSession
    names = spark.createDataFrame(ordered, "window STRING, seconds BIGINT").crossJoin(
        spark.createDataFrame([(name,) for name in INDICATORS], "indicator STRING")
    )
    full = names.join(parts, ["window", "indicator"], "left").fillna(0, subset=["n", "total", "squares"])
    upto = Window.partitionBy("indicator").orderBy("seconds").rowsBetween(Window.unboundedPreceding, Window.currentRow)
    merged = full.select(
        "window",
        "seconds",
        "indicator",
        F.sum("n").over(upto).alias("n"),
        F.sum("total").over(upto).alias("total"),
        F.sum("squares").over(upto).alias("squares"),
        F.max("peak").over(upto).alias("peak"),
    )
    return (
        _finish(merged.where(F.col("n") > 0))
        .select("window", "seconds", "indicator", "max", "avg", "stddev", F.col("n").alias("samples"))
        .orderBy("indicator", "seconds")
    )


def indicator_history(per_second: DataFrame) -> DataFrame:
    """Max/avg/stddev per tumbling window of every size (epoch-aligned), for history beyond the server's memory.

    Seconds are first reduced to minute aggregates; every window length is a
    multiple of a minute, so each window is an exact merge of whole minutes.
    """
    long = _stack(per_second, ["second"]).withColumn("minute", F.col("second") - F.col("second") % _MINUTE)
    minutes = long.groupBy("minute", "indicator").agg(
        F.count(F.lit(1)).alias("n"),
        F.sum("value").alias("total"),
        F.sum(F.col("value") * F.col("value")).alias("squares"),
        F.max("value").alias("peak"),
    )
    sizes = F.array(
        *[F.struct(F.lit(name).alias("window"), F.lit(seconds).alias("seconds")) for name, seconds in WINDOWS.items()]
    )
    exploded = minutes.select("*", F.explode(sizes).alias("w")).select(
        F.col("w.window").alias("window"),
        F.col("w.seconds").alias("seconds"),
        (F.col("minute") - F.col("minute") % F.col("w.seconds")).alias("start_second"),
        "indicator",
        "n",
        "total",
        "squares",
        "peak",
    )
    grouped = exploded.groupBy("window", "seconds", "start_second", "indicator").agg(
        F.sum("n").alias("n"),
        F.sum("total").alias("total"),
        F.sum("squares").alias("squares"),
        F.max("peak").alias("peak"),
    )
    start = F.timestamp_seconds("start_second")
    return _finish(grouped).select(
        "window",
        "seconds",
        start.alias("start"),
        F.to_date(start).alias("date"),
        "indicator",
        "max",
        "avg",
        "stddev",
        F.col("n").alias("samples"),
    )
