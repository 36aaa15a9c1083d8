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

from migratory_spark.schema import STATS_INDICATORS

__all__ = [
    "INDICATORS",
    "WINDOWS",
    "concurrency_from_partials",
    "indicator_history",
    "indicator_windows",
    "indicators_per_second",
    "message_rates",
    "minute_partials",
    "rates_per_second",
    "traffic",
    "traffic_from_rates",
    "weight",
]

INDICATORS = STATS_INDICATORS  # the seven indicators of the seeds, as the server's stats.log names them

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
    _check_unit(unit)
    rates = message_rates(messages, F.date_trunc(unit, F.col("time")))
    return rates.withColumnRenamed("bucket", "start").withColumn("date", F.to_date("start")).orderBy("start")


def _check_unit(unit: str) -> None:
    if unit not in ("minute", "hour", "day"):
        raise ValueError(f"unit must be minute, hour or day, not {unit!r}")


_SUMS = ("messages_in", "messages_out", "bytes_in", "bytes_out", "lines")


def rates_per_second(messages: DataFrame) -> DataFrame:
    """Weighted messages and bytes in/out and logged lines per second (only the seconds that have any)."""
    return message_rates(messages, F.col("second")).withColumnRenamed("bucket", "second")


def traffic_from_rates(rates: DataFrame, unit: str) -> DataFrame:
    """:func:`traffic` from per-second rates (or from a finer traffic table with ``start``): sums add up exactly."""
    _check_unit(unit)
    time = F.col("start") if "start" in rates.columns else F.timestamp_seconds("second")
    start = F.date_trunc(unit, time)
    return (
        rates.groupBy(start.alias("start"))
        .agg(*[F.sum(name).alias(name) for name in _SUMS])
        .withColumn("date", F.to_date("start"))
        .orderBy("start")
    )


def indicators_per_second(
    access: DataFrame,
    messages: DataFrame,
    spark: SparkSession,
    rates: DataFrame | None = None,
    bounds: tuple[int, int] | None = None,
) -> DataFrame:
    """One row per second from the first to the last logged second, the seven indicators as columns.

    Connected clients is the running sum of connects minus disconnects. Sessions
    that were already connected when the logs begin show up as disconnects
    without a connect; the count is lifted by the deepest deficit so it never
    goes below zero. The running sum is computed per day and offset by the days
    before it, so no step moves every second into one partition. ``rates``
    (:func:`rates_per_second`) and ``bounds`` (first and last second), when the
    caller has them already, save a pass over the logs each.
    """
    if bounds is None:
        found = (
            access.select("second").unionByName(messages.select("second")).agg(F.min("second"), F.max("second")).first()
        )
        if found is not None and found[0] is not None:
            bounds = (int(found[0]), int(found[1]))
    if bounds is None:
        schema = "second BIGINT, time TIMESTAMP, date DATE, " + ", ".join(f"{name} DOUBLE" for name in INDICATORS)
        return spark.createDataFrame([], schema)
    first, last = bounds
    zero = F.lit(0.0)
    sums = ("messages_in", "messages_out", "bytes_in", "bytes_out")
    # every second of the period (zeros), the connects and disconnects, the message rates: summed per second
    quiet = spark.range(first, last + 1).select(
        F.col("id").alias("second"), zero.alias("connects"), zero.alias("disconnects"), *[zero.alias(n) for n in sums]
    )
    moves = access.where(F.col("event").isin("connect", "disconnect")).select(
        "second",
        (F.col("event") == "connect").cast("double").alias("connects"),
        (F.col("event") == "disconnect").cast("double").alias("disconnects"),
        *[zero.alias(n) for n in sums],
    )
    flows = (rates if rates is not None else rates_per_second(messages)).select(
        "second", zero.alias("connects"), zero.alias("disconnects"), *[F.col(n).cast("double").alias(n) for n in sums]
    )
    # one shuffle, by day: the sums per second and the running count within the day need no other
    per_second = (
        quiet.unionByName(moves)
        .unionByName(flows)
        .withColumn("day", F.floor(F.col("second") / _DAY))
        .repartition("day")
        .groupBy("day", "second")
        .agg(*[F.sum(n).alias(n) for n in ("connects", "disconnects", *sums)])
        .withColumn("delta", F.col("connects") - F.col("disconnects"))
    )
    in_day = Window.partitionBy("day").orderBy("second").rowsBetween(Window.unboundedPreceding, Window.currentRow)
    series = per_second.withColumn("running", F.sum("delta").over(in_day))
    # per day: its net change and its lowest point; the days before offset it, the deepest point lifts all
    days = series.groupBy("day").agg(F.sum("delta").alias("day_delta"), F.min("running").alias("low"))
    before = Window.orderBy("day").rowsBetween(Window.unboundedPreceding, -1)
    offsets = days.withColumn("offset", F.coalesce(F.sum("day_delta").over(before), F.lit(0.0)))
    offsets = offsets.withColumn(
        "lift", F.greatest(F.lit(0.0), -F.min(F.col("offset") + F.col("low")).over(Window.partitionBy()))
    ).select("day", (F.col("offset") + F.col("lift")).alias("base"))
    series = series.join(F.broadcast(offsets), "day").withColumn("connected_clients", F.col("running") + F.col("base"))
    time = F.timestamp_seconds("second")
    return series.select(
        "second",
        time.alias("time"),
        F.to_date(time).alias("date"),
        F.col("connected_clients").cast("double").alias("connected_clients"),
        F.col("connects").alias("connections_per_second"),
        F.col("disconnects").alias("disconnections_per_second"),
        *[F.col(n).alias(f"{n}_per_second") for n in sums],
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


def _moments() -> list[Column]:
    """Per-second values -> sums that merge exactly: count, total, squares, max, min, first second."""
    return [
        F.count(F.lit(1)).alias("n"),
        F.sum("value").alias("total"),
        F.sum(F.col("value") * F.col("value")).alias("squares"),
        F.max("value").alias("peak"),
        F.min("value").alias("low"),
        F.min("second").alias("first"),
    ]


def minute_partials(per_second: DataFrame, end_second: int | None = None) -> DataFrame:
    """The one pass over the per-second series that the windows and the history both merge from.

    Per epoch minute, indicator and *tag* (the smallest of :data:`WINDOWS` that
    holds the second, counted back from ``end_second``; null after it or beyond
    the largest): count, total, squares, max, min and the first second. Window
    ends are whole minutes apart, so a minute holds at most two tags.
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
    tagged = aged.withColumn("tag", F.when(F.col("age") >= 0, smallest)).withColumn(
        "minute", F.col("second") - F.col("second") % _MINUTE
    )
    return _stack(tagged, ["minute", "tag", "second"]).groupBy("minute", "tag", "indicator").agg(*_moments())


def indicator_windows(
    per_second: DataFrame,
    end_second: int | None = None,
    partials: DataFrame | None = None,
    first_second: int | None = None,
) -> DataFrame:
    """Max/avg/stddev of each indicator over the last 1/5/15 minutes ... months before ``end_second``.

    Windows nest: each second is summed once, into the smallest window that
    holds it (:func:`minute_partials`), and each window then merges its own tag
    and every smaller one (one small aggregation): exact. ``full_history`` is
    false for a window that reaches back before the first logged second
    (``first_second``): its figures are those of the shorter span the logs cover.
    """
    parts = partials if partials is not None else minute_partials(per_second, end_second)
    ordered = sorted(WINDOWS.items(), key=lambda item: item[1])
    # tag -> every window at least as long
    covers = F.lit(None).cast("array<string>")
    for index in reversed(range(len(ordered))):
        wider = F.array(*[F.lit(name) for name, _ in ordered[index:]])
        covers = F.when(F.col("tag") == ordered[index][0], wider).otherwise(covers)
    seconds = F.lit(None).cast("bigint")
    for name, length in ordered:
        seconds = F.when(F.col("window") == name, F.lit(length)).otherwise(seconds)
    merged = (
        parts.where(F.col("tag").isNotNull())
        .select(F.explode(covers).alias("window"), "indicator", "n", "total", "squares", "peak", "low", "first")
        .groupBy("window", "indicator")
        .agg(*_merged())
        .withColumn("seconds", seconds)
    )
    if first_second is None or end_second is None:
        found = per_second.agg(F.min("second").alias("begin"), F.max("second").alias("stop"))
        if end_second is not None:
            found = found.withColumn("stop", F.lit(end_second))
        if first_second is not None:
            found = found.withColumn("begin", F.lit(first_second))
        merged = merged.crossJoin(F.broadcast(found))
    else:
        merged = merged.withColumn("begin", F.lit(first_second)).withColumn("stop", F.lit(end_second))
    reach = F.col("stop") - F.col("seconds") + 1  # the window's first second
    return (
        _finish(merged)
        .select(
            "window",
            "seconds",
            "indicator",
            "max",
            "avg",
            "stddev",
            F.col("n").alias("samples"),
            (reach >= F.col("begin")).alias("full_history"),
        )
        .orderBy("indicator", "seconds")
    )


def _merged() -> list[Column]:
    return [
        F.sum("n").alias("n"),
        F.sum("total").alias("total"),
        F.sum("squares").alias("squares"),
        F.max("peak").alias("peak"),
        F.min("low").alias("low"),
        F.min("first").alias("first"),
    ]


def indicator_history(per_second: DataFrame, partials: DataFrame | None = None) -> DataFrame:
    """Max/avg/stddev per tumbling window of every size (epoch-aligned), for history beyond the server's memory.

    Seconds are first reduced to minute aggregates (:func:`minute_partials`);
    every window length is a multiple of a minute, so each window is an exact
    merge of whole minutes (one aggregation).
    """
    parts = partials if partials is not None else minute_partials(per_second)
    sizes = F.array(
        *[F.struct(F.lit(name).alias("window"), F.lit(seconds).alias("seconds")) for name, seconds in WINDOWS.items()]
    )
    exploded = parts.select("*", F.explode(sizes).alias("w")).select(
        F.col("w.window").alias("window"),
        F.col("w.seconds").alias("seconds"),
        (F.col("minute") - F.col("minute") % F.col("w.seconds")).alias("start_second"),
        "indicator",
        "n",
        "total",
        "squares",
        "peak",
        "low",
        "first",
    )
    grouped = exploded.groupBy("window", "seconds", "start_second", "indicator").agg(*_merged())
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


def concurrency_from_partials(partials: DataFrame) -> DataFrame:
    """Connected clients per minute (max, min, average), as ``sessions.concurrency`` but from the partials."""
    start = F.timestamp_seconds("minute")
    return (
        partials.where(F.col("indicator") == "connected_clients")
        .groupBy("minute")
        .agg(*_merged())
        .select(
            start.alias("start"),
            F.col("peak").alias("max"),
            F.col("low").alias("min"),
            (F.col("total") / F.col("n")).alias("avg"),
            F.to_date(start).alias("date"),
        )
        .orderBy("start")
    )
