"""Subjects: publications, deliveries and bytes per subject, fan-out distribution,
and subjects published but never subscribed (candidates for a wasted feed).

:func:`subject_totals` groups the logs by subject once (publication totals,
subscriptions and the fan-out latency percentiles together); the subject
tables and ``latency.latency_by_subject`` are projections of it.
"""

from __future__ import annotations

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from migratory_spark.latency import ACCURACY, PERCENTILES
from migratory_spark.traffic import weight

__all__ = [
    "FANOUT_BUCKETS",
    "STATS_COLUMNS",
    "fanout_distribution",
    "subject_stats",
    "subject_totals",
    "unsubscribed_subjects",
]

# (label, lowest recipients, highest recipients); None = no upper bound
FANOUT_BUCKETS: tuple[tuple[str, int, int | None], ...] = (
    ("0", 0, 0),
    ("1", 1, 1),
    ("2-10", 2, 10),
    ("11-100", 11, 100),
    ("101-1000", 101, 1000),
    ("1001-10000", 1001, 10000),
    (">10000", 10001, None),
)

STATS_COLUMNS = (
    "subject",
    "publications",
    "deliveries",
    "bytes_in",
    "bytes_out",
    "max_fanout",
    "no_subscriber",
    "subscriptions",
    "subscriber_sessions",
)


def _bucket(index: int) -> Column:
    _, low, high = FANOUT_BUCKETS[index]
    recipients = F.col("recipients")
    return recipients >= low if high is None else recipients.between(low, high)


def subject_totals(access: DataFrame, messages: DataFrame) -> DataFrame:
    """One row per subject seen published or subscribed (and one for publications without a subject):
    :data:`STATS_COLUMNS`, then ``timed`` (publications with a latency), ``q`` (their latency
    percentiles), ``max_us`` and ``fanout_0`` ... (publications per :data:`FANOUT_BUCKETS` bucket)."""
    w = weight()
    published = messages.groupBy("subject").agg(
        F.sum(w).alias("publications"),
        F.sum(F.coalesce("recipients", F.lit(0)) * w).alias("deliveries"),
        F.sum(F.coalesce("size", F.lit(0)) * w).alias("bytes_in"),
        F.sum(F.coalesce("bytes_out", F.lit(0)) * w).alias("bytes_out"),
        F.max("recipients").alias("max_fanout"),
        F.sum(F.when(F.col("status") == "NO_SUBSCRIBER", w).otherwise(0.0)).alias("no_subscriber"),
        F.count("latency_us").alias("timed"),
        F.percentile_approx("latency_us", list(PERCENTILES), ACCURACY).alias("q"),
        F.max("latency_us").alias("max_us"),
        *[F.sum(F.when(_bucket(i), w).otherwise(0.0)).alias(f"fanout_{i}") for i in range(len(FANOUT_BUCKETS))],
    )
    subscribed = (
        access.where(F.col("event") == "subscribe")
        .groupBy("subject")
        .agg(F.count(F.lit(1)).alias("subscriptions"), F.countDistinct("session_key").alias("subscriber_sessions"))
    )
    return (
        published.join(subscribed, "subject", "full_outer")
        .fillna(0, subset=["publications", "deliveries", "bytes_in", "bytes_out", "no_subscriber"])
        .fillna(0, subset=["subscriptions", "subscriber_sessions", "max_fanout", "timed"])
    )


def subject_stats(access: DataFrame, messages: DataFrame, totals: DataFrame | None = None) -> DataFrame:
    """One row per subject seen published or subscribed: every total a top-N table sorts by."""
    source = totals if totals is not None else subject_totals(access, messages)
    return source.where(F.col("subject").isNotNull()).select(*STATS_COLUMNS)


def fanout_distribution(messages: DataFrame, totals: DataFrame | None = None) -> DataFrame:
    """Publications (weighted) per bucket of recipients, in bucket order (summed from ``totals`` when given)."""
    if totals is not None:
        sums = totals.agg(*[F.sum(f"fanout_{i}").alias(f"fanout_{i}") for i in range(len(FANOUT_BUCKETS))])
        pairs = ", ".join(f"{i}, '{name}', fanout_{i}" for i, (name, _, _) in enumerate(FANOUT_BUCKETS))
        counted = sums.select(
            F.expr(f"stack({len(FANOUT_BUCKETS)}, {pairs}) as (bucket_order, recipients, publications)")
        ).where(F.col("publications") > 0)
    else:
        label = F.lit(None).cast("string")
        order = F.lit(None).cast("int")
        for index, (name, _, _) in reversed(list(enumerate(FANOUT_BUCKETS))):
            label = F.when(_bucket(index), F.lit(name)).otherwise(label)
            order = F.when(_bucket(index), F.lit(index)).otherwise(order)
        counted = (
            messages.where(F.col("recipients").isNotNull())
            .groupBy(order.alias("bucket_order"), label.alias("recipients"))
            .agg(F.sum(weight()).alias("publications"))
        )
    total = counted.agg(F.sum("publications").alias("all"))
    return (
        counted.crossJoin(F.broadcast(total))
        .withColumn("share", F.col("publications") / F.col("all"))
        .drop("all")
        .orderBy("bucket_order")
    )


def unsubscribed_subjects(access: DataFrame, messages: DataFrame, totals: DataFrame | None = None) -> DataFrame:
    """Subjects published in the period that no client subscribed to in the period."""
    source = totals if totals is not None else subject_totals(access, messages)
    return (
        source.where(F.col("subject").isNotNull() & (F.col("publications") > 0) & (F.col("subscriptions") == 0))
        .select("subject", "publications", "bytes_in")
        .orderBy(F.desc("publications"), "subject")
    )
