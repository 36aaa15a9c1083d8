"""Security audit: every ``denied`` access-log line, by reason, address, subject and request."""

from __future__ import annotations

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

__all__ = ["denied", "denied_by_address", "denied_by_reason", "denied_by_subject", "denied_over_time"]


def denied(access: DataFrame) -> DataFrame:
    """The denied events only, with their reason code never null."""
    return access.where(F.col("event") == "denied").withColumn(
        "reason_code", F.coalesce("reason_code", F.lit("unknown"))
    )


def denied_by_reason(access: DataFrame) -> DataFrame:
    """Denials per reason code and request kind, with distinct offending addresses."""
    return (
        denied(access)
        .groupBy("reason_code", F.coalesce("request", F.lit("unknown")).alias("request"))
        .agg(F.count(F.lit(1)).alias("denied"), F.countDistinct("addr").alias("addresses"))
        .orderBy(F.desc("denied"), "reason_code", "request")
    )


def denied_by_address(access: DataFrame) -> DataFrame:
    """Denials per client address, with the reason codes it tripped."""
    return (
        denied(access)
        .groupBy("addr")
        .agg(
            F.count(F.lit(1)).alias("denied"),
            F.array_sort(F.collect_set("reason_code")).alias("reason_codes"),
            F.min("time").alias("first"),
            F.max("time").alias("last"),
        )
        .orderBy(F.desc("denied"), "addr")
    )


def denied_by_subject(access: DataFrame) -> DataFrame:
    """Denials per subject (requests that named one), with the reason codes."""
    return (
        denied(access)
        .where(F.col("subject").isNotNull())
        .groupBy("subject")
        .agg(
            F.count(F.lit(1)).alias("denied"),
            F.array_sort(F.collect_set("reason_code")).alias("reason_codes"),
            F.countDistinct("addr").alias("addresses"),
        )
        .orderBy(F.desc("denied"), "subject")
    )


def denied_over_time(access: DataFrame) -> DataFrame:
    """Denials per hour and reason code."""
    return (
        denied(access)
        .groupBy(F.date_trunc("hour", "time").alias("start"), "reason_code")
        .agg(F.count(F.lit(1)).alias("denied"))
        .withColumn("date", F.to_date("start"))
        .orderBy("start", "reason_code")
    )
