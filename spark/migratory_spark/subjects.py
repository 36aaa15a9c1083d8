"""Subjects: publications, deliveries and bytes per subject, fan-out distribution,
and subjects published but never subscribed (candidates for a wasted feed).
"""

from __future__ import annotations

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from migratory_spark.traffic import weight

__all__ = ["FANOUT_BUCKETS", "fanout_distribution", "subject_stats", "unsubscribed_subjects"]

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


def subject_stats(access: DataFrame, messages: DataFrame) -> DataFrame:
    """One row per subject seen published or subscribed: every total a top-N table sorts by."""
    w = weight()
    published = messages.groupBy("subject").agg(
        F.sum(w).alias("publications"),
        F.sum(F.coalesce("recipients", F.lit(0)) * w).alias("deliveries"),
        F.sum(F.coalesce("size", F.lit(0)) * w).alias("bytes_in"),
        F.sum(F.coalesce("bytes_out", F.lit(0)) * w).alias("bytes_out"),
        F.max("recipients").alias("max_fanout"),
        F.sum(F.when(F.col("status") == "NO_SUBSCRIBER", w).otherwise(0.0)).alias("no_subscriber"),
    )
    subscribed = (
        access.where(F.col("event") == "subscribe")
        .groupBy("subject")
        .agg(F.count(F.lit(1)).alias("subscriptions"), F.countDistinct("session_key").alias("subscriber_sessions"))
    )
    return (
        published.join(subscribed, "subject", "full_outer")
        .fillna(0, subset=["publications", "deliveries", "bytes_in", "bytes_out", "no_subscriber"])
        .fillna(0, subset=["subscriptions", "subscriber_sessions", "max_fanout"])
        .where(F.col("subject").isNotNull())
    )


def fanout_distribution(messages: DataFrame) -> DataFrame:
    """Publications (weighted) per bucket of recipients, in bucket order."""
    label = F.lit(None).cast("string")
    order = F.lit(None).cast("int")
    for index, (name, low, high) in reversed(list(enumerate(FANOUT_BUCKETS))):
        inside = F.col("recipients") >= low if high is None else F.col("recipients").between(low, high)
        label = F.when(inside, F.lit(name)).otherwise(label)
        order = F.when(inside, F.lit(index)).otherwise(order)
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


def unsubscribed_subjects(access: DataFrame, messages: DataFrame) -> DataFrame:
    """Subjects published in the period that no client subscribed to in the period."""
    subscribed = access.where(F.col("event") == "subscribe").select("subject").distinct()
    return (
        messages.join(subscribed, "subject", "left_anti")
        .groupBy("subject")
        .agg(F.sum(weight()).alias("publications"), F.sum(F.coalesce("size", F.lit(0)) * weight()).alias("bytes_in"))
        .orderBy(F.desc("publications"), "subject")
    )
