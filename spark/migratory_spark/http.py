"""HTTP requests (access.log ``http`` lines) by endpoint and status.

``method`` and ``path`` are null for a request answered before its head could be
parsed (a malformed or oversized request line); such requests are kept, under a
null endpoint, so that every status the server answered is counted.
"""

from __future__ import annotations

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

__all__ = ["http_requests", "status_class"]


def http_requests(access: DataFrame) -> DataFrame:
    """Per method, path and status: requests, bytes sent, distinct client addresses, first and last."""
    return (
        access.where(F.col("event") == "http")
        .groupBy("method", "path", "status")
        .agg(
            F.count(F.lit(1)).alias("requests"),
            F.sum(F.coalesce("bytes_out", F.lit(0))).alias("bytes_out"),
            F.countDistinct("addr").alias("addresses"),
            F.min("time").alias("first"),
            F.max("time").alias("last"),
        )
        .orderBy(F.desc("requests"), "path", "method", "status")
    )


def status_class(status: int | None) -> str:
    """200 -> ``2xx``; None -> ``unknown``."""
    return "unknown" if status is None else f"{status // 100}xx"
